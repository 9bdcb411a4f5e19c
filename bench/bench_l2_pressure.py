"""The L2 disk tier under pressure, as a user meets it: `lmcache-mp-server --device cpu` processes
with a small L1 and a disk tier, driven by one client (chunks of --chunk-mib MiB).

  burst     --prompts prompts of 4 chunks stored back to back into --l1-size, then idle: what
            was written and dropped, and after a restart how many prompts the disk serves whole,
            in part (a prefix) or not at all; chunks on disk no lookup reaches (fragments)
  steady    the same with one store every --interval seconds: nothing should be dropped
  long      a prefix of --long-chunks chunks of --long-chunk-mib only on disk (a restarted server), longer than L1:
            a lookup with lock leases the longest prefix that fits (twice), one without lock
            counts all of it

    python bench/bench_l2_pressure.py --dir /tmp/l2-pressure [--l1-size 64MiB] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from lmcache_mp import Client, chunk_hashes, shared_cpu_tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_l2 import ServerProc  # noqa: E402

CHUNK, BLOCK = 256, 16
MiB = 1 << 20


class Node:
    """A server process on a disk directory, a client and a registered CPU KV cache."""

    def __init__(self, args, disk: str, l1: str, *extra: str, chunk_mib: int = 0):
        import torch

        self.url = f"ipc://{tempfile.mkdtemp()}/s.sock"
        self.srv = ServerProc(["--url", self.url, "--device", "cpu", "--l1-size", l1, "--l2-disk", disk,
                               "--l2-disk-size", args.disk_size, "--http-addr", "off", *extra])
        self.c = Client(self.url, timeout=60)
        width = (chunk_mib or args.chunk_mib) * MiB // (2 * CHUNK * 2)  # bf16 elements per token of one segment
        self.kv = [shared_cpu_tensor((2, 2 * args.long_chunks * CHUNK // BLOCK, BLOCK, 1, width), torch.bfloat16)]
        self.kv[0].view(torch.int16).random_()
        self.h = self.c.register_kv_cache(self.kv, model="m", layout="mha")

    def store(self, seed: int, chunks: int, end: int | None = None) -> int:
        hashes = chunk_hashes(prompt(seed, chunks), CHUNK)[:end]
        return self.c.store(self.h, hashes, np.arange(len(hashes) * CHUNK // BLOCK)).result(60).chunks

    def found(self, seed: int, chunks: int, lock: bool = False) -> int:
        n = self.c.lookup(chunk_hashes(prompt(seed, chunks), CHUNK), model="m", lock=lock)
        if lock and n:
            self.c.release(lease=n)
        return int(n)

    def l2(self) -> dict:
        return self.c.status()["l2"]

    def idle(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not self.l2()["idle"] and time.monotonic() < deadline:
            time.sleep(0.02)

    def stop(self) -> None:
        self.c.close()
        self.srv.stop()


def prompt(seed: int, chunks: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50000, chunks * CHUNK)


def stores(args, name: str, interval: float) -> dict:
    disk = os.path.join(args.dir, name)
    a = Node(args, disk, args.l1_size)
    t0 = time.perf_counter()
    for seed in range(args.prompts):
        assert a.store(seed, 4) == 4
        if interval:
            time.sleep(interval)
    took = time.perf_counter() - t0
    time.sleep(args.idle)
    st = a.l2()
    a.stop()
    b = Node(args, disk, args.l1_size)  # L1 empty: every hit comes from the disk
    counts = [b.found(seed, 4) for seed in range(args.prompts)]
    on_disk = b.l2()["tiers"][0]["objects"]
    b.stop()
    whole = sum(n == 4 for n in counts)
    nbytes = 4 * args.prompts * args.chunk_mib * MiB
    return {"prompts": args.prompts, "store_s": took, "store_GBps": nbytes / took / 1e9,
            "written": st["written"], "dropped_writes": st["dropped_writes"], "whole": whole,
            "partial": sum(0 < n < 4 for n in counts), "none": counts.count(0), "chunks_on_disk": on_disk,
            "chunks_found": sum(counts), "fragments": on_disk - sum(counts),
            "disk_write_GBps": st["tiers"][0]["write_GBps"]}


def long_prefix(args) -> dict:
    disk = os.path.join(args.dir, "long")
    n = args.long_chunks
    mib = args.long_chunk_mib
    a = Node(args, disk, f"{2 * n * mib}MiB", "--l2-disk-write", "all", chunk_mib=mib)
    for end in range(8, n + 8, 8):
        assert a.store(1, n, min(end, n)) == min(end, n)
        a.idle()
    written = a.l2()["written"]
    a.stop()
    b = Node(args, disk, args.l1_size, chunk_mib=mib)
    out = {"chunks": n, "chunk_mib": mib, "written": written, "lookup": b.found(1, n)}
    for k in ("first", "second"):
        t0 = time.perf_counter()
        out[f"locked_{k}"] = b.found(1, n, lock=True)
        out[f"locked_{k}_s"] = time.perf_counter() - t0
    b.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="a directory on the disk to use (emptied first)")
    ap.add_argument("--l1-size", default="64MiB")
    ap.add_argument("--disk-size", default="2GiB")
    ap.add_argument("--chunk-mib", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--interval", type=float, default=0.05, help="steady: seconds between stores")
    ap.add_argument("--steady-prompts", type=int, default=48, help="steady: prompts (L1 must evict)")
    ap.add_argument("--idle", type=float, default=2.0, help="seconds of idle after the stores")
    ap.add_argument("--long-chunks", type=int, default=40)
    ap.add_argument("--long-chunk-mib", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    out = {"burst": stores(args, "burst", 0.0)}
    burst_prompts, args.prompts = args.prompts, args.steady_prompts
    out["steady"] = stores(args, "steady", args.interval)
    args.prompts = burst_prompts
    out["long"] = long_prefix(args)
    for name in ("burst", "steady"):
        r = out[name]
        print(f"{name}: {r['prompts']} prompts of 4 x {args.chunk_mib} MiB in {r['store_s']:.2f} s "
              f"({r['store_GBps']:.2f} GB/s) into L1 {args.l1_size}; written {r['written']}, dropped "
              f"{r['dropped_writes']} (disk writes {r['disk_write_GBps']:.2f} GB/s); after a restart: "
              f"{r['whole']} whole, {r['partial']} in part, {r['none']} absent; {r['chunks_on_disk']} chunks on "
              f"disk, {r['chunks_found']} found by lookups, {r['fragments']} fragments (after a missing chunk)")
    r = out["long"]
    print(f"long: {r['chunks']} chunks of {r['chunk_mib']} MiB on disk, L1 {args.l1_size}: lookup {r['lookup']}; "
          f"with lock {r['locked_first']} ({r['locked_first_s']:.2f} s), again {r['locked_second']} "
          f"({r['locked_second_s']:.2f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "bench_l2_pressure", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                       "config": vars(args), **out}, f, indent=1)
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
