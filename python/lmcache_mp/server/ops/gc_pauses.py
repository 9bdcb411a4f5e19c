"""The garbage collections of this process. Each one stops every Python thread, the socket thread
included, so they are part of what a request can wait for: counted for the status ("gc") and
/metrics, and the latest ones kept so that a benchmark can line its slow requests up with them.

In a process that is only a cache server (`settle_after_setup(True)`, by the command line),
what start-up and each registration made lives long: it is frozen out of the collector, so a
young collection walks only what requests made since the last one (on a 2-core machine the first
young collection after start-up and a registration took 226 µs, the later ones 61-77 µs; 98 µs
with this).

So are L1's chunk objects, every SETTLE_OBJECTS of them (`made_long_lived`). CPython counts a
young collection due when allocations outnumber deallocations by 700, and a deallocation of *any*
object counts, old ones included. Once L1 is full, every store frees as many old chunk objects as
it makes: young collections stop, the young generation grows to the whole index, and the next
burst of allocations walks it all (121 ms at 300,000 objects on a 2-core machine; with this,
every collection took under 4 ms)."""

from __future__ import annotations

import collections
import contextlib
import gc
import time

_settle = False
_settled = 0  # times settle() froze
SETTLE_OBJECTS = 8192  # long-lived objects made between two settles (a young collection walks them)
_made = 0


def settle_after_setup(enabled: bool) -> None:
    global _settle
    _settle = enabled


def settle() -> None:
    """Freeze what exists now out of the collector, after collecting the young generations (their
    garbage would otherwise never be freed). No-op unless settle_after_setup(True): freezing is a
    decision for the whole process, not for a server embedded in another program."""
    global _settled
    if _settle:
        gc.collect(1)
        gc.freeze()
        _settled += 1


def made_long_lived(n: int) -> None:
    """n objects that live long (L1 chunks) were made: settle once SETTLE_OBJECTS have been
    (no lock: two threads that both settle only make the second one cheap)."""
    global _made
    if _settle:
        _made += n
        if _made >= SETTLE_OBJECTS:
            _made = 0
            settle()


class GCPauses:
    def __init__(self, keep: int | None = 128):
        self.recent: collections.deque = collections.deque(maxlen=keep)  # (start ns, length ns, generation)
        self.collections = [0, 0, 0]  # per generation
        self.total_ns = 0  # (integers: a length compared with them is never off by a float's rounding)
        self.longest_ns = 0
        self._start = 0
        gc.callbacks.append(self._seen)

    def _seen(self, phase: str, info: dict) -> None:
        now = time.monotonic_ns()
        if phase == "start":
            self._start = now
            return
        length, gen = now - self._start, info["generation"]
        self.recent.append((self._start, length, gen))
        self.collections[gen] += 1
        self.total_ns += length
        self.longest_ns = max(self.longest_ns, length)

    def stats(self) -> dict:
        """Collections per generation, their total and longest time, the latest ones (their
        start, CLOCK_MONOTONIC nanoseconds, their length and generation), and how many times the
        process froze what it had made (settle). Not the number of frozen objects:
        gc.get_freeze_count() walks them all, and with a full L1 that held the socket thread for
        over 20 ms per status. The latest ones are copied first, in one step that allocates no
        tracked object: a collection the listing itself starts appends to them."""
        recent = self.recent.copy()
        return {"collections": list(self.collections), "seconds": self.total_ns / 1e9,
                "longest_s": self.longest_ns / 1e9, "total_ns": self.total_ns, "longest_ns": self.longest_ns,
                "recent": [{"start_ns": s, "length_ns": n, "generation": g} for s, n, g in recent],
                "settled": _settled}

    def close(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._seen)
