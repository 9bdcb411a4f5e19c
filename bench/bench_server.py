"""End to end through the server: real worker processes register KV caches (CUDA IPC, or shared
memory on the CPU device) and store, look up and retrieve whole requests through `Client`.

One server process (`python -m lmcache_mp.server.cli`) serves every run; for each worker count
the workers are fresh spawned processes, spread round-robin over --gpus GPUs, each seeing only
its own GPU (CUDA_VISIBLE_DEVICES=<that GPU's UUID>; the server sees them all and maps caches to
its devices by UUID). Each worker fills its KV cache with random bits and then, phases separated
by barriers:

  store     --requests requests of --chunks chunks each (distinct tokens -> distinct chunk hashes),
            one at a time, each from a different permutation of the first half of the blocks
  lookup    --lookups lookups of --chunks hashes each
  retrieve  every stored request into the second half of the blocks (wait="host")

then checks every retrieved request bit for bit against its source blocks (the last timed
retrieve in place, the others retrieved again untimed). Aggregate GB/s of a phase = bytes moved
by all workers / the slowest worker's phase wall time. The ceiling, measured in this process
before the workers start: a contiguous pinned cudaMemcpyAsync of one request's bytes per GPU
used (several GPUs at once, one thread and stream each), or a NumPy copy on the CPU device.

    python bench/bench_server.py [--device cuda|cpu] [--workers 1,2,4] [--gpus 1] [--chunks 128]
        [--requests 4] [--layout llama3-8b|mla] [--tp] [--transfer-mode auto] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import queue
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import numpy as np

CHUNK = 256
DTYPE_BYTES = 2  # bfloat16
SLAB = 256 << 20
SLOT_ALIGN = 256  # the arena's slot alignment (csrc/host_arena.cpp)
LAYOUTS = {
    "llama3-8b": dict(kind="mha", layers=32, heads=8, head_size=128, block_size=16),
    "mla": dict(kind="mla", layers=61, dim=576, block_size=16),
}
GiB = 1 << 30


# ---- geometry -------------------------------------------------------------------------------

def kv_shape(cfg: dict, num_blocks: int) -> tuple:
    if cfg["kind"] == "mha":
        return (2, num_blocks, cfg["block_size"], cfg["heads"], cfg["head_size"])
    return (num_blocks, cfg["block_size"], cfg["dim"])


def object_bytes(cfg: dict, chunk: int = CHUNK) -> int:
    if cfg["kind"] == "mha":
        return 2 * cfg["layers"] * chunk * cfg["heads"] * cfg["head_size"] * DTYPE_BYTES
    return cfg["layers"] * chunk * cfg["dim"] * DTYPE_BYTES


def request_ids(seed: tuple, half: int, offset: int) -> np.ndarray:
    """A permutation of the `half` blocks starting at `offset` (a request's block table)."""
    return (offset + np.random.default_rng(list(seed)).permutation(half)).astype(np.int64)


def request_tokens(seed: tuple, n_tokens: int) -> np.ndarray:
    return np.random.default_rng(list(seed)).integers(0, 1 << 31, n_tokens, dtype=np.int64)


# ---- the worker process -----------------------------------------------------------------------

def count_mismatches(kv: list, kind: str, src: np.ndarray, dst: np.ndarray, n: int, loaded: int) -> int:
    """Chunks whose destination blocks differ from their source blocks in any bit (random bits
    include NaNs, which never equal themselves: compare bit patterns), plus chunks not loaded."""
    import torch

    dev = kv[0].device
    s = torch.as_tensor(src, device=dev)
    d = torch.as_tensor(dst, device=dev)
    bad = torch.zeros(n, dtype=torch.bool, device=dev)
    for t in kv:
        b = t.view(torch.int16)
        if kind == "mha":
            bad |= (b[:, s] != b[:, d]).reshape(2, n, -1).any(dim=2).any(dim=0)
        else:
            bad |= (b[s] != b[d]).reshape(n, -1).any(dim=1)
    bad[loaded:] = True
    return int(bad.sum().item())


def _worker(cfg: dict, wid: int, barrier) -> dict:
    import torch
    from lmcache_mp import Client, chunk_hashes, shared_cpu_tensor

    lay = LAYOUTS[cfg["layout"]]
    cuda = cfg["device"] == "cuda"
    info: dict = {"wid": wid, "pid": os.getpid()}
    if cuda:
        if torch.cuda.device_count() != 1:
            raise RuntimeError(f"worker {wid} sees {torch.cuda.device_count()} GPUs, expected exactly 1 "
                               f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})")
        torch.cuda.set_device(0)
        uuid = f"GPU-{torch.cuda.get_device_properties(0).uuid}"
        if uuid != cfg["gpu_uuids"][wid]:
            raise RuntimeError(f"worker {wid} is on {uuid}, expected {cfg['gpu_uuids'][wid]}")
        info["gpu_uuid"] = uuid
    timeout = cfg["timeout"]
    client = Client(cfg["url"], timeout=timeout, name=f"bench-w{wid}")
    chunk = client.chunk_size
    bpc = chunk // lay["block_size"]
    n = cfg["chunks"]
    R = cfg["requests"]
    half = n * bpc
    nb = 2 * half + bpc  # the first half is the source, the second the destination, + warm-up
    tp = cfg["tp"]
    world, rank = (cfg["workers"], wid) if tp else (1, 0)
    model = f"bench-{cfg['layout']}-run{cfg['run']}" + ("" if tp else f"-w{wid}")
    # MLA under TP: every rank holds the same bytes (as in a real engine), stored once, read by all.
    shared = tp and lay["kind"] == "mla"
    data_seed = 1000 * cfg["run"] + (0 if shared else wid + 1)

    shape = kv_shape(lay, nb)
    if cuda:
        kv = [torch.empty(shape, dtype=torch.bfloat16, device="cuda") for _ in range(lay["layers"])]
        gen = torch.Generator(device="cuda").manual_seed(data_seed)
    else:
        kv = [shared_cpu_tensor(shape, torch.bfloat16, fill=None) for _ in range(lay["layers"])]
        gen = torch.Generator().manual_seed(data_seed)
    for t in kv:
        t.view(torch.uint8).random_(0, 256, generator=gen)
    if cuda:
        torch.cuda.synchronize()
    handle = client.register_kv_cache(kv, model=model, world_size=world, rank=rank, layout=lay["kind"])
    info.update(model=model, rank=rank, world_size=world, layout=handle.layout, shared=handle.shared,
                object_bytes=handle.object_bytes, transfer_mode=handle.transfer_mode)
    obj = handle.object_bytes

    # Token ids: per request, and per worker unless the workers are ranks of one model.
    tok_seed = (cfg["run"],) if tp else (cfg["run"], wid + 1)
    hashes = [chunk_hashes(request_tokens(tok_seed + (r,), n * chunk), chunk) for r in range(R)]
    src = [request_ids((r, 0), half, 0) for r in range(R)]
    dst = [request_ids((r, 1), half, half) for r in range(R)]

    # Warm-up (untimed): one chunk each way, on blocks of their own.
    warm_ids = np.arange(2 * half, nb, dtype=np.int64)
    warm_hash = chunk_hashes(request_tokens(tok_seed + (R, 9), chunk), chunk)
    if client.store(handle, warm_hash, warm_ids).result().chunks != 1:
        raise RuntimeError("warm-up store failed")
    barrier.wait(timeout)  # a shared (MLA) chunk may be another rank's, still being written until then
    if client.retrieve(handle, warm_hash, warm_ids).result().loaded != 1:
        raise RuntimeError("warm-up retrieve failed")

    # (a) store
    barrier.wait(timeout)
    lat_store, stored, present, skipped = [], 0, 0, 0
    t_phase = time.perf_counter()
    for r in range(R):
        t0 = time.perf_counter()
        res = client.store(handle, hashes[r], src[r]).result()
        lat_store.append(time.perf_counter() - t0)
        stored, present, skipped = stored + res.stored, present + res.present, skipped + res.skipped
    store_wall = time.perf_counter() - t_phase
    barrier.wait(timeout)
    if wid == 0:  # every worker is registered now: the server says which transfer mode each uses
        info["status_registrations"] = [
            {k: reg.get(k) for k in ("model", "rank", "world_size", "layout", "device", "transfer_mode",
                                     "object_bytes")}
            for reg in client.status()["registrations"] if str(reg.get("model", "")).startswith("bench-")
        ]

    # (b) lookup
    barrier.wait(timeout)
    lat_lookup, lookup_short = [], 0
    for i in range(cfg["lookups"]):
        t0 = time.perf_counter()
        hits = client.lookup(hashes[i % R], model=model, world_size=world)
        lat_lookup.append(time.perf_counter() - t0)
        lookup_short += hits != n

    # (c) retrieve
    barrier.wait(timeout)
    lat_retrieve, loaded_per_request = [], []
    t_phase = time.perf_counter()
    for r in range(R):
        t0 = time.perf_counter()
        res = client.retrieve(handle, hashes[r], dst[r], wait="host").result()
        lat_retrieve.append(time.perf_counter() - t0)
        loaded_per_request.append(res.loaded)
    retrieve_wall = time.perf_counter() - t_phase
    barrier.wait(timeout)  # nobody verifies while another worker is still timing

    # verification: the last timed retrieve in place, every other request retrieved again
    mismatches = count_mismatches(kv, lay["kind"], src[R - 1], dst[R - 1], n, loaded_per_request[R - 1])
    reloaded_short = 0
    for r in range(R - 1):
        res = client.retrieve(handle, hashes[r], dst[r]).result()
        reloaded_short += n - res.loaded
        mismatches += count_mismatches(kv, lay["kind"], src[r], dst[r], n, res.loaded)
    barrier.wait(timeout)
    client.unregister_kv_cache(handle)
    client.close()
    info.update(
        store_latency_s=lat_store, retrieve_latency_s=lat_retrieve, lookup_latency_s=lat_lookup,
        store_wall_s=store_wall, retrieve_wall_s=retrieve_wall,
        stored_chunks=stored, present_chunks=present, skipped_chunks=skipped,
        loaded_chunks=int(sum(loaded_per_request)), requested_chunks=R * n,
        store_bytes=stored * obj, retrieve_bytes=int(sum(loaded_per_request)) * obj,
        lookups_short=int(lookup_short), reloaded_short=reloaded_short, mismatches=mismatches,
    )
    return info


def worker_main(cfg: dict, wid: int, barrier, q) -> None:
    try:
        q.put((wid, "ok", _worker(cfg, wid, barrier)))
    except BaseException:
        with contextlib.suppress(Exception):
            barrier.abort()  # the others stop waiting at the next barrier
        q.put((wid, "fail", traceback.format_exc()))


# ---- ceilings ---------------------------------------------------------------------------------

class GpuMemcpy:
    """One GPU's contiguous pinned copy of one request's bytes, on its own stream."""

    def __init__(self, index: int, nbytes: int):
        import torch

        self.index = index
        with torch.cuda.device(index):
            self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self.dev = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{index}")
            self.stream = torch.cuda.Stream(device=index)
            self.host.fill_(1)
            self.dev.fill_(2)
            torch.cuda.synchronize(index)

    def run(self, direction: str) -> None:
        import torch

        with torch.cuda.device(self.index), torch.cuda.stream(self.stream):
            if direction == "d2h":
                self.host.copy_(self.dev, non_blocking=True)
            else:
                self.dev.copy_(self.host, non_blocking=True)
        self.stream.synchronize()


def _median_seconds(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gpu_ceilings(gpus: int, counts: list[int], nbytes: int, repeat: int) -> dict:
    """GB/s of one GPU alone (each GPU), and of the first k GPUs copying at once (each k used)."""
    import torch

    copies = [GpuMemcpy(g, nbytes) for g in range(gpus)]
    out: dict = {"bytes_per_gpu": nbytes, "single": [], "concurrent": {}}
    pool = ThreadPoolExecutor(max(1, gpus))

    def together(group: list, direction: str) -> None:
        for f in [pool.submit(cp.run, direction) for cp in group]:
            f.result()

    def gbps(group: list, direction: str) -> float:
        return len(group) * nbytes / _median_seconds(lambda: together(group, direction), repeat) / 1e9

    try:
        out["single"] = [{d: gbps([cp], d) for d in ("d2h", "h2d")} for cp in copies]
        for k in sorted(set(counts)):
            out["concurrent"][k] = (dict(out["single"][0]) if k == 1
                                    else {d: gbps(copies[:k], d) for d in ("d2h", "h2d")})
    finally:
        pool.shutdown()
        copies.clear()  # free the buffers before the workers need the memory
        for g in range(gpus):
            with torch.cuda.device(g):
                torch.cuda.empty_cache()
        empty_host = getattr(torch._C, "_host_emptyCache", None)
        if empty_host is not None:
            empty_host()  # torch keeps freed pinned blocks cached otherwise
    return out


def cpu_ceiling(nbytes: int, repeat: int) -> dict:
    src = np.full(nbytes, 1, dtype=np.uint8)
    dst = np.full(nbytes, 2, dtype=np.uint8)
    gbps = nbytes / _median_seconds(lambda: np.copyto(dst, src), repeat) / 1e9
    return {"bytes_per_gpu": nbytes, "single": [], "concurrent": {1: {"d2h": gbps, "h2d": gbps}}}


# ---- the server process -----------------------------------------------------------------------

class ServerProcess:
    def __init__(self, args, l1_bytes: int, slab_bytes: int, env: dict):
        self.dir = tempfile.mkdtemp(prefix="lmcache-bench-")
        self.url = f"ipc://{self.dir}/server.sock"
        self.log_path = os.path.join(self.dir, "server.log")
        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "lmcache_mp.server.cli", "--url", self.url, "--device", args.device,
               "--l1-size", str(l1_bytes), "--slab-size", str(slab_bytes), "--chunk-size", str(CHUNK),
               "--transfer-mode", args.transfer_mode, "--log-level", "INFO"]
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.client = None

    def connect(self, timeout: float):
        from lmcache_mp import Client

        deadline = time.monotonic() + timeout
        while True:
            try:
                self.client = Client(self.url, connect_timeout=1, timeout=60, name="bench-parent")
                return self.client
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start:\n{self.log_tail()}") from None
                time.sleep(0.2)

    def wait_pinned(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        last = 0.0
        while True:
            pin = self.client.status()["l1"]["pinning"]
            if pin.get("done") or not pin.get("requested"):
                return pin
            if time.monotonic() > deadline:
                raise RuntimeError(f"L1 pinning not finished after {timeout:.0f} s: {pin}")
            if time.monotonic() - last > 5:
                last = time.monotonic()
                print(f"  pinning L1: {pin.get('bytes_pinned', 0) / GiB:.1f} of "
                      f"{pin.get('bytes_total', 0) / GiB:.1f} GiB", flush=True)
            time.sleep(0.25)

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return "".join(f.readlines()[-lines:])

    def stop(self) -> dict:
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()
        self.proc.terminate()
        try:
            rc = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait(10)
        self._log.close()
        text = open(self.log_path).read()
        return {"exit_code": rc, "tracebacks": text.count("Traceback"),
                "error_lines": sum(1 for ln in text.splitlines() if " ERROR " in ln), "log": self.log_path}


# ---- one run ----------------------------------------------------------------------------------

@contextlib.contextmanager
def patched_env(values: dict):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def collect(procs, q, timeout: float) -> dict:
    """Results by worker id; a worker that died without one is reported after a grace period."""
    results: dict = {}
    dead_since: dict = {}
    deadline = time.monotonic() + timeout
    while len(results) < len(procs):
        try:
            wid, status, payload = q.get(timeout=0.5)
            results[wid] = (status, payload)
            continue
        except queue.Empty:
            pass
        now = time.monotonic()
        for wid, p in enumerate(procs):
            if wid in results or p.is_alive():
                continue
            first = dead_since.setdefault(wid, now)
            if now - first > 5:
                results[wid] = ("fail", f"worker {wid} exited with code {p.exitcode} without a result")
        if now > deadline:
            for wid in range(len(procs)):
                results.setdefault(wid, ("fail", f"worker {wid}: no result within {timeout:.0f} s"))
    return results


def percentiles(values: list[float], scale: float) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    p50, p99 = np.percentile(np.asarray(values) * scale, [50, 99])
    return float(p50), float(p99)


def run_workers(args, run: int, workers: int, url: str, uuids: list[str]) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    barrier = ctx.Barrier(workers)
    worker_uuids = [uuids[w % args.gpus] for w in range(workers)] if args.device == "cuda" else []
    cfg = dict(url=url, device=args.device, layout=args.layout, chunks=args.chunks, requests=args.requests,
               lookups=args.lookups, tp=args.tp, workers=workers, run=run, timeout=args.timeout,
               gpu_uuids=worker_uuids)
    procs = []
    for w in range(workers):
        env = {"CUDA_VISIBLE_DEVICES": worker_uuids[w]} if args.device == "cuda" else {}
        with patched_env(env):  # a spawned child starts with this process's environment
            p = ctx.Process(target=worker_main, args=(cfg, w, barrier, q), name=f"bench-worker-{w}")
            p.start()
        procs.append(p)
    try:
        results = collect(procs, q, args.timeout + 300)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
    failures = {w: msg for w, (st, msg) in results.items() if st != "ok"}
    if failures:
        return {"workers": workers, "error": failures}
    infos = [results[w][1] for w in range(workers)]
    return {"workers": workers, "infos": infos}


def summarize(args, workers: int, infos: list[dict], ceilings: dict) -> dict:
    gpus_used = min(workers, args.gpus) if args.device == "cuda" else 0
    ceil = ceilings["concurrent"][max(1, gpus_used)]
    store_bytes = sum(i["store_bytes"] for i in infos)
    retrieve_bytes = sum(i["retrieve_bytes"] for i in infos)
    store_gbps = store_bytes / max(i["store_wall_s"] for i in infos) / 1e9
    retrieve_gbps = retrieve_bytes / max(i["retrieve_wall_s"] for i in infos) / 1e9
    cat = lambda k: [x for i in infos for x in i[k]]
    s50, s99 = percentiles(cat("store_latency_s"), 1e3)
    r50, r99 = percentiles(cat("retrieve_latency_s"), 1e3)
    l50, l99 = percentiles(cat("lookup_latency_s"), 1e6)
    requested = sum(i["requested_chunks"] for i in infos)
    return {
        "workers": workers, "gpus": gpus_used,
        "store_GBps": store_gbps, "store_ratio": store_gbps / ceil["d2h"],
        "retrieve_GBps": retrieve_gbps, "retrieve_ratio": retrieve_gbps / ceil["h2d"],
        "ceiling_d2h_GBps": ceil["d2h"], "ceiling_h2d_GBps": ceil["h2d"],
        "store_ms_p50": s50, "store_ms_p99": s99, "retrieve_ms_p50": r50, "retrieve_ms_p99": r99,
        "lookup_us_p50": l50, "lookup_us_p99": l99,
        "mismatches": sum(i["mismatches"] for i in infos),
        "requested_chunks": requested,
        "stored_chunks": sum(i["stored_chunks"] for i in infos),
        "present_chunks": sum(i["present_chunks"] for i in infos),
        "skipped_chunks": sum(i["skipped_chunks"] for i in infos),
        "loaded_chunks": sum(i["loaded_chunks"] for i in infos),
        "lookups_short": sum(i["lookups_short"] for i in infos),
        "store_bytes": store_bytes, "retrieve_bytes": retrieve_bytes,
    }


# ---- main -------------------------------------------------------------------------------------

def l1_plan(args, obj: int) -> tuple[int, int, int]:
    """(L1 bytes, slab bytes, objects) so that every worker's stored chunks fit at once."""
    slab = max(SLAB, -(-obj // 4096) * 4096)
    slot = -(-obj // SLOT_ALIGN) * SLOT_ALIGN
    per_slab = slab // slot
    objects = max(args.workers) * (args.requests * args.chunks + 1)  # + one warm-up chunk each
    slabs = max(4, math.ceil(objects / per_slab) + 1)
    return slabs * slab, slab, objects


def mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def transfer_mode_label(args, lay: dict, regs: list[dict]) -> str:
    modes = sorted({str(r.get("transfer_mode")) for r in regs}) or ["?"]
    label = ",".join(modes)
    if modes == ["auto"]:
        from lmcache_mp.layout import infer_layout
        from lmcache_mp.server.policy import choose_transfer_mode

        shape = kv_shape(lay, 2 * args.chunks * (CHUNK // lay["block_size"]))
        strides = [int(np.prod(shape[i + 1:])) for i in range(len(shape))]
        spec = infer_layout(shape, strides, DTYPE_BYTES, "bfloat16", lay["layers"], lay["kind"])
        label += (f" (policy: store {choose_transfer_mode(spec, 'gather', args.chunks)}, "
                  f"retrieve {choose_transfer_mode(spec, 'scatter', args.chunks)})")
    return label


def print_table(rows: list[dict], unit_note: str) -> None:
    head = (f"{'workers':>7} {'GPUs':>4} | {'store GB/s':>10} {'x D2H':>6} | {'retr GB/s':>10} {'x H2D':>6} | "
            f"{'store ms p50/p99':>17} | {'retr ms p50/p99':>17} | {'lookup us p50/p99':>18} | {'mismatch':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['workers']:>7} FAILED: see above")
            continue
        print(f"{r['workers']:>7} {r['gpus']:>4} | {r['store_GBps']:>10.2f} {r['store_ratio']:>6.2f} | "
              f"{r['retrieve_GBps']:>10.2f} {r['retrieve_ratio']:>6.2f} | "
              f"{r['store_ms_p50']:>8.2f}/{r['store_ms_p99']:<8.2f} | "
              f"{r['retrieve_ms_p50']:>8.2f}/{r['retrieve_ms_p99']:<8.2f} | "
              f"{r['lookup_us_p50']:>8.1f}/{r['lookup_us_p99']:<9.1f} | {r['mismatches']:>8}")
    print(unit_note)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--workers", default="1,2,4", help="worker counts, one run each (default 1,2,4)")
    ap.add_argument("--gpus", type=int, default=1, help="spread the workers round-robin over this many GPUs")
    ap.add_argument("--chunks", type=int, default=128, help=f"chunks of {CHUNK} tokens per request")
    ap.add_argument("--requests", type=int, default=4, help="requests stored and retrieved per worker")
    ap.add_argument("--lookups", type=int, default=200)
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="llama3-8b")
    ap.add_argument("--tp", action="store_true",
                    help="the workers are TP ranks of one model (default: separate models)")
    ap.add_argument("--l1-size", default=None, help="server L1 (default: enough for every stored chunk)")
    ap.add_argument("--transfer-mode", default="auto", choices=("auto", "direct", "staged", "dma"))
    ap.add_argument("--repeat", type=int, default=5, help="ceiling: timed copies (median)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds a worker waits on a request or barrier")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    args.workers = [int(w) for w in str(args.workers).split(",") if w.strip()]
    if not args.workers or min(args.workers) < 1 or args.chunks < 1 or args.requests < 1 or args.gpus < 1:
        ap.error("--workers, --chunks, --requests and --gpus must be positive")

    from lmcache_mp.config import format_size, parse_size
    from lmcache_mp.native import build_info

    os.environ["NCCL_NVLS_ENABLE"] = "0"  # no NCCL here; keep NVLink multicast off regardless
    # CUDA IPC needs plain cudaMalloc allocations, not the expandable-segments allocator.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    lay = LAYOUTS[args.layout]
    obj = object_bytes(lay)
    req_bytes = args.chunks * obj
    l1, slab, objects = l1_plan(args, obj)
    if args.l1_size:
        given = parse_size(args.l1_size)
        if given < l1:
            print(f"warning: --l1-size {format_size(given)} is less than the {format_size(l1)} that holds every "
                  "stored chunk: evictions will show up as missing chunks", file=sys.stderr)
        l1 = given
    need = l1 + (args.gpus * req_bytes if args.device == "cuda" else 2 * req_bytes)
    if args.device == "cpu":
        need += max(args.workers) * (2 * req_bytes + obj)  # the workers' KV caches in shared memory
    avail = mem_available()
    if need > 0.85 * avail:
        print(f"error: this run needs about {format_size(need)} of host memory (L1 {format_size(l1)}), "
              f"{format_size(avail)} is available: lower --requests, --chunks or the worker count",
              file=sys.stderr)
        return 2

    uuids: list[str] = []
    gpu_names: list[str] = []
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() < args.gpus:
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            print(f"error: --gpus {args.gpus} but {n} CUDA device(s) visible", file=sys.stderr)
            return 2
        uuids = [f"GPU-{torch.cuda.get_device_properties(g).uuid}" for g in range(args.gpus)]
        gpu_names = [torch.cuda.get_device_name(g) for g in range(args.gpus)]
    else:
        args.gpus = 1

    print(f"layout {args.layout}: {format_size(obj)} per chunk, {format_size(req_bytes)} per request of "
          f"{args.chunks} chunks; {args.requests} requests per worker; workers {args.workers}"
          f"{' as TP ranks of one model' if args.tp else ''}; device {args.device}"
          f"{f' ({args.gpus} GPU(s): {gpu_names[0]})' if gpu_names else ''}", flush=True)
    print(f"server: L1 {format_size(l1)} (slabs of {format_size(slab)}, for {objects} chunks), "
          f"transfer mode {args.transfer_mode}", flush=True)

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    server = ServerProcess(args, l1, slab, env)
    rows, runs, exit_code = [], [], 0
    result: dict = {}
    try:
        client = server.connect(120)
        t0 = time.monotonic()
        pin = server.wait_pinned(900)
        status = client.status()
        if pin.get("error"):
            print(f"warning: pinning L1 reported {pin['error']}", file=sys.stderr)
        print(f"server ready: pinned {pin.get('bytes_pinned', 0) / GiB:.1f} GiB in "
              f"{time.monotonic() - t0:.1f} s", flush=True)

        counts = sorted({min(w, args.gpus) for w in args.workers})
        if args.device == "cuda":
            ceilings = gpu_ceilings(args.gpus, counts, req_bytes, args.repeat)
        else:
            ceilings = cpu_ceiling(req_bytes, args.repeat)
        for k, c in sorted(ceilings["concurrent"].items()):
            print(f"ceiling ({'pinned cudaMemcpyAsync' if args.device == 'cuda' else 'NumPy copy'}, "
                  f"{k} GPU(s) at once): D2H {c['d2h']:.2f} GB/s, H2D {c['h2d']:.2f} GB/s", flush=True)

        modes = "?"
        for run, w in enumerate(args.workers):
            t_run = time.monotonic()
            evicted_before = client.status()["l1"].get("evicted", 0)
            res = run_workers(args, run, w, server.url, uuids)
            after = client.status()["l1"]
            if "error" in res:
                for wid, msg in sorted(res["error"].items()):
                    print(f"--- worker {wid} of the {w}-worker run failed:\n{msg}", file=sys.stderr)
                print(f"--- server log (tail):\n{server.log_tail()}", file=sys.stderr)
                rows.append({"workers": w, "error": res["error"]})
                runs.append({"workers": w, "error": res["error"]})
                exit_code = 1
                break
            infos = res["infos"]
            row = summarize(args, w, infos, ceilings)
            row["evicted"] = after.get("evicted", 0) - evicted_before
            regs = next((i["status_registrations"] for i in infos if "status_registrations" in i), [])
            modes = transfer_mode_label(args, lay, regs)
            row["transfer_mode"] = modes
            rows.append(row)
            runs.append({"summary": row, "workers_detail": infos, "l1_after": after,
                         "seconds": time.monotonic() - t_run})
            problems = []
            if row["mismatches"]:
                problems.append(f"{row['mismatches']} mismatching or missing chunks")
            if row["evicted"]:
                problems.append(f"{row['evicted']} chunks evicted from L1 during the run")
            if row["skipped_chunks"]:
                problems.append(f"{row['skipped_chunks']} chunks skipped by the store (L1 full)")
            if row["lookups_short"]:
                problems.append(f"{row['lookups_short']} lookups found fewer than {args.chunks} chunks")
            if not (args.tp and lay["kind"] == "mla") and row["stored_chunks"] != row["requested_chunks"]:
                problems.append(f"stored {row['stored_chunks']} of {row['requested_chunks']} chunks")
            if problems:
                exit_code = 1
                print(f"!! {w} workers: " + "; ".join(problems), file=sys.stderr)
            print(f"run with {w} worker(s): {time.monotonic() - t_run:.1f} s, transfer mode {modes}", flush=True)
            client.clear()  # the next run starts from an empty L1

        print()
        print_table(rows, "GB/s = 1e9 bytes/s, bytes of all workers / slowest worker's phase wall time; "
                          "x D2H / x H2D = ratio to the ceiling measured in this run")
        print(f"transfer mode (server status): {modes}")
        result = {
            "bench": "bench_server",
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "config": {**vars(args), "chunk_size": CHUNK, "object_bytes": obj, "request_bytes": req_bytes,
                       "l1_bytes": l1, "slab_bytes": slab},
            "host": {"platform": platform.platform(), "python": platform.python_version(),
                     "cpus": os.cpu_count(), "build": build_info(), "gpus": gpu_names, "gpu_uuids": uuids},
            "server": {"pinning": pin, "arena": status["l1"].get("arena"), "transfer_mode": modes},
            "ceilings": ceilings,
            "rows": rows,
            "runs": runs,
        }
    except BaseException:
        traceback.print_exc()
        print(f"--- server log (tail):\n{server.log_tail()}", file=sys.stderr)
        exit_code = 1
    finally:
        stopped = server.stop()
    if stopped["exit_code"] != 0 or stopped["tracebacks"]:
        print(f"!! server exited with {stopped['exit_code']}, {stopped['tracebacks']} traceback(s) in its log "
              f"{stopped['log']}", file=sys.stderr)
        exit_code = 1
    if result:
        result["server"]["shutdown"] = stopped
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1, default=str)
            print(f"wrote {args.json}")
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
