"""L1: the index of chunk objects in the host arena, with leases and eviction.

An object is *committed* (visible to lookup and retrieve) only after its bytes have landed; a
store that fails or is abandoned frees its slots and leaves nothing visible. An object is
*evictable* when it is committed, nobody reads it, it carries no live lease and it is not being
moved; evictable objects of every size are *parked* with one eviction policy (storage/eviction/),
which picks the victim whatever its size. Reads and stores of chunks already held are the uses a
policy counts; lookup hits only refresh LRU's recency. The chunks of one request are handed to the
policy deepest first, so that a prompt is evicted from its end.

L1Store owns its parts, each built from the collaborators it names: the index of its objects
(storage/l1_index.py), reads, lookups and leases (storage/l1_reads.py), the tp-shared objects being
filled (storage/l1_slices.py), the application's hints (storage/l1_hints.py), the slab moves
(memory across sizes), the L2 writeback and, with --l1-persist, the journal's persistence. L1Store
itself stores, commits and frees objects.

Memory across sizes (storage/slab_moves.py): one eviction order over every size; a size that needs memory
takes a whole slab from another size by moving that slab's live objects, never by evicting them.

L2 (storage/l1_writeback.py): which objects the L2 tiers' writers take, in prefix order, and
which victim eviction picks (a clean one before a dirty one near the eviction end). An object
being written to L2 keeps its place in the eviction order but is not freed or moved until the write
has read its bytes.

All methods are thread-safe under one lock, which no call holds for long: requests are worked
through in slices of at most SLICE keys with the lock released between them, object moves copy
without it, and no table of the index is ever rebuilt whole (storage/index.py).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Sequence

from lmcache_mp.storage.eviction import DEFAULT_POLICY, make_policy
from lmcache_mp.storage.eviction.chooser import VictimChooser
from lmcache_mp.storage.eviction.quotas import Quotas
from lmcache_mp.storage.events import REMOVED, STORED
from lmcache_mp.storage.l1_hints import L1Hints
from lmcache_mp.storage.l1_index import SLICE, L1Index  # noqa: F401 (SLICE re-exported)
from lmcache_mp.storage.l1_journal import Entry, L1Journal
from lmcache_mp.storage.l1_persist import L1Persistence
from lmcache_mp.storage.l1_reads import L1Reads
from lmcache_mp.storage.l1_slices import TpSharedSlices
from lmcache_mp.storage.l1_writeback import SCAN, L1Writeback, busy
from lmcache_mp.storage.leases import Lease, LeaseTable
from lmcache_mp.storage.objects import SHARED_RANK, TP_SHARED_WORLD, L1Object, ObjectKey  # noqa: F401 (re-exported)
from lmcache_mp.storage.slab_moves import MAX_MOVES, SlabMove, SlabMoves


@dataclass
class StorePlan:
    """What a store will write: `objects[i]` receives chunk `indices[i]` of the request."""

    indices: list[int]
    objects: list[L1Object]
    present: int  # chunks already stored
    skipped: int  # chunks not stored: no memory
    pending: list[L1Object] = field(default_factory=list)  # being written by another request
    cover: int = 0  # tp-shared objects: the heads this store writes of each (0: whole objects)


class L1Store:
    def __init__(self, arena, clock: Callable[[], float] = time.monotonic, policy: str = DEFAULT_POLICY,
                 quotas: Quotas | None = None, lock=None):
        """quotas: tenants' shares of L1 (storage/eviction/quotas.py; a server with a tenants file).
        lock: the one lock of L1 and its parts (default a new threading.Lock; tests pass a timed one)."""
        self.arena = arena
        self.on_commit: Callable[[int], None] | None = None  # (objects committed), called without the lock
        self._lock = threading.Lock() if lock is None else lock
        self._index = L1Index()
        self._at = self._index.at  # arena offset -> object
        self._policy = make_policy(policy)  # orders what may be evicted, every size
        self._leases = LeaseTable(on_unheld=self._park)
        self._classes: dict[int, int] = {}  # object bytes -> size class
        self._class_bytes: dict[int, int] = {}  # size class -> object bytes
        self._evicted: dict[int, int] = {}  # size class -> objects evicted
        self._committed = 0
        self.events = None  # an EventLog of commits and removals for subscribers (events.py)
        self.counters = {"stored": 0, "evicted": 0, "hits": 0, "lookups": 0, "lookup_chunks": 0, "moved": 0, "slab_moves": 0,
                         "cleared": 0, "replaced": 0, "format_mismatches": 0, "partial_dropped": 0}
        self.quotas = quotas
        self.writeback = L1Writeback(arena, self._lock, self._index, self._policy)
        self.chooser = VictimChooser(self._policy, quotas, busy=busy)  # told which are dirty by attach_l2
        self.moves = SlabMoves(arena, self._lock, self._index, self.chooser, evict=self._evict, moved=self._moved,
                               counters=self.counters, evicted=self._evicted)
        self.persistence: L1Persistence | None = None  # with --l1-persist (attach_journal)
        self.reads = L1Reads(self._lock, self._index, self._policy, self._leases, self.counters, clock,
                             pause=self._pause, use=self._use, park_all=self._park_all)
        self.slices = TpSharedSlices(self._lock, clock, self.counters, abandon=self._abandon)
        self.hints = L1Hints(self._lock, self._index, self._policy, pause=self._pause, park=self._park,
                             evictable=self._evictable, free=self._free)
        # what the parts answer for L1 (their docstrings say how)
        r, h = self.reads, self.hints
        self.begin_read, self.end_read, self.lookup, self.release = r.begin_read, r.end_read, r.lookup, r.release
        self.lease, self.drop_owner, self.expire = r.lease, r.drop_owner, r.expire
        self.prefix_objects, self.retain, self.drop_objects = h.prefix_objects, h.retain, h.drop_objects

    def _pause(self) -> None:
        """Between slices of one request: let a waiting thread take the lock (and the GIL)."""
        self._lock.release()
        time.sleep(0)
        self._lock.acquire()

    # ---- helpers (lock held) -------------------------------------------------------------------

    def _put(self, obj: L1Object) -> None:
        self._index.put(obj)
        if self.quotas is not None:
            obj.owner = self.quotas.owner_of(obj.key.model)
            self.quotas.added(obj.owner, obj.nbytes)

    def _get(self, key: ObjectKey) -> L1Object | None:
        return self._index.get(key)

    @staticmethod
    def _parkable(obj: L1Object) -> bool:
        return obj.committed and obj.readers == 0 and not obj.leases

    def _evictable(self, obj: L1Object) -> bool:
        return self._parkable(obj) and not obj.moving and not obj.l2_writing

    def _park(self, obj: L1Object) -> None:
        """Make obj a candidate for eviction again if nothing holds it (for LRU: the most recent)."""
        if self._parkable(obj):
            self._policy.park(obj)
        else:
            self._policy.unpark(obj)

    def _park_all(self, objs: Sequence[L1Object]) -> None:
        """_park, deepest chunk first (objs in prefix order)."""
        for i in range(len(objs) - 1, -1, -1):
            self._park(objs[i])

    def _use(self, obj: L1Object) -> None:
        obj.uses += 1
        self.writeback.admitted(obj)

    def _free(self, obj: L1Object) -> None:
        if obj.committed:
            if self.events is not None:
                self.events.add(REMOVED, obj.key)
            self._policy.remove(obj)
        if self.writeback.wanted:
            self.writeback.leaving(obj)
        # Gone, it ends every walk back from its successors (each tier has a copy of it or lost
        # it), so it holds on to no predecessor: chains of a long conversation stay bounded.
        obj.prev = None
        self._index.remove(obj)
        if obj.committed:
            self._committed -= 1
            if self.persistence is not None:  # before the slot can go to anyone else
                self.persistence.freed(obj)
        self.slices.discard(obj)
        self.arena.free(obj.offset)
        if obj.owner >= 0:
            self.quotas.removed(obj.owner, obj.nbytes)

    def _evict(self, victim: L1Object, cause: str) -> None:
        """victim leaves L1 for room (cause: pressure, or its owner's cap)."""
        self.writeback.evicting(victim)
        self.chooser.evicted(victim, cause)
        self._free(victim)
        self.counters["evicted"] += 1
        self._evicted[victim.size_class] = self._evicted.get(victim.size_class, 0) + 1

    def _moved(self, obj: L1Object, old: int) -> None:
        if self.persistence is not None and obj.committed:
            self.persistence.moved(obj, old)

    def _size_class(self, object_bytes: int) -> int:
        cls = self._classes.get(object_bytes)
        if cls is None:
            cls = self.arena.size_class(object_bytes)
            self._classes[object_bytes] = cls
            self._class_bytes[cls] = object_bytes
        return cls

    def object_bytes(self, size_class: int) -> int:
        """The object size of a size class (its slots may be larger)."""
        return self._class_bytes[size_class]

    # ---- store -------------------------------------------------------------------------------

    def begin_store(self, keys: Sequence[ObjectKey], object_bytes: int, format_key: tuple,
                    parent: ObjectKey | None = None, cover: int = 0, full: int = 0) -> StorePlan:
        """Reserve objects for the keys not yet present. Stops at the first chunk it cannot place
        (a later chunk is useless without the earlier ones: lookups are prefix lookups). parent:
        the key of the chunk before the first, when the request names only a prompt's new chunks
        (its object, in L1 or lately gone, becomes the first one's prefix for L2 writes).

        cover, full: a store of one slice (the heads `cover`, of `full`) of tp-shared objects. It
        writes its slice into an object other stores are filling, unless one of them writes or
        wrote any of these heads (then the chunk counts as present); commit() makes an object
        visible once every head has landed."""
        plan = StorePlan(indices=[], objects=[], present=0, skipped=0, cover=cover)
        with self._lock:
            cls = self._size_class(object_bytes)
            slot_bytes = self.arena.slot_bytes(cls)
            i = moves = 0
            # chunks already held: uses, held (not evicted for this store's own new chunks) and
            # parked again deepest first at the end
            used: list[L1Object] = []
            # the object of the chunk before: its prefix, for L2 writes
            last = self.writeback.parent(parent, format_key) if parent is not None else None
            owner = self.quotas.owner_of(keys[0].model) if self.quotas is not None and keys else -1
            while i < len(keys):
                if i and i % SLICE == 0:
                    self._pause()
                key = keys[i]
                obj = self._get(key)
                if obj is not None and obj.format_key != format_key:
                    if not self._evictable(obj):
                        plan.skipped = len(keys) - i
                        break
                    self._free(obj)  # stale bytes of another layout: replace them
                    self.counters["replaced"] += 1
                    obj = None
                if obj is not None:
                    if cover and not obj.committed and obj.heads_full == full:
                        if self.slices.join(obj, cover):
                            plan.indices.append(i)
                            plan.objects.append(obj)
                        else:
                            plan.present += 1  # another store has these heads
                    elif obj.committed:
                        plan.present += 1
                        self._use(obj)
                        self._policy.use(obj)  # a store of existing data counts as a use
                        self._policy.unpark(obj)
                        used.append(obj)
                    else:
                        plan.pending.append(obj)
                    if last is not None and obj.prev is not last:
                        obj.prev, obj.l2_lost = last, 0  # its prefix is this store's now
                    last = obj
                    i += 1
                    continue
                got = self.moves.allocate(cls, moves < MAX_MOVES, owner)
                if isinstance(got, SlabMove):
                    moves += 1
                    self.moves.run(got)
                    continue  # the same key again: the index may have changed meanwhile
                if got < 0:
                    plan.skipped = len(keys) - i
                    if owner >= 0:
                        self.quotas.skipped[owner] += plan.skipped
                    break
                obj = L1Object(key=key, offset=got, size_class=cls, nbytes=slot_bytes, format_key=format_key,
                               prev=last)
                if cover:
                    self.slices.opened(obj, cover, full)
                last = obj
                self._put(obj)
                plan.indices.append(i)
                plan.objects.append(obj)
                i += 1
            # (the lock was let go between slices: one may have been replaced meanwhile)
            self._park_all([obj for obj in used if self._get(obj.key) is obj])
        return plan

    def commit(self, plan: StorePlan, from_l2: bool = False) -> None:
        """The plan's bytes have landed; from_l2: they were loaded from L2 (not a use; the loader
        set the tiers they came from in l2_copies)."""
        waiters = []
        objs = self.slices.land(plan.objects, plan.cover) if plan.cover else plan.objects
        if self.persistence is not None:  # room in the journal's queue, or this store sums its own chunks
            self.persistence.sum_ahead(objs)
        with self._lock:
            for start in range(0, len(objs), SLICE):
                if start:
                    self._pause()
                part = objs[start:start + SLICE]
                for obj in part:
                    obj.committed = True
                    if self.events is not None:
                        self.events.add(STORED, obj.key)
                    if not from_l2:
                        self._use(obj)
                    waiters += obj.waiters or ()
                    obj.waiters = None
                self._committed += len(part)
                self._policy.admit(part, lead=objs[0], last=start + SLICE >= len(objs))
            self.counters["stored"] += len(objs)
            if self.persistence is not None and objs:
                self.persistence.record_commits(objs)
        for fn in waiters:
            fn(True)
        if self.on_commit is not None and objs:
            self.on_commit(len(objs))

    def abort(self, plan: StorePlan) -> None:
        waiters = []
        with self._lock:
            for i, obj in enumerate(plan.objects):
                if i and i % SLICE == 0:
                    self._pause()
                # other slices of a tp-shared object may still land: it goes when none is left
                if not plan.cover or self.slices.abandoned(obj, plan.cover):
                    waiters += self._abandon(obj)
        for fn in waiters:
            fn(False)

    def _abandon(self, obj: L1Object) -> list:
        """(lock held) obj's store is abandoned: it leaves L1; returns its waiters to tell."""
        obj.aborted = True
        self._free(obj)
        waiters, obj.waiters = obj.waiters or [], None
        return waiters

    def when_written(self, objs: Sequence[L1Object], fn: Callable[[int], None]) -> None:
        """Call fn(number abandoned) once every object has been committed or abandoned by the
        store writing it (at once if they all are). A store that finds its chunks being written
        by another request answers only then, so its reply still means "the bytes are there"."""
        if not objs:  # the usual case: nobody else was writing any of them
            fn(0)
            return
        state = {"left": 0, "failed": 0}
        with self._lock:
            for obj in objs:
                if obj.aborted:
                    state["failed"] += 1
                elif not obj.committed:
                    state["left"] += 1

                    def settled(ok: bool) -> None:
                        with self._lock:
                            state["left"] -= 1
                            state["failed"] += 0 if ok else 1
                            last = state["left"] == 0
                        if last:
                            fn(state["failed"])

                    obj.waiters = (obj.waiters or []) + [settled]
            done_now = state["left"] == 0
        if done_now:
            fn(state["failed"])

    def clear(self) -> int:
        """End every lease and free every object nobody is reading, writing or moving."""
        removed = 0
        with self._lock:
            self.reads.unhold(self._leases.clear())
            while True:
                victims = list(itertools.islice((o for o in self._policy.order() if not o.moving and not o.l2_writing),
                                                SLICE))
                for obj in victims:
                    self._free(obj)
                removed += len(victims)
                self.counters["cleared"] += len(victims)
                if len(victims) < SLICE:
                    break
                self._pause()
        return removed

    def set_quota(self, tenant: str, l1_min: int, l1_max: int) -> None:
        """A tenant's share of L1 (storage/eviction/quotas.py; L1 must have been given quotas)."""
        with self._lock:
            self.quotas.set_limits(tenant, l1_min, l1_max)

    def quota_stats(self) -> dict[str, dict]:
        with self._lock:
            return self.quotas.stats() if self.quotas is not None else {}

    # ---- introspection -----------------------------------------------------------------------

    def contains(self, key: ObjectKey) -> bool:
        with self._lock:
            obj = self._get(key)
            return obj is not None and obj.committed

    def stats(self) -> dict:
        """Counts kept as things happen: O(1), never a walk over the objects."""
        a = self.arena.stats()
        with self._lock:
            return {
                "objects": self._committed,
                "writing": len(self._at) - self._committed,
                "leased_objects": self._leases.leased_objects,
                "leases": len(self._leases),
                "bytes_used": a["bytes_allocated"],
                "evictable": len(self._policy),
                "leases_expired": self._leases.expired,
                "journal_backlog": self.journal_backlog(),
                "eviction": self._policy.stats(),
                **self.counters,
            }

    def size_stats(self) -> list[dict]:
        """Per object size: slabs held, objects, and where the held bytes go (storage/slab_moves.py)."""
        return self.moves.size_stats()

    # ---- the journal (storage/l1_persist.py) ---------------------------------------------------

    @property
    def journal(self) -> L1Journal | None:
        return self.persistence.journal if self.persistence is not None else None

    def attach_journal(self, journal: L1Journal) -> None:
        """Keep a journal from now on (--l1-persist): L1 outlives the server."""
        self.persistence = L1Persistence(journal, self.arena, self._lock, self._index, self._class_bytes, self.counters,
                                         committed=lambda: self._committed)

    def restore(self, entries: Collection[Entry]) -> tuple[int, int]:
        """Re-attach a previous server's chunks, before any request: (restored, dropped)."""
        return self.persistence.restore(entries, self._size_class, self._adopt)

    def _adopt(self, e: Entry, cls: int) -> L1Object | None:
        """(lock held) A restored chunk joins the index, unless its key is held already."""
        key = ObjectKey(*e.key)
        if self._get(key) is not None:
            return None
        obj = L1Object(key=key, offset=e.offset, size_class=cls, nbytes=self.arena.slot_bytes(cls),
                       format_key=e.format_key, committed=True, checksum=e.checksum)
        self._put(obj)
        self._committed += 1
        self._policy.admit((obj,))
        return obj

    def journal_backlog(self) -> int:
        """Committed objects whose journal records are not written yet (a glance)."""
        return self.persistence.backlog() if self.persistence is not None else 0

    def flush_journal(self, timeout: float = 60.0) -> bool:
        """Wait until every object committed so far is recorded; False after timeout."""
        return self.persistence.flush(timeout) if self.persistence is not None else True

    def close_journal(self, timeout: float = 60.0) -> None:
        """Record what was committed (a clean stop loses nothing), then close the journal."""
        if self.persistence is not None:
            self.persistence.close(timeout)

    # ---- L2 writes (storage/l1_writeback.py) ---------------------------------------------------

    def attach_l2(self, wanted: int, admit: int, on_dirty: Callable | None, on_drop: Callable | None,
                  on_evict: Callable | None) -> None:
        """The tiers that take writes (bits; 0: none), the admission count and the writers' hooks."""
        self.writeback.attach(wanted, admit, on_dirty, on_drop, on_evict)
        with self._lock:  # a clean victim before a dirty one, while tiers take writes
            self.chooser.prefer_clean(self.writeback.dirty if wanted else None)

    def l2_take(self, bit: int, below: int, max_bytes: int, fresh=None, scan: int = SCAN, dry: bool = False) -> list:
        """For the writer of tier `bit`: the dirty objects to write now (L1Writeback.take)."""
        return self.writeback.take(bit, below, max_bytes, fresh, scan, dry)

    def l2_written(self, bit: int, results) -> list:
        """Tier `bit` has read these objects' bytes (L1Writeback.written)."""
        return self.writeback.written(bit, results)

    def l2_flush_order(self) -> list:
        """Every object L1 holds, the most valuable first (what a stopping server writes)."""
        return self.writeback.flush_order()
