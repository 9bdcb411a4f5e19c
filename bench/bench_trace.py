"""Hits from a real request trace: which share of the requested blocks a cache of a given size
serves, per eviction policy, next to Belady's offline optimum measured in the same run.

  sim      the trace replayed on each policy's own code (storage/eviction/), without a server:
           every policy (switch is the server's default) and Belady's MIN, for every size in
           seconds; each figure also as a ratio to Belady and to LRU, and each policy's CPU time
           per block as a ratio to the default's; with --next-turn, an offline model of valuing
           sessions by when their next turn comes (simulate.next_turn) beside Belady
  server   the trace driven through a real server (`lmcache-mp-server --device cpu` in its own
           process) as an engine drives it: per request a lookup with lock of its chunk keys, a
           retrieve of the hits, a store of the rest naming the chunk before it. One block of
           the trace is one chunk of 4 KiB (the run is bound by the control plane), L1 holds
           exactly SIZE of them; with --disk-blocks a disk tier below it. Reports the blocks and
           tokens served from L1, from the disk tier and recomputed, and the simulation of the
           same policy and of Belady beside them

A trace is JSON lines with `hash_ids` (prefix-chained ids of a prompt's 512-token blocks) and
`input_length` (its tokens), as bench/traces/README.md describes; or `--synthetic KIND`, generated
with a fixed seed (SYNTHETIC below says what each models: docs, agent, chat, sessions, scan).

    python bench/bench_trace.py [--trace FILE] [--sizes 1000,2000,4000,8000,16000] [--mode sim|server|both]
        [--policies switch,adaptive,lru,arc,s3fifo] [--server-policies switch] [--requests N] [--disk-blocks N|NX]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import lzma
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from lmcache_mp.storage.eviction import DEFAULT_POLICY, POLICIES
from lmcache_mp.storage.eviction.simulate import belady, block_key, next_turn, replay

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TRACE = os.path.join(HERE, "traces", "mooncake_conversation_trace.jsonl.xz")
BLOCK_TOKENS = 512
TOKENS_PER_CHUNK = 16  # of the server's chunks here: 16 tokens x --heads heads of 64 fp16 x (K, V)
HEAD_BYTES = 4096  # of a chunk, per head
DISK_HEADER = 4096  # of each file of the disk tier


def load(path: str, limit: int = 0) -> list[dict]:
    opener = lzma.open if path.endswith(".xz") else open
    out = []
    with opener(path, "rt") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                blocks = r["hash_ids"]
                out.append({"blocks": blocks, "tokens": r.get("input_length", BLOCK_TOKENS * len(blocks))})
                if limit and len(out) >= limit:
                    break
    return out


SYNTHETIC = {
    "docs": "popular documents (Zipf skew 1 over 3,000 of 4-40 blocks), each request with a question of its own",
    "agent": "about 60 sessions at a time, each turn adding 1-3 blocks to its session's prompt, quick turns",
    "chat": "a conversation service: 40 system prompts (Zipf), users' multi-turn chats whose next turn comes "
            "hundreds of requests later, a third of them one turn only (reuse rare and late)",
    "sessions": "agentic sessions: long contexts (10-250 blocks) growing 1-6 blocks a turn, 150 or more live, "
                "turns after an exponential think time, sub-agents forking a parent's context",
    "scan": "a hot set of 400 prompts of 4-16 blocks (Zipf) under a flood of one-off documents of 20-120 blocks "
            "(a third of the requests): recency alone keeps the flood",
}


def synthetic(kind: str, requests: int = 12000, seed: int = 1) -> list[dict]:
    """A generated trace (SYNTHETIC says what each models), with a fixed seed."""
    rng = random.Random(seed)
    out: list[list[int]] = []
    fresh = itertools.count(1)

    def zipf(n: int, s: float = 1.0):
        weights = list(itertools.accumulate(1 / (i + 1) ** s for i in range(n)))
        return lambda: bisect.bisect(weights, rng.random() * weights[-1])

    if kind == "docs":
        docs = 3000
        lengths = [rng.randint(4, 40) for _ in range(docs)]
        pick = zipf(docs)
        for n in range(requests):
            d = pick()
            out.append([0, *(1 + d * 1000 + i for i in range(lengths[d])), 10**7 + n])
    elif kind == "agent":
        sessions: list[list[int]] = []
        while len(out) < requests:
            if len(sessions) < 60 or rng.random() < 0.05:
                sessions.append([0, *(next(fresh) for _ in range(rng.randint(2, 10)))])
            i = rng.randrange(len(sessions))
            sessions[i] = sessions[i] + [next(fresh) for _ in range(rng.randint(1, 3))]
            out.append(list(sessions[i]))
            if len(sessions[i]) > 80 or rng.random() < 0.02:
                sessions.pop(i)
    elif kind == "chat":
        prompts = [[next(fresh) for _ in range(rng.randint(2, 8))] for _ in range(40)]
        pick = zipf(len(prompts))
        due: list[tuple[float, int, list[int], int]] = []  # (when, tie, prompt so far, turns left)
        for n in range(requests):
            if due and due[0][0] <= n and rng.random() < 0.6:
                _, _, prompt, left = heapq.heappop(due)
            else:
                prompt, left = list(prompts[pick()]), (0 if rng.random() < 0.33 else rng.randint(1, 8))
            prompt = prompt + [next(fresh) for _ in range(rng.randint(2, 12))]  # the answer and a question
            out.append(prompt)
            if left:
                heapq.heappush(due, (n + rng.expovariate(1 / 400), n, prompt, left - 1))
    elif kind == "sessions":
        live: list[tuple[float, int, list[int]]] = []  # (next turn, tie, context)
        clock = 0.0
        while len(out) < requests:
            clock += rng.expovariate(1.0)
            if len(live) < 150 or rng.random() < 0.02:
                heapq.heappush(live, (clock, next(fresh), [next(fresh) for _ in range(rng.randint(10, 120))]))
            when, tie, ctx = heapq.heappop(live)
            clock = max(clock, when)
            ctx = ctx + [next(fresh) for _ in range(rng.randint(1, 6))]
            out.append(ctx)
            if rng.random() < 0.03:  # a sub-agent: the parent's context and a task of its own
                heapq.heappush(live, (clock + rng.expovariate(1 / 20), next(fresh), ctx + [next(fresh)]))
            if len(ctx) < 250 and rng.random() > 0.01:
                heapq.heappush(live, (clock + rng.expovariate(1 / 150), tie, ctx))
    elif kind == "scan":
        hot = [[next(fresh) for _ in range(rng.randint(4, 16))] for _ in range(400)]
        pick = zipf(len(hot), 0.8)
        for _ in range(requests):
            if rng.random() < 0.33:
                out.append([next(fresh) for _ in range(rng.randint(20, 120))])
            else:
                out.append(hot[pick()] + [next(fresh)])
    else:
        raise ValueError(f"no synthetic trace {kind!r}: one of {', '.join(SYNTHETIC)}")
    return [{"blocks": b, "tokens": BLOCK_TOKENS * len(b)} for b in out[:requests]]


def block_tokens(req: dict) -> list[int]:
    """Tokens of each block of a request (the last block may be partial)."""
    n = len(req["blocks"])
    last = req["tokens"] - BLOCK_TOKENS * (n - 1)
    return [BLOCK_TOKENS] * (n - 1) + [min(BLOCK_TOKENS, max(1, last))] if n else []


# ---- simulation -----------------------------------------------------------------------------------


def simulate(requests: list[list[int]], sizes: list[int], policies: list[str], sessions: bool = False) -> list[dict]:
    """Each policy's share served at each size, and the CPU time of its replay per block (the
    replay's own work included: compare policies of the same run)."""
    rows = []
    blocks = sum(map(len, requests)) or 1
    for size in sizes:
        t0 = time.monotonic()
        best = belady(requests, size)["ratio"]
        got, cpu = {}, {}
        for p in policies:
            c0 = time.process_time()
            got[p] = replay(requests, p, size)["ratio"]
            cpu[p] = (time.process_time() - c0) / blocks * 1e6
        lru = got.get("lru") or replay(requests, "lru", size)["ratio"]
        models = [("belady", best)]
        if sessions:
            models.append(("next-turn", next_turn(requests, size)["ratio"]))
        for name, ratio in [*got.items(), *models]:
            rows.append({"size": size, "policy": name, "ratio": round(ratio, 4),
                         "vs_belady": round(ratio / best, 3) if best else 0.0,
                         "vs_lru": round(ratio / lru, 3) if lru else 0.0,
                         "us_per_block": round(cpu.get(name, 0.0), 2)})
        print(f"  simulated {size} blocks in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    return rows


def print_sim(rows: list[dict], policies: list[str]) -> None:
    names = [*policies, "belady", *(["next-turn"] if any(r["policy"] == "next-turn" for r in rows) else [])]
    print(f"\nshare of requested blocks served (simulation; x Belady, x LRU):")
    print(f"{'blocks':>8} " + " ".join(f"{n:>22}" for n in names))
    for size in sorted({r["size"] for r in rows}):
        by = {r["policy"]: r for r in rows if r["size"] == size}
        print(f"{size:>8} " + " ".join(f"{by[n]['ratio']:>8.3f} {by[n]['vs_belady']:>5.2f}x {by[n]['vs_lru']:>5.2f}x"
                                     for n in names))
    print(f"\nCPU time of the replay per block, µs (x the {DEFAULT_POLICY} policy's):")
    for size in sorted({r["size"] for r in rows}):
        by = {r["policy"]: r["us_per_block"] for r in rows if r["size"] == size}
        ref = by.get(DEFAULT_POLICY) or 0.0
        print(f"{size:>8} " + " ".join(f"{n:>10} {by[n]:>6.2f} ({by[n] / ref if ref else 0:.2f}x)" for n in policies))


# ---- a real server -------------------------------------------------------------------------------


class ServerProcess:
    """lmcache-mp-server in its own process, its output in a file."""

    def __init__(self, folder: str, args: list[str]):
        self.url = f"ipc://{folder}/server.sock"
        self.log = os.path.join(folder, "server.log")
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "lmcache_mp.server.cli", "--url", self.url, *args],
                                         stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with open(self.log) as f:
                if "ready: serving on" in f.read():
                    return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        with open(self.log) as f:
            raise RuntimeError(f"the server did not start:\n{f.read()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def drive(url: str, trace: list[dict], digests: dict[int, bytes], heads: int) -> dict:
    """Replay the trace as an engine: lookup with lock, retrieve the hits, store the rest."""
    from lmcache_mp import Client, shared_cpu_array

    most = max(len(r["blocks"]) for r in trace)
    kv = shared_cpu_array((2, most, TOKENS_PER_CHUNK, heads, 64), np.float16)
    kv[...] = np.random.default_rng(0).standard_normal(kv.shape, dtype=np.float32)
    # (a heartbeat every 10 s: on a busy machine a server deep in a long store may not answer one
    # within the default 2 s, and the client would take it for gone)
    client = Client(url, timeout=120, heartbeat_interval=10.0, name="bench-trace")
    try:
        handle = client.register_kv_cache([kv], model="trace")
        blocks = np.arange(most)
        out = {"blocks": 0, "tokens": 0, "l1_blocks": 0, "l2_blocks": 0, "l1_tokens": 0, "l2_tokens": 0,
               "stored": 0, "skipped": 0}
        t0 = time.monotonic()
        for req in trace:
            keys = [digests[b] for b in req["blocks"]]
            tokens = block_tokens(req)
            found = client.lookup(keys, model="trace", lock=True)
            n, from_l2 = int(found), found.from_l2
            if n:
                client.retrieve(handle, keys[:n], blocks[:n], lease=found).result()
            if n < len(keys):
                r = client.store(handle, keys[n:], blocks[n:len(keys)], parent=keys[n - 1] if n else b"").result()
                out["stored"] += r.stored
                out["skipped"] += r.skipped
            out["blocks"] += len(keys)
            out["tokens"] += sum(tokens)
            out["l1_blocks"] += n - from_l2
            out["l2_blocks"] += from_l2
            out["l1_tokens"] += sum(tokens[:n - from_l2])
            out["l2_tokens"] += sum(tokens[n - from_l2:n])
        out["seconds"] = round(time.monotonic() - t0, 2)
        out["requests"] = len(trace)
        status = client.status()
        out["server"] = status["l1"]
        out["disk_written"] = status.get("l2", {}).get("written", 0)
        out["disk_dropped_writes"] = status.get("l2", {}).get("dropped_writes", 0)
        client.unregister_kv_cache(handle)
    finally:
        client.close()
        del kv
    return out


def run_server(trace: list[dict], size: int, policy: str, disk_blocks: int, digests: dict[int, bytes],
               heads: int = 1, disk_codec: str = "none") -> dict:
    folder = tempfile.mkdtemp(prefix="lmcache-bench-trace-")
    chunk = heads * HEAD_BYTES
    args = ["--device", "cpu", "--l1-size", str(size * chunk), "--slab-size", str(chunk),
            "--chunk-size", str(TOKENS_PER_CHUNK), "--eviction-policy", policy, "--http-addr", "off",
            "--heartbeat-timeout", "600"]
    if disk_blocks:
        # room for disk_blocks files of raw chunks (a codec fits more in it)
        args += ["--l2-disk", os.path.join(folder, "disk"), "--l2-disk-size", str(disk_blocks * (DISK_HEADER + chunk)),
                 "--l2-disk-codec", disk_codec]
    srv = ServerProcess(folder, args)
    try:
        got = drive(srv.url, trace, digests, heads)
    finally:
        srv.stop()
        shutil.rmtree(folder, ignore_errors=True)
    l1 = got.pop("server")
    return {"size": size, "policy": policy, "disk_blocks": disk_blocks, "disk_codec": disk_codec,
            "chunk_bytes": chunk, **got,
            "ratio": round((got["l1_blocks"] + got["l2_blocks"]) / got["blocks"], 4),
            "l1_token_share": round(got["l1_tokens"] / got["tokens"], 4),
            "l2_token_share": round(got["l2_tokens"] / got["tokens"], 4),
            "recomputed_token_share": round(1 - (got["l1_tokens"] + got["l2_tokens"]) / got["tokens"], 4),
            "evicted": l1["evicted"], "history_bytes": l1["eviction"]["history_bytes"],
            "leader": {k: l1["eviction"][k] for k in ("leader", "switches", "miniature_hits") if k in l1["eviction"]},
            "requests_per_s": round(got["requests"] / got["seconds"], 1)}


def print_server(rows: list[dict], sim: list[dict], requests: list[list[int]]) -> None:
    """The server's rows beside simulations. A row with a disk tier is measured against Belady and
    LRU of one cache as large as L1 and the disk together (simulated here: L1's own Belady is no
    ceiling of two tiers), one without against those of L1's size; "sim L1" is the same policy on
    L1 alone. The disk tier's writes and the writes it dropped (stores that outran it: chunks it
    never got) stand beside, and explain most of what it serves."""

    def simulated(policy: str, blocks: int) -> float:
        for s in sim:
            if s["size"] == blocks and s["policy"] == policy:
                return s["ratio"]
        return (belady(requests, blocks) if policy == "belady" else replay(requests, policy, blocks))["ratio"]

    print("\nthrough the server (blocks served, as a share of those requested; x Belady and x LRU of a cache as "
          "large as L1 and the disk together; tokens from L1 / the disk tier / recomputed; the disk tier's writes "
          "and the writes it dropped), beside the simulation of the same run:")
    print(f"{'blocks':>8} {'disk':>7} {'codec':>5} {'policy':>9} {'served':>7} {'sim L1':>7} {'belady':>7} "
          f"{'x belady':>9} {'x lru':>6} {'tokens L1':>10} {'disk':>7} {'recomp.':>8} {'written':>8} "
          f"{'dropped':>8} {'req/s':>7}")
    for r in rows:
        total = r["size"] + r["disk_blocks"]
        best, lru = simulated("belady", total), simulated("lru", total)
        r["belady_same_blocks"], r["lru_same_blocks"] = best, lru
        disk = r["disk_blocks"] > 0
        print(f"{r['size']:>8} {r['disk_blocks']:>7} {r['disk_codec'] if disk else '-':>5} {r['policy']:>9} "
              f"{r['ratio']:>7.3f} {simulated(r['policy'], r['size']):>7.3f} {best:>7.3f} "
              f"{r['ratio'] / best if best else 0:>8.2f}x {r['ratio'] / lru if lru else 0:>5.2f}x "
              f"{r['l1_token_share']:>10.3f} {r['l2_token_share']:>7.3f} {r['recomputed_token_share']:>8.3f} "
              f"{r['disk_written'] if disk else '-':>8} {r['disk_dropped_writes'] if disk else '-':>8} "
              f"{r['requests_per_s']:>7.0f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=DEFAULT_TRACE)
    ap.add_argument("--synthetic", choices=tuple(SYNTHETIC), help="a generated trace instead of --trace: "
                    + "; ".join(f"{k}: {v}" for k, v in SYNTHETIC.items()))
    ap.add_argument("--requests", type=int, default=0, help="the first N requests only (0: all)")
    ap.add_argument("--sizes", default="1000,2000,4000,8000,16000", help="cache sizes, in blocks")
    ap.add_argument("--mode", choices=("sim", "server", "both"), default="sim")
    ap.add_argument("--policies", default=",".join(POLICIES), help="policies simulated")
    ap.add_argument("--server-policies", default=DEFAULT_POLICY, help="policies run through the server")
    ap.add_argument("--disk-blocks", default="0",
                    help="a disk tier of this many blocks below L1 (server); NX: N times L1's size")
    ap.add_argument("--disk-codec", default="none", help="the disk tier's codecs, comma-separated: none, fp8")
    ap.add_argument("--heads", type=int, default=1, help="heads of 64 values a chunk has (4 KiB each)")
    ap.add_argument("--next-turn", action="store_true",
                    help="also the offline model of valuing sessions by their predicted next turn (simulate.next_turn)")
    ap.add_argument("--json")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies + args.server_policies.split(",") if p not in POLICIES]
    if unknown:
        ap.error(f"unknown policies {unknown}: one of {', '.join(POLICIES)}")
    trace = synthetic(args.synthetic, args.requests or 12000) if args.synthetic else load(args.trace, args.requests)
    if args.synthetic:
        args.trace = f"synthetic {args.synthetic}"
    requests = [r["blocks"] for r in trace]
    total = sum(map(len, requests))
    print(f"{args.trace}: {len(trace)} requests, {total} blocks, {len({b for r in requests for b in r})} distinct")
    sim = simulate(requests, sizes, policies, args.next_turn)
    print_sim(sim, policies)
    served = []
    if args.mode in ("server", "both"):
        digests = {b: block_key(b).digest for r in requests for b in r}
        for size in sizes:
            disk = (int(float(args.disk_blocks[:-1]) * size) if args.disk_blocks.lower().endswith("x")
                    else int(args.disk_blocks))
            for policy in args.server_policies.split(","):
                for codec in args.disk_codec.split(",") if disk else ["none"]:
                    served.append(run_server(trace, size, policy, disk, digests, args.heads, codec))
                    print(f"  {size} blocks, {policy}, disk codec {codec}: {served[-1]['seconds']} s", file=sys.stderr)
        print_server(served, sim, requests)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "bench_trace", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                       "trace": os.path.basename(args.trace), "requests": len(trace), "blocks": total,
                       "sim": sim, "server": served}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
