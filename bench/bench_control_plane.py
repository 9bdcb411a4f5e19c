"""Control-plane cost: lookup and store round trips through Client and the server, next to a bare
pyzmq DEALER/ROUTER round trip of the same message size measured in the same run.

The server (CPU device) and the bare echo peer each run in their own process, like a real
deployment; the client side runs here, one thread.

    python bench/bench_control_plane.py [--iters 3000] [--chunks 1,32,128] [--tenants] [--json out.json]

--tenants: the server runs with a tenants file naming this process's uid (docs/tenants.md), so every
request is checked against its connection's credential and scoped into the tenant's namespace.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import zmq

from lmcache_mp.loadgen.trace import ECHO
from server_process import ServerProcess


def percentiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"p50_us": xs[len(xs) // 2] * 1e6, "p99_us": xs[int(len(xs) * 0.99)] * 1e6}


def timed_pair(a, b, iters: int) -> tuple[list[float], list[float]]:
    """Round trips of a and b, alternating, so that both see the same machine state (CPU
    frequency and idle states change ping-pong latency a lot)."""
    for _ in range(min(200, iters)):
        a()
        b()
    ta, tb = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        a()
        t1 = time.perf_counter()
        b()
        t2 = time.perf_counter()
        ta.append(t1 - t0)
        tb.append(t2 - t1)
    return ta, tb


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--chunks", default="1,32,128", help="chunk hashes per lookup")
    ap.add_argument("--tenants", action="store_true", help="a server with a tenants file (this uid's tenant)")
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch

    from lmcache_mp import Client, chunk_hashes, protocol as p, shared_cpu_tensor

    tmp = tempfile.mkdtemp(prefix="lmcache-cp-")
    server_url, echo_url = f"ipc://{tmp}/server", f"ipc://{tmp}/echo"
    tenants = []
    if args.tenants:
        with open(f"{tmp}/tenants.toml", "w") as f:
            f.write(f"[tenants.bench]\nuids = [{os.getuid()}]\n")
        tenants = ["--tenants", f"{tmp}/tenants.toml"]
    server = ServerProcess(["--url", server_url, "--device", "cpu", "--l1-size", "256MiB", "--chunk-size", "16",
                            "--log-level", "WARNING", *tenants], log_path=f"{tmp}/server.log")
    echo = subprocess.Popen([sys.executable, "-c", ECHO, echo_url])
    results: dict = {"benchmark": "bench_control_plane", "date": time.strftime("%Y-%m-%d"), "iters": args.iters,
                     "tenants": args.tenants, "rows": []}
    try:
        server.wait_ready(60)
        client = Client(server_url)
        ctx = zmq.Context()
        bare = ctx.socket(zmq.DEALER)
        bare.connect(echo_url)
        kv = [shared_cpu_tensor((2, 64, 16, 1, 8), torch.float16) for _ in range(2)]
        handle = client.register_kv_cache(kv, model="m")
        for n in [int(c) for c in args.chunks.split(",")]:
            hashes = chunk_hashes(np.arange(n * 16), 16)
            body = p.encode(p.Lookup(client_id=client.client_id, model="m", world_size=1,
                                     hashes=b"".join(hashes), lock=False))
            rid = p.pack_request_id(1)

            def bare_rt():
                bare.send_multipart((rid, body))
                bare.recv_multipart()

            t_bare, t_lookup = timed_pair(bare_rt, lambda h=hashes: client.lookup(h, model="m"), args.iters)
            row = {"op": "lookup", "chunks": n, "bytes": len(body), "bare": percentiles(t_bare),
                   "client": percentiles(t_lookup)}
            row["ratio_p50"] = row["client"]["p50_us"] / row["bare"]["p50_us"]
            results["rows"].append(row)
        # a 1-chunk store of a tiny CPU cache: the whole request path, bytes nearly free
        hashes = chunk_hashes(np.arange(16), 16)
        client.store(handle, hashes, [0]).result()
        body = p.encode(p.Store(kv_id=handle.kv_id, hashes=hashes[0], block_ids=p.pack_block_ids([0]),
                                client_id=client.client_id))

        def bare_store():
            bare.send_multipart((rid, body))
            bare.recv_multipart()

        t_bare, t_store = timed_pair(bare_store, lambda: client.store(handle, hashes, [0]).result(), args.iters // 3)
        t_bare2, t_retr = timed_pair(bare_store, lambda: client.retrieve(handle, hashes, [1]).result(),
                                     args.iters // 3)
        for op, t, tb in (("store (present)", t_store, t_bare), ("retrieve 1 chunk", t_retr, t_bare2)):
            row = {"op": op, "chunks": 1, "bytes": len(body), "bare": percentiles(tb), "client": percentiles(t)}
            row["ratio_p50"] = row["client"]["p50_us"] / row["bare"]["p50_us"]
            results["rows"].append(row)
        # throughput: lookups from one thread, back to back
        hashes = chunk_hashes(np.arange(32 * 16), 16)
        t0 = time.perf_counter()
        for _ in range(args.iters):
            client.lookup(hashes, model="m")
        results["lookups_per_s"] = args.iters / (time.perf_counter() - t0)
        client.close()
        bare.close(linger=0)
        ctx.term()
    finally:
        echo.kill()
        server.stop(30)
    print(f"control plane, {os.cpu_count()} cores, {args.iters} iterations, server and echo peer in own processes"
          f"{', server with tenants' if args.tenants else ''}")
    print(f"{'op':18s} {'chunks':>6s} {'bytes':>6s} {'bare p50/p99 us':>18s} {'client p50/p99 us':>19s} {'x bare':>7s}")
    for r in results["rows"]:
        print(f"{r['op']:18s} {r['chunks']:6d} {r['bytes']:6d} {r['bare']['p50_us']:8.1f}/{r['bare']['p99_us']:8.1f} "
              f"{r['client']['p50_us']:9.1f}/{r['client']['p99_us']:8.1f} {r['ratio_p50']:7.2f}")
    print(f"lookups/s (32 chunks, one thread): {results['lookups_per_s']:.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
