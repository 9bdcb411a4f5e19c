"""A small store or retrieve while the engine's own process uses the GPU.

The server and the engine are different processes, so different CUDA contexts. Without MPS a GPU
runs the kernels of one context at a time and switches between them; copy engines are shared
more freely. This measures what that costs a 1-chunk request: for each transfer mode, one server
(in its own process) and this process as the engine, which before each request does one of

  idle              no GPU work
  tiny kernel       launches an empty kernel on a stream the request does not wait for
  long kernel       launches a ~0.5 ms kernel on a stream the request does not wait for
  event             launches an empty kernel on the request's stream (the server waits for it)

and reports p50 latencies and each case's ratio to the idle one (the ceiling of this run).

    python bench/bench_cross_process.py [--layers 8] [--requests 100] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

CASES = ("idle", "tiny kernel", "long kernel", "event")
LONG_KERNEL_CYCLES = 1_000_000  # ~0.5 ms on an H200


def serve(url: str, mode: str, q) -> None:
    from lmcache_mp import Server, ServerConfig

    srv = Server(ServerConfig(url=url, device="cuda", l1_size="4GiB", transfer_mode=mode)).start()
    q.put(srv.url)
    while True:
        time.sleep(1)


def run_mode(mode: str, args, tmp: str) -> dict:
    from lmcache_mp import Client, chunk_hashes

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=serve, args=(f"ipc://{tmp}/{mode}.sock", mode, q), daemon=True)
    proc.start()
    out: dict = {}
    try:
        c = Client(q.get(timeout=120), timeout=60)
        while not c.status()["l1"]["pinning"]["done"]:
            time.sleep(0.1)
        if args.layout == "mla":
            kv = [torch.randn((64, 16, 576), dtype=torch.bfloat16, device="cuda") for _ in range(args.layers)]
        else:
            kv = [torch.randn((2, 64, 16, 8, 128), dtype=torch.bfloat16, device="cuda") for _ in range(args.layers)]
        h = c.register_kv_cache(kv, model=f"bench-{mode}", layout=args.layout)
        src = np.arange(16, dtype=np.int64)
        dst = np.arange(16, 32, dtype=np.int64)
        s, other = torch.cuda.Stream(), torch.cuda.Stream()
        rng = np.random.default_rng(0)
        for case in CASES:
            lat = {"store": [], "retrieve": []}
            for _ in range(args.requests):
                hashes = chunk_hashes(rng.integers(0, 50000, 256), 256)
                for op in ("store", "retrieve"):
                    if case != "idle":
                        with torch.cuda.stream(s if case == "event" else other):
                            torch.cuda._sleep(LONG_KERNEL_CYCLES if case == "long kernel" else 0)
                    t0 = time.perf_counter()
                    if op == "store":
                        ok = c.store(h, hashes, src, stream=s).result().chunks == 1
                    else:
                        ok = c.retrieve(h, hashes, dst, stream=s).result().loaded == 1
                    lat[op].append(time.perf_counter() - t0)
                    if not ok:
                        raise RuntimeError(f"{op} did not move its chunk")
                    torch.cuda.synchronize()
                    time.sleep(0.001)
            out[case] = {op: statistics.median(v) * 1e3 for op, v in lat.items()}
        c.close()
    finally:
        proc.terminate()
        proc.join()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", choices=("mla", "mha"), default="mla")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--modes", default="staged,direct,dma")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--json")
    args = ap.parse_args()
    # how long the long kernel runs alone, seen from the host
    t = []
    for _ in range(20):
        t0 = time.perf_counter()
        torch.cuda._sleep(LONG_KERNEL_CYCLES)
        torch.cuda.synchronize()
        t.append(time.perf_counter() - t0)
    long_ms = statistics.median(t) * 1e3
    print(f"{args.layout}, {args.layers} layers, 1 chunk of 256 tokens; long kernel alone: {long_ms:.3f} ms")
    print(f"{'mode':8s} {'engine before the request':28s} {'store ms':>9s} {'x idle':>7s} {'retrieve ms':>12s} "
          f"{'x idle':>7s}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            r = results[mode] = run_mode(mode, args, tmp)
            for case in CASES:
                st, rt = r[case]["store"], r[case]["retrieve"]
                print(f"{mode:8s} {case:28s} {st:9.3f} {st / r['idle']['store']:7.2f} {rt:12.3f} "
                      f"{rt / r['idle']['retrieve']:7.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "bench_cross_process", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                       "config": vars(args), "long_kernel_ms": long_ms, "p50_ms": results,
                       "gpu": torch.cuda.get_device_name(0)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
