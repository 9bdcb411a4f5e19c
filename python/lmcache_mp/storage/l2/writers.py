"""TierWriter: what goes from L1 to one L2 tier, on a thread of its own.

Policies, per tier:
- `evicted` (write-back, the local disk's default): while less than `below` bytes of L1 are
  free, the chunks L1 will evict next are written ahead of the eviction, nearest it first, as far
  as the tier's bandwidth goes. While the tier writes faster than chunks reach that end,
  eviction finds them written and drops nothing; while L1 has room, nothing is written.
- `all` (write-through, the default of the shared tiers): every admitted chunk is written soon
  after it is stored, so that other nodes find it; the few nearest eviction go first.
- `none`: nothing (the tier is only read).

Writes go in prefix order, a chunk after the chunks before it in its prompt, and when the tier
cannot keep up it is the prompts at L1's eviction end that lose their unwritten rest, never a
chunk in the middle of a written prefix (storage/l1_writeback.py). Drops are counted per tier
and logged as one WARNING with counts, at most once every WARN_EVERY_S.

Demotions (a hint, server/hints.py): chunks named by the application are written ahead of
everything else, each after its unwritten predecessors, on the writer's own thread.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

import msgspec

from lmcache_mp.sizes import format_size
from lmcache_mp.storage.eviction.chooser import EVICTION_WINDOW
from lmcache_mp.storage.l1_writeback import SCAN

logger = logging.getLogger(__name__)

WRITE_BATCH_BYTES = 256 << 20  # one put() call at most: parallel on the tier's I/O threads
POLL_S = 0.05  # between looks at L1's eviction end while nothing wakes the writer
WARN_EVERY_S = 60.0
FRESH_MAX = 1 << 16  # write-through: objects listed at most (beyond, the oldest go unlisted; the write-ahead sees them)
POLICIES = ("evicted", "all", "none")


class Incident:
    """Logs a failing operation once when it starts failing and once when it works again."""

    def __init__(self, what: str):
        self.what = what
        self.failing = False

    def update(self, failed: int, total: int, detail: Callable[[], str]) -> None:
        if failed and not self.failing:
            self.failing = True
            logger.warning("L2 %s failing (%d of %d): %s; requests go on from L1", self.what, failed, total, detail())
        elif not failed and total and self.failing:
            self.failing = False
            logger.info("L2 %s work again", self.what)


def key_bytes(key) -> bytes:
    return msgspec.msgpack.encode((key.model, key.world_size, key.rank, key.digest, key.salt))


def format_bytes(format_key: tuple) -> bytes:
    return msgspec.msgpack.encode(format_key)


class TierWriter:
    def __init__(self, l1, tier, index: int, policy: str, below: int):
        if policy not in ("evicted", "all"):
            raise ValueError(f"a writer's policy is evicted or all, got {policy!r}")
        self.l1, self.tier, self.policy, self.below = l1, tier, policy, below
        self.bit = 1 << index
        self.batch_bytes = max(1, min(WRITE_BATCH_BYTES, below))
        # write-through: only the objects eviction looks at next, before the fresh ones (the rest
        # are written already, unless the writer fell behind: a walk over them would be wasted)
        self.scan = SCAN if policy == "evicted" else EVICTION_WINDOW
        self.fresh: collections.deque | None = collections.deque(maxlen=FRESH_MAX) if policy == "all" else None
        self.counts = collections.Counter({k: 0 for k in ("written", "write_errors", "dropped", "lost", "fragments")})
        self.written_bytes = 0
        self.writing = self.writing_bytes = 0  # the write in flight
        self._taking = False  # from before it takes a batch until that batch is written
        self._incident = Incident(f"writes to {tier.name}")
        self._wake = threading.Event()
        self._demotions: collections.deque = collections.deque()  # (objects, done) to write first
        self._closing = False
        self._deadline = float("inf")
        self._warned = (time.monotonic(), 0, 0, 0, 0)  # when, dropped, lost, written, bytes written
        self._next_warning = 0.0
        self._thread = threading.Thread(target=self._loop, name=f"lmcache-l2-writer-{tier.name}", daemon=True)
        self._thread.start()

    # called by L1 with its lock held: cheap
    def dirty(self, obj) -> None:
        if self.fresh is not None:
            self.fresh.append(obj)
            self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def demote(self, objs: list, done: Callable[[], None]) -> None:
        """Write these objects (those the tier should have and lacks) before anything else, then
        call done() on the writer's thread (at once if it is closing)."""
        if self._closing:
            done()
            return
        self._demotions.append((objs, done))
        self._wake.set()

    def _write_demotions(self) -> None:
        while self._demotions:
            objs, done = self._demotions.popleft()
            try:
                batch = self.l1.l2_take(self.bit, 0, 1 << 62, collections.deque(objs), 0)
                if batch:
                    self._write(batch)
            finally:
                done()

    def dropped(self, dropped: int, lost: int) -> None:
        self.counts["dropped"] += dropped
        self.counts["lost"] += lost

    # ---- the thread ----------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            closing = self._closing
            if closing and time.monotonic() > self._deadline:
                while self._demotions:  # (not written: their chunks stay in L1)
                    self._demotions.popleft()[1]()
                return
            # closing: what write-through still has listed, nothing ahead of eviction any more
            self._taking = True
            try:
                self._write_demotions()
                batch = self.l1.l2_take(self.bit, 0 if closing else self.below, self.batch_bytes, self.fresh,
                                        self.scan)
                if batch:
                    self._write(batch)
                self._warn_drops()  # (before the writer is idle: whoever sees it idle finds the warning)
            finally:
                self._taking = False
            if not batch:
                if closing:
                    while self._demotions:
                        self._demotions.popleft()[1]()
                    return
                self._wake.wait(POLL_S)
                self._wake.clear()

    def _write(self, batch: list) -> None:
        l1 = self.l1
        sizes = [l1.object_bytes(o.size_class) for o in batch]
        self.writing, self.writing_bytes = len(batch), sum(sizes)
        results = [False] * len(batch)
        try:
            base = l1.arena.base
            results = self.tier.put([key_bytes(o.key) for o in batch], [format_bytes(o.format_key) for o in batch],
                                    [base + o.offset for o in batch], sizes)
        except Exception as e:  # a tier bug must not leave objects pinned in L1
            logger.exception("L2 write to %s failed: %s", self.tier.name, e)
        finally:
            fragments = l1.l2_written(self.bit, zip(batch, results))
            self.writing = self.writing_bytes = 0
        failed = len(batch) - sum(map(bool, results))
        # (logged before it is counted: whoever sees the count finds the log line that goes with it)
        self._incident.update(failed, len(batch), lambda: str(self.tier.stats().get("last_error", "")))
        # Chunks written after one that failed stay (the tier may hold an older copy of the
        # failed one, another node's maybe), but nothing more of their prompt follows them.
        self.counts["fragments"] += len(fragments)
        self.counts["written"] += len(batch) - failed
        self.counts["write_errors"] += failed
        self.written_bytes += sum(n for n, ok in zip(sizes, results) if ok)

    def _warn_drops(self) -> None:
        c = self.counts
        now = time.monotonic()
        when, dropped, lost, written, nbytes = self._warned
        if c["dropped"] + c["lost"] == dropped + lost or now < self._next_warning:
            return
        secs = max(now - when, 1e-3)
        logger.warning(
            "L2 %s: %d chunk writes dropped in the last %.0f s (%d chunks left L1 unwritten, taking %d later chunks "
            "of their prompts with them); %d chunks (%s) written meanwhile. Stores come faster than the tier writes; "
            "they go on from L1: give the tier more bandwidth, or L1 more memory",
            self.tier.name, c["dropped"] - dropped + c["lost"] - lost, secs, c["dropped"] - dropped,
            c["lost"] - lost, c["written"] - written, format_size(self.written_bytes - nbytes))
        self._warned = (now, c["dropped"], c["lost"], c["written"], self.written_bytes)
        self._next_warning = now + WARN_EVERY_S

    # ---- status and shutdown ---------------------------------------------------------------------

    def idle(self) -> bool:
        """Nothing it would write now, and nothing being written (asked in this order: a batch
        taken after the first question is still being written at the second)."""
        return not self.l1.l2_take(self.bit, self.below, self.batch_bytes, self.fresh, self.scan,
                                   dry=True) and not self._taking

    def stats(self) -> dict:
        return {"write": self.policy, "written": self.counts["written"], "write_errors": self.counts["write_errors"],
                "dropped_writes": self.counts["dropped"] + self.counts["lost"],
                "dropped_evicted": self.counts["dropped"], "written_after_failed": self.counts["fragments"],
                "listed": len(self.fresh or ()),
                "writing": self.writing, "writing_bytes": self.writing_bytes}

    def begin_close(self, deadline: float, flush: list | None = None) -> None:
        """Write what write-through still has listed, and a write-back writer what L1 holds that
        the tier lacks (`flush`: L1's objects, most valuable first), until deadline; then stop.
        Without this a clean stop left a write-back tier (the disk's default) with nothing of
        what L1 held: a restarted server found none of it."""
        if self._closing:
            return
        if flush is not None and self.policy == "evicted":
            self.fresh = collections.deque(flush)  # (taken as write-through's list: each after its predecessors)
        self._flushing = len(flush) if flush is not None and self.policy == "evicted" else 0
        self._close_started, self._written_before = time.monotonic(), (self.counts["written"], self.written_bytes)
        self._deadline = deadline
        self._closing = True
        self._wake.set()

    def close(self, deadline: float, flush: list | None = None) -> None:
        self.begin_close(deadline, flush)
        self._thread.join(max(0.0, deadline - time.monotonic()) + 1.0)
        n, nbytes = self.counts["written"] - self._written_before[0], self.written_bytes - self._written_before[1]
        if self._flushing and n:
            logger.info("L2 %s: wrote %d chunks (%s) of L1 at shutdown in %.1f s", self.tier.name, n,
                        format_size(nbytes), time.monotonic() - self._close_started)
        if self._thread.is_alive() or (self.fresh and time.monotonic() > deadline):
            logger.warning("L2 %s: writes at shutdown stopped at their bound of %.0f s, %d %s", self.tier.name,
                           deadline - self._close_started, len(self.fresh or ()),
                           "chunks of L1 not looked at (those the tier lacks are lost)" if self._flushing
                           else "listed writes not finished")
