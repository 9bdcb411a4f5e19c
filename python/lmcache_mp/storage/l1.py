"""L1: the index of chunk objects in the host arena, with leases and LRU eviction.

An object is *committed* (visible to lookup and retrieve) only after its bytes have landed; a
store that fails or is abandoned frees its slots and leaves nothing visible. An object is
*evictable* when it is committed, nobody reads it, it carries no live lease and it is not being
moved; evictable objects of every size sit in one LRU list, so the victim is always the least
recently used evictable object, whatever its size.

Memory across sizes. Objects stay contiguous and inside one pinned slab (one DMA per chunk, no
re-pinning), so the arena hands out same-size slots from slabs of one size each (O(log slabs),
no fragmentation inside a size). A size that needs memory when none is free evicts LRU victims
until either its own slot frees, or another size holds a slab's worth of free slots: then that
size's emptiest slab is drained, its live objects are *moved* (a memcpy inside the arena, done
without the lock) into the size's other free slots, and the empty slab changes size. Moving
instead of evicting the slab's objects means nothing newer than an LRU victim is ever dropped;
the price is memory held idle as free slots, less than one slab per size (see `size_stats`).
Segregated slabs were chosen over one extent or buddy allocator because those need contiguous
holes, which LRU order does not produce without evicting hot neighbours.

Leases: lookup(lock=True) leases the objects of the found prefix, one *use* per rank that will
read the object (a shared MLA object gets world_size uses). A retrieve consumes one use of each
object it reads; release() drops the leases a client took; a lease also ends when its client is
gone or its TTL passes.

All methods are thread-safe (one lock; every operation is short, object moves run without it).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

logger = logging.getLogger(__name__)

SHARED_RANK = -1  # rank of objects shared by every rank (MLA)


class ObjectKey(NamedTuple):
    model: str
    world_size: int
    rank: int  # SHARED_RANK for objects every rank reads
    digest: bytes
    salt: bytes


@dataclass
class Lease:
    owner: bytes
    uses: int
    expires: float
    serial: int


@dataclass(eq=False)
class L1Object:
    key: ObjectKey
    offset: int
    size_class: int
    nbytes: int  # slot bytes taken from the arena
    format_key: tuple
    committed: bool = False
    aborted: bool = False
    moving: bool = False  # being copied to another slot (its slab is changing size)
    readers: int = 0
    leases: list[Lease] = field(default_factory=list)
    waiters: list = field(default_factory=list)  # called with True/False once written/abandoned


@dataclass
class StorePlan:
    """What a store will write: `objects[i]` receives chunk `indices[i]` of the request."""

    indices: list[int]
    objects: list[L1Object]
    present: int  # chunks already stored
    skipped: int  # chunks not stored: no memory
    pending: list[L1Object] = field(default_factory=list)  # being written by another request


@dataclass
class _SlabMove:
    """Objects of a draining slab and the free slots of their size they are copied to."""

    slab: int
    objects: list[L1Object]
    dst: list[int]
    nbytes: int


_MAX_MOVES = 3  # slab moves one allocation may try (a move is abandoned when a reader arrives)


class L1Store:
    def __init__(self, arena, clock: Callable[[], float] = time.monotonic):
        self.arena = arena
        self._clock = clock
        self._lock = threading.Lock()
        # (model, world_size, rank, salt) -> digest -> object: a lookup walks one dict per rank
        self._spaces: dict[tuple, dict[bytes, L1Object]] = {}
        self._lru: OrderedDict[ObjectKey, L1Object] = OrderedDict()  # every size, least recently used first
        self._at: dict[int, L1Object] = {}  # arena offset -> object
        self._expiry: list[tuple[float, int, L1Object, Lease]] = []  # heap of lease deadlines
        self._serial = itertools.count()
        self._classes: dict[int, int] = {}  # object bytes -> size class
        self._evicted: dict[int, int] = {}  # size class -> objects evicted
        self.counters = {"stored": 0, "evicted": 0, "hits": 0, "lookups": 0, "leases_expired": 0,
                         "moved": 0, "slab_moves": 0}

    # ---- helpers (lock held) -------------------------------------------------------------------

    @staticmethod
    def _space_of(key: ObjectKey) -> tuple:
        return (key.model, key.world_size, key.rank, key.salt)

    def _get(self, key: ObjectKey) -> L1Object | None:
        space = self._spaces.get(self._space_of(key))
        return space.get(key.digest) if space else None

    def _put(self, obj: L1Object) -> None:
        self._spaces.setdefault(self._space_of(obj.key), {})[obj.key.digest] = obj
        self._at[obj.offset] = obj

    def _objects(self):
        for space in self._spaces.values():
            yield from space.values()

    @staticmethod
    def _parkable(obj: L1Object) -> bool:
        return obj.committed and obj.readers == 0 and not obj.leases

    def _evictable(self, obj: L1Object) -> bool:
        return self._parkable(obj) and not obj.moving

    def _park(self, obj: L1Object) -> None:
        """Put obj at the most-recently-used end of the LRU list if nothing holds it."""
        self._lru.pop(obj.key, None)
        if self._parkable(obj):
            self._lru[obj.key] = obj

    def _unpark(self, obj: L1Object) -> None:
        self._lru.pop(obj.key, None)

    def _free(self, obj: L1Object) -> None:
        self._unpark(obj)
        space = self._spaces.get(self._space_of(obj.key))
        if space is not None and space.get(obj.key.digest) is obj:
            del space[obj.key.digest]
            if not space:
                del self._spaces[self._space_of(obj.key)]
        del self._at[obj.offset]
        self.arena.free(obj.offset)

    def _expire_leases(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            _, _, obj, lease = heapq.heappop(self._expiry)
            if lease in obj.leases:
                obj.leases.remove(lease)
                self.counters["leases_expired"] += 1
                self._park(obj)

    def _allocate(self, cls: int, may_move: bool) -> int | _SlabMove:
        """A slot of class cls: its offset, -1 when nothing evictable is left, or a slab move
        the caller runs without the lock (then asks again)."""
        off = self.arena.allocate(cls)
        if off >= 0:
            return off
        self._expire_leases(self._clock())
        donors = [c for c in range(self.arena.num_classes) if c != cls]
        while True:
            off = self.arena.allocate(cls)
            if off >= 0:
                return off
            for donor in donors if may_move else ():
                move = self._plan_slab_move(donor)
                if move is not None:
                    return move
            victim = next((o for o in self._lru.values() if not o.moving), None)
            if victim is None or (not may_move and victim.size_class != cls):
                return -1  # nothing to evict, or only victims whose memory could not reach cls
            self._free(victim)
            self.counters["evicted"] += 1
            self._evicted[victim.size_class] = self._evicted.get(victim.size_class, 0) + 1
            donors = [victim.size_class] if victim.size_class != cls else []

    def _plan_slab_move(self, cls: int) -> _SlabMove | None:
        """When class cls holds a slab's worth of free slots, drain its emptiest slab whose
        objects may move (committed, not being read), reserving the slots they go to."""
        if self.arena.free_slots(cls) < self.arena.slots_per_slab(cls):
            return None
        for slab in self.arena.drain_candidates(cls, 4):
            objs = [self._at[off] for off in self.arena.slab_objects(slab)]
            if any(o.moving or o.readers or not o.committed for o in objs):
                continue
            self.arena.drain(slab)
            dst = [self.arena.allocate(cls) for _ in objs]  # never the draining slab
            if min(dst, default=0) < 0:  # cannot happen with the free count above; stay safe
                for off in dst:
                    if off >= 0:
                        self.arena.free(off)
                self.arena.undrain(slab)
                return None
            for o in objs:
                o.moving = True
            return _SlabMove(slab, objs, dst, objs[0].nbytes)
        return None

    def _finish_move(self, move: _SlabMove, copied: bool) -> None:
        """Point each object at its copy and free its old slot, unless a reader arrived during
        the copy (it reads the old slot, which therefore stays)."""
        for obj, dst in zip(move.objects, move.dst):
            obj.moving = False
            if copied and obj.readers == 0:
                del self._at[obj.offset]
                self.arena.free(obj.offset)
                obj.offset = dst
                self._at[dst] = obj
                self.counters["moved"] += 1
            else:
                self.arena.free(dst)
        self.arena.undrain(move.slab)  # no-op once the slab emptied and went back to the pool
        self.counters["slab_moves"] += 1

    def _size_class(self, object_bytes: int) -> int:
        cls = self._classes.get(object_bytes)
        if cls is None:
            cls = self.arena.size_class(object_bytes)
            self._classes[object_bytes] = cls
        return cls

    # ---- store -------------------------------------------------------------------------------

    def begin_store(self, keys: Sequence[ObjectKey], object_bytes: int, format_key: tuple) -> StorePlan:
        """Reserve objects for the keys not yet present. Stops at the first chunk it cannot place
        (a later chunk is useless without the earlier ones: lookups are prefix lookups)."""
        plan = StorePlan(indices=[], objects=[], present=0, skipped=0)
        with self._lock:
            cls = self._size_class(object_bytes)
            i = moves = 0
            while i < len(keys):
                key = keys[i]
                obj = self._get(key)
                if obj is not None and obj.format_key != format_key:
                    if not self._evictable(obj):
                        plan.skipped = len(keys) - i
                        break
                    self._free(obj)  # stale bytes of another layout: replace them
                    obj = None
                if obj is not None:
                    if obj.committed:
                        plan.present += 1
                        self._park(obj)  # a store of existing data counts as a use
                    else:
                        plan.pending.append(obj)
                    i += 1
                    continue
                got = self._allocate(cls, moves < _MAX_MOVES)
                if isinstance(got, _SlabMove):
                    moves += 1
                    self._run_move(got)
                    continue  # the same key again: the index may have changed meanwhile
                if got < 0:
                    plan.skipped = len(keys) - i
                    break
                obj = L1Object(key=key, offset=got, size_class=cls, nbytes=self.arena.slot_bytes(cls),
                               format_key=format_key)
                self._put(obj)
                plan.indices.append(i)
                plan.objects.append(obj)
                i += 1
        return plan

    def _run_move(self, move: _SlabMove) -> None:
        """Copy the objects of a draining slab with the lock released (called with it held)."""
        copied = False
        self._lock.release()
        try:
            self.arena.move_objects([o.offset for o in move.objects], move.dst, move.nbytes)
            copied = True
        finally:
            self._lock.acquire()
            self._finish_move(move, copied)

    def commit(self, plan: StorePlan) -> None:
        waiters = []
        with self._lock:
            for obj in plan.objects:
                obj.committed = True
                self._park(obj)
                waiters += obj.waiters
                obj.waiters = []
            self.counters["stored"] += len(plan.objects)
        for fn in waiters:
            fn(True)

    def abort(self, plan: StorePlan) -> None:
        waiters = []
        with self._lock:
            for obj in plan.objects:
                obj.aborted = True
                self._free(obj)
                waiters += obj.waiters
                obj.waiters = []
        for fn in waiters:
            fn(False)

    def when_written(self, objs: Sequence[L1Object], fn: Callable[[int], None]) -> None:
        """Call fn(number abandoned) once every object has been committed or abandoned by the
        store writing it (at once if they all are). A store that finds its chunks being written
        by another request answers only then, so its reply still means "the bytes are there"."""
        state = {"left": 0, "failed": 0}
        done_now = False
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

                    obj.waiters.append(settled)
            done_now = state["left"] == 0
        if done_now:
            fn(state["failed"])

    # ---- read --------------------------------------------------------------------------------

    def begin_read(self, keys: Sequence[ObjectKey], format_key: tuple) -> list[L1Object]:
        """Pin the leading committed objects of this format and consume one lease use of each."""
        out: list[L1Object] = []
        with self._lock:
            for key in keys:
                obj = self._get(key)
                if obj is None or not obj.committed or obj.format_key != format_key:
                    break
                obj.readers += 1
                if obj.leases:
                    lease = obj.leases[0]
                    lease.uses -= 1
                    if lease.uses <= 0:
                        obj.leases.pop(0)
                self._unpark(obj)
                out.append(obj)
        return out

    def end_read(self, objs: Sequence[L1Object]) -> None:
        with self._lock:
            for obj in objs:
                obj.readers -= 1
                self._park(obj)

    # ---- lookup and leases -------------------------------------------------------------------

    def _present(self, key: ObjectKey) -> L1Object | None:
        obj = self._get(key)
        return obj if obj is not None and obj.committed else None

    def lookup(
        self,
        model: str,
        world_size: int,
        digests: Sequence[bytes],
        salt: bytes = b"",
        lock: bool = False,
        owner: bytes = b"",
        ttl: float = 30.0,
    ) -> int:
        """Leading chunks present for every rank (or as one shared object), leased if lock."""
        hits = 0
        empty: dict = {}
        with self._lock:
            now = self._clock()
            self._expire_leases(now)
            shared = self._spaces.get((model, world_size, SHARED_RANK, salt), empty)
            ranks = [self._spaces.get((model, world_size, r, salt), empty) for r in range(world_size)]
            for digest in digests:
                obj = shared.get(digest)
                if obj is not None and obj.committed:
                    found = [(obj, world_size)]
                else:
                    found = []
                    for space in ranks:
                        obj = space.get(digest)
                        if obj is None or not obj.committed:
                            break
                        found.append((obj, 1))
                    if len(found) != world_size:
                        break
                hits += 1
                if lock:
                    for obj, uses in found:
                        lease = Lease(owner=owner, uses=uses, expires=now + ttl, serial=next(self._serial))
                        obj.leases.append(lease)
                        heapq.heappush(self._expiry, (lease.expires, lease.serial, obj, lease))
                        self._unpark(obj)
                else:
                    for obj, _ in found:
                        self._park(obj)  # a lookup hit is a use
            self.counters["lookups"] += 1
            self.counters["hits"] += hits
        return hits

    def release(self, owner: bytes, model: str, world_size: int, digests: Sequence[bytes], salt: bytes = b"") -> int:
        """Drop one lease of `owner` on each object of these chunks; returns leases dropped."""
        dropped = 0
        with self._lock:
            for digest in digests:
                keys = [ObjectKey(model, world_size, SHARED_RANK, digest, salt)]
                keys += [ObjectKey(model, world_size, r, digest, salt) for r in range(world_size)]
                for key in keys:
                    obj = self._get(key)
                    if obj is None:
                        continue
                    for lease in obj.leases:
                        if lease.owner == owner:
                            obj.leases.remove(lease)
                            dropped += 1
                            self._park(obj)
                            break
        return dropped

    def drop_owner(self, owner: bytes) -> int:
        """Drop every lease of a client that went away."""
        dropped = 0
        with self._lock:
            for obj in self._objects():
                if obj.leases:
                    keep = [ls for ls in obj.leases if ls.owner != owner]
                    if len(keep) != len(obj.leases):
                        dropped += len(obj.leases) - len(keep)
                        obj.leases = keep
                        self._park(obj)
        return dropped

    def expire(self) -> None:
        with self._lock:
            self._expire_leases(self._clock())

    def clear(self) -> int:
        """Drop every lease and free every object nobody is reading, writing or moving."""
        removed = 0
        with self._lock:
            for obj in list(self._objects()):
                obj.leases.clear()
                if obj.committed and obj.readers == 0 and not obj.moving:
                    self._free(obj)
                    removed += 1
            self._expiry.clear()
        return removed

    # ---- introspection -----------------------------------------------------------------------

    def contains(self, key: ObjectKey) -> bool:
        with self._lock:
            return self._present(key) is not None

    def stats(self) -> dict:
        with self._lock:
            objs = list(self._objects())
            committed = sum(1 for o in objs if o.committed)
            return {
                "objects": committed,
                "writing": len(objs) - committed,
                "leased_objects": sum(1 for o in objs if o.leases),
                "leases": sum(len(o.leases) for o in objs),
                "bytes_used": sum(o.nbytes for o in objs),
                "evictable": len(self._lru),
                **self.counters,
            }

    def size_stats(self) -> list[dict]:
        """Per object size: slabs held, objects, and where the held bytes go. bytes_free are free
        slots only this size can use (fewer than one slab's worth, except while a slab cannot
        move because an object in it is being read or written); bytes_fragmented is slot
        rounding (< 256 B per object) and slab tails (< one slot per slab)."""
        slab = self.arena.slab_bytes
        with self._lock:
            evicted = dict(self._evicted)
        out = []
        for cls, c in enumerate(self.arena.class_stats()):
            held = c["slabs"] * slab
            used = c["objects"] * c["object_bytes"]
            free = c["free_slots"] * c["slot_bytes"]
            out.append({"object_bytes": c["object_bytes"], "slot_bytes": c["slot_bytes"],
                        "slots_per_slab": c["slots_per_slab"], "slabs": c["slabs"], "objects": c["objects"],
                        "bytes_used": used, "bytes_free": free, "bytes_fragmented": held - used - free,
                        "evicted": evicted.get(cls, 0)})
        return out
