"""How far the L1 journal (--l1-persist) lags behind the stores, and what keeping up costs a store.

A `lmcache-mp-server --device cpu --l1-persist` process; --clients client processes store
one-chunk requests of --chunk-kib KiB without pause, each counting the stores answered to it.

  kill   after --acks answered stores, SIGKILL the server, restart it on the same file and count
         the answered stores whose chunks did not come back (each store names a chunk of its
         own; --l1-size must hold them all, an evicted chunk would count as missing).
  cost   --seconds of the same load without and with --l1-persist, one server each, in this
         run: stores per second, store latency (p50, p99), the most chunks that waited for
         their journal records at once and how many a store summed itself.

  --unbounded   the journal's queue without its bound (what it was before it had one), for
                comparison: kill runs only that; cost adds it as a third server.

    python bench/bench_persist_lag.py kill [--runs 3] [--policy lru] [--unbounded] [--json out.json]
    python bench/bench_persist_lag.py cost [--seconds 10] [--unbounded]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from server_process import ServerProcess

CHUNK, BLOCK = 256, 16


UNBOUNDED = ("import sys; import lmcache_mp.storage.l1_persist as p; p.MAX_LAG_STORES = p.MAX_LAG_BYTES = 1 << 60; "
             "from lmcache_mp.server.cli import main; sys.argv[0] = 'lmcache-mp-server'; sys.exit(main())")


def server(url: str, args, persist: str | None, unbounded: bool = False) -> ServerProcess:
    """unbounded: the journal's queue without its bound (as before it had one), for comparison."""
    flags = ["--url", url, "--device", "cpu", "--chunk-size", str(CHUNK), "--l1-size", args.l1_size, "--http-addr",
             "off", "--eviction-policy", args.policy]
    if persist:
        flags += ["--l1-persist", persist]
    srv = ServerProcess(flags, command=[sys.executable, "-c", UNBOUNDED] if unbounded else None)
    srv.wait_ready()
    return srv


def digest(worker: int, i: int) -> bytes:
    from lmcache_mp import chunk_hashes

    tokens = np.random.default_rng((worker, i)).integers(0, 1 << 30, CHUNK)
    return chunk_hashes(tokens, CHUNK)[0]


def store_loop(url: str, worker: int, chunk_kib: int, acks, start, stop, out: str) -> None:
    """Once every client is registered (`start`), store one-chunk requests until `stop`; append
    each answered chunk's hash to `out`."""
    import torch

    from lmcache_mp import Client, shared_cpu_tensor

    width = chunk_kib * 1024 // (2 * CHUNK * 2)  # bf16 elements per token of one segment
    kv = [shared_cpu_tensor((2, 4 * CHUNK // BLOCK, BLOCK, 1, width), torch.bfloat16)]
    kv[0].view(torch.int16).random_()
    c = Client(url, timeout=30)
    h = c.register_kv_cache(kv, model="m")
    blocks = np.arange(CHUNK // BLOCK)
    latencies = []
    start.wait()
    with open(out, "w") as f:
        i = 0
        while not stop.is_set():
            hashed = digest(worker, i)
            t0 = time.perf_counter()
            try:
                got = c.store(h, [hashed], blocks).result(30).chunks
            except Exception:  # the server was killed
                break
            latencies.append(time.perf_counter() - t0)
            if got == 1:
                f.write(hashed.hex() + "\n")
                f.flush()
                with acks.get_lock():
                    acks.value += 1
            i += 1
    np.save(out + ".lat.npy", np.array(latencies))
    try:
        c.close()
    except Exception:
        pass


def load(url: str, args, until):
    """Start the clients; `until(acks)` returns when they should stop. Returns the hashes each
    client was answered for and every store's latency."""
    ctx = mp.get_context("spawn")
    acks, start, stop = ctx.Value("l", 0), ctx.Barrier(args.clients + 1), ctx.Event()
    tmp = tempfile.mkdtemp()
    outs = [f"{tmp}/w{k}" for k in range(args.clients)]
    procs = [ctx.Process(target=store_loop, args=(url, k, args.chunk_kib, acks, start, stop, outs[k]))
             for k in range(args.clients)]
    for p in procs:
        p.start()
    start.wait(120)
    until(acks)
    stop.set()
    return procs, outs


def collect(procs, outs):
    for p in procs:
        p.join(60)
    answered = [bytes.fromhex(x) for o in outs for x in Path(o).read_text().split()]
    lat = np.concatenate([np.load(o + ".lat.npy") for o in outs if os.path.exists(o + ".lat.npy")])
    return answered, lat


def kill_run(args) -> dict:
    from lmcache_mp import Client

    persist = f"/dev/shm/lmcache-mp-bench-{uuid.uuid4().hex[:8]}"
    url = f"ipc://{tempfile.mkdtemp()}/s.sock"
    try:
        srv = server(url, args, persist, args.unbounded)
        t_start = time.monotonic()

        def until(acks):
            while acks.value < args.acks:
                time.sleep(0.002)
            os.kill(srv.pid, signal.SIGKILL)

        procs, outs = load(url, args, until)
        srv.proc.wait(30)
        os.unlink(srv.log_path)
        killed_after = time.monotonic() - t_start
        answered, _ = collect(procs, outs)
        srv = server(url, args, persist)
        try:
            c = Client(url, timeout=30)
            missing = sum(c.lookup([h], model="m") == 0 for h in answered)
            status = c.status()
            c.close()
        finally:
            srv.stop(60)
        reattach = next((x for x in srv.log().splitlines() if "L1 journal:" in x or "L1 in" in x), "")
        os.unlink(srv.log_path)
        return {"answered": len(answered), "missing": int(missing), "seconds": round(killed_after, 2),
                "objects_after": status["l1"]["objects"], "log": reattach}
    finally:
        for p in Path("/dev/shm").glob(Path(persist).name + "*"):
            p.unlink(missing_ok=True)


def cost_run(args, persist: bool, unbounded: bool = False) -> dict:
    from lmcache_mp import Client

    path = f"/dev/shm/lmcache-mp-bench-{uuid.uuid4().hex[:8]}" if persist else None
    url = f"ipc://{tempfile.mkdtemp()}/s.sock"
    status = {}

    def until(acks):
        time.sleep(args.seconds)
        c = Client(url, timeout=60)
        status.update(c.status()["l1"])
        c.close()

    try:
        srv = server(url, args, path, unbounded)
        try:
            procs, outs = load(url, args, until)
            answered, lat = collect(procs, outs)
        finally:
            srv.stop(120)
            os.unlink(srv.log_path)
        return {"persist": ("unbounded" if unbounded else "bounded") if persist else "off", "stores": len(answered),
                "stores_per_s": round(len(answered) / args.seconds, 1),
                "p50_ms": round(float(np.percentile(lat, 50)) * 1e3, 3),
                "p99_ms": round(float(np.percentile(lat, 99)) * 1e3, 3),
                "journal_backlog_max": status.get("journal_backlog_max"),
                "summed_by_stores": status.get("summed_by_stores")}
    finally:
        if path:
            for p in Path("/dev/shm").glob(Path(path).name + "*"):
                p.unlink(missing_ok=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["kill", "cost"])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--chunk-kib", type=int, default=512)
    ap.add_argument("--acks", type=int, default=250)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--l1-size", default="2GiB")
    ap.add_argument("--policy", default="adaptive")
    ap.add_argument("--unbounded", action="store_true", help="kill: the journal without its bound (as before "
                    "it had one); cost: that as a third server")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    results = []
    for _ in range(args.runs):
        if args.mode == "kill":
            r = kill_run(args)
        else:
            r = [cost_run(args, False), cost_run(args, True)] + ([cost_run(args, True, True)] if args.unbounded else [])
        results.append(r)
        print(json.dumps(r), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "load": os.getloadavg(), "results": results},
                                              indent=1))


if __name__ == "__main__":
    main()
