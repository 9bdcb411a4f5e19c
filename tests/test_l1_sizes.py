"""L1 over several object sizes at once: one eviction order across sizes, memory that moves between
sizes, and the fragmentation bound, checked against a plain reference model of LRU by bytes.

The model keeps what an LRU by bytes needs and nothing of the allocator: each object's size, the
order of use of the evictable ones (a request's chunks deepest first, new chunks just behind the
chunk before them) and whether something holds it (readers, writers, leases). After every step it
checks:
  * under LRU, victims are taken in LRU order across sizes: every object evicted in a step was
    older than every object that stayed evictable through it (nothing fresh goes while something
    stale stays); under every policy, no victim was held;
  * a step that evicted left no more memory unused than the stated bound (docs/PERFORMANCE.md):
    per size fewer than one slab of free slots plus slot rounding and slab tails; so the cache
    holds at least capacity - bound bytes whenever it had to evict, as an ideal LRU by bytes
    would hold capacity;
  * every resident object still has its own bytes, also after being moved to another slab.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from lmcache_mp.native import HostArena
from lmcache_mp.storage.l1 import L1Store, ObjectKey

KiB = 1 << 10
SLAB = 64 * KiB
SLABS = 6
SIZES = (16000, 6000, 21000)  # slots 16128 (4 per slab), 6144 (10), 21248 (3): rounding and tails
POOL = 12  # digests per size: all of them together overflow the arena
TTL = 5.0
OWNERS = (b"a", b"b")
FMT = {n: ("tokens", 1, 1, n, "uint8") for n in SIZES}


def key(size: int, i: int) -> ObjectKey:
    return ObjectKey(f"m{size}", 1, 0, bytes([i + 1]) * 16, b"")


def slot_of(n: int) -> int:
    return (n + 255) // 256 * 256


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass(eq=False)
class Obj:
    size: int
    fill: int
    committed: bool = False
    readers: int = 0
    leases: int = 0  # leases holding it
    prev: Obj | None = None  # the object of the chunk before it in the latest store naming it

    def held(self) -> bool:
        return not self.committed or self.readers > 0 or self.leases > 0


class LRUModel:
    """Recency and holds of the objects the cache has, with the L1 rules for what counts as a use."""

    def __init__(self):
        self.objs: dict[ObjectKey, Obj] = {}
        self.leases: dict[int, tuple[float, dict]] = {}  # id -> (expires, {key: reads left})
        self.order: list[Obj] = []  # the evictable ones, least recently used first

    def use(self, objs) -> None:
        """These objects (prefix order) were used: the evictable ones become the most recent."""
        for o in reversed(list(objs)):
            if o in self.order:
                self.order.remove(o)
            if not o.held():
                self.order.append(o)

    def unpark(self, o: Obj) -> None:
        if o in self.order:
            self.order.remove(o)

    def admit(self, objs: list, parent: Obj | None) -> None:
        if parent is not None and parent in self.order:
            at = self.order.index(parent)
            self.order[at:at] = list(reversed(objs))
        else:
            self.order += list(reversed(objs))

    def let_go(self, lease: int, keys) -> None:
        uses = self.leases[lease][1]
        for k in reversed(list(keys)):
            if uses.pop(k, None) is not None:
                o = self.objs[k]
                o.leases -= 1
                self.use([o])
        if not uses:
            del self.leases[lease]

    def expire(self, now: float) -> None:
        for lease, (expires, uses) in sorted(self.leases.items(), key=lambda kv: (kv[1][0], kv[0])):
            if expires <= now:
                self.let_go(lease, list(uses))


class SizesMachine(RuleBasedStateMachine):
    writes = Bundle("writes")
    reads = Bundle("reads")
    lease_ids = Bundle("lease_ids")
    policy = "lru"

    def __init__(self):
        super().__init__()
        self.arena = HostArena(SLABS * SLAB, SLAB)
        self.clock = Clock()
        self.l1 = L1Store(self.arena, clock=self.clock, policy=self.policy)
        self.m = LRUModel()
        self.fills = 0
        self.evictions = 0

    # ---- helpers -------------------------------------------------------------------------------

    def _view(self, k: ObjectKey, size: int) -> np.ndarray:
        return np.frombuffer(self.arena.view(self.l1._get(k).offset, size), dtype=np.uint8)

    def _step(self, fn, touched: set):
        """Run one L1 call that may evict and check what it evicted against the model; the
        call's own keys are excluded from "stayed" (it holds those it finds while it stores)."""
        before = {k: o for k, o in self.m.objs.items()}
        held_during = any(not o.committed or o.readers for o in before.values())
        order = list(self.m.order)
        out = fn()
        gone = [k for k in before if self.l1._get(k) is None or self.l1._get(k) is not before[k]._l1]
        for k in gone:
            o = before[k]
            assert not o.held(), f"{k} was evicted while held"
            del self.m.objs[k]
            self.m.unpark(o)
        if gone:
            self.evictions += len(gone)
            event("evicted")
            if self.policy == "lru":
                stale = max(order.index(before[k]) for k in gone)
                kept = [order.index(o) for k, o in self.m.objs.items() if o in order and k not in touched]
                assert not kept or stale < min(kept), "a fresher object was evicted while an older one stayed"
        return out, bool(gone) and not held_during

    def _check_bound(self) -> None:
        resident = sum(slot_of(o.size) for o in self.m.objs.values())
        bound = 0
        for c in self.arena.class_stats():
            spp, slot = c["slots_per_slab"], c["slot_bytes"]
            bound += (spp - 1) * slot + c["slabs"] * (SLAB - spp * slot)
        unused = self.arena.capacity - resident
        assert unused <= bound, f"{unused} bytes unused after evicting, bound {bound}"
        event("bound checked")

    def _begin_store(self, size: int, chunks: list[int]):
        self.l1.expire()  # leases due now end before, not inside, the store (a use either way)
        self.m.expire(self.clock.now)
        keys = [key(size, i) for i in chunks]
        plan, evicted = self._step(lambda: self.l1.begin_store(keys, size, FMT[size]), set(keys))
        made, used, last = [], [], None
        for pos, k in enumerate(keys[:len(keys) - plan.skipped]):
            if pos in plan.indices:
                obj = plan.objects[plan.indices.index(pos)]
                self.fills += 1
                o = Obj(size=size, fill=self.fills % 251 + 1)
                o._l1, o.prev = obj, last
                self.m.objs[k] = o
                np.frombuffer(self.arena.view(obj.offset, size), dtype=np.uint8)[:] = o.fill
                made.append(o)
            else:  # there already (or being written): the chunk before it here is its prefix now
                o = self.m.objs[k]
                if last is not None:
                    o.prev = last
                if o.committed:
                    used.append(o)  # storing what is there is a use
            last = o
        self.m.use(used)
        if evicted:
            self._check_bound()
        return plan, made

    def _commit(self, plan, made) -> None:
        self.l1.commit(plan)
        for o in made:
            o.committed = True
        self.m.admit(made, made[0].prev if made else None)

    # ---- rules ---------------------------------------------------------------------------------

    chunk_lists = st.lists(st.integers(0, POOL - 1), min_size=1, max_size=4, unique=True)
    sizes = st.sampled_from(SIZES)

    @rule(size=sizes, chunks=chunk_lists)
    def store(self, size, chunks):
        self._commit(*self._begin_store(size, chunks))

    @rule(target=writes, size=sizes, chunks=chunk_lists)
    def begin_store(self, size, chunks):
        return self._begin_store(size, chunks)

    @rule(w=consumes(writes), ok=st.booleans())
    def finish_store(self, w, ok):
        plan, made = w
        if ok:
            self._commit(plan, made)
            return
        self.l1.abort(plan)
        for k, o in list(self.m.objs.items()):
            if o in made:
                del self.m.objs[k]

    @rule(target=reads, size=sizes, chunks=chunk_lists, lease=st.one_of(st.just(0), lease_ids))
    def begin_read(self, size, chunks, lease):
        got = self.l1.begin_read([key(size, i) for i in chunks], FMT[size], lease)
        want = []
        uses = self.m.leases[lease][1] if lease in self.m.leases else {}
        for i in chunks:
            k = key(size, i)
            o = self.m.objs.get(k)
            if o is None or not o.committed:
                break
            o.readers += 1
            self.m.unpark(o)
            if k in uses:
                self.m.let_go(lease, [k])
            want.append(o)
        assert len(got) == len(want)
        for obj, o in zip(got, want):
            assert (np.frombuffer(self.arena.view(obj.offset, o.size), dtype=np.uint8) == o.fill).all()
        return got, want

    @rule(r=consumes(reads))
    def end_read(self, r):
        got, want = r
        self.l1.end_read(got)
        for o in want:
            o.readers -= 1
        self.m.use(want)

    @rule(size=sizes, chunks=chunk_lists, lease=st.one_of(st.just(0), lease_ids))
    def retrieve(self, size, chunks, lease):
        self.end_read(self.begin_read(size, chunks, lease))

    @rule(target=lease_ids, size=sizes, chunks=chunk_lists, lock=st.booleans(), owner=st.sampled_from(OWNERS))
    def lookup(self, size, chunks, lock, owner):
        self.l1.expire()
        self.m.expire(self.clock.now)
        hits, lease = self.l1.lookup(f"m{size}", 1, [key(size, i).digest for i in chunks], lock=lock, owner=owner,
                                     ttl=TTL)
        want = []
        for i in chunks:
            o = self.m.objs.get(key(size, i))
            if o is None or not o.committed:
                break
            want.append(o)
        assert hits == len(want)
        if not lock:
            self.m.use(want)
        if lease:
            uses = {}
            for i in chunks[:hits]:
                self.m.objs[key(size, i)].leases += 1
                self.m.unpark(self.m.objs[key(size, i)])
                uses[key(size, i)] = 1
            self.m.leases[lease] = (self.clock.now + TTL, uses)
        return lease

    @rule(lease=lease_ids)
    def release(self, lease):
        self.l1.release(lease)
        if lease in self.m.leases:
            self.m.let_go(lease, list(self.m.leases[lease][1]))

    @rule(dt=st.sampled_from([1.0, TTL + 1]))
    def advance_clock(self, dt):
        self.clock.now += dt

    # ---- invariants ----------------------------------------------------------------------------

    @invariant()
    def resident_objects_keep_their_bytes(self):
        for k, o in self.m.objs.items():
            assert self.l1._get(k) is o._l1
            assert (self._view(k, o.size) == o.fill).all(), f"{k} lost its bytes"
        s = self.l1.stats()
        assert s["objects"] == sum(o.committed for o in self.m.objs.values())
        assert self.arena.stats()["objects"] == len(self.m.objs)

    def teardown(self):
        event(f"moved objects: {'yes' if self.l1.counters['moved'] else 'no'}")
        self.l1.clear()


SizesMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestL1AcrossSizes = SizesMachine.TestCase
# Every other policy over the same steps: no victim held, the bound, every object's bytes.
for _name, _examples in (("adaptive", 150), ("arc", 60), ("s3fifo", 60)):
    _machine = type(f"SizesMachine_{_name}", (SizesMachine,), {"policy": _name})
    _machine.TestCase.settings = settings(max_examples=_examples, stateful_step_count=60, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
    globals()[f"TestL1AcrossSizes_{_name}"] = _machine.TestCase


# ---- unit tests -----------------------------------------------------------------------------------


def _fill(l1, arena, keys, size, value):
    plan = l1.begin_store(keys, size, FMT.get(size, ("t", size)))
    for obj in plan.objects:
        np.frombuffer(arena.view(obj.offset, size), dtype=np.uint8)[:] = value
    l1.commit(plan)
    return plan


def test_a_new_size_evicts_the_oldest_objects_of_another_size_not_its_own():
    """The issue's scenario in small: big objects fill L1, then a working set of small objects
    (well under capacity) arrives; the small ones all stay, the old big ones make room."""
    arena = HostArena(SLABS * SLAB, SLAB)
    l1 = L1Store(arena, policy="lru")
    big = [key(21000, i) for i in range(SLABS * 3 + 2)]
    for k in big:
        _fill(l1, arena, [k], 21000, 7)
    small = [key(6000, i) for i in range(2 * POOL)]  # 24 x 6 KiB: 37% of the arena
    for _ in range(3):
        for k in small:
            _fill(l1, arena, [k], 6000, 9)
            assert l1.contains(k)
    assert all(l1.contains(k) for k in small), "a fresh object of the new size was evicted"
    kept = [i for i, k in enumerate(big) if l1.contains(k)]
    assert kept == list(range(len(big) - len(kept), len(big))), "the big objects kept are the newest"
    assert len(kept) >= SLABS * 3 - 3 * 3 - 3  # at most one idle slab's worth per size
    for k in small:
        (obj,) = l1.begin_read([k], FMT[6000])
        assert (np.frombuffer(arena.view(obj.offset, 6000), dtype=np.uint8) == 9).all()
        l1.end_read([obj])
    by_size = {s["object_bytes"]: s for s in l1.size_stats()}
    assert by_size[6000]["evicted"] == 0 and by_size[21000]["evicted"] == len(big) - len(kept)


def test_a_slab_changes_size_by_moving_its_objects_not_evicting_them():
    arena = HostArena(2 * SLAB, SLAB)
    l1 = L1Store(arena, policy="lru")
    small = [key(16000, i) for i in range(8)]  # 4 per slab: both slabs full
    for i, k in enumerate(small):
        _fill(l1, arena, [k], 16000, i + 1)
    hits, lease = l1.lookup("m16000", 1, [small[3].digest], lock=True, owner=b"a")  # leased objects may move
    assert hits == 1
    for k in (small[0], small[4], small[5], small[6], small[7]):
        l1.lookup("m16000", 1, [k.digest])  # used again: LRU order is now 1, 2, 0, 4, 5, 6, 7
    # A 60000-byte object needs a whole slab. The four oldest go (1, 2, 0, 4: only then does the
    # small size hold a slab's worth of free slots); 3, alone in its slab, moves to the other one.
    plan = _fill(l1, arena, [ObjectKey("big", 1, 0, b"x" * 16, b"")], 60000, 99)
    assert len(plan.objects) == 1
    assert [l1.contains(k) for k in small] == [False, False, False, True, False, True, True, True]
    assert l1.counters["evicted"] == 4 and l1.counters["moved"] == 1
    for i, k in enumerate(small):
        if l1.contains(k):
            obj = l1._get(k)
            assert (np.frombuffer(arena.view(obj.offset, 16000), dtype=np.uint8) == i + 1).all()
            assert obj.offset // SLAB != plan.objects[0].offset // SLAB
    assert l1.stats()["leases"] == 1 and l1.release(lease) == 1


class _ReadDuringCopy:
    """An arena whose object copies let a retrieve begin on the first moving object."""

    def __init__(self, arena, l1_ref, key_, fmt):
        self._arena, self._l1, self._key, self._fmt, self.read = arena, l1_ref, key_, fmt, None

    def __getattr__(self, name):
        return getattr(self._arena, name)

    def move_objects(self, src, dst, nbytes):
        self.read = self._l1[0].begin_read([self._key], self._fmt)  # the lock is free during the copy
        self._arena.move_objects(src, dst, nbytes)


def test_an_object_read_during_its_move_keeps_its_slot_and_bytes():
    arena = HostArena(2 * SLAB, SLAB)
    ref: list = []
    small = [key(16000, i) for i in range(8)]
    proxy = _ReadDuringCopy(arena, ref, small[3], FMT[16000])
    l1 = L1Store(proxy, policy="lru")
    ref.append(l1)
    for i, k in enumerate(small):
        _fill(l1, arena, [k], 16000, i + 1)
    for k in (small[3], small[5], small[6], small[7]):
        l1.lookup("m16000", 1, [k.digest])  # 0, 1, 2 and 4 go; 3, alone in its slab, moves
    old = l1._get(small[3]).offset
    plan = l1.begin_store([ObjectKey("big", 1, 0, b"x" * 16, b"")], 60000, ("t", 60000))
    (reading,) = proxy.read
    assert reading.offset == old and l1._get(small[3]).offset == old, "a read object stays where it is read"
    assert (np.frombuffer(arena.view(old, 16000), dtype=np.uint8) == 4).all()
    # The other slab moved instead (its three objects into the three free slots around 3).
    assert len(plan.objects) == 1 and plan.objects[0].offset // SLAB != old // SLAB
    assert l1.counters["moved"] == 3 and l1.counters["evicted"] == 4
    l1.end_read([reading])
    for i in (3, 5, 6, 7):
        obj = l1._get(small[i])
        assert (np.frombuffer(arena.view(obj.offset, 16000), dtype=np.uint8) == i + 1).all()
    l1.abort(plan)


@pytest.mark.parametrize("held", ["reading", "writing"])
def test_objects_being_read_or_written_are_never_moved(held):
    arena = HostArena(2 * SLAB, SLAB)
    l1 = L1Store(arena, policy="lru")
    small = [key(16000, i) for i in range(7)]
    for i, k in enumerate(small):
        _fill(l1, arena, [k], 16000, i + 1)
    if held == "reading":
        pinned = l1.begin_read([small[6]], FMT[16000])
        offset = pinned[0].offset
    else:
        pinned = l1.begin_store([key(16000, 7)], 16000, FMT[16000])
        offset = pinned.objects[0].offset
    plan = l1.begin_store([ObjectKey("big", 1, 0, b"x" * 16, b"")], 60000, ("t", 60000))
    if plan.objects:  # the slab without the held object moved or emptied
        assert offset // SLAB != plan.objects[0].offset // SLAB
        l1.abort(plan)
    if held == "reading":
        assert l1._get(small[6]).offset == offset
        l1.end_read(pinned)
    else:
        assert l1._get(key(16000, 7)).offset == offset
        l1.commit(pinned)
