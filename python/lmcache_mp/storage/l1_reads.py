"""Reads and leases of L1's objects (a part L1Store owns, built from L1's lock, index, eviction
policy, lease table and counters, and what using, parking and pausing mean to L1).

A read pins the leading committed objects of one format (`readers`), so they are neither evicted
nor moved until end_read. A lookup counts the leading chunks present for every rank (or as one
tp-shared object); with lock=True it opens a named lease on the found prefix (storage/leases.py),
which only retrieves that name consume. Every method takes L1's lock and works through a request
in slices of at most SLICE keys, letting the lock go between them.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Callable, Collection, Iterator, Sequence

from lmcache_mp.storage.eviction.base import EvictionPolicy
from lmcache_mp.storage.index import PART_MASK
from lmcache_mp.storage.l1_index import SLICE, L1Index
from lmcache_mp.storage.leases import Lease, LeaseTable
from lmcache_mp.storage.objects import L1Object, ObjectKey

logger = logging.getLogger(__name__)

class L1Reads:
    def __init__(self, lock: threading.Lock, index: L1Index, policy: EvictionPolicy, leases: LeaseTable,
                 counters: dict, clock: Callable[[], float], pause: Callable[[], None],
                 use: Callable[[L1Object], None], park_all: Callable[[Sequence[L1Object]], None]):
        """counters: L1's (lookups, hits and format mismatches are counted there); pause(): let a
        waiting thread take the lock between slices; use(obj): a use of obj (L2 admission);
        park_all(objs): objs may be evicted again where nothing holds them, deepest first."""
        self._lock = lock
        self._index = index
        self._policy = policy
        self._leases = leases
        self.counters = counters
        self._clock = clock
        self._pause = pause
        self._use = use
        self._park_all = park_all
        self._mismatches_logged: set[str] = set()

    def begin_read(self, keys: Sequence[ObjectKey], format_key: tuple, lease: int = 0,
                   fallback: Sequence[ObjectKey] | None = None) -> list[L1Object]:
        """Pin the leading committed objects of this format; a read under `lease` consumes one
        use of each object that lease holds (other leases on them are untouched). fallback[i]:
        the key read when keys[i] is not held (a tenant's reads of the shared namespace)."""
        out: list[L1Object] = []
        with self._lock:
            held = self._leases.get(lease)
            for i, key in enumerate(keys):
                if i and i % SLICE == 0:
                    self._pause()
                    held = self._leases.get(lease)  # it may have expired meanwhile
                obj = self._index.get(key)
                if fallback is not None and (obj is None or not obj.committed):
                    obj = self._index.get(fallback[i])
                if obj is None or not obj.committed:
                    break
                if obj.format_key != format_key:
                    self._format_mismatch(key.model, obj.format_key, format_key)
                    break
                obj.readers += 1
                self._policy.unpark(obj)
                self._policy.use(obj)
                if held is not None:
                    self._leases.consume(held, obj)
                out.append(obj)
        return out

    def _format_mismatch(self, model: str, held: tuple, wanted: tuple) -> None:
        """A read stopped at a chunk whose bytes are of another format: counted, and logged once
        per pair of formats (the engine recomputes such chunks; a steady rate of them is a bug)."""
        self.counters["format_mismatches"] += 1
        pair = repr((held, wanted))
        if pair in self._mismatches_logged or len(self._mismatches_logged) >= 64:
            return
        self._mismatches_logged.add(pair)
        logger.warning("a read of model %s stopped at a chunk stored in format %s, not the reader's %s: "
                       "its bytes are not copied", model, held, wanted)

    def end_read(self, objs: Sequence[L1Object]) -> None:
        with self._lock:
            for part in self._deepest_slices(objs):
                for obj in part:
                    obj.readers -= 1
                self._park_all(part)

    def _deepest_slices(self, objs: Sequence[L1Object]) -> Iterator[Sequence[L1Object]]:
        """(lock held) objs (in prefix order) a slice at a time, the deepest first, letting the
        lock go between slices: parked in prefix order, a long prompt's first slice would be
        older than its second and go first, leaving the rest unreachable."""
        for n, start in enumerate(reversed(range(0, len(objs), SLICE))):
            if n:
                self._pause()
            yield objs[start:start + SLICE]

    def _repark(self, objs: Sequence[L1Object]) -> None:
        """(lock held) Park again the objs a lookup found (in prefix order), the deepest slice
        first, those still held only (the lookup let the lock go between its slices)."""
        for part in self._deepest_slices(objs):
            self._park_all([obj for obj in part if self._index.get(obj.key) is obj])

    def lookup(
        self,
        model: str,
        world_size: int,
        digests: Sequence[bytes],
        salt: bytes = b"",
        lock: bool = False,
        owner: bytes = b"",
        ttl: float = 30.0,
        extend: int = 0,
        fallback_model: str = "",
        tp_shared: bool = False,
        counted: bool = True,
    ) -> tuple[int, int]:
        """(leading chunks present for every rank or as one shared object, lease id). With lock
        and at least one hit, the found prefix is leased under that id, else the id is 0.
        extend: a live lease to add the found chunks to instead (returns (0, 0) if it ended).
        fallback_model: a chunk not found under model is looked for under it (a tenant's reads
        of the shared namespace). tp_shared: the chunks are tp-shared objects (one object serves
        every rank of any TP size). counted=False: neither a lookup in the counters nor a use of the
        chunks found (a pin, server/hints.py). Raises TooManyLeases when the owner holds too many leases."""
        hits = 0
        with self._lock:
            if extend:
                lease = self._leases.get(extend)
                if lease is None:
                    return 0, 0
            else:
                lease = self._leases.open(owner, self._clock() + ttl) if lock else None
            budget = SLICE
            spaces = None
            seen: list[L1Object] = []  # hits without a lease: parked again at the end, deepest first
            for digest in digests:
                if budget <= 0:  # objects already leased stay; unleased hits are advisory anyway
                    self._pause()
                    budget, spaces = SLICE, None
                    if lease is not None and self._leases.get(lease.lease_id) is not lease:
                        break  # it ended meanwhile (TTL, owner gone): report what it covered
                if spaces is None:  # the indexes of a namespace come and go with its objects
                    spaces = [self._index.namespace(m, world_size, salt, tp_shared) for m in (model, fallback_model) if m]
                budget -= 1 if tp_shared else world_size
                part = hash(digest) & PART_MASK
                for shared, ranks in spaces:
                    found = self._index.found(shared, ranks, part, digest, world_size)
                    if found:
                        break
                if not found:
                    break
                hits += 1
                if lease is not None:
                    for obj, _ in found:
                        self._policy.unpark(obj)
                        if counted:
                            self._use(obj)
                    self._leases.add(lease, digest, found)
                else:
                    for obj, _ in found:
                        seen.append(obj)  # a lookup hit: recent (for LRU), and a use for L2 admission
                        self._use(obj)
            self._repark(seen)
            if extend:
                return hits, lease.lease_id
            if counted:
                self.counters["lookups"] += 1
                self.counters["lookup_chunks"] += len(digests)
                self.counters["hits"] += hits
            if lease is None:
                return hits, 0
            self._leases.close(lease)  # no-op unless it holds nothing
            return hits, (lease.lease_id if hits else 0)

    def unhold(self, parts: list[Collection]) -> int:
        """Let go of objects leases no longer hold (one collection per lease), a slice at a time
        (lock held)."""
        for i, obj in enumerate(itertools.chain.from_iterable(map(reversed, parts))):  # deepest first
            if i and i % SLICE == 0:
                self._pause()
            self._leases.unhold(obj)
        return sum(map(len, parts))

    def release(self, lease: int, digests: Sequence[bytes] | None = None) -> int:
        """Drop what is left of a lease, on these chunks only or on all of them; returns the
        objects let go (0 for an unknown or ended lease)."""
        with self._lock:
            held = self._leases.get(lease)
            return self.unhold([self._leases.release(held, digests)]) if held is not None else 0

    def lease(self, lease: int) -> Lease | None:
        """The live lease of this id (for tests and status)."""
        with self._lock:
            return self._leases.get(lease)

    def drop_owner(self, owner: bytes) -> int:
        """End every lease of a client that went away; returns how many."""
        with self._lock:
            ended, parts = self._leases.drop_owner(owner)
            self.unhold(parts)
            return ended

    def expire(self) -> None:
        with self._lock:
            self.unhold(self._leases.expire(self._clock()))