"""What pinning each live session's context for its think time buys (hints, docs/hints.md), on a trace of
sessions replayed through a real server, against the same replay without pins in the same run.

Each request is replayed as bench_trace.py's server mode does (lookup with lock, retrieve the hits,
store the rest naming the chunk before it: one block of the trace is one 4 KiB chunk, L1 holds
exactly SIZE of them). A session is the requests that share their first block (the agentic trace's
ids are local to a session). With pins, once a request is answered its session's whole context is
pinned (`pin` hint) until the session's next request comes, in trace time:

  --pin-ttl think      for the gap to the session's next request (what a harness knows while a
                       tool runs); none after a session's last request
  --pin-ttl think<=S   the same, only where that gap is at most S seconds (a tool call, not a
                       person reading: the median gap of the agentic trace is 18 s, its 90th
                       percentile 107 s)
  --pin-ttl S          for S seconds, whenever a next request comes

A pin's end is the driver's `unpin` once the trace's clock passes it (the server's own TTL, in
wall-clock seconds, is only a backstop), so a replay faster than the trace keeps the trace's
timing. Pins past the hint budget (--budget, a share of L1) are refused and counted. Reports the
share of requested blocks served, and x the run without pins.

    python bench/bench_pins.py [--trace FILE] [--sizes 1000,2000,4000,8000] [--pin-ttl think,60]
        [--budget 0.25,0.5] [--policy lru] [--requests N] [--json out.json]
        (--pin-ttl values are comma-separated: think, think<=S or S)
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from server_process import ServerProcess  # noqa: E402

from lmcache_mp.storage.eviction import DEFAULT_POLICY, POLICIES  # noqa: E402
from lmcache_mp.storage.eviction.simulate import block_key  # noqa: E402

DEFAULT_TRACE = os.path.join(HERE, "..", "..", "shared", "traces", "agentic_coding_trace.jsonl")
TOKENS_PER_CHUNK = 16  # of the server's chunks here (bench_trace.py's): 16 tokens x 1 head of 64 fp16 x (K, V)
CHUNK_BYTES = 4096
SERVER_TTL = 3600.0  # the most a pin may ask: the driver ends each pin itself, in trace time


def load(path: str, limit: int = 0) -> list[dict]:
    """Requests in arrival order: their blocks and arrival time (ms)."""
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                out.append({"blocks": r["hash_ids"], "t": float(r["timestamp"])})
                if limit and len(out) >= limit:
                    break
    return out


def next_turns(trace: list[dict]) -> list[float | None]:
    """Per request, the time (ms) of its session's next request (None after its last)."""
    out: list[float | None] = [None] * len(trace)
    last: dict[int, int] = {}
    for i, req in enumerate(trace):
        if not req["blocks"]:
            continue
        session = req["blocks"][0]
        if session in last:
            out[last[session]] = req["t"]
        last[session] = i
    return out


def drive(url: str, trace: list[dict], digests: dict[int, bytes], pin_ttl: str) -> dict:
    from lmcache_mp import Client, shared_cpu_array
    from lmcache_mp.errors import RequestError

    most = max(len(r["blocks"]) for r in trace)
    kv = shared_cpu_array((2, most, TOKENS_PER_CHUNK, 1, 64), np.float16)
    client = Client(url, timeout=120, name="bench-pins")
    turns = next_turns(trace) if pin_ttl else []
    out = {"blocks": 0, "served": 0, "pins": 0, "refused": 0, "skipped": 0, "most_pinned_bytes": 0}
    pinned: dict[int, list[bytes]] = {}  # session -> the keys its live pin holds
    ends: list[tuple[float, int, int]] = []  # (trace ms, request index, session): when a pin ends
    until: dict[int, int] = {}  # session -> the request whose pin is its live one
    try:
        handle = client.register_kv_cache([kv], model="trace")
        blocks = np.arange(most)
        t0 = time.monotonic()
        for i, req in enumerate(trace):
            while ends and ends[0][0] <= req["t"]:  # the pins whose time is up, in trace time
                _, owner, session = heapq.heappop(ends)
                if until.get(session) == owner:
                    client.hint("unpin", pinned.pop(session), model="trace")
                    del until[session]
            keys = [digests[b] for b in req["blocks"]]
            found = client.lookup(keys, model="trace", lock=True)
            n = int(found)
            if n:
                client.retrieve(handle, keys[:n], blocks[:n], lease=found).result()
            if n < len(keys):
                out["skipped"] += client.store(handle, keys[n:], blocks[n:len(keys)],
                                               parent=keys[n - 1] if n else b"").result().skipped
            out["blocks"] += len(keys)
            out["served"] += n
            if not pin_ttl or not keys:
                continue
            nxt = turns[i]
            if nxt is None:
                continue
            if pin_ttl.startswith("think"):
                if nxt - req["t"] > 1000 * float(pin_ttl.partition("<=")[2] or "inf"):
                    continue
                end = nxt
            else:
                end = req["t"] + 1000 * float(pin_ttl)
            session = req["blocks"][0]
            old = pinned.pop(session, None)
            if old is not None:  # the new pin holds the session's whole context: the old one goes first
                client.hint("unpin", old, model="trace")
                until.pop(session, None)
            try:
                r = client.hint("pin", keys, model="trace", ttl=SERVER_TTL)
            except RequestError as e:
                if "LIMIT_EXCEEDED" not in str(e):
                    raise
                out["refused"] += 1
                continue
            out["pins"] += 1
            out["most_pinned_bytes"] = max(out["most_pinned_bytes"], r.pinned_bytes)
            pinned[session], until[session] = keys, i
            heapq.heappush(ends, (end, i, session))
        out["seconds"] = round(time.monotonic() - t0, 2)
        client.unregister_kv_cache(handle)
    finally:
        client.close()
        del kv
    out["ratio"] = round(out["served"] / out["blocks"], 4)
    return out


def run(trace: list[dict], digests: dict[int, bytes], size: int, policy: str, pin_ttl: str, budget: float) -> dict:
    folder = tempfile.mkdtemp(prefix="lmcache-bench-pins-")
    args = ["--device", "cpu", "--l1-size", str(size * CHUNK_BYTES), "--slab-size", str(CHUNK_BYTES),
            "--chunk-size", str(TOKENS_PER_CHUNK), "--eviction-policy", policy, "--http-addr", "off",
            "--heartbeat-timeout", "600", "--hint-budget", str(max(CHUNK_BYTES, int(budget * size) * CHUNK_BYTES))]
    srv = ServerProcess(args, os.path.join(folder, "server.log"))
    try:
        srv.wait_ready()
        got = drive(srv.url, trace, digests, pin_ttl)
    finally:
        srv.stop()
        shutil.rmtree(folder, ignore_errors=True)
    return {"size": size, "policy": policy, "pin_ttl": pin_ttl or "-", "budget": budget if pin_ttl else 0.0, **got}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=DEFAULT_TRACE)
    ap.add_argument("--requests", type=int, default=0, help="the first N requests only (0: all)")
    ap.add_argument("--sizes", default="1000,2000,4000,8000", help="L1 sizes, in blocks")
    ap.add_argument("--policy", default=DEFAULT_POLICY, help=f"the eviction policy ({', '.join(POLICIES)})")
    ap.add_argument("--pin-ttl", default="think", help="how long a pin lasts: think, or seconds (comma-separated)")
    ap.add_argument("--budget", default="0.25", help="the hint budget as a share of L1 (comma-separated)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.policy not in POLICIES:
        ap.error(f"unknown policy {args.policy}: one of {', '.join(POLICIES)}")
    trace = load(args.trace, args.requests)
    digests = {b: block_key(b).digest for r in trace for b in r["blocks"]}
    ttls = [t for t in args.pin_ttl.split(",") if t]
    budgets = [float(b) for b in args.budget.split(",") if b]
    print(f"{args.trace}: {len(trace)} requests, {sum(len(r['blocks']) for r in trace)} blocks, "
          f"{len({r['blocks'][0] for r in trace if r['blocks']})} sessions; policy {args.policy}")
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        base = run(trace, digests, size, args.policy, "", 0.0)
        rows.append({**base, "vs_no_pins": 1.0})
        print(f"  {size} blocks, no pins: {base['ratio']:.3f} ({base['seconds']} s)", file=sys.stderr)
        for ttl in ttls:
            for budget in budgets:
                got = run(trace, digests, size, args.policy, ttl, budget)
                got["vs_no_pins"] = round(got["ratio"] / base["ratio"], 3) if base["ratio"] else 0.0
                rows.append(got)
                print(f"  {size} blocks, pins {ttl} within {budget:g} of L1: {got['ratio']:.3f} ({got['seconds']} s)",
                      file=sys.stderr)
    print("\nshare of requested blocks served through the server, with and without pins (x the run without pins; "
          "pins made and refused over the budget; the most bytes pinned at once, as a share of L1):")
    print(f"{'blocks':>8} {'pin ttl':>10} {'budget':>7} {'served':>7} {'x none':>7} {'pins':>6} {'refused':>8} "
          f"{'pinned':>7} {'req/s':>6}")
    for r in rows:
        share = r["most_pinned_bytes"] / (r["size"] * CHUNK_BYTES)
        print(f"{r['size']:>8} {r['pin_ttl']:>10} {r['budget']:>7.2f} {r['ratio']:>7.3f} {r['vs_no_pins']:>6.2f}x "
              f"{r['pins']:>6} {r['refused']:>8} {share:>7.2f} {len(trace) / r['seconds']:>6.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "bench_pins", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                       "trace": os.path.basename(args.trace), "requests": len(trace), "policy": args.policy,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
