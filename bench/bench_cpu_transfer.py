"""CPU gather/scatter bandwidth for a Llama-3-8B-like layout, next to a contiguous copy of the
same bytes measured in the same run.

    python bench/bench_cpu_transfer.py [--chunks 16] [--repeat 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np

from lmcache_mp import _C
from lmcache_mp.layout import infer_layout
from lmcache_mp.native import cpu_gather, cpu_scatter


def interleaved_medians(arms: dict, repeat: int) -> dict[str, float]:
    """Median seconds per arm, the arms taking turns in every round, so that whatever else the
    machine does slows them alike."""
    for fn in arms.values():
        fn()  # warm-up: page faults, thread start
    times: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(repeat):
        for name, fn in arms.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=16, help="chunks per request")
    ap.add_argument("--blocks", type=int, default=1024, help="blocks in the KV cache")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    if args.threads:
        _C.set_cpu_threads(args.threads)
    L, NB, BS, H, D = args.layers, args.blocks, args.block_size, args.heads, args.head_size
    rng = np.random.default_rng(0)
    esize = 2  # bf16, copied as bytes
    layer_elems = 2 * NB * BS * H * D
    caches = [rng.integers(0, 256, size=layer_elems * esize, dtype=np.uint8) for _ in range(L)]
    spec = infer_layout((2, NB, BS, H, D), (NB * BS * H * D, BS * H * D, H * D, D, 1), esize, "bfloat16", L)
    layout = spec.native([c.ctypes.data for c in caches])
    bpc = args.chunk_size // BS
    n = args.chunks
    ids = rng.permutation(NB)[: n * bpc].astype(np.int64)
    obj_bytes = spec.object_bytes(args.chunk_size)
    objects = np.empty((n, obj_bytes), dtype=np.uint8)
    objects[:] = 1  # fault the pages in before timing
    ptrs = np.array([objects[i].ctypes.data for i in range(n)], dtype=np.uint64)
    total = n * obj_bytes
    src = rng.integers(0, 256, size=total, dtype=np.uint8)
    dst = np.empty_like(src)
    dst[:] = 1

    t = interleaved_medians({
        "gather": lambda: cpu_gather(layout, args.chunk_size, ids, ptrs, obj_bytes),
        "scatter": lambda: cpu_scatter(layout, args.chunk_size, ids, ptrs, obj_bytes),
        "pool": lambda: _C.parallel_memcpy(dst.ctypes.data, src.ctypes.data, total),
        "numpy": lambda: np.copyto(dst, src),
    }, args.repeat)
    t_gather, t_scatter, t_pool, t_numpy = t["gather"], t["scatter"], t["pool"], t["numpy"]
    ceiling = min(t_pool, t_numpy)  # the faster contiguous copy is the ceiling

    gbps = lambda t: total / t / 1e9  # noqa: E731
    rows = [
        ("contiguous copy (thread pool)", gbps(t_pool), t_pool),
        ("contiguous copy (numpy, 1 thread)", gbps(t_numpy), t_numpy),
        ("gather  (KV blocks -> objects)", gbps(t_gather), t_gather),
        ("scatter (objects -> KV blocks)", gbps(t_scatter), t_scatter),
    ]
    print(f"CPU transfer: {L} layers x {H} heads x {D}, bf16, block {BS}, {n} chunks of {args.chunk_size} "
          f"tokens = {total / 2**20:.0f} MiB, random blocks, {_C.cpu_threads()} threads, {platform.processor()}")
    print(f"{'arm':36s} {'GB/s':>8s} {'ms':>8s} {'x ceiling':>10s}")
    for name, g, t in rows:
        print(f"{name:36s} {g:8.2f} {t * 1e3:8.2f} {ceiling / t:10.2f}")
    result = {
        "benchmark": "bench_cpu_transfer",
        "date": time.strftime("%Y-%m-%d"),
        "config": vars(args) | {"bytes": total, "threads_used": _C.cpu_threads()},
        "gbps": {"pool_memcpy": gbps(t_pool), "numpy_memcpy": gbps(t_numpy), "gather": gbps(t_gather),
                 "scatter": gbps(t_scatter)},
        "ratio_to_ceiling": {"gather": ceiling / t_gather, "scatter": ceiling / t_scatter},
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
