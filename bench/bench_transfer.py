"""The GPU data plane alone: every way to move KV chunks between paged GPU blocks and pinned host
objects, side by side with the ceiling, all measured in one run.

Arms: (a) memcpy: one contiguous pinned cudaMemcpyAsync of the same bytes (the ceiling), each
direction and both at once; (b) segment_loop: one cudaMemcpyAsync per (layer, K/V, block);
(c) batch_uncoalesced: one cudaMemcpyBatchAsync of every segment; (d) single_buffer: per chunk a
gather into one device buffer, then one memcpy, chunks one after another; (e) lmcache: LMCache
0.5.3's MP-server transfer path (bench/peers/lmcache_peer.py; skipped when not installed);
(f) ours: direct, staged, dma and auto.

Layouts: per-layer caches (flash-attention's [2, blocks, 16, 8, 128] per layer for Llama-3-8B,
MLA's [blocks, 16, 576]) and block-outermost ones (vLLM's BLNHC: per-layer views into one
[blocks, layers, ...] buffer, registered as one packed cache whose blocks move whole). `pages-N`
is a block-outermost cache of N Llama-3-8B layers (a copy of N x 64 KiB per block): a sweep over
N measures the copy engines' rate by copy size, which sets the `auto` policy's threshold
(server/copies/transfer_mode.py). `hybrid-pages-2m` / `hybrid-pages-512k` are a hybrid model's pages (vLLM gives
attention layers and Mamba / Gated DeltaNet state layers pages of one size, per layer
`[blocks, page]`, layer after layer): a Qwen3-Next-80B-like 2 MiB page (GDN state of 32 heads of
128 x 128 fp32) and a smaller model's 512 KiB one; a chunk is one block (a state's boundary).

Every figure is host wall time from submission to completion, median of --repeat runs, shown
as GB/s and as a ratio to (a) of the same direction. Destinations are checked byte-exact after
timing. --gemm also measures each arm beside a bf16 GEMM loop on another stream: the GEMM's
slowdown and the arm's GB/s under that load.

    python bench/bench_transfer.py --json out.json --png out.png [--quick] [--gemm]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import numpy as np
import torch

from lmcache_mp import _C
from lmcache_mp.layout import infer_layout, pack_layers
from lmcache_mp.native import HostArena, build_info
from lmcache_mp.server.copies.transfer_mode import choose_transfer_mode

LAYOUTS = {
    "llama3-8b-bs16": dict(kind="mha", layers=32, heads=8, head_size=128, block_size=16),
    "llama3-8b-bs64": dict(kind="mha", layers=32, heads=8, head_size=128, block_size=64),
    "mla-bs16": dict(kind="mla", layers=61, dim=576, block_size=16),
    "mla-bs64": dict(kind="mla", layers=61, dim=576, block_size=64),
    # block-outermost (vLLM BLNHC): a block's page of each layer is [tokens, heads, K+V] / [tokens, dim]
    "llama3-8b-packed": dict(kind="packed", layers=32, page=(16, 8, 256), block_size=16),
    "mla-packed": dict(kind="packed", layers=61, page=(16, 576), block_size=16),
    # hybrid models: per-layer opaque pages, one block per chunk (bytes per page)
    "hybrid-pages-2m": dict(kind="pages", layers=12, page=2 << 20, block_size=256),
    "hybrid-pages-512k": dict(kind="pages", layers=12, page=512 << 10, block_size=256),
    # SGLang's MHA pool through the unified cache linker: a page of 64 tokens is one object of
    # 64 runs (32 layers x K/V) of 128 KiB, each run in a buffer of its own
    "sglang-page64": dict(kind="pages", layers=64, page=128 << 10, block_size=256),
}


def layout_config(name: str) -> dict:
    if name.startswith("pages-"):  # N Llama-3-8B layers per block
        return dict(kind="packed", layers=int(name.removeprefix("pages-")), page=(16, 8, 256), block_size=16)
    return LAYOUTS[name]
OURS = ["direct", "staged", "dma"]
REFERENCES = ["segment_loop", "batch_uncoalesced", "single_buffer"]
CHUNK = 256
GiB = 1 << 30


class Bench:
    def __init__(self, name: str, cfg: dict, max_chunks: int, arena: HostArena):
        self.name, self.cfg, self.max_chunks, self.arena = name, cfg, max_chunks, arena
        bs = cfg["block_size"]
        self.bpc = CHUNK // bs
        nb = 2 * max_chunks * self.bpc + 8
        g = torch.Generator(device="cuda").manual_seed(1)
        self.whole = self.pages = None
        if cfg["kind"] == "packed":
            self.whole = torch.empty((nb, cfg["layers"], *cfg["page"]), dtype=torch.bfloat16, device="cuda")
            self.whole.view(torch.int16).random_(generator=g)
            self.kv = [self.whole[:, i] for i in range(cfg["layers"])]
            t = self.kv[0]
            per_layer = infer_layout(t.shape, t.stride(), 2, "bfloat16", len(self.kv),
                                     "mla" if t.dim() == 3 else "opaque", block_size=bs)
            # one layer: its own block is the span
            self.spec = pack_layers(per_layer, [v.data_ptr() - t.data_ptr() for v in self.kv]) or per_layer
        elif cfg["kind"] == "pages":  # [layers, blocks, page] as vLLM lays out a hybrid's pages
            self.pages = torch.empty((cfg["layers"], nb, cfg["page"] // 2), dtype=torch.bfloat16, device="cuda")
            self.pages.view(torch.int16).random_(generator=g)
            self.kv = [self.pages[i] for i in range(cfg["layers"])]
            t = self.kv[0]
            self.spec = infer_layout(t.shape, t.stride(), 2, "bfloat16", len(self.kv), "opaque", block_size=bs)
        else:
            shape = (2, nb, bs, cfg["heads"], cfg["head_size"]) if cfg["kind"] == "mha" else (nb, bs, cfg["dim"])
            self.kv = [torch.empty(shape, dtype=torch.bfloat16, device="cuda") for _ in range(cfg["layers"])]
            for t in self.kv:
                t.view(torch.int16).random_(generator=g)
            t = self.kv[0]
            self.spec = infer_layout(t.shape, t.stride(), 2, "bfloat16", len(self.kv), cfg["kind"])
        self.native = self.spec.native([self.kv[i].data_ptr() for i in self.spec.addressed_layers()])
        self.obj_bytes = self.spec.object_bytes(CHUNK)
        self.cls = arena.size_class(self.obj_bytes)
        self.slot = arena.slot_bytes(self.cls)
        self.offs_a = [arena.allocate(self.cls) for _ in range(max_chunks)]  # gather targets
        self.offs_b = [arena.allocate(self.cls) for _ in range(max_chunks)]  # scatter sources
        assert min(self.offs_a + self.offs_b) >= 0, "arena too small"
        self.engine = _C.cuda.TransferEngine(0, self.native, CHUNK)
        self.half = nb // 2
        self.src_ids = self.ids(max_chunks, "random", 0)  # the chunks the scatter sources hold

    def ids(self, n: int, pattern: str, side: int) -> np.ndarray:
        """Block ids of n chunks in the first (side 0) or second (side 1) half of the cache."""
        base = side * self.half
        if pattern == "adjacent":
            return np.arange(base, base + n * self.bpc, dtype=np.int64)
        rng = np.random.default_rng(n * 7 + side)
        return (base + rng.permutation(self.half)[: n * self.bpc]).astype(np.int64)

    def ptrs(self, offs, n: int) -> np.ndarray:
        return np.array([self.arena.base + o for o in offs[:n]], dtype=np.uint64)

    def close(self) -> None:
        torch.cuda.synchronize()
        self.engine = None
        for o in self.offs_a + self.offs_b:
            self.arena.free(o)
        self.kv = self.pages = None
        torch.cuda.empty_cache()

    # ---- verification (on the GPU, against torch indexing) -----------------------------------

    def expected_objects(self, ids: np.ndarray) -> torch.Tensor:
        idx = torch.from_numpy(ids).cuda()
        n = len(ids) // self.bpc
        if self.whole is not None:  # packed: each block's span, one after the other
            return self.whole[idx].contiguous().view(torch.uint8).reshape(n, -1)
        if self.cfg["kind"] == "mha":
            x = torch.stack([t[:, idx] for t in self.kv], dim=1)  # [2, L, n*bpc, BS, H, D]
            x = x.reshape(2, len(self.kv), n, -1).permute(2, 0, 1, 3)
        else:
            x = torch.stack([t[idx] for t in self.kv], dim=0)  # [L, n*bpc, BS, D]
            x = x.reshape(len(self.kv), n, -1).permute(1, 0, 2)
        return x.contiguous().view(torch.uint8).reshape(n, -1)

    def objects_on_gpu(self, offs, n: int) -> torch.Tensor:
        rows = [torch.frombuffer(self.arena.view(o, self.obj_bytes), dtype=torch.uint8) for o in offs[:n]]
        return torch.stack(rows).cuda()

    def check_gather(self, ids: np.ndarray, offs) -> bool:
        n = len(ids) // self.bpc
        return torch.equal(self.objects_on_gpu(offs, n), self.expected_objects(ids))

    def check_blocks_equal(self, a: np.ndarray, b: np.ndarray) -> bool:
        ia, ib = torch.from_numpy(a).cuda(), torch.from_numpy(b).cuda()
        bits = [t.view(torch.int16) for t in self.kv]  # random bits include NaNs: compare bit patterns
        if self.whole is not None:
            return torch.equal(self.whole.view(torch.int16)[ia], self.whole.view(torch.int16)[ib])
        if self.cfg["kind"] == "mha":
            return all(torch.equal(t[:, ia], t[:, ib]) for t in bits)
        return all(torch.equal(t[ia], t[ib]) for t in bits)


def wall(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_wall(fn, repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(wall(fn) for _ in range(repeat))


class Memcpy:
    """The ceiling: one contiguous cudaMemcpyAsync between pinned host and device memory."""

    def __init__(self, nbytes: int):
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.dev2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.s1, self.s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def run(self, direction: str, nbytes: int) -> None:
        with torch.cuda.stream(self.s1):
            if direction in ("gather", "both"):
                self.host[:nbytes].copy_(self.dev[:nbytes], non_blocking=True)
        with torch.cuda.stream(self.s2):
            if direction in ("scatter", "both"):
                self.dev2[:nbytes].copy_(self.host2[:nbytes], non_blocking=True)
        self.s1.synchronize()
        self.s2.synchronize()


def run_ours(b: Bench, mode: str, direction: str, n: int, pattern: str) -> float:
    if direction == "gather":
        ids, offs = b.ids(n, pattern, 0), b.offs_a
    else:
        ids, offs = b.ids(n, pattern, 1), b.offs_b
    ptrs = b.ptrs(offs, n)
    return wall(lambda: b.engine.wait(b.engine.submit(direction, mode, ids, ptrs, CHUNK, b.slot)))


def submit_seconds(b: Bench, mode: str, direction: str, n: int, pattern: str) -> float:
    ids = b.ids(n, pattern, 0 if direction == "gather" else 1)
    ptrs = b.ptrs(b.offs_a if direction == "gather" else b.offs_b, n)
    t0 = time.perf_counter()
    ticket = b.engine.submit(direction, mode, ids, ptrs, CHUNK, b.slot)
    dt = time.perf_counter() - t0
    b.engine.wait(ticket)
    return dt


def make_peer(b: Bench):
    if b.whole is not None:
        return None, "LMCache has no block-outermost arm here"
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "peers"))
    try:
        import lmcache_peer
    except ImportError as e:
        return None, f"bench/peers/lmcache_peer.py not importable: {e}"
    ok, why = lmcache_peer.available()
    if not ok:
        return None, why
    # its pool holds the scatter sources and the largest store at once
    peer = lmcache_peer.LMCachePeer(b.kv, b.cfg["block_size"], CHUNK, layout=b.cfg["kind"],
                                    max_chunks=2 * b.max_chunks + 2)
    return peer, ""


def run_peer(b: Bench, peer, direction: str, n: int, pattern: str, state: dict) -> float:
    if direction == "gather":
        ids = b.ids(n, pattern, 0).reshape(n, b.bpc).tolist()

        def go():
            objs = peer.store(ids)
            peer.synchronize()
            state["objs"] = objs

        old = state.pop("objs", None)
        if old:
            peer.free(old)
        return wall(go)
    ids = b.ids(n, pattern, 1).reshape(n, b.bpc).tolist()
    objs = state["src_objs"][:n]
    return wall(lambda: (peer.retrieve(objs, ids), peer.synchronize()))


def gemm_interference(b: Bench, arm_fn, iters: int = 30, rounds: int = 3) -> tuple[float, float]:
    """(GEMM time with the arm running / alone, arm GB/s while the GEMMs run)."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()

    def gemms() -> float:
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
        with torch.cuda.stream(stream):
            evs[0].record()
            for i in range(iters):
                torch.mm(a, w)
                evs[i + 1].record()
        stream.synchronize()
        return statistics.median(evs[i].elapsed_time(evs[i + 1]) for i in range(2, iters))

    gemms()
    ratios, moved = [], []
    for _ in range(rounds):  # alone, loaded, alone: clocks drift, so each loaded run is compared
        before = gemms()     # with the runs just before and after it
        stop = threading.Event()

        def loop():
            while not stop.is_set():
                t0 = time.perf_counter()
                nbytes = arm_fn()
                moved.append((nbytes, time.perf_counter() - t0))

        th = threading.Thread(target=loop)
        th.start()
        time.sleep(0.05)
        loaded = gemms()
        stop.set()
        th.join()
        ratios.append(loaded / ((before + gemms()) / 2))
    gbps = sum(n for n, _ in moved) / sum(t for _, t in moved) / 1e9
    return statistics.median(ratios), gbps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default=",".join(n for n in LAYOUTS if not n.startswith(("hybrid", "sglang"))))
    ap.add_argument("--chunks", default="1,8,64")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="fewer repeats, random ids only")
    ap.add_argument("--gemm", action="store_true", help="also measure beside a concurrent GEMM")
    ap.add_argument("--no-peer", action="store_true", help="skip LMCache's arm")
    ap.add_argument("--arms", help="comma-separated subset of our modes and the references (default: all)")
    ap.add_argument("--json")
    ap.add_argument("--png")
    args = ap.parse_args()
    chunk_counts = [int(c) for c in args.chunks.split(",")]
    patterns = ["random"] if args.quick else ["random", "adjacent"]
    repeat = 3 if args.quick else args.repeat
    max_chunks = max(chunk_counts)
    arena = HostArena(6 * GiB, 256 << 20, True, -1)
    assert arena.wait_pinned(300) and not arena.pin_status()["error"], arena.pin_status()
    props = torch.cuda.get_device_properties(0)
    env = {"date": time.strftime("%Y-%m-%d"), "gpu": props.name, "torch": torch.__version__,
           "cuda_runtime": _C.cuda.runtime_version(), "driver": _C.cuda.driver_version(), "build": build_info()}
    print(f"# {env['gpu']}, torch {env['torch']}, CUDA runtime {env['cuda_runtime']}, driver {env['driver']}")
    results, failures = [], []
    def chunk_bytes(cfg):
        if cfg["kind"] == "pages":
            return cfg["layers"] * cfg["page"] * (CHUNK // cfg["block_size"])
        if cfg["kind"] == "packed":
            width = int(np.prod(cfg["page"][1:]))
        else:
            width = 2 * cfg["heads"] * cfg["head_size"] if cfg["kind"] == "mha" else cfg["dim"]
        return cfg["layers"] * CHUNK * width * 2

    max_bytes = max(chunk_bytes(layout_config(n)) for n in args.layouts.split(",")) * max_chunks
    mc = Memcpy(max_bytes)
    picked = args.arms.split(",") if args.arms else OURS + REFERENCES + ["auto"]

    for name in args.layouts.split(","):
        b = Bench(name, layout_config(name), max_chunks, arena)
        peer, why = (None, "--no-peer") if args.no_peer else make_peer(b)
        peer_state: dict = {}
        if peer is not None:  # objects holding the source blocks, for the peer's retrieves
            peer_state["src_objs"] = peer.store(b.src_ids.reshape(max_chunks, b.bpc).tolist())
            peer.synchronize()
        print(f"\n## {name}: {b.spec.model_layers} layers, block {b.spec.block_size}, copies of "
              f"{b.spec.segment_bytes / 2**10:.0f} KiB, {b.obj_bytes / 2**20:.1f} MiB per chunk"
              + ("" if peer else f"  (lmcache arm skipped: {why})"))
        # fill the scatter sources with real chunks of side 0
        b.engine.wait(b.engine.submit("gather", "dma", b.src_ids, b.ptrs(b.offs_b, max_chunks), CHUNK, b.slot))
        if not b.check_gather(b.src_ids, b.offs_b):
            failures.append(f"{name}: filling the scatter sources")
        for pattern in patterns:
            for n in chunk_counts:
                nbytes = n * b.obj_bytes
                for direction in ("gather", "scatter"):
                    ceil = median_wall(lambda: mc.run(direction, nbytes), repeat)
                    row = {"layout": name, "pattern": pattern, "chunks": n, "direction": direction,
                           "bytes": nbytes, "arms": {"memcpy": {"s": ceil, "gbps": nbytes / ceil / 1e9, "ratio": 1.0}}}
                    for arm in picked:
                        mode = choose_transfer_mode(b.spec)[0] if arm == "auto" else arm
                        run_ours(b, mode, direction, n, pattern)
                        s = statistics.median(run_ours(b, mode, direction, n, pattern) for _ in range(repeat))
                        entry = {"s": s, "gbps": nbytes / s / 1e9, "ratio": ceil / s, "mode": mode,
                                 "submit_s": submit_seconds(b, mode, direction, n, pattern)}
                        if n == max_chunks or n == chunk_counts[0]:  # verify the destinations
                            if direction == "gather":
                                entry["exact"] = b.check_gather(b.ids(n, pattern, 0), b.offs_a)
                            else:
                                entry["exact"] = b.check_blocks_equal(b.ids(n, pattern, 1), b.src_ids[: n * b.bpc])
                            if not entry["exact"]:
                                failures.append(f"{name} {pattern} {n} {direction} {arm}")
                        row["arms"][arm] = entry
                    if peer is not None:
                        run_peer(b, peer, direction, n, pattern, peer_state)
                        s = statistics.median(run_peer(b, peer, direction, n, pattern, peer_state)
                                              for _ in range(repeat))
                        entry = {"s": s, "gbps": nbytes / s / 1e9, "ratio": ceil / s}
                        if n == max_chunks or n == chunk_counts[0]:
                            if direction == "scatter":
                                entry["exact"] = b.check_blocks_equal(b.ids(n, pattern, 1), b.src_ids[: n * b.bpc])
                            else:
                                got = torch.stack([peer.object_tensor(o).contiguous().view(torch.uint8).reshape(-1)
                                                   for o in peer_state["objs"]]).cuda()
                                entry["exact"] = torch.equal(got, b.expected_objects(b.ids(n, pattern, 0)))
                            if not entry["exact"]:
                                failures.append(f"{name} {pattern} {n} {direction} lmcache")
                        row["arms"]["lmcache"] = entry
                    results.append(row)
                    print(f"{pattern:8s} {n:3d} chunks {direction:7s} memcpy {nbytes / ceil / 1e9:6.1f} GB/s | " +
                          " ".join(f"{a} {e['ratio']:.2f}" for a, e in row["arms"].items() if a != "memcpy"))
            # both directions at once, largest request
            n = max_chunks
            nbytes = n * b.obj_bytes
            ceil = median_wall(lambda: mc.run("both", nbytes), repeat)
            row = {"layout": name, "pattern": pattern, "chunks": n, "direction": "both", "bytes": 2 * nbytes,
                   "arms": {"memcpy": {"s": ceil, "gbps": 2 * nbytes / ceil / 1e9, "ratio": 1.0}}}
            for mode in [a for a in OURS if a in picked]:
                ga, gp = b.ids(n, pattern, 0), b.ptrs(b.offs_a, n)
                sa, sp = b.ids(n, pattern, 1), b.ptrs(b.offs_b, n)

                def both():
                    t1 = b.engine.submit("gather", mode, ga, gp, CHUNK, b.slot)
                    t2 = b.engine.submit("scatter", mode, sa, sp, CHUNK, b.slot)
                    b.engine.wait(t1)
                    b.engine.wait(t2)

                s = median_wall(both, repeat)
                row["arms"][mode] = {"s": s, "gbps": 2 * nbytes / s / 1e9, "ratio": ceil / s}
            results.append(row)
            print(f"{pattern:8s} {n:3d} chunks both    memcpy {2 * nbytes / ceil / 1e9:6.1f} GB/s | " +
                  " ".join(f"{a} {e['ratio']:.2f}" for a, e in row["arms"].items() if a != "memcpy"))

        if args.gemm and b.spec.block_size == 16:
            n = max_chunks
            nbytes = n * b.obj_bytes
            for direction in ("gather", "scatter"):
                row = {"layout": name, "pattern": "random", "chunks": n, "direction": direction, "bytes": nbytes,
                       "gemm": {}}

                def mem():
                    mc.run(direction, nbytes)
                    return nbytes

                row["gemm"]["memcpy"] = gemm_interference(b, mem)
                for arm in [a for a in OURS + ["single_buffer"] if a in picked]:
                    def ours(arm=arm):
                        run_ours(b, arm, direction, n, "random")
                        return nbytes

                    row["gemm"][arm] = gemm_interference(b, ours)
                if peer is not None:
                    row["gemm"]["lmcache"] = gemm_interference(
                        b, lambda: (run_peer(b, peer, direction, n, "random", peer_state), nbytes)[1])
                mem_load = row["gemm"]["memcpy"][1]
                print(f"GEMM beside {direction:7s}: " + " ".join(
                    f"{a} slow {v[0]:.3f} {v[1]:.1f}GB/s ({v[1] / mem_load:.2f}x memcpy)" for a, v in row["gemm"].items()))
                results.append(row)
        if peer is not None:
            peer.close()
        b.close()

    out = {"benchmark": "bench_transfer", "env": env, "chunk_size": CHUNK, "results": results, "failures": failures}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    if args.png:
        plot(results, args.png, env)
    print("\nbyte-exact:", "ALL PASS" if not failures else f"FAILED {failures}")
    return 1 if failures else 0


def plot(results, path: str, env: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if "arms" in r and r["pattern"] == "random" and r["direction"] in ("gather", "scatter")
            and r["chunks"] == max(x["chunks"] for x in results if "arms" in x)]
    layouts = sorted({r["layout"] for r in rows})
    fig, axes = plt.subplots(2, len(layouts), figsize=(4 * len(layouts), 7), squeeze=False)
    for j, lay in enumerate(layouts):
        for i, d in enumerate(("gather", "scatter")):
            ax = axes[i][j]
            r = next((x for x in rows if x["layout"] == lay and x["direction"] == d), None)
            if r is None:
                continue
            names = [a for a in r["arms"] if a != "memcpy"]
            ax.bar(names, [r["arms"][a]["gbps"] for a in names], color="tab:blue")
            ax.axhline(r["arms"]["memcpy"]["gbps"], color="red", linestyle="--", label="memcpy ceiling")
            ax.set_title(f"{lay} {'store' if d == 'gather' else 'retrieve'}", fontsize=9)
            ax.set_ylabel("GB/s")
            ax.tick_params(axis="x", rotation=60, labelsize=7)
            ax.legend(fontsize=7)
    fig.suptitle(f"KV transfer, {rows[0]['chunks'] if rows else 0} chunks of 256 tokens, random blocks — "
                 f"{env['gpu']}, {env['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
