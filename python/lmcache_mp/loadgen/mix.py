"""lmcache-mp-bench --mix: two layouts (two models, or two engines' settings) share one server,
as engines use it; their hit ratios are shown next to those of an ideal LRU by bytes.

Every worker plays an engine serving a stream of requests: it picks one of its `prompts` prompts
(popularity ~ 1 / rank**skew), looks the prompt's chunks up with a lease, retrieves the hits into
blocks of their own, checks them bit for bit, and stores the chunks it missed. Workers of both
layouts run at once. Afterwards every request of every worker is replayed in time order on a plain
LRU by bytes with the server's L1 capacity (no slabs, no fragmentation): the ideal hit ratio.

A prompt's chunks come from one permutation of the worker's source blocks, each block stamped
with the prompt number, so a chunk of another prompt or position never passes the check.
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from collections import OrderedDict

import numpy as np

from lmcache_mp.sizes import format_size
from lmcache_mp.loadgen.runs import print_failures, run_processes
from lmcache_mp.loadgen.worker import (Reporter, bits, count_mismatches, object_bytes, random_kv, request_ids,
                                       request_tokens)


def _stamp(kv: list, kind: str, block_ids: np.ndarray, prompt: int) -> None:
    """Write the prompt number into the first element of every block (K of the first token)."""
    for t in kv:
        b, on_device = bits(t)
        ids = on_device(block_ids)
        if kind == "mha":
            b[0, ids, 0, 0, 0] = prompt
        else:
            b[ids, 0, 0] = prompt


def popularity(prompts: int, skew: float, requests: int, seed: int) -> np.ndarray:
    """Prompt numbers of `requests` requests, prompt k drawn with weight 1 / (k + 1) ** skew."""
    w = 1.0 / np.arange(1, prompts + 1) ** skew
    return np.random.default_rng(seed).choice(prompts, size=requests, p=w / w.sum())


def mix_worker(cfg: dict, wid: int, barrier, reporter: Reporter) -> dict:
    from lmcache_mp import Client, chunk_hashes

    lay = cfg["geometry"]
    cuda = cfg["device"] == "cuda"
    reporter.begin("register")
    if cuda:
        import torch

        torch.cuda.set_device(0)
    client = Client(cfg["url"], timeout=cfg["timeout"], name=f"bench-mix-w{wid}")
    chunk = client.chunk_size
    bpc = chunk // lay["block_size"]
    n = cfg["chunks"]
    half = n * bpc
    seed = 7919 * (wid + 1)
    kv = random_kv(lay, 2 * half, cuda, seed)
    model = f"{cfg['model']}-w{wid}"
    handle = client.register_kv_cache(kv, model=model, world_size=1, rank=0, layout=lay["kind"])
    order = popularity(cfg["prompts"], cfg["skew"], cfg["requests"], seed)
    reporter.begin("requests")
    hashes = [chunk_hashes(request_tokens((cfg["run"], wid, k), n * chunk), chunk) for k in range(cfg["prompts"])]
    requests, hits, loaded_total, missing, mismatches = [], 0, 0, 0, 0
    barrier.wait(cfg["timeout"])
    quarters = {len(order) * q // 4: q for q in (1, 2, 3, 4)}  # request count -> quarter done
    for i, k in enumerate(order):
        k = int(k)
        src, dst = request_ids((k, 0), half, 0), request_ids((k, 1), half, half)
        t = time.monotonic()  # one clock for every process on the machine: orders the merged replay
        h = client.lookup(hashes[k], model=model, world_size=1, lock=True)
        loaded = client.retrieve(handle, hashes[k][:h], dst[: h * bpc]).result().loaded if h else 0
        if loaded:
            _stamp(kv, lay["kind"], src[: loaded * bpc], k)  # what this prompt's chunks were made of
            mismatches += count_mismatches(kv, lay["kind"], src, dst, n, loaded)
        if loaded < h:
            missing += h - loaded
            client.release(hashes[k][loaded:h], model=model, world_size=1)
        if loaded < n:
            _stamp(kv, lay["kind"], src[loaded * bpc:], k)
            client.store(handle, hashes[k][loaded:], src[loaded * bpc:]).result()
        requests.append((t, k))
        hits += h
        loaded_total += loaded
        if i + 1 in quarters:
            reporter.done(f"{25 * quarters[i + 1]}% of the requests", requests=i + 1, hits=hits, mismatching=mismatches)
    reporter.begin("unregister")
    barrier.wait(cfg["timeout"])
    client.unregister_kv_cache(handle)
    client.close()
    return {"wid": wid, "model": model, "requests": requests, "chunks_per_request": n, "hits": hits,
            "loaded": loaded_total, "missing": missing, "mismatches": mismatches, "chunks": n * len(order)}


def ideal_lru_hits(trace: list[tuple], capacity: int) -> dict:
    """Replay requests (time, group, prompt key, chunks, object bytes) in time order on an LRU by
    bytes of `capacity`; returns the leading-chunk hits per group."""
    lru: OrderedDict = OrderedDict()
    used = 0
    hits: dict = {}
    for _, group, prompt, n, nbytes in sorted(trace):
        keys = [(prompt, j) for j in range(n)]
        h = 0
        while h < n and keys[h] in lru:
            h += 1
        hits[group] = hits.get(group, 0) + h
        for k in keys:  # hits are read, misses stored: the whole prompt is now the newest
            if k in lru:
                lru.move_to_end(k)
                continue
            lru[k] = nbytes
            used += nbytes
            while used > capacity:
                used -= lru.popitem(last=False)[1]
    return hits


def run_mix(groups: list[dict], workers: int, timeout: float) -> list[list[dict]] | None:
    """Run `workers` workers of every group (a worker config each) at once; returns, per group,
    the workers' results, or None once it has printed why a worker failed."""
    cfgs = [cfg for cfg in groups for _ in range(workers)]
    results = run_processes(mix_worker, cfgs, [{}] * len(cfgs), timeout,
                            f"{len(cfgs)} worker(s) started, serving prompts; shown once every worker got there:")
    failed = {w: f for w, (status, f) in results.items() if status != "ok"}
    if failed:
        print_failures(failed, len(cfgs))
        return None
    return [[results[g * workers + w][1] for w in range(workers)] for g in range(len(groups))]


def mix_rows(names: list[str], object_bytes: list[int], results: list[list[dict]], capacity: int,
             evicted: list[int]) -> list[dict]:
    """Per group: requests, chunks, hits, hit ratio, the ideal LRU's, missing and mismatching chunks."""
    trace = [(t, g, (info["model"], k), info["chunks_per_request"], object_bytes[g])
             for g, infos in enumerate(results) for info in infos for t, k in info["requests"]]
    ideal = ideal_lru_hits(trace, capacity)
    rows = []
    for g, infos in enumerate(results):
        chunks = sum(i["chunks"] for i in infos)
        loaded = sum(i["loaded"] for i in infos)
        rows.append({"layout": names[g], "object_bytes": object_bytes[g],
                     "requests": sum(len(i["requests"]) for i in infos), "chunks": chunks, "hits": loaded,
                     "hit_ratio": loaded / chunks, "ideal_hits": ideal.get(g, 0),
                     "ideal_hit_ratio": ideal.get(g, 0) / chunks, "evicted": evicted[g],
                     "missing": sum(i["missing"] for i in infos), "mismatches": sum(i["mismatches"] for i in infos)})
    return rows


def print_mix(rows: list[dict]) -> None:
    head = (f"{'layout':<14} | {'requests':>8} | {'chunks':>7} | {'hits':>7} | {'hit ratio':>9} | "
            f"{'ideal LRU':>9} | {'x ideal':>7} | {'evicted':>7} | {'missing':>7} | {'mismatch':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        x = r["hit_ratio"] / r["ideal_hit_ratio"] if r["ideal_hit_ratio"] else float("nan")
        print(f"{r['layout']:<14} | {r['requests']:>8} | {r['chunks']:>7} | {r['hits']:>7} | "
              f"{r['hit_ratio']:>9.3f} | {r['ideal_hit_ratio']:>9.3f} | {x:>7.3f} | {r['evicted']:>7} | "
              f"{r['missing']:>7} | {r['mismatches']:>8}")
    print("ideal LRU: the same requests replayed in time order on an LRU by bytes of the L1 capacity; evicted: "
          "chunks of that object size the server evicted during the run; missing: leased chunks a retrieve did "
          "not load; mismatch: loaded chunks whose bytes differ")


def bench_mix(args, lay: dict, mix: dict, client) -> int:
    """lmcache-mp-bench --mix: run both layouts, print the table, write --json; exit status."""
    status = client.status()
    chunk = client.chunk_size
    args.device = args.device or status["device"]
    if args.device != status["device"]:
        print(f"lmcache-mp-bench: the server runs on device {status['device']}, not {args.device}", file=sys.stderr)
        return 2
    names = [f"{args.layout}" + (f":{lay['layers']}" if args.layers else ""), args.mix]
    sizes = [object_bytes(g, chunk) for g in (lay, mix)]
    capacity = status["l1"]["capacity"]
    run = secrets.token_hex(4)
    groups = [dict(url=args.url, device=args.device, geometry=g, model=f"bench-mix{i}-{run}", chunks=args.chunks,
                   prompts=args.prompts, skew=args.skew, requests=args.requests, run=i, timeout=args.timeout)
              for i, g in enumerate((lay, mix))]
    print(f"mix: {names[0]} ({format_size(sizes[0])} per chunk) and {names[1]} ({format_size(sizes[1])} per "
          f"chunk); {args.workers} worker(s) each, {args.requests} requests over {args.prompts} prompts of "
          f"{args.chunks} chunks, skew {args.skew:g}; server L1 {format_size(capacity)}", flush=True)
    evicted_by_size = lambda st: {s["object_bytes"]: s["evicted"] for s in st["l1"]["sizes"]}  # noqa: E731
    before = evicted_by_size(status)
    t0 = time.monotonic()
    results = run_mix(groups, args.workers, args.timeout)
    if results is None:
        return 1
    after = evicted_by_size(client.status())
    evicted = [after.get(n, 0) - before.get(n, 0) for n in sizes]
    rows = mix_rows(names, sizes, results, capacity, evicted)
    print(f"run: {time.monotonic() - t0:.1f} s\n")
    print_mix(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "lmcache-mp-bench --mix", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                       "config": {**vars(args), "chunk_size": chunk}, "rows": rows,
                       "l1_after": client.status()["l1"]}, f, indent=1, default=str)
        print(f"wrote {args.json}")
    bad = sum(r["mismatches"] + r["missing"] for r in rows)
    if bad:
        print(f"!! {bad} chunks were missing after a lease or came back with other bytes", file=sys.stderr)
    return 1 if bad else 0
