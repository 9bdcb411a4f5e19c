"""The L1 index at scale: does any single store stall while L1 holds a million objects?

Fills an L1Store (no server, no copies: only the index, the LRU list and the arena's slots) with
--objects objects of --object-bytes, then keeps storing requests of --chunks new chunks, each
one evicting as many old ones, for --requests requests. Prints the per-request time: p50, p99,
p99.9 and the longest, and the longest as a multiple of the p50 (the ceiling: a request that
meets no rebuild of any table). Both phases are timed: while L1 fills (the tables grow) and once
it is full (they only churn). The process runs as lmcache-mp-server does: its collector
thresholds, and its chunk objects settled out of the collector every few thousand (gc_pauses).
With --journal DIR, L1 also keeps a journal there (as --l1-persist does), rewritten as it grows.

    python bench/bench_l1_index.py --objects 1000000 --requests 300000 --json l1_index.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

from lmcache_mp.native import HostArena
from lmcache_mp.server.cli import tune_process
from lmcache_mp.server.ops.gc_pauses import made_long_lived
from lmcache_mp.storage.l1 import L1Store, ObjectKey
from lmcache_mp.storage.l1_journal import L1Journal


def _summary(times: list[float]) -> dict:
    s = sorted(times)
    p50 = statistics.median(s)
    return {"requests": len(s), "p50_us": p50 * 1e6, "p99_us": s[int(0.99 * (len(s) - 1))] * 1e6,
            "p999_us": s[int(0.999 * (len(s) - 1))] * 1e6, "max_ms": s[-1] * 1e3, "max_over_p50": s[-1] / p50,
            "over_5ms": sum(t > 0.005 for t in s)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--objects", type=int, default=1_000_000, help="L1 capacity in objects")
    ap.add_argument("--object-bytes", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=16, help="chunks per store request")
    ap.add_argument("--requests", type=int, default=300_000, help="requests in all (fill, then churn)")
    ap.add_argument("--journal", metavar="DIR", help="keep an L1 journal in DIR (a file j.journal)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")  # the journal's rewrites
    tune_process()  # the collector thresholds of lmcache-mp-server, and settling
    arena_bytes = args.objects * args.object_bytes // (1 << 20) * (1 << 20)
    l1 = L1Store(HostArena(arena_bytes, 1 << 20))
    l1.on_commit = made_long_lived
    if args.journal:
        l1.attach_journal(L1Journal(os.path.join(args.journal, "j.journal"), arena_bytes, 1 << 20))
        l1.journal.rewrite([])
    fill, churn = [], []
    started = time.perf_counter()
    for _ in range(args.requests):
        keys = [ObjectKey("m", 1, 0, os.urandom(16), b"") for _ in range(args.chunks)]
        t = time.perf_counter()
        plan = l1.begin_store(keys, args.object_bytes, ("bench",))
        l1.commit(plan)
        t = time.perf_counter() - t
        full = l1.counters["evicted"] > 0
        (churn if full else fill).append(t)
        if len(plan.objects) != args.chunks:
            print(f"a store placed {len(plan.objects)} of {args.chunks} chunks", file=sys.stderr)
            return 1
    l1.close_journal()
    row = {"objects": args.objects, "object_bytes": args.object_bytes, "chunks": args.chunks,
           "journal": bool(args.journal),
           "seconds": time.perf_counter() - started, "objects_held": l1.stats()["objects"],
           "filling": _summary(fill) if fill else None, "full": _summary(churn) if churn else None}
    for phase in ("filling", "full"):
        r = row[phase]
        if r:
            print(f"{phase:>8}: {r['requests']:7} stores of {args.chunks} chunks, p50 {r['p50_us']:6.1f} us, "
                  f"p99 {r['p99_us']:6.1f} us, p99.9 {r['p999_us']:7.1f} us, longest {r['max_ms']:6.1f} ms "
                  f"({r['max_over_p50']:.0f}x p50), {r['over_5ms']} over 5 ms")
    print(f"{row['seconds']:.1f} s in all, {row['objects_held']} objects held at the end")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
