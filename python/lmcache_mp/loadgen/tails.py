"""What the slow requests of a benchmark run met: stalls of the machine itself, and garbage
collections of the worker (the engine) and of the server.

A request that takes more than twice the median is checked against
  - a stall probe: a process of its own that does nothing but read the clock in a loop; a gap
    between two reads means the machine took the CPU away from a runnable thread (another
    thread, the kernel, or the hypervisor under a VM). It runs through the whole run, so it
    also gives the machine's own rate of stalls beside our tails;
  - the garbage collections of the worker and of the server (server/ops/gc_pauses.py), each of
    which stops every thread of its process.

All times are CLOCK_MONOTONIC nanoseconds (time.monotonic_ns()), one clock for every process.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from typing import Iterator

import numpy as np

from lmcache_mp.loadgen.processes import deaf_to_ctrl_c

STALL_NS = 20_000  # the probe records gaps longer than this
LONG_STALL_NS = 50_000  # the gaps reported (and kept in the JSON record)

PROBE = """
import json, signal, sys, time
threshold, stop = int(sys.argv[1]), False
def _stop(*_):
    global stop
    stop = True
signal.signal(signal.SIGTERM, _stop)
now, stalls = time.monotonic_ns, []
last = now()  # before "ready": a stall right after it falls between two readings
print("ready", flush=True)
while not stop:
    t = now()
    if t - last > threshold:
        stalls.append((last, t - last))
    last = t
json.dump(stalls, sys.stdout)
"""


class StallProbe:
    """After the `with` block: `stalls`, [(start ns, length ns)] of every gap the probe saw, and
    `seconds`, how long it watched (0: it did not run). `pid`: the probe's process, meanwhile."""

    def __init__(self):
        self.stalls: list[tuple[int, int]] = []
        self.seconds = 0.0
        self.pid = 0


@contextlib.contextmanager
def stall_probe(enabled: bool = True, threshold_ns: int = STALL_NS) -> Iterator[StallProbe]:
    probe = StallProbe()
    if not enabled:
        yield probe
        return
    with deaf_to_ctrl_c():
        proc = subprocess.Popen([sys.executable, "-c", PROBE, str(threshold_ns)], stdout=subprocess.PIPE, text=True)
    probe.pid = proc.pid
    proc.stdout.readline()  # "ready" (or nothing, if it failed to start: it then reports no stalls)
    t0 = time.monotonic()
    try:
        yield probe
    finally:
        probe.seconds = time.monotonic() - t0
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=10)
            probe.stalls = [tuple(s) for s in json.loads(out or "[]")]
        except (subprocess.TimeoutExpired, ValueError):
            proc.kill()
            proc.wait()


class _Events:
    """(start, length, ...) events in time order, none overlapping another (one clock reader,
    one process's collections): the longest that overlaps a span."""

    def __init__(self, events):
        self._start = np.array([e[0] for e in events], dtype=np.int64)
        self._len = np.array([e[1] for e in events], dtype=np.int64)
        self._end = self._start + self._len

    def longest_within(self, t0: int, t1: int) -> int:
        lo, hi = np.searchsorted(self._end, t0, "right"), np.searchsorted(self._start, t1, "left")
        return int(self._len[lo:hi].max()) if hi > lo else 0


def attribute(workers: list[tuple[list, list]], stalls, server_gc) -> dict:
    """workers: per worker, (spans, gc pauses): the (start, end) ns of its timed requests of one
    kind and its collections; stalls: the probe's; server_gc: the server's collections. The
    requests over twice the median and what each overlapped: {"p50_ms", "slow": [(worker,
    index, ms, longest probe stall us, longest gc pause of the worker us, of the server us)],
    "with_stall", "with_gc", "with_server_gc", "with_none", "share_with_stall" (of all
    requests: what chance alone gives)}."""
    ms = [np.array([(b - a) / 1e6 for a, b in spans]) for spans, _ in workers]
    if not sum(len(m) for m in ms):
        return {}
    p50 = float(np.median(np.concatenate(ms)))
    stalls, server_gc = _Events(stalls), _Events(server_gc)
    slow, met = [], 0
    for w, ((spans, pauses), lat) in enumerate(zip(workers, ms)):
        pauses = _Events(pauses)
        met += sum(1 for a, b in spans if stalls.longest_within(a, b))
        for i in np.flatnonzero(lat > 2 * p50):
            a, b = spans[i]
            met_us = (e.longest_within(a, b) / 1e3 for e in (stalls, pauses, server_gc))
            slow.append((w, int(i), float(lat[i]), *met_us))
    return {"p50_ms": p50, "slow": slow,
            **{name: sum(1 for s in slow if s[k]) for k, name in ((3, "with_stall"), (4, "with_gc"),
                                                                   (5, "with_server_gc"))},
            "with_none": sum(1 for s in slow if not any(s[3:])),
            "share_with_stall": met / sum(len(m) for m in ms)}


def machine_stalls(probe: StallProbe) -> dict:
    """The probe's gaps over LONG_STALL_NS ({} when it did not run)."""
    if not probe.seconds:
        return {}
    long = [s[1] / 1e3 for s in probe.stalls if s[1] > LONG_STALL_NS]
    return {"seconds": probe.seconds, "over_50us": len(long), "per_second": len(long) / probe.seconds,
            "longest_us": max(long, default=0.0)}


def print_tails(tails: dict, machine: dict) -> None:
    for kind, t in tails.items():
        if not t:
            continue
        worst = ", ".join(f"w{s[0]}#{s[1]} {s[2]:.2f}" for s in sorted(t["slow"], key=lambda s: -s[2])[:5])
        probe = (f"{t['with_stall']} met a stall of the probe (as did {t['share_with_stall']:.0%} of all), "
                 if machine else "")
        print(f"tail of {kind}: {len(t['slow'])} requests over 2x the p50 of {t['p50_ms']:.3f} ms"
              + (f" (slowest, ms: {worst}); {probe}{t['with_gc']} a garbage collection of the engine process, "
                 f"{t['with_server_gc']} one of the server, {t['with_none']} none of these" if t["slow"] else ""))
    if machine:
        print(f"stall probe (a process that only reads the clock): {machine['over_50us']} gaps over 50 us in "
              f"{machine['seconds']:.1f} s ({machine['per_second']:.1f}/s), longest {machine['longest_us']:.0f} us")
