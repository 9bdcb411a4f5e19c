"""One run of the load generator: spawn the workers, collect what they measured, turn it into a
table row (GB/s per phase, latency percentiles, traces, tails) and print it. Used by
lmcache-mp-bench (lmcache_mp.loadgen.cli) and bench/bench_server.py."""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import time

import numpy as np

from lmcache_mp.sizes import format_size
from lmcache_mp.loadgen.processes import deaf_to_ctrl_c, end_processes
from lmcache_mp.loadgen.tails import LONG_STALL_NS, attribute, machine_stalls, print_tails, stall_probe
from lmcache_mp.loadgen.trace import print_idle, print_traces
from lmcache_mp.loadgen.trace import slowest as slowest_traces
from lmcache_mp.loadgen.trace import summarize as summarize_traces
from lmcache_mp.loadgen.watch import ServerWatch
from lmcache_mp.loadgen.worker import LAYOUTS, bench_worker, worker_main

DEFAULT_URL = "tcp://127.0.0.1:5555"
TABLE_NOTE = "GB/s = 1e9 bytes/s, bytes of all workers / slowest worker's phase wall time"


# ---- setup ------------------------------------------------------------------------------------

def geometry(name: str, layers: int | None = None, heads: int | None = None, head_size: int | None = None,
             block_size: int | None = None) -> dict:
    """A LAYOUTS entry with some sizes overridden (head_size is the latent dim of MLA)."""
    lay = dict(LAYOUTS[name])
    if heads is not None and lay["kind"] != "mha":
        raise ValueError("--heads applies to MHA layouts only")
    overrides = {"layers": layers, "heads": heads, "block_size": block_size,
                 ("head_size" if lay["kind"] == "mha" else "dim"): head_size}
    for key, value in overrides.items():
        if value is not None:
            if value < 1:
                raise ValueError(f"--{key.replace('_', '-')} must be positive")
            lay[key] = value
    return lay


def worker_env_defaults() -> None:
    """Environment the spawned workers inherit; call before torch touches CUDA."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # no NCCL here; keep NVLink multicast off regardless
    # CUDA IPC needs plain cudaMalloc allocations, not the expandable-segments allocator.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")


def gpu_uuids(gpus: int) -> tuple[list[str], list[str]]:
    """UUIDs and names of the first `gpus` CUDA devices; RuntimeError if there are fewer."""
    try:
        import torch
    except ImportError:
        raise RuntimeError("--device cuda needs torch for the workers' GPU caches: pip install torch") from None

    if not torch.cuda.is_available() or torch.cuda.device_count() < gpus:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise RuntimeError(f"--gpus {gpus} but {n} CUDA device(s) visible")
    return ([f"GPU-{torch.cuda.get_device_properties(g).uuid}" for g in range(gpus)],
            [torch.cuda.get_device_name(g) for g in range(gpus)])


def worker_settings(args, url: str, lay: dict, model: str, run: int) -> dict:
    """What every worker of a run gets (args: device, chunks, requests, lookups, tp, timeout)."""
    return dict(url=url, device=args.device, geometry=lay, model=model, chunks=args.chunks,
                requests=args.requests, lookups=args.lookups, tp=args.tp, run=run, timeout=args.timeout,
                trace=getattr(args, "trace", False), stall_probe=getattr(args, "stall_probe", False),
                echo_url=getattr(args, "echo_url", None))


def banner(args, obj: int, req_bytes: int, gpu_names: list[str]) -> str:
    return (f"layout {args.layout}: {format_size(obj)} per chunk, {format_size(req_bytes)} per request of "
            f"{args.chunks} chunks; {args.requests} requests per worker; workers {args.workers}"
            f"{' as TP ranks of one model' if args.tp else ''}; device {args.device}"
            f"{f' ({args.gpus} GPU(s): {gpu_names[0]})' if gpu_names else ''}")


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


# What a worker does in a phase that takes a while before it reports anything: said when the
# first worker begins it, so that a run of many seconds is never silent.
SLOW_PHASES = {
    "register": "each worker fills its KV cache with random bytes and registers it with the server",
    "verify": "each worker retrieves every request again and compares it with what it stored, bit for bit",
}
AFTER_FAILURE_S = 10.0  # how long the others may take to stop once one worker failed
FAILED_GRACE_S = 3.0  # how long workers may take to exit after a failure or a Ctrl-C: then they are killed


class Progress:
    """Prints a phase of the workers once every one of them has finished it (they report
    (phase, {count: n}) on the result queue), with the counts summed and the time since the
    start, and what a slow phase waits for when the first worker begins it: a run of many
    seconds says what it is doing."""

    def __init__(self, workers: int):
        self.workers = workers
        self.t0 = time.monotonic()
        self._reports: dict[str, dict] = {}
        self._begun: set[str] = set()

    def begun(self, phase: str) -> None:
        if phase in SLOW_PHASES and phase not in self._begun:
            self._begun.add(phase)
            print(f"  {time.monotonic() - self.t0:6.1f} s  ({phase}: {SLOW_PHASES[phase]})", flush=True)

    def __call__(self, wid: int, report: tuple[str, dict]) -> None:
        phase, counts = report
        got = self._reports.setdefault(phase, {})
        got[wid] = counts
        if len(got) == self.workers:
            total = ", ".join(f"{sum(c[k] for c in got.values())} {k}" for k in counts)
            print(f"  {time.monotonic() - self.t0:6.1f} s  {phase}: {total}", flush=True)


def failure(phase: str, error: str, server_gone: bool = False) -> dict:
    """A worker's failure as the parent notes it (worker_main sends the same fields)."""
    return {"phase": phase, "error": error, "traceback": "", "after_another": False, "server_gone": server_gone}


def collect(procs, q, timeout: float, progress: Progress | None = None, watch: ServerWatch | None = None) -> dict:
    """Results by worker id: ("ok", result) or ("fail", failure). A worker that died without a
    result is reported after a grace period; once one failed, the others get AFTER_FAILURE_S to
    stop; once the server is gone (`watch`), every worker without a result has failed with it.
    The workers' progress reports go to `progress`."""
    results: dict = {}
    phases: dict = {}  # the phase each worker is in
    dead_since: dict = {}
    deadline = time.monotonic() + timeout
    late = f"no result within {timeout:.0f} s"
    while len(results) < len(procs):
        try:
            wid, status, payload = q.get(timeout=0.5)
            if status == "phase":
                phases[wid] = payload
                if progress is not None:
                    progress.begun(payload)
            elif status == "progress":
                if progress is not None:
                    progress(wid, payload)
            else:
                results[wid] = (status, payload)
                if status != "ok" and time.monotonic() + AFTER_FAILURE_S < deadline:
                    deadline = time.monotonic() + AFTER_FAILURE_S
                    late = f"it did not stop within {AFTER_FAILURE_S:.0f} s of another worker's failure"
        except queue.Empty:
            pass
        now = time.monotonic()
        gone = watch.gone() if watch is not None else None
        for wid, p in enumerate(procs):
            if wid in results:
                continue
            if gone:
                results[wid] = ("fail", failure(phases.get(wid, "start-up"),
                                                f"no reply from the server at {watch.url}: {gone}", True))
            elif not p.is_alive() and now - dead_since.setdefault(wid, now) > 5:
                results[wid] = ("fail", failure(phases.get(wid, "start-up"),
                                                f"the worker process exited with code {p.exitcode} without a result"))
            elif now > deadline:
                results[wid] = ("fail", failure(phases.get(wid, "start-up"), late))
    return results


def print_failures(failures: dict, workers: int) -> None:
    """One line per cause, naming the workers and the phases they were in (workers that stopped at
    a barrier because another failed are no cause; a server gone is one cause, however each worker
    met it: the first one's words tell it), then the tracebacks of errors that are no server's or
    connection's (bugs)."""
    causes = {w: f for w, f in failures.items() if not f["after_another"]} or failures
    by_cause: dict = {}
    for w, f in sorted(causes.items()):
        cause = by_cause.setdefault("server gone" if f.get("server_gone") else f["error"], [f["error"], {}])
        cause[1].setdefault(f["phase"], []).append(w)
    for error, phases in by_cause.values():
        ws = sorted(w for in_phase in phases.values() for w in in_phase)
        who = f"worker {ws[0]}" if len(ws) == 1 else f"workers {', '.join(map(str, ws))}"
        if len(phases) == 1:
            where = f"the {next(iter(phases))} phase"
        else:
            where = "the " + " and ".join(f"{phase} ({'worker' if len(w) == 1 else 'workers'} {', '.join(map(str, w))})"
                                          for phase, w in phases.items()) + " phases"
        print(f"lmcache-mp-bench: {who}{f' of {workers}' if workers > 1 else ''} failed in {where}: {error}",
              file=sys.stderr)
    for w, f in sorted(causes.items()):
        if f["traceback"]:
            print(f"--- worker {w}:\n{f['traceback']}", file=sys.stderr)


def percentiles(values: list[float], scale: float) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    p50, p99 = np.percentile(np.asarray(values) * scale, [50, 99])
    return float(p50), float(p99)


def run_workers(settings: dict, workers: int, uuids: list[str]) -> dict:
    """Spawn `workers` workers (on cuda, worker w sees only GPU uuids[w % len(uuids)]) and wait
    for them: {"workers", "infos": [per worker]} or {"workers", "error": {wid: failure}}."""
    cuda = settings["device"] == "cuda"
    worker_uuids = [uuids[w % len(uuids)] for w in range(workers)] if cuda else []
    cfg = dict(settings, workers=workers, gpu_uuids=worker_uuids)
    envs = [{"CUDA_VISIBLE_DEVICES": worker_uuids[w]} if cuda else {} for w in range(workers)]
    results = run_processes(bench_worker, [cfg] * workers, envs, settings["timeout"],
                            f"{workers} worker(s) started; each phase is shown once every worker has finished it:")
    failures = {w: f for w, (st, f) in results.items() if st != "ok"}
    if failures:
        return {"workers": workers, "error": failures}
    return {"workers": workers, "infos": [results[w][1] for w in range(workers)]}


def run_processes(body, cfgs: list[dict], envs: list[dict], timeout: float, intro: str) -> dict:
    """One worker process per cfg, running worker_main(cfg, wid, barrier, q, body) with envs[wid]
    added to its environment, watched until each has a result (see collect); they are ended,
    whatever happens meanwhile (a Ctrl-C too), before this returns."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    barrier = ctx.Barrier(len(cfgs))
    watch = ServerWatch(cfgs[0]["url"])
    procs = []
    results: dict = {}
    try:
        for wid, (cfg, env) in enumerate(zip(cfgs, envs)):
            with patched_env(env), deaf_to_ctrl_c():  # a spawned child starts with this process's environment
                proc = ctx.Process(target=worker_main, args=(cfg, wid, barrier, q, body), name=f"bench-worker-{wid}")
                proc.start()
            procs.append(proc)
        print(intro, flush=True)
        results = collect(procs, q, timeout + 300, Progress(len(cfgs)), watch)
    finally:
        # a worker with its result is exiting; one without (failed run, Ctrl-C) is waited for only briefly
        done = all(st == "ok" for st, _ in results.values()) and len(results) == len(procs)
        end_processes(procs, 30 if done else FAILED_GRACE_S)
        watch.close()
    return results


def summarize(infos: list[dict], workers: int, gpus_used: int, ceilings: dict | None = None) -> dict:
    """One table row; with ceilings (bench/bench_server.py), also the ratios to them."""
    store_bytes = sum(i["store_bytes"] for i in infos)
    retrieve_bytes = sum(i["retrieve_bytes"] for i in infos)
    store_gbps = store_bytes / max(i["store_wall_s"] for i in infos) / 1e9
    retrieve_gbps = retrieve_bytes / max(i["retrieve_wall_s"] for i in infos) / 1e9
    cat = lambda k: [x for i in infos for x in i[k]]  # noqa: E731
    s50, s99 = percentiles(cat("store_latency_s"), 1e3)
    r50, r99 = percentiles(cat("retrieve_latency_s"), 1e3)
    l50, l99 = percentiles(cat("lookup_latency_s"), 1e6)
    bare = cat("bare_latency_s")
    row = {"workers": workers, "gpus": gpus_used, "store_GBps": store_gbps, "retrieve_GBps": retrieve_gbps}
    if ceilings is not None:
        ceil = ceilings["concurrent"][max(1, gpus_used)]
        row.update(store_ratio=store_gbps / ceil["d2h"], retrieve_ratio=retrieve_gbps / ceil["h2d"],
                   ceiling_d2h_GBps=ceil["d2h"], ceiling_h2d_GBps=ceil["h2d"])
        if "bytes_per_gpu" in ceilings:  # one request's bytes: its copy time at the ceiling
            row.update(raw_d2h_ms=ceilings["bytes_per_gpu"] / ceil["d2h"] / 1e6,
                       raw_h2d_ms=ceilings["bytes_per_gpu"] / ceil["h2d"] / 1e6)
    return {
        **row,
        "store_ms_p50": s50, "store_ms_p99": s99, "retrieve_ms_p50": r50, "retrieve_ms_p99": r99,
        "lookup_us_p50": l50, "lookup_us_p99": l99,
        **(dict(zip(("bare_rt_us_p50", "bare_rt_us_p99"), percentiles(bare, 1e6))) if bare else {}),
        "mismatches": sum(i["mismatches"] for i in infos),
        "missing": sum(i["missing"] for i in infos),
        "requested_chunks": sum(i["requested_chunks"] for i in infos),
        "stored_chunks": sum(i["stored_chunks"] for i in infos),
        "present_chunks": sum(i["present_chunks"] for i in infos),
        "skipped_chunks": sum(i["skipped_chunks"] for i in infos),
        "loaded_chunks": sum(i["loaded_chunks"] for i in infos),
        "lookups_short": sum(i["lookups_short"] for i in infos),
        "store_bytes": store_bytes, "retrieve_bytes": retrieve_bytes,
    }


def transfer_mode_label(regs: list[dict]) -> str:
    """The modes the server gave the run's caches (it decides at registration)."""
    return ",".join(sorted({str(r.get("transfer_mode")) for r in regs})) or "?"


def run_once(client, settings: dict, workers: int, uuids: list[str], chunk: int,
             ceilings: dict | None = None, own_l1: bool = True) -> tuple[dict, dict, bool]:
    """One run of `workers` workers against the server `client` talks to: (table row, JSON
    record, whether it was clean). Prints failures and problems to stderr as it goes.

    own_l1: the run had the L1 to itself, so any eviction is a problem. On a shared server older
    chunks make room (only a note); evicting this run's own chunks shows up as missing chunks."""
    t_run = time.monotonic()
    lay, chunks = settings["geometry"], settings["chunks"]
    gpus_used = min(workers, len(uuids)) if settings["device"] == "cuda" else 0
    evicted_before = client.status()["l1"].get("evicted", 0)
    with stall_probe(enabled=bool(settings.get("stall_probe"))) as probe:
        res = run_workers(settings, workers, uuids)
    if "error" in res:  # (before asking the server anything: it may be gone)
        print_failures(res["error"], workers)
        failed = {"workers": workers, "error": res["error"]}
        return failed, dict(failed), False
    status_after = client.status()
    after = status_after["l1"]
    infos = res["infos"]
    row = summarize(infos, workers, gpus_used, ceilings)
    row["evicted"] = after.get("evicted", 0) - evicted_before
    regs = next((i["status_registrations"] for i in infos if "status_registrations" in i), [])
    row["transfer_mode"] = modes = transfer_mode_label(regs)
    traces = {k: [t for i in infos for t in i.get("traces", {}).get(k, [])] for k in ("store", "lookup", "retrieve")}
    if any(traces.values()):
        print_traces(traces)
        row["trace_us"] = {k: dict(summarize_traces(v)) for k, v in traces.items() if v}
        row["trace_p99_us"] = {k: dict(summarize_traces(v, 0.99)) for k, v in traces.items() if v}
        row["trace_slowest"] = {k: slowest_traces(v) for k, v in traces.items() if v}
    idle = {k: [t for i in infos for t in i.get("idle_traces", {}).get(k, [])] for k in ("lookup", "retrieve")}
    if any(idle.values()):
        row["idle_us"] = print_idle(idle, traces, {"lookup": row["lookup_us_p50"],
                                                   "retrieve": row["retrieve_ms_p50"] * 1e3})
    server_gc = [(g["start_ns"], g["length_ns"]) for g in status_after.get("gc", {}).get("recent", [])]
    row["tails"] = {k: attribute([(i["spans_ns"][k], i["gc_pauses_ns"]) for i in infos], probe.stalls, server_gc)
                    for k in ("store", "lookup", "retrieve")}
    row["machine_stalls"] = machine_stalls(probe)
    print_tails(row["tails"], row["machine_stalls"])
    record = {"summary": row, "workers_detail": infos, "l1_after": after, "server_gc": status_after.get("gc"),
              "seconds": time.monotonic() - t_run,
              "probe_stalls_ns": [s for s in probe.stalls if s[1] > LONG_STALL_NS]}
    problems = []
    if row["mismatches"]:
        problems.append(f"{row['mismatches']} chunks came back with other bytes than were stored (corruption)")
    if row["missing"]:
        problems.append(f"{row['missing']} chunks missing at verification (evicted, or never stored)")
    if row["evicted"]:
        evicted = f"{row['evicted']} chunks evicted from L1 during the run"
        if own_l1:
            problems.append(evicted)
        else:
            print(f"note: {evicted}", file=sys.stderr)
    if row["skipped_chunks"]:
        problems.append(f"{row['skipped_chunks']} chunks skipped by the store (L1 full)")
    if row["lookups_short"]:
        problems.append(f"{row['lookups_short']} lookups found fewer than {chunks} chunks")
    if not (settings["tp"] and lay["kind"] == "mla") and row["stored_chunks"] != row["requested_chunks"]:
        problems.append(f"stored {row['stored_chunks']} of {row['requested_chunks']} chunks")
    if problems:
        print(f"!! {workers} workers: " + "; ".join(problems), file=sys.stderr)
    print(f"run with {workers} worker(s): {time.monotonic() - t_run:.1f} s, transfer mode {modes}", flush=True)
    return row, record, not problems


def print_table(rows: list[dict], unit_note: str) -> None:
    """Ratio columns (x D2H, x H2D) only when the rows have them."""
    ratios = all("store_ratio" in r for r in rows if "error" not in r)
    d2h, h2d = (f" {'x D2H':>6}", f" {'x H2D':>6}") if ratios else ("", "")
    head = (f"{'workers':>7} {'GPUs':>4} | {'store GB/s':>10}{d2h} | {'retr GB/s':>10}{h2d} | "
            f"{'store ms p50/p99':>17} | {'retr ms p50/p99':>17} | {'lookup us p50/p99':>18} | {'evicted':>7} | "
            f"{'missing':>7} | {'mismatch':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['workers']:>7} FAILED: see above")
            continue
        sr, rr = (f" {r['store_ratio']:>6.2f}", f" {r['retrieve_ratio']:>6.2f}") if ratios else ("", "")
        print(f"{r['workers']:>7} {r['gpus']:>4} | {r['store_GBps']:>10.2f}{sr} | "
              f"{r['retrieve_GBps']:>10.2f}{rr} | "
              f"{r['store_ms_p50']:>8.2f}/{r['store_ms_p99']:<8.2f} | "
              f"{r['retrieve_ms_p50']:>8.2f}/{r['retrieve_ms_p99']:<8.2f} | "
              f"{r['lookup_us_p50']:>8.1f}/{r['lookup_us_p99']:<9.1f} | {r.get('evicted', 0):>7} | "
              f"{r['missing']:>7} | {r['mismatches']:>8}")
    print(unit_note + "; evicted: chunks the server evicted during the run (any run's); missing: chunks "
          "not loaded at verification; mismatch: loaded chunks whose bytes differ")
    for r in rows:
        if "raw_d2h_ms" in r:
            print(f"{r['workers']} worker(s), one request's raw copy: D2H {r['raw_d2h_ms']:.3f} ms, H2D "
                  f"{r['raw_h2d_ms']:.3f} ms; p50 above it: store {r['store_ms_p50'] - r['raw_d2h_ms']:+.3f} ms, "
                  f"retrieve {r['retrieve_ms_p50'] - r['raw_h2d_ms']:+.3f} ms")
        if "bare_rt_us_p50" in r:
            print(f"lookup p50 {r['lookup_us_p50']:.1f} us = {r['lookup_us_p50'] / r['bare_rt_us_p50']:.2f}x a bare "
                  f"pyzmq round trip of the same size ({r['bare_rt_us_p50']:.1f} us, to an echo process, "
                  f"measured alternately); the bare round trip's own p99 is {r['bare_rt_us_p99']:.1f} us = "
                  f"{r['bare_rt_us_p99'] / r['bare_rt_us_p50']:.2f}x its p50 (the machine's jitter)")
