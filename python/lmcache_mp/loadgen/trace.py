"""Where a request's time goes: the stage timestamps of traced requests (`Client(trace=True)`,
`lmcache-mp-bench --trace`) turned into a per-stage table.

A trace is [(stage, time.monotonic_ns()), ...] from the client and the server (one clock for
every process of a machine): call, client sent, received, decoded, started, submitted, copied,
replied, sent, client received, client resolved, returned.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Iterator

from lmcache_mp.loadgen.processes import deaf_to_ctrl_c

ECHO = """
import sys, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.ROUTER); s.bind(sys.argv[1])
while True:
    s.send_multipart(s.recv_multipart())
"""


@contextlib.contextmanager
def echo_peer() -> Iterator[str]:
    """A bare pyzmq ROUTER echo in its own process (the ceiling of a lookup); yields its URL."""
    with tempfile.TemporaryDirectory(prefix="lmcache-echo-") as tmp:
        url = f"ipc://{os.path.join(tmp, 'echo')}"
        with deaf_to_ctrl_c():
            proc = subprocess.Popen([sys.executable, "-c", ECHO, url])
        try:
            yield url
        finally:
            proc.kill()
            proc.wait()


def segments(trace: list[tuple[str, int]]) -> list[tuple[str, float]]:
    """(stage -> next stage, microseconds) of one trace, in time order."""
    stamps = sorted(trace, key=lambda s: s[1])
    return [(f"{a} -> {b}", (tb - ta) / 1e3) for (a, ta), (b, tb) in zip(stamps, stamps[1:])]


def summarize(traces: list[list[tuple[str, int]]], quantile: float = 0.5) -> list[tuple[str, float]]:
    """That quantile (default: the median) of every segment over the traces, in microseconds,
    in the order they occur; the last row is the whole request. Other quantiles are by nearest
    rank, rounded up, so that a p99 is never below the median however few values there are (a
    segment may occur in only some traces: stamps of client and server can swap places)."""
    def q(values: list[float]) -> float:
        if quantile == 0.5:
            return statistics.median(values)
        return sorted(values)[max(0, math.ceil(quantile * len(values)) - 1)]

    by_segment: dict[str, list[float]] = {}
    for t in traces:
        for name, us in segments(t):
            by_segment.setdefault(name, []).append(us)
    rows = [(name, q(v)) for name, v in by_segment.items()]
    total = [(max(s for _, s in t) - min(s for _, s in t)) / 1e3 for t in traces if t]
    if total:
        rows.append(("whole request", q(total)))
    return rows


def slowest(traces: list[list[tuple[str, int]]], n: int = 3, over_us: float = 20) -> list[dict]:
    """The n slowest traced requests: their whole time and the segments that took more than
    over_us beyond their median (where the extra time went)."""
    medians = dict(summarize(traces))
    whole = [((max(s for _, s in t) - min(s for _, s in t)) / 1e3, t) for t in traces if t]
    out = []
    for us, t in sorted(whole, key=lambda w: -w[0])[:n]:
        extra = {name: round(seg - medians[name], 1) for name, seg in segments(t) if seg - medians[name] > over_us}
        out.append({"whole_us": round(us, 1), "over_median_us": extra})
    return out


def print_traces(by_kind: dict[str, list]) -> None:
    for kind, traces in by_kind.items():
        if not traces:
            continue
        print(f"trace of {kind} ({len(traces)} requests, us per stage: median, p99):")
        for (name, us), (_, tail) in zip(summarize(traces), summarize(traces, 0.99)):
            print(f"  {name:40s} {us:9.1f} {tail:9.1f}")
        for s in slowest(traces):
            where = ", ".join(f"{name} +{us:.0f}" for name, us in s["over_median_us"].items()) or "spread out"
            print(f"  slow one: {s['whole_us']:.0f} us; beyond the medians: {where}")


def print_idle(idle: dict[str, list], hot: dict[str, list], hot_p50_us: dict[str, float]) -> dict:
    """The requests that came after the server sat idle, beside the back-to-back ones (the p50
    of the untimed ones; with their traces, the segments where the idle ones spent more than
    10 us beyond the traced median). Returns {kind: {"whole_us", "hot_us", "over_hot_us"}}."""
    out = {}
    for kind, traces in idle.items():
        if not traces:
            continue
        rows = dict(summarize(traces))
        whole = rows.pop("whole request")
        base = dict(summarize(hot[kind])) if hot.get(kind) else {}
        extra = {name: round(us - base[name], 1) for name, us in rows.items() if name in base and us - base[name] > 10}
        out[kind] = {"whole_us": whole, "hot_us": hot_p50_us[kind], "over_hot_us": extra}
        where = "; the extra: " + (", ".join(f"{name} +{us:.0f}" for name, us in extra.items()) or "spread out")
        print(f"{kind} after {len(traces)} idle gaps (median): {whole:.0f} us against {hot_p50_us[kind]:.0f} back to "
              f"back{where if base else ''}")
    return out
