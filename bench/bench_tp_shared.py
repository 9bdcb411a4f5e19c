"""Tensor-parallel-shared chunks on one GPU: a TP-2-shaped engine's store read back by a TP 1
engine, and the reverse, against a pinned memcpy of the same bytes measured in the same run.

One model (default Llama-3-8B's KV: 32 layers, 8 KV heads of 128, bf16, blocks of 16 tokens),
three KV caches on one GPU: the two ranks of a TP 2 engine (4 heads each) and a TP 1 engine (8
heads). Each moves its slice of the same host objects ([2, L, T, 8 * 128] bf16, docs/tensor-parallel.md)
through the data plane the server uses (the transfer engine, one per cache). A request is
--chunks chunks of 256 tokens:

- TP2->TP1: both TP 2 ranks store their slices (submitted together), then the TP 1 engine loads
  the whole objects;
- TP1->TP2: the TP 1 engine stores whole objects, then both TP 2 ranks load their slices.

Each phase is timed alone (host wall time, submission to completion, median of --repeat) and
shown as a ratio to one contiguous pinned cudaMemcpyAsync of the object bytes in that direction;
a TP 2 phase moves the same bytes as the TP 1 one, split over two caches. Bytes are checked exact
after timing (every rank's blocks against the TP 1 cache's heads).

    python bench/bench_tp_shared.py [--modes direct,staged,dma] [--chunks 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from lmcache_mp import _C
from lmcache_mp.head_slices import head_slice
from lmcache_mp.layout import infer_layout
from lmcache_mp.native import HostArena, build_info

CHUNK = 256
GiB = 1 << 30


class Cache:
    """One engine rank's per-layer KV cache on the GPU and its transfer engine."""

    def __init__(self, layers: int, heads: int, world: int, rank: int, head_size: int, block_size: int,
                 num_blocks: int, seed: int):
        local = heads // world
        shape = (2, num_blocks, block_size, local, head_size)
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.kv = [torch.empty(shape, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
        for t in self.kv:
            t.view(torch.int16).random_(generator=g)
        t = self.kv[0]
        spec = infer_layout(t.shape, t.stride(), 2, "bfloat16", layers, "mha")
        spec, self.slice = head_slice(spec, t.shape, t.stride(), world, rank, heads)
        native = spec.native([k.data_ptr() for k in self.kv])
        if self.slice.pitch != spec.row_bytes:
            native.object_row_pitch, native.object_row_offset = self.slice.pitch, self.slice.offset
        self.engine = _C.cuda.TransferEngine(0, native, CHUNK)
        self.heads = slice(self.slice.first, self.slice.first + self.slice.count)

    def submit(self, direction: str, mode: str, ids: np.ndarray, ptrs: np.ndarray, capacity: int) -> int:
        return self.engine.submit(direction, mode, ids, ptrs, CHUNK, capacity)


def median_wall(fn, repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="direct,staged,dma")
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8, help="the model's KV heads (the TP 2 ranks hold half each)")
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    n, bs = args.chunks, args.block_size
    bpc = CHUNK // bs
    nb = 2 * n * bpc + 8
    tp1 = Cache(args.layers, args.heads, 1, 0, args.head_size, bs, nb, seed=1)
    tp2 = [Cache(args.layers, args.heads, 2, r, args.head_size, bs, nb, seed=2 + r) for r in range(2)]
    obj_bytes = 2 * args.layers * CHUNK * tp1.slice.pitch
    arena = HostArena(max(2 * GiB, 2 * n * obj_bytes + GiB), 256 << 20, True, -1)
    assert arena.wait_pinned(300) and not arena.pin_status()["error"], arena.pin_status()
    cls = arena.size_class(obj_bytes)
    slot = arena.slot_bytes(cls)
    offs = [arena.allocate(cls) for _ in range(n)]
    assert min(offs) >= 0, "arena too small"
    ptrs = np.array([arena.base + o for o in offs], dtype=np.uint64)
    rng = np.random.default_rng(7)
    src = rng.permutation(nb // 2)[: n * bpc].astype(np.int64)  # blocks a store reads
    dst = (nb // 2 + rng.permutation(nb // 2)[: n * bpc]).astype(np.int64)  # blocks a load writes

    total = n * obj_bytes
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()

    def memcpy(direction: str) -> None:
        with torch.cuda.stream(stream):
            if direction == "gather":
                host.copy_(dev, non_blocking=True)
            else:
                dev.copy_(host, non_blocking=True)
        stream.synchronize()

    ceiling = {d: total / median_wall(lambda d=d: memcpy(d), args.repeat) for d in ("gather", "scatter")}

    def phase(caches: list[Cache], direction: str, mode: str, ids: np.ndarray) -> None:
        tickets = [c.submit(direction, mode, ids, ptrs, slot) for c in caches]
        for c, t in zip(caches, tickets):
            c.engine.wait(t)

    def same_bytes(reader: list[Cache], writer: list[Cache], r_ids, w_ids) -> bool:
        """Every rank's heads in its blocks equal the other engine's same heads in its blocks."""
        ri, wi = torch.from_numpy(r_ids).cuda(), torch.from_numpy(w_ids).cuda()
        for layer in range(args.layers):
            full_r = torch.cat([c.kv[layer][:, ri] for c in reader], dim=-2).view(torch.int16)
            full_w = torch.cat([c.kv[layer][:, wi] for c in writer], dim=-2).view(torch.int16)
            if not torch.equal(full_r, full_w):
                return False
        return True

    props = torch.cuda.get_device_properties(0)
    results = {"env": {"date": time.strftime("%Y-%m-%d"), "gpu": props.name, "torch": torch.__version__,
                       "cuda_runtime": _C.cuda.runtime_version(), "driver": _C.cuda.driver_version(),
                       "build": build_info()},
               "shape": vars(args), "object_bytes": obj_bytes,
               "memcpy_gbps": {d: v / 1e9 for d, v in ceiling.items()}, "rows": []}
    print(f"{props.name}: {n} chunks of {obj_bytes / 2**20:.1f} MiB; pinned memcpy D2H {ceiling['gather'] / 1e9:.1f} "
          f"GB/s, H2D {ceiling['scatter'] / 1e9:.1f} GB/s")
    print(f"{'mode':8} {'case':9} {'store':>16} {'load':>16}  check")
    for mode in args.modes.split(","):
        for case, writer, reader in (("TP2->TP1", tp2, [tp1]), ("TP1->TP2", [tp1], tp2)):
            store = total / median_wall(lambda: phase(writer, "gather", mode, src), args.repeat)
            load = total / median_wall(lambda: phase(reader, "scatter", mode, dst), args.repeat)
            ok = same_bytes(reader, writer, dst, src)
            row = {"mode": mode, "case": case, "store_gbps": store / 1e9, "load_gbps": load / 1e9,
                   "store_x_memcpy": store / ceiling["gather"], "load_x_memcpy": load / ceiling["scatter"],
                   "exact": ok}
            results["rows"].append(row)
            print(f"{mode:8} {case:9} {store / 1e9:6.1f} GB/s {row['store_x_memcpy']:4.2f}x "
                  f"{load / 1e9:6.1f} GB/s {row['load_x_memcpy']:4.2f}x  {'exact' if ok else 'MISMATCH'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    for o in offs:
        arena.free(o)
    return 0 if all(r["exact"] for r in results["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
