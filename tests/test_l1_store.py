"""L1Store over a real (small) HostArena: a hypothesis state machine against a plain dict model
(under LRU the exact victims, under every other policy victims that were evictable), plus unit
tests of multi-rank lookups, MLA sharing and layout (format key) checks."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, initialize, invariant, precondition,
                                 rule)

from lmcache_mp.native import HostArena
from lmcache_mp.storage import l1_reads
from lmcache_mp.storage.eviction import POLICIES
from lmcache_mp.storage.l1 import SHARED_RANK, L1Store, ObjectKey

SLAB = 4096
OBJECT_BYTES = 2048  # two objects per slab
SLABS = 3
CAPACITY = SLABS * (SLAB // OBJECT_BYTES)  # objects the arena holds
POOL = 10  # distinct chunk digests: more than fit, so stores evict
TTL = 5.0
FMT = ("tokens", 2, 1, 16, "uint8")
OWNERS = (b"owner-a", b"owner-b")
DIGESTS = [bytes([i + 1]) * 16 for i in range(POOL)]


# Requests name runs of consecutive chunks (prompts share prefixes), sometimes arbitrary lists.
chunk_lists = st.one_of(
    st.builds(lambda start, n: list(range(start, min(POOL, start + n))), st.integers(0, POOL - 1), st.integers(1, 4)),
    st.lists(st.integers(0, POOL - 1), min_size=1, max_size=4),
)


def key(i: int, model: str = "m", world_size: int = 1, rank: int = 0, salt: bytes = b"") -> ObjectKey:
    return ObjectKey(model, world_size, rank, DIGESTS[i], salt)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- the model ----------------------------------------------------------------------------------


@dataclass
class MLease:
    owner: bytes
    expires: float
    uses: dict = field(default_factory=dict)  # chunk index -> reads left, in lookup order


@dataclass(eq=False)
class MObject:
    offset: int
    fill: int  # the byte written into the slot when the store began
    committed: bool = False
    readers: int = 0
    leases: int = 0  # leases holding it
    storing: bool = False  # named by the store in progress, which holds it meanwhile
    prev: MObject | None = None  # the object of the chunk before it in the latest store naming it


class Model:
    """What L1Store should do, written as plainly as possible: a dict from digest index to object
    and leases by id. With LRU (`exact`), also the evictable objects least recently used first: a
    request makes its chunks recent deepest first, and new chunks go just behind the chunk before
    them when that one is evictable. With other policies the victims are not predicted: a store
    is told which chunks are new by its result and finds the objects that went, each of which must
    have been evictable."""

    def __init__(self, exact: bool):
        self.exact = exact
        self.objs: dict[int, MObject] = {}  # insertion order = creation order, as in the store
        self.leases: dict[int, MLease] = {}
        self.order: list[MObject] = []  # (exact) the evictable objects, least recently used first
        self.evicted = 0
        self.expired = 0

    @staticmethod
    def evictable(o: MObject) -> bool:
        return o.committed and o.readers == 0 and not o.leases and not o.storing

    def park(self, objs) -> None:
        """These objects (prefix order) were used: the evictable ones become the most recent."""
        for o in reversed(list(objs)):
            if o in self.order:
                self.order.remove(o)
            if self.evictable(o):
                self.order.append(o)

    def unpark(self, o: MObject) -> None:
        if o in self.order:
            self.order.remove(o)

    def admit(self, objs: list, parent: MObject | None) -> None:
        if parent is not None and parent in self.order:
            at = self.order.index(parent)
            self.order[at:at] = list(reversed(objs))
        else:
            self.order += list(reversed(objs))

    def let_go(self, lease_id: int, chunks) -> int:
        """The lease stops holding these chunks (deepest first); an object nothing holds any more
        becomes the most recent."""
        ls = self.leases[lease_id]
        n = 0
        for i in reversed(list(dict.fromkeys(chunks))):
            if ls.uses.pop(i, None) is None:
                continue
            n += 1
            o = self.objs[i]
            o.leases -= 1
            self.park([o])
        if not ls.uses:
            del self.leases[lease_id]
        return n

    def expire(self, now: float) -> None:
        for lease_id, ls in sorted(self.leases.items(), key=lambda kv: (kv[1].expires, kv[0])):
            if ls.expires <= now:
                self.expired += 1
                event("lease expired")
                self.let_go(lease_id, list(ls.uses))

    def make_room(self) -> bool:
        if len(self.objs) < CAPACITY:
            return True
        if not self.order:
            return False
        victim = self.order.pop(0)
        del self.objs[next(i for i, o in self.objs.items() if o is victim)]
        self.evicted += 1
        event("evicted")
        return True

    def evicted_by_store(self, l1, evictable: set, remade: list) -> None:
        """(not exact) The objects a store evicted: those L1 no longer holds, or made anew; each
        must have been evictable when it began."""
        gone = [i for i, o in self.objs.items() if o.committed and (not l1.contains(key(i)) or i in remade)]
        for i in gone:
            assert i in evictable, f"chunk {i} was evicted while held"
            del self.objs[i]
        self.evicted += len(gone)


class L1Machine(RuleBasedStateMachine):
    stores = Bundle("stores")
    reads = Bundle("reads")
    lease_ids = Bundle("lease_ids")
    policy = "lru"

    def __init__(self):
        super().__init__()
        self.arena = HostArena(SLABS * SLAB, SLAB)
        self.clock = Clock()
        self.l1 = L1Store(self.arena, clock=self.clock, policy=self.policy)
        self.model = Model(exact=self.policy == "lru")
        self.fills = 0

    def _view(self, offset: int) -> np.ndarray:
        return np.frombuffer(self.arena.view(offset, OBJECT_BYTES), dtype=np.uint8)

    # ---- store -----------------------------------------------------------------------------

    @initialize(n=st.integers(0, CAPACITY))
    def some_chunks_stored(self, n):
        if n:
            self.commit(self.begin_store(list(range(n))))

    @rule(chunks=chunk_lists)
    def store(self, chunks):
        """A store whose bytes land at once."""
        self.commit(self.begin_store(chunks))

    @rule(target=stores, chunks=chunk_lists)
    def begin_store(self, chunks):
        """A store still in flight until commit or abort."""
        m = self.model
        evictable = {i for i, o in m.objs.items() if m.evictable(o)}
        plan = self.l1.begin_store([key(i) for i in chunks], OBJECT_BYTES, FMT)
        if not m.exact:
            m.evicted_by_store(self.l1, evictable, [chunks[pos] for pos in plan.indices])
        indices, present, pending, skipped, created, used = [], 0, 0, 0, [], []
        last = None
        for pos, i in enumerate(chunks):
            o = m.objs.get(i)
            if o is not None:
                if o.committed:
                    present += 1
                    used.append(o)  # storing what is already there counts as a use
                    o.storing = True  # (and it stays while the rest of the store makes room)
                    m.unpark(o)
                else:
                    pending += 1  # another store is writing it: answered once it is written
                if last is not None:
                    o.prev = last
                last = o
                continue
            if not (m.make_room() if m.exact else pos in plan.indices):
                event("store skipped: nothing evictable")
                skipped = len(chunks) - pos
                break
            indices.append(pos)
            last = m.objs.setdefault(i, MObject(offset=-1, fill=0, prev=last))
            created.append(last)
        for o in used:
            o.storing = False
        m.park(used)
        assert len(m.objs) <= CAPACITY
        assert plan.indices == indices
        assert (plan.present, len(plan.pending), plan.skipped) == (present, pending, skipped)
        for pos, obj, o in zip(indices, plan.objects, created, strict=True):
            assert obj.key == key(chunks[pos]) and obj.nbytes >= OBJECT_BYTES
            self.fills += 1
            o.offset, o.fill = obj.offset, self.fills % 251 + 1
            self._view(obj.offset)[:] = o.fill  # the "copy" into host memory
        return (plan, created)

    @rule(store=consumes(stores))
    def commit(self, store):
        plan, objs = store
        self.l1.commit(plan)
        for o in objs:
            o.committed = True
        self.model.admit(objs, objs[0].prev if objs else None)

    @rule(store=consumes(stores))
    def abort(self, store):
        plan, objs = store
        self.l1.abort(plan)
        for i, o in list(self.model.objs.items()):
            if o in objs:
                del self.model.objs[i]

    # ---- read ------------------------------------------------------------------------------

    @rule(chunks=chunk_lists, lease=st.one_of(st.just(0), lease_ids))
    def retrieve(self, chunks, lease):
        self.end_read(self.begin_read(chunks, lease))

    @rule(target=reads, chunks=chunk_lists, lease=st.one_of(st.just(0), lease_ids))
    def begin_read(self, chunks, lease):
        got = self.l1.begin_read([key(i) for i in chunks], FMT, lease)
        want = []
        held = self.model.leases.get(lease)
        for i in chunks:
            o = self.model.objs.get(i)
            if o is None or not o.committed:
                break
            o.readers += 1
            self.model.unpark(o)
            if held is not None and i in held.uses:  # a read consumes one use of its own lease only
                event("read consumed its lease")
                if held.uses[i] > 1:
                    held.uses[i] -= 1
                else:
                    self.model.let_go(lease, [i])
            want.append(o)
        assert [obj.key for obj in got] == [key(i) for i in chunks[: len(want)]]
        for obj, o in zip(got, want, strict=True):
            assert obj.offset == o.offset
            assert (self._view(obj.offset) == o.fill).all(), "read the bytes of another object"
        return (got, want)

    @rule(read=consumes(reads))
    def end_read(self, read):
        got, want = read
        self.l1.end_read(got)
        for o in want:
            o.readers -= 1
        self.model.park(want)

    # ---- lookup and leases -----------------------------------------------------------------

    @rule(target=lease_ids, chunks=chunk_lists, lock=st.booleans(), owner=st.sampled_from(OWNERS))
    def lookup(self, chunks, lock, owner):
        hits, lease = self.l1.lookup("m", 1, [DIGESTS[i] for i in chunks], lock=lock, owner=owner, ttl=TTL)
        m = self.model
        want = []
        for i in chunks:
            o = m.objs.get(i)
            if o is None or not o.committed:
                break
            want.append(o)
        assert hits == len(want)
        assert bool(lease) == (lock and hits > 0)
        if not lock:
            m.park(want)  # a lookup hit is recent
        if lease:
            ls = m.leases[lease] = MLease(owner, self.clock.now + TTL)
            for i in chunks[:hits]:
                if i not in ls.uses:
                    m.objs[i].leases += 1
                    m.unpark(m.objs[i])
                ls.uses[i] = ls.uses.get(i, 0) + 1  # a chunk named twice is leased for two reads
            event("locked hit")
        return lease

    @rule(chunks=chunk_lists, owner=st.sampled_from(OWNERS), read=st.booleans())
    def lookup_then_retrieve(self, chunks, owner, read):
        """The engine's flow: the scheduler leases what it found, a worker reads it (or not)."""
        lease = self.lookup(chunks, True, owner)
        if read:
            self.retrieve(chunks, lease)

    @rule(chunks=chunk_lists, owner=st.sampled_from(OWNERS), wait=st.sampled_from([TTL - 0.1, TTL, TTL + 1]))
    def lookup_then_abandon(self, chunks, owner, wait):
        """A lease nobody consumes ends with its TTL (the server's tick calls expire)."""
        self.lookup(chunks, True, owner)
        self.advance_clock(wait)
        self.expire()

    @rule(lease=lease_ids, chunks=st.one_of(st.none(), chunk_lists))
    def release(self, lease, chunks):
        dropped = self.l1.release(lease, None if chunks is None else [DIGESTS[i] for i in chunks])
        held = self.model.leases.get(lease)
        want = 0 if held is None else self.model.let_go(lease, list(held.uses) if chunks is None else chunks)
        assert dropped == want

    @rule(owner=st.sampled_from(OWNERS))
    def drop_owner(self, owner):
        dropped = self.l1.drop_owner(owner)
        mine = [i for i, ls in self.model.leases.items() if ls.owner == owner]  # oldest first
        for lease_id in mine:
            self.model.let_go(lease_id, list(self.model.leases[lease_id].uses))
        assert dropped == len(mine)

    @rule(dt=st.sampled_from([0.0, 1.0, TTL - 0.1, TTL, TTL + 3.0]))
    def advance_clock(self, dt):
        self.clock.now += dt

    @rule()
    def expire(self):
        self.l1.expire()
        self.model.expire(self.clock.now)

    @precondition(lambda self: self.model.objs)
    @rule()
    def clear(self):
        removed = self.l1.clear()
        want = 0
        for lease_id in list(self.model.leases):  # oldest first, as the store ends them
            self.model.let_go(lease_id, list(self.model.leases[lease_id].uses))
        for i, o in list(self.model.objs.items()):
            if o.committed and o.readers == 0:
                del self.model.objs[i]
                self.model.unpark(o)
                want += 1
        assert removed == want

    # ---- invariants ------------------------------------------------------------------------

    @invariant()
    def index_matches_the_model(self):
        m = self.model
        for i in range(POOL):
            o = m.objs.get(i)
            assert self.l1.contains(key(i)) == (o is not None and o.committed), f"chunk {i}"
        objs = list(m.objs.values())
        s = self.l1.stats()
        assert s["objects"] == sum(o.committed for o in objs)
        assert s["writing"] == sum(not o.committed for o in objs)
        assert s["leases"] == len(m.leases)
        assert s["leased_objects"] == sum(bool(o.leases) for o in objs)
        assert s["evictable"] == sum(m.evictable(o) for o in objs)
        assert s["evicted"] == m.evicted
        assert s["leases_expired"] == m.expired
        assert self.arena.stats()["objects"] == len(objs)

    @invariant()
    def every_live_object_keeps_its_own_bytes(self):
        offsets = [o.offset for o in self.model.objs.values()]
        assert len(set(offsets)) == len(offsets)
        for o in self.model.objs.values():
            assert (self._view(o.offset) == o.fill).all()

    def teardown(self):
        self.l1.clear()


L1Machine.TestCase.settings = settings(max_examples=250, stateful_step_count=50, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
TestL1Store = L1Machine.TestCase

# The same machine under every other policy: victims are not predicted, only checked.

for _name in POLICIES:
    if _name != "lru":
        _machine = type(f"L1Machine_{_name}", (L1Machine,), {"policy": _name})
        _machine.TestCase.settings = settings(max_examples=120, stateful_step_count=50, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
        globals()[f"TestL1Store_{_name}"] = _machine.TestCase


# ---- unit tests ---------------------------------------------------------------------------------


def found(l1, *args, **kwargs) -> int:
    return l1.lookup(*args, **kwargs)[0]


def _store(l1, keys, fmt=FMT, nbytes=OBJECT_BYTES):
    plan = l1.begin_store(keys, nbytes, fmt)
    l1.commit(plan)
    return plan


@pytest.fixture
def store():
    clock = Clock()
    l1 = L1Store(HostArena(SLABS * SLAB, SLAB), clock=clock, policy="lru")  # (tests of order name LRU's)
    l1.clock = clock
    return l1


def test_lru_order_follows_use(store):
    for i in range(CAPACITY):  # one request each: chunk 0 the oldest
        _store(store, [key(i)])
    assert found(store, "m", 1, [DIGESTS[0]]) == 1  # chunk 0 is used again: now the newest
    plan = _store(store, [key(CAPACITY)])
    assert plan.indices == [0]
    assert not store.contains(key(1)), "chunk 1 was the least recently used"
    assert all(store.contains(key(i)) for i in [0] + list(range(2, CAPACITY + 1)))


def _evicted_in_turn(l1, n: int) -> list[int]:
    """The chunks n stores of one new chunk each evict, in turn."""
    out = []
    for i in range(n):
        before = {d for d in range(CAPACITY) if l1.contains(key(d))}
        _store(l1, [key(CAPACITY + i)])
        out += sorted(before - {d for d in range(CAPACITY) if l1.contains(key(d))})
    return out


@pytest.mark.parametrize("how", ["read", "lookup"])
def test_a_prompt_longer_than_a_slice_still_goes_from_its_end(store, monkeypatch, how):
    """A read (or a lookup) of more chunks than a slice parks them again a slice at a time: the
    deepest slice first, so that its last chunks go first. (Parked in prefix order, the first
    slice's chunks were older than the second's and went first, leaving the rest of the prompt
    held and unreachable.)"""
    monkeypatch.setattr(l1_reads, "SLICE", 2)
    for i in range(CAPACITY):  # one chunk a request, the last the newest: reversed by the read
        _store(store, [key(i)])
    if how == "read":
        store.end_read(store.begin_read([key(i) for i in range(CAPACITY)], FMT))
    else:
        assert found(store, "m", 1, DIGESTS[:CAPACITY]) == CAPACITY
    assert _evicted_in_turn(store, 4) == [CAPACITY - 1, CAPACITY - 2, CAPACITY - 3, CAPACITY - 4]


def test_a_store_naming_a_held_chunk_twice_under_follow():
    """A store (or read) may name a chunk twice: `follow` hands its miniatures a request's uses
    as one request, each chunk once. (Twice, a miniature that did not hold it made two shadows
    of one key, and a later eviction found the key gone: found by the state machine above.)"""
    l1 = L1Store(HostArena(SLABS * SLAB, SLAB), clock=Clock(), policy="follow")
    for chunks in ([1, 2, 3], [0, 1, 2, 3], [6, 7], [0, 4], [0, 1, 2], [0, 3, 3], [4, 5, 6], [0, 3, 3, 5]):
        _store(l1, [key(i) for i in chunks])
    for mini in l1._policy._mini:
        assert len(mini.held) == mini.policy.resident


def test_aborted_store_leaves_nothing(store):
    plan = store.begin_store([key(0), key(1)], OBJECT_BYTES, FMT)
    assert found(store, "m", 1, DIGESTS[:2]) == 0  # not visible while being written
    assert store.begin_read([key(0)], FMT) == []
    store.abort(plan)
    assert not store.contains(key(0)) and store.stats()["writing"] == 0
    assert store.arena.stats()["objects"] == 0
    assert _store(store, [key(0)]).indices == [0]  # stored afresh


def test_leased_prefix_survives_pressure_and_unleased_chunks_go(store):
    _store(store, [key(i) for i in range(CAPACITY)])
    assert found(store, "m", 1, DIGESTS[:2], lock=True, owner=b"a") == 2
    plan = _store(store, [key(i) for i in range(CAPACITY, POOL)])
    assert plan.indices == list(range(CAPACITY - 2)) and plan.skipped == POOL - CAPACITY - (CAPACITY - 2)
    assert store.contains(key(0)) and store.contains(key(1))
    assert not any(store.contains(key(i)) for i in range(2, CAPACITY))


def test_being_read_and_being_written_objects_are_never_evicted(store):
    _store(store, [key(i) for i in range(CAPACITY - 1)])
    reading = store.begin_read([key(0)], FMT)
    writing = store.begin_store([key(CAPACITY - 1)], OBJECT_BYTES, FMT)
    plan = store.begin_store([key(i) for i in range(CAPACITY, POOL)], OBJECT_BYTES, FMT)
    assert len(plan.objects) == CAPACITY - 2  # every slot except the two in use
    assert store.contains(key(0))
    store.commit(writing)
    assert store.contains(key(CAPACITY - 1))
    store.end_read(reading)
    store.abort(plan)


def test_lease_ttl_with_an_injected_clock(store):
    _store(store, [key(0)])
    assert found(store, "m", 1, [DIGESTS[0]], lock=True, owner=b"a", ttl=5.0) == 1
    store.clock.now += 4.9
    store.expire()
    assert store.stats()["leases"] == 1 and store.stats()["evictable"] == 0
    store.clock.now += 0.2
    store.expire()
    assert store.stats()["leases"] == 0 and store.stats()["evictable"] == 1
    assert store.stats()["leases_expired"] == 1


def test_a_lease_protects_the_request_that_took_it():
    """Two engines lease the same chunk; one reads and releases it; pressure comes: the other's
    lease still holds, and its read finds the chunk (a lease is consumed only by its own reads)."""
    arena = HostArena(SLABS * SLAB, SLAB)
    l1 = L1Store(arena, clock=Clock())
    _store(l1, [key(0)])
    hits_a, lease_a = l1.lookup("m", 1, [DIGESTS[0]], lock=True, owner=b"a")
    hits_b, lease_b = l1.lookup("m", 1, [DIGESTS[0]], lock=True, owner=b"b")
    assert hits_a == hits_b == 1 and lease_a != lease_b
    l1.end_read(l1.begin_read([key(0)], FMT, lease_b))  # B reads under its own lease...
    assert l1.release(lease_b) == 0  # ...which that read used up
    assert l1.stats()["leases"] == 1
    plan = _store(l1, [key(i) for i in range(1, POOL)])  # C fills memory: only unleased chunks go
    assert plan.skipped == POOL - CAPACITY
    objs = l1.begin_read([key(0)], FMT, lease_a)
    assert [o.key for o in objs] == [key(0)], "A's leased chunk was evicted"
    l1.end_read(objs)
    assert l1.stats()["leases"] == 0


def test_release_by_id_and_chunks_and_drop_owner(store):
    _store(store, [key(0), key(1), key(2)])
    _, mine = store.lookup("m", 1, DIGESTS[:3], lock=True, owner=b"a")
    _, theirs = store.lookup("m", 1, DIGESTS[:1], lock=True, owner=b"b")
    assert store.release(12345) == 0  # unknown id
    assert store.release(mine, [DIGESTS[1], DIGESTS[1], DIGESTS[7]]) == 1  # chunk 1 only
    assert store.stats()["leased_objects"] == 2 and store.lease(mine) is not None
    assert store.release(mine) == 2 and store.lease(mine) is None
    assert store.release(mine) == 0
    assert store.stats()["evictable"] == 2  # chunk 0 is still held by the other lease
    assert store.drop_owner(b"b") == 1 and store.lease(theirs) is None
    assert store.stats()["evictable"] == 3 and store.stats()["leases"] == 0


def test_a_client_cannot_hold_leases_without_bound(store, monkeypatch):
    from lmcache_mp.storage import leases

    monkeypatch.setattr(leases, "MAX_LEASES_PER_CLIENT", 3)
    _store(store, [key(0)])
    ids = [store.lookup("m", 1, [DIGESTS[0]], lock=True, owner=b"a")[1] for _ in range(3)]
    with pytest.raises(leases.TooManyLeases):
        store.lookup("m", 1, [DIGESTS[0]], lock=True, owner=b"a")
    assert store.lookup("m", 1, [DIGESTS[0]], lock=True, owner=b"b")[1]  # another client may
    store.release(ids[0])
    assert store.lookup("m", 1, [DIGESTS[0]], lock=True, owner=b"a")[1]


def test_mla_shared_object_is_leased_once_per_rank(store):
    """An MLA chunk is one object for every rank: a lease on it has world_size uses, and it stays
    protected until every rank has read it."""
    shared = ObjectKey("mla", 2, SHARED_RANK, DIGESTS[0], b"")
    _store(store, [shared])
    assert found(store, "mla", 2, [DIGESTS[0]]) == 1  # present for both ranks at once
    assert found(store, "mla", 1, [DIGESTS[0]]) == 0  # another world size is another namespace
    hits, lease = store.lookup("mla", 2, [DIGESTS[0]], lock=True, owner=b"sched")
    assert hits == 1 and store.stats()["leases"] == 1
    for rank in range(2):
        objs = store.begin_read([shared], FMT, lease)  # rank 0, then rank 1
        assert len(objs) == 1
        store.end_read(objs)
        assert store.stats()["leases"] == (1 if rank == 0 else 0)
        assert store.stats()["evictable"] == (0 if rank == 0 else 1)


def test_lookup_counts_a_chunk_only_when_every_rank_has_it(store):
    _store(store, [key(i, world_size=2, rank=0) for i in range(3)])
    assert found(store, "m", 2, DIGESTS[:3]) == 0  # rank 1 has nothing yet
    _store(store, [key(i, world_size=2, rank=1) for i in (0, 1)])
    assert found(store, "m", 2, DIGESTS[:3]) == 2  # chunk 2 is on rank 0 only
    assert found(store, "m", 2, DIGESTS[:3], lock=True, owner=b"a") == 2
    assert store.stats()["leases"] == 1 and store.stats()["leased_objects"] == 4  # 2 chunks x 2 ranks
    assert store.stats()["evictable"] == 1  # rank 0's chunk 2 is not leased
    writing = store.begin_store([key(2, world_size=2, rank=1)], OBJECT_BYTES, FMT)
    assert found(store, "m", 2, DIGESTS[:3]) == 2  # still being written: not a hit
    store.commit(writing)
    assert found(store, "m", 2, DIGESTS[:3]) == 3
    assert found(store, "m", 2, [DIGESTS[5]] + DIGESTS[:3]) == 0  # hits are a prefix of the request


def test_release_by_chunk_lets_go_of_every_rank_of_that_chunk_only(store):
    """A chunk of world size 2 is two objects in a lease; a chunk named again (extend) adds uses,
    not objects. A release by chunk lets go of both ranks' objects of that chunk and no other."""
    _store(store, [key(i, world_size=2, rank=r) for i in range(3) for r in range(2)])
    hits, lease = store.lookup("m", 2, DIGESTS[:2], lock=True, owner=b"a")
    assert hits == 2 and store.stats()["leased_objects"] == 4
    assert store.lookup("m", 2, DIGESTS[1:3], extend=lease) == (2, lease)
    assert store.stats()["leased_objects"] == 6
    assert store.release(lease, [DIGESTS[1]]) == 2  # both ranks of chunk 1, named twice
    assert store.stats()["leased_objects"] == 4 and store.stats()["evictable"] == 2
    assert store.release(lease, [DIGESTS[1]]) == 0
    assert store.release(lease, [DIGESTS[2], DIGESTS[0]]) == 4 and store.lease(lease) is None
    assert store.stats()["leased_objects"] == 0 and store.stats()["evictable"] == 6


def test_salt_is_a_separate_namespace(store):
    _store(store, [key(0, salt=b"tenant")])
    assert found(store, "m", 1, [DIGESTS[0]]) == 0
    assert found(store, "m", 1, [DIGESTS[0]], salt=b"tenant") == 1


def test_format_key_mismatch_is_a_miss_on_read(store):
    other = ("tokens", 1, 1, 32, "uint8")
    _store(store, [key(0), key(1)])
    _store(store, [key(2)], fmt=other)
    assert store.begin_read([key(0)], other) == []
    objs = store.begin_read([key(0), key(1), key(2)], FMT)  # stops at the chunk of another layout
    assert [o.key for o in objs] == [key(0), key(1)]
    store.end_read(objs)


def test_store_replaces_stale_bytes_of_another_layout_unless_in_use(store):
    other = ("opaque", 16, 1, 32, "uint8")
    _store(store, [key(0), key(1)])
    hits, lease = store.lookup("m", 1, DIGESTS[:2], lock=True, owner=b"a")
    assert hits == 2
    store.release(lease, [DIGESTS[0]])
    plan = store.begin_store([key(0), key(1)], OBJECT_BYTES, other)
    assert plan.indices == [0]  # chunk 0 replaced; chunk 1 is leased in the old layout
    assert plan.skipped == 1
    store.commit(plan)
    assert [o.key for o in store.begin_read([key(0)], other)] == [key(0)]


def test_mixed_sizes_never_evict_protected_objects():
    """A big object needs a whole slab: eviction frees small objects, never protected ones."""
    arena = HostArena(2 * SLAB, SLAB)
    l1 = L1Store(arena, clock=Clock())
    small = [key(i, model="small") for i in range(8)]  # 1 KiB slots: 4 per slab, both slabs full
    _store(l1, small[:7], nbytes=1024)
    writing = l1.begin_store([small[7]], 1024, FMT)
    assert len(writing.objects) == 1
    offsets = {small[7]: writing.objects[0].offset}
    for k in (small[0], small[1]):
        (obj,) = l1.begin_read([k], FMT)
        offsets[k] = obj.offset
        l1.end_read([obj])
    assert found(l1, "small", 1, [small[0].digest], lock=True, owner=b"a") == 1
    reading = l1.begin_read([small[1]], FMT)
    big = l1.begin_store([ObjectKey("big", 1, 0, DIGESTS[9], b"")], SLAB, FMT)
    assert l1.contains(small[0]) and l1.contains(small[1])
    if big.objects:  # possible only if the three protected objects share one slab
        lo = big.objects[0].offset
        assert not any(lo <= off < lo + SLAB for off in offsets.values()), "overlaps a protected object"
        l1.abort(big)
    else:
        assert big.skipped == 1
    l1.commit(writing)
    assert l1.contains(small[7])
    l1.end_read(reading)
    assert l1.stats()["leases"] == 1


def test_a_store_of_chunks_being_written_answers_once_they_land():
    """Two requests store the same chunk at once (e.g. MLA ranks): the second one's reply must
    wait for the first one's bytes, and says "skipped" if the first store is abandoned."""
    arena = HostArena(4 << 20, 1 << 20)
    store = L1Store(arena)
    first = store.begin_store([key(0), key(1)], OBJECT_BYTES, FMT)
    second = store.begin_store([key(0), key(1)], OBJECT_BYTES, FMT)
    assert second.objects == [] and len(second.pending) == 2
    results = []
    store.when_written(second.pending, results.append)
    assert results == []  # still being written
    store.commit(first)
    assert results == [0]
    third = store.begin_store([key(2)], OBJECT_BYTES, FMT)
    fourth = store.begin_store([key(2)], OBJECT_BYTES, FMT)
    store.when_written(fourth.pending, results.append)
    store.abort(third)
    assert results == [0, 1]  # one chunk was abandoned
    store.when_written([], results.append)
    assert results == [0, 1, 0]
