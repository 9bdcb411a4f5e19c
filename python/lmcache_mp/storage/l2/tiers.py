"""L2Tiers: what goes from L1 to the L2 tiers and back.

Writes. Policy `evicted` writes what L1 is about to evict, `all` every chunk once admitted (both
in the background), `none` nothing (the tiers are then only read, e.g. a disk kept from an
earlier run). A chunk is admitted once it was stored or looked up `admit` times, so one-off
chunks do not churn the tiers. Writes wait in a queue bounded by bytes; when it is full a write
is dropped and counted, never waited for; it holds at most a quarter of L1. A queued object is
not freed or moved before its write has read it; one queued at eviction leaves L1 then, unless it
was used again meanwhile (storage/l1.py). With `evicted`, while L1 is nearly full and the queue
is empty, the writer also takes the oldest unwritten objects (`spill_ahead`), so that evictions
find their victims on disk already instead of dropping them. Writes go to every tier.

Reads. `find` continues a lookup into the tiers after the L1 prefix (from their in-memory
indexes). `prefetch` loads found chunks into L1 on the reader thread and calls back once they
are resident or the prefetch deadline passed, whichever comes first, so that a lookup with lock
can lease them; at most `max_prefetches` run at once (beyond that a lookup is answered from L1
alone). `load` does the same for a retrieve that names chunks only L2 has.

Keys and formats are stored as msgpack of the L1 key and of the layout's format key.
"""

from __future__ import annotations

import collections
import heapq
import logging
import queue
import threading
import time
from typing import Callable, NamedTuple, Sequence

import msgspec

from lmcache_mp.storage.l1 import SHARED_RANK, L1Object, L1Store, ObjectKey, StorePlan
from lmcache_mp.storage.l1_journal import format_key_from
from lmcache_mp.storage.l2 import CORRUPT, FORMAT_MISMATCH, IO_ERROR, MISS, L2Backend

logger = logging.getLogger(__name__)

WRITE_BATCH_BYTES = 256 << 20  # one put() call: parallel on the tier's I/O threads
LOAD_BATCH_CHUNKS = 16  # chunks per get() call: a deadline can answer with the chunks loaded so far
DRAIN_SECONDS = 30.0  # on close, queued writes get this long to finish
SPILL_AHEAD_POLL = 0.05  # seconds between looks at L1's fill level while the writer is idle

_encode = msgspec.msgpack.encode
_decode = msgspec.msgpack.decode


def key_bytes(key: ObjectKey) -> bytes:
    return _encode((key.model, key.world_size, key.rank, key.digest, key.salt))


class Found(NamedTuple):
    """An object one of the tiers holds."""

    key: ObjectKey
    tier: int
    nbytes: int
    fmt: bytes


def _first() -> Callable[[], bool]:
    """True for the first call only, from any thread: of two events (done, deadline), the
    first one answers."""
    once = iter((True,))
    return lambda: next(once, False)


class _Deadlines:
    """One thread that runs callbacks at their time."""

    def __init__(self):
        self._heap: list = []
        self._seq = 0
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="lmcache-l2-deadlines", daemon=True)
        self._thread.start()

    def at(self, when: float, fn: Callable[[], None]) -> None:
        with self._cv:
            self._seq += 1
            heapq.heappush(self._heap, (when, self._seq, fn))
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cv.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                if self._stop:
                    return
                _, _, fn = heapq.heappop(self._heap)
            try:
                fn()
            except Exception:
                logger.exception("L2 deadline callback failed")

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join()


class _Incident:
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


class L2Tiers:
    def __init__(self, tiers: Sequence[L2Backend], l1: L1Store, write: str = "evicted", admit: int = 1,
                 queue_bytes: int = 1 << 30, max_prefetches: int = 64, prefetch_timeout: float = 0.5):
        if not tiers:
            raise ValueError("L2Tiers needs at least one tier")
        self.tiers = list(tiers)
        self.l1 = l1
        self.write = write
        self.admit = admit
        self.queue_limit = min(queue_bytes, l1.arena.capacity // 4)
        self.max_prefetches = max_prefetches
        self.prefetch_timeout = prefetch_timeout
        self.counters = collections.Counter({k: 0 for k in (
            "written", "written_ahead", "write_errors", "dropped_writes", "lookup_hits", "loaded", "prefetches",
            "prefetch_timeouts", "prefetches_refused")})
        self._tier_counts = [collections.Counter() for _ in self.tiers]
        self._queue: collections.deque[L1Object] = collections.deque()
        self._queued_bytes = 0
        self._cv = threading.Condition()
        self._closing = False
        self._prefetching = 0
        self._writing = 0  # objects of the write in progress
        self._pressure = False  # L1 was nearly full at the writer's last look
        self._write_incident = _Incident("writes")
        self._read_incident = _Incident("reads")
        self._deadlines = _Deadlines()
        self._reads: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="lmcache-l2-writer", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="lmcache-l2-reader", daemon=True)
        self._writer.start()
        self._reader.start()
        if write != "none":
            l1.offer_l2 = self._offer

    # ---- writes ------------------------------------------------------------------------------

    def _offer(self, obj: L1Object, evicting: bool) -> bool:
        """Called by L1 with its lock held: whether to write obj to L2 now."""
        if not evicting and self.write == "evicted":
            if self._pressure:  # L1 is nearly full: the writer looks whether to spill ahead
                with self._cv:
                    self._cv.notify()
            return False
        if (not evicting and self.write != "all") or obj.uses < self.admit:
            return False
        with self._cv:
            if self._closing:
                return False
            if self._queued_bytes + obj.nbytes > self.queue_limit:
                self.counters["dropped_writes"] += 1
                return False
            self._queue.append(obj)
            self._queued_bytes += obj.nbytes
            self._cv.notify()
        return True

    def _next_batch(self) -> tuple[list[L1Object], int] | None:
        """Queued writes (and their bytes), else objects to spill ahead; None once closing and
        nothing is queued."""
        while True:
            with self._cv:
                if self._queue:
                    batch, size = [], 0
                    while self._queue and (not batch or size + self._queue[0].nbytes <= WRITE_BATCH_BYTES):
                        obj = self._queue.popleft()
                        batch.append(obj)
                        size += obj.nbytes
                    self._writing = len(batch)
                    return batch, size
                if self._closing:
                    return None
            if self.write == "evicted":
                ahead = self.l1.spill_ahead(self.admit, self.queue_limit)
                self._pressure = ahead is not None
                if ahead:
                    self.counters["written_ahead"] += len(ahead)
                    with self._cv:
                        self._writing = len(ahead)
                    return ahead, 0
            with self._cv:
                if not self._queue and not self._closing:
                    self._cv.wait(SPILL_AHEAD_POLL if self.write == "evicted" else None)

    @property
    def remote(self) -> bool:
        """Some tier answers lookups over the network: lookups then run off the socket thread."""
        return any(not getattr(t, "local", True) for t in self.tiers)

    def run_read(self, fn: Callable[[], None]) -> None:
        """fn on the reader thread (e.g. a lookup that asks a remote tier)."""
        self._reads.put(fn)

    def _write_loop(self) -> None:
        while True:
            got = self._next_batch()
            if got is None:
                return
            batch, size = got
            results = [False] * len(batch)
            try:
                sizes = [self.l1.object_bytes(o.size_class) for o in batch]
                base = self.l1.arena.base
                args = ([key_bytes(o.key) for o in batch], [self._fmt(o.format_key) for o in batch],
                        [base + o.offset for o in batch], sizes)
                for tier in self.tiers:  # every tier: a local disk for this node, a shared one for all
                    results = [a or b for a, b in zip(results, tier.put(*args))]
            except Exception as e:  # a tier bug must not leave objects pinned in L1
                logger.exception("L2 write failed: %s", e)
            finally:
                self.l1.l2_written(list(zip(batch, results)))
                with self._cv:
                    self._queued_bytes -= size
                    self._writing = 0
            written = sum(results)
            self.counters["written"] += written
            self.counters["write_errors"] += len(batch) - written
            self._write_incident.update(len(batch) - written, len(batch), lambda: "; ".join(
                str(t.stats().get("last_error", "")) for t in self.tiers))

    @staticmethod
    def _fmt(format_key: tuple) -> bytes:
        return _encode(format_key)

    # ---- reads -------------------------------------------------------------------------------

    def _locate(self, keys: Sequence[ObjectKey]) -> list[Found | None]:
        """Where each object is: the first tier that has it (from the tiers' indexes)."""
        out: list[Found | None] = [None] * len(keys)
        blobs = [key_bytes(k) for k in keys]
        for t, tier in enumerate(self.tiers):
            todo = [i for i, f in enumerate(out) if f is None]
            if not todo:
                break
            for i, got in zip(todo, tier.lookup([blobs[i] for i in todo])):
                if got is not None:
                    out[i] = Found(keys[i], t, got[0], got[1])
        return out

    def find(self, model: str, world_size: int, digests: Sequence[bytes], salt: bytes = b"") -> list[list[Found]]:
        """The objects of the leading chunks the tiers hold for every rank (or as one shared
        object), chunk by chunk."""
        shared = self._locate([ObjectKey(model, world_size, SHARED_RANK, d, salt) for d in digests])
        chunks: list[list[Found]] = []
        for i, d in enumerate(digests):
            if shared[i] is not None:
                chunks.append([shared[i]])
                continue
            ranks = self._locate([ObjectKey(model, world_size, r, d, salt) for r in range(world_size)])
            if any(f is None for f in ranks):
                break
            chunks.append(ranks)  # type: ignore[arg-type]
        self.counters["lookup_hits"] += len(chunks)
        return chunks

    def find_keys(self, keys: Sequence[ObjectKey]) -> list[Found]:
        """The leading objects of these keys the tiers hold."""
        out = []
        for f in self._locate(keys):
            if f is None:
                break
            out.append(f)
        return out

    def prefetch(self, chunks: list[list[Found]], answer: Callable[[], None]) -> bool:
        """Load these chunks into L1, then call answer() once: when they are in, or at the
        prefetch deadline. False (and nothing done) when too many prefetches run already."""
        with self._cv:
            if self._prefetching >= self.max_prefetches or self._closing:
                self.counters["prefetches_refused"] += 1
                return False
            self._prefetching += 1
        self.counters["prefetches"] += 1
        first = _first()

        def at_deadline() -> None:
            if first():
                self.counters["prefetch_timeouts"] += 1
                answer()

        def run() -> None:
            try:
                self._load([f for chunk in chunks for f in chunk])
            finally:
                with self._cv:
                    self._prefetching -= 1
                if first():
                    answer()

        self._deadlines.at(time.monotonic() + self.prefetch_timeout, at_deadline)
        self._reads.put(run)
        return True

    def lookup_remote(self, find: Callable[[], list[list[Found]]], lock: bool,
                      answer: Callable[[int | None], None]) -> None:
        """For tiers behind a network, the whole L2 part of a lookup runs on the reader thread:
        find(), and with lock the load of what it found. answer(chunks found) is called once,
        when done, or answer(None) at the prefetch deadline, whichever comes first: a slow or
        hung server delays no lookup beyond it."""
        first = _first()

        def at_deadline() -> None:
            if first():
                self.counters["prefetch_timeouts"] += 1
                answer(None)

        def run() -> None:
            n = 0
            try:
                found = find()
                n = len(found)
                if lock and found:
                    self.counters["prefetches"] += 1
                    with self._cv:
                        self._prefetching += 1
                    try:
                        self._load([f for chunk in found for f in chunk])
                    finally:
                        with self._cv:
                            self._prefetching -= 1
            finally:
                if first():
                    answer(n)

        self._deadlines.at(time.monotonic() + self.prefetch_timeout, at_deadline)
        self._reads.put(run)

    def load(self, found: list[Found], then: Callable[[], None]) -> None:
        """Load these objects into L1 on the reader thread, then call then() there."""

        def run() -> None:
            try:
                self._load(found)
            finally:
                then()

        self._reads.put(run)

    def load_keys(self, keys: Sequence[ObjectKey], then: Callable[[], None]) -> None:
        """find_keys and load on the reader thread, then then() there."""

        def run() -> None:
            try:
                found = self.find_keys(keys)
                if found:
                    self._load(found)
            finally:
                then()

        self._reads.put(run)

    def _read_loop(self) -> None:
        while True:
            job = self._reads.get()
            if job is None:
                return
            try:
                job()
            except Exception:
                logger.exception("L2 read failed")

    def _load(self, found: list[Found]) -> int:
        """Read objects into new L1 objects, in order, a batch at a time; stops at the first one
        that cannot be placed or read. Returns how many are in L1 now."""
        done = 0
        for start in range(0, len(found), LOAD_BATCH_CHUNKS):
            batch = found[start:start + LOAD_BATCH_CHUNKS]
            first = batch[0]
            batch = batch[: next((i for i, f in enumerate(batch) if (f.nbytes, f.fmt) != (first.nbytes, first.fmt)),
                                 len(batch))]
            n = self._load_batch(batch)
            done += n
            if n < len(batch):
                break
        return done

    def _load_batch(self, batch: list[Found]) -> int:
        fmt = format_key_from(_decode(batch[0].fmt))
        plan = self.l1.begin_store([f.key for f in batch], batch[0].nbytes, fmt)
        results: list[int] = []
        if plan.objects:
            base = self.l1.arena.base
            by_tier: dict[int, list[int]] = collections.defaultdict(list)
            for j, i in enumerate(plan.indices):
                by_tier[batch[i].tier].append(j)
            results = [IO_ERROR] * len(plan.objects)
            for t, js in by_tier.items():
                try:
                    got = self.tiers[t].get([key_bytes(plan.objects[j].key) for j in js], [batch[0].fmt] * len(js),
                                            [base + plan.objects[j].offset for j in js], [batch[0].nbytes] * len(js))
                except Exception as e:
                    logger.exception("L2 read failed: %s", e)
                    got = [IO_ERROR] * len(js)
                for j, r in zip(js, got):
                    results[j] = r
                    c = self._tier_counts[t]
                    c["hits" if r >= 0 else "misses" if r in (MISS, FORMAT_MISMATCH) else
                      "corrupt" if r == CORRUPT else "errors"] += 1
            ok = [o for o, r in zip(plan.objects, results) if r == batch[0].nbytes]
            bad = [o for o, r in zip(plan.objects, results) if r != batch[0].nbytes]
            if ok:
                self.l1.commit(StorePlan([], ok, 0, 0), from_l2=True)
            if bad:
                self.l1.abort(StorePlan([], bad, 0, 0))
            self.counters["loaded"] += len(ok)
            errors = sum(r not in (MISS, FORMAT_MISMATCH) and r < 0 for r in results)
            self._read_incident.update(errors, len(results), lambda: "; ".join(
                str(t.stats().get("last_error", "")) for t in self.tiers))
        # the leading objects now in L1: present before, written by this batch, or by another store
        good = {id(o) for o, r in zip(plan.objects, results) if r == batch[0].nbytes}
        placed = {i: o for i, o in zip(plan.indices, plan.objects)}
        n = 0
        for i in range(len(batch) - plan.skipped):
            o = placed.get(i)
            if o is not None and id(o) not in good:
                break
            n += 1
        return n

    # ---- status ------------------------------------------------------------------------------

    def stats(self) -> dict:
        with self._cv:
            depth, queued, writing = len(self._queue), self._queued_bytes, self._writing
            prefetching = self._prefetching
        tiers = []
        for tier, counts in zip(self.tiers, self._tier_counts):
            st = dict(tier.stats())
            st.update(name=tier.name, hits=counts["hits"], misses=counts["misses"], read_corrupt=counts["corrupt"],
                      read_errors=counts["errors"])
            for op in ("read", "write"):
                secs = st.get(f"{op}_seconds", 0)
                st[f"{op}_GBps"] = round(st.get(f"{op}_bytes", 0) / secs / 1e9, 3) if secs else 0.0
            tiers.append(st)
        idle = not depth and not writing and not (self.write == "evicted" and self.l1.spill_ahead(
            self.admit, self.queue_limit, dry=True))
        return {"write": self.write, "admit": self.admit, "queue_objects": depth, "queue_bytes": queued,
                "writing": writing, "idle": idle,
                "queue_limit": self.queue_limit, "prefetching": prefetching, **dict(self.counters), "tiers": tiers}

    def close(self) -> None:
        """Finish the queued writes (for a while), stop the threads, close the tiers."""
        deadline = time.monotonic() + DRAIN_SECONDS
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self.l1.offer_l2 = None
        self._writer.join(max(0.0, deadline - time.monotonic()))
        if self._writer.is_alive():
            logger.warning("L2: %d queued writes not finished at shutdown", len(self._queue))
        self._reads.put(None)
        self._reader.join()
        self._deadlines.stop()
        for tier in self.tiers:
            tier.close()
