"""The follow policy (storage/eviction/follow.py): it follows whichever candidate its miniature
caches say is winning, and keeps the guarantees of every policy across a switch of leader: held
objects are never victims, each parked object is offered once, a prompt goes from its end, what
it remembers is bounded; and on a small generated trace it serves about what the best textbook
policy serves at each size."""

from __future__ import annotations

import os
import random
import sys

import pytest

from lmcache_mp.storage.eviction import make_policy
from lmcache_mp.storage.eviction.base import GHOST_BYTES, ghost_limit
from lmcache_mp.storage.eviction.follow import CANDIDATES, MINI_OBJECTS, FollowPolicy
from lmcache_mp.storage.eviction.simulate import SimObject, block_key, replay

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _objs(n: int, start: int = 0) -> list[SimObject]:
    out: list[SimObject] = []
    for i in range(start, start + n):
        out.append(SimObject(block_key(i), i, out[-1] if out else None))
    return out


def _evict(pol, held: dict) -> SimObject:
    victim = next(pol.candidates())
    pol.evicted(victim)
    pol.remove(victim)
    del held[victim.block]
    return victim


def _run(pol, requests, capacity: int, hold=(), held=None) -> dict:
    """replay() with some objects held (leased) throughout: they must never be victims."""
    held = {} if held is None else held
    for blocks in requests:
        new, present, before = [], [], None
        for b in blocks:
            obj = held.get(b)
            if obj is None:
                obj = held[b] = SimObject(block_key(b), b, before)
                new.append(obj)
                if b in hold:
                    hold[b] = obj
            else:
                present.append(obj)
            before = obj
        while pol.resident + len(new) > capacity and len(pol):
            victim = _evict(pol, held)
            assert victim.block not in hold, victim.block
        pol.admit(new)
        for obj in new:
            if obj.block in hold:
                pol.unpark(obj)
        for obj in reversed(present):
            if held.get(obj.block) is obj:
                pol.use(obj)
                if obj.block not in hold:
                    pol.park(obj)
    return held


def _sessions(n: int, seed: int = 3) -> list[list[int]]:
    """Sessions whose turns re-send a growing context, next to one-off prompts."""
    rng = random.Random(seed)
    nxt = iter(range(1, 10**9))
    live = [[next(nxt) for _ in range(rng.randint(5, 30))] for _ in range(20)]
    out = []
    for _ in range(n):
        if rng.random() < 0.3:
            out.append([next(nxt) for _ in range(rng.randint(5, 20))])
            continue
        i = rng.randrange(len(live))
        live[i] = live[i] + [next(nxt) for _ in range(rng.randint(1, 3))]
        out.append(list(live[i]))
        if len(live[i]) > 60:
            live[i] = [next(nxt) for _ in range(rng.randint(5, 30))]
    return out


def test_it_reports_its_leader_and_history():
    st = make_policy("follow").stats()
    assert st["policy"] == "follow" and st["leader"] == "adaptive" and st["sample_rate"] == 1.0
    assert st["history_bytes"] == st["history_keys"] * GHOST_BYTES


@pytest.mark.parametrize("leader", range(len(CANDIDATES)))
def test_every_leader_keeps_held_objects_and_offers_each_parked_object_once(leader):
    pol = FollowPolicy()
    hold = {3: None, 17: None, 40: None}
    reqs = _sessions(600)
    held = _run(pol, reqs[:300], 120, hold)
    pol.leader = leader  # a switch, with everything the others did meanwhile
    _run(pol, reqs[300:], 120, hold, held)
    order = list(pol.order())
    assert len(order) == len(set(map(id, order))) == len(pol) == len(held) - sum(o is not None for o in hold.values())
    assert not any(o.block in hold for o in order)
    assert not any(o.block in hold for o in pol.candidates())
    while len(pol):  # every parked object can go, and then nothing is left but the held ones
        assert _evict(pol, held).block not in hold
    assert pol.resident == sum(o is not None and o.block in held for o in hold.values())


@pytest.mark.parametrize("leader", range(len(CANDIDATES)))
def test_a_prompt_goes_from_its_end_under_every_leader(leader):
    pol = FollowPolicy()
    _run(pol, _sessions(200), 100)
    pol.leader = leader
    a = _objs(6, start=10**6)
    pol.admit(a)
    order = list(pol.candidates())
    mine = [order.index(o) for o in a]
    assert mine == sorted(mine, reverse=True), (leader, mine)


def test_a_switch_carries_the_resident_set_and_the_live_cache_becomes_the_leaders():
    """With every key sampled, the live cache evicts first what the leader's miniature evicted:
    fixed on one candidate, it serves what that candidate serves alone."""
    reqs = _sessions(1500)
    for i, cand in enumerate(CANDIDATES):
        alone = replay(reqs, cand.name, 150)["ratio"]

        class Fixed(FollowPolicy):
            def _choose(self):
                self.leader = i

        import lmcache_mp.storage.eviction.simulate as sim

        made = sim.make_policy
        sim.make_policy = lambda name: Fixed()
        try:
            got = replay(reqs, "follow", 150)["ratio"]
        finally:
            sim.make_policy = made
        assert abs(got - alone) <= 0.002, (cand.name, got, alone)


def test_what_it_remembers_is_bounded_and_large_caches_are_sampled():
    pol = FollowPolicy()
    live: dict = {}
    cap = 3 * MINI_OBJECTS
    for i in range(0, 160000, 4):
        batch = _objs(4, start=i)
        for o in batch:
            live[o.block] = o
        while pol.resident + 4 > cap and len(pol):
            _evict(pol, live)
        pol.admit(batch)
        if i % 64 == 0:
            for o in batch:
                pol.use(o)
    st = pol.stats()
    assert st["sample_rate"] < 0.5 and st["miniature_objects"] <= MINI_OBJECTS + 1
    per_candidate = ghost_limit(cap) + 65536 + 2 * cap
    assert st["history_keys"] <= 2 * len(CANDIDATES) * per_candidate, st
    assert st["history_bytes"] == st["history_keys"] * GHOST_BYTES


def test_lookups_do_not_move_it():
    """A lookup hit parks a parked object: that changes nothing. A lease taken and released (a
    lookup with lock) changes no miniature: the choice of leader cannot be gamed."""
    a, b = FollowPolicy(), FollowPolicy()
    reqs = _sessions(300)
    _run(a, reqs, 100)
    hb = _run(b, reqs, 100)
    for obj in list(hb.values())[:50]:
        for _ in range(5):
            b.park(obj)
    assert [o.block for o in a.order()] == [o.block for o in b.order()]
    for obj in list(hb.values())[:50]:
        for _ in range(5):
            b.unpark(obj)
            b.park(obj)
    assert a.stats()["miniature_hits"] == b.stats()["miniature_hits"] and a.leader == b.leader


@pytest.mark.parametrize("size", [150, 400, 1000])
def test_it_serves_about_what_the_best_textbook_policy_serves(size):
    reqs = _sessions(6000)  # (a leader is chosen on evidence: a few thousand requests)
    got = {p: replay(reqs, p, size)["ratio"] for p in ("lru", "arc", "s3fifo", "follow")}
    assert got["follow"] >= max(got["lru"], got["arc"], got["s3fifo"]) - 0.002, got


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["chat", "scan", "docs", "agent"])
def test_on_the_generated_traces_it_stays_near_the_best_textbook_policy(kind):
    """A guard, not the goal: the goal is the best textbook policy within 0.002, which the default
    does not reach everywhere yet (docs/eviction.md says where); on 4,000 requests of each
    generated trace it was at most 0.031 below (chat, 4,000 blocks: a leader known late)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from bench_trace import synthetic

    reqs = [r["blocks"] for r in synthetic(kind, 4000)]
    for size in (1000, 4000):
        got = {p: replay(reqs, p, size)["ratio"] for p in ("lru", "arc", "s3fifo", "follow")}
        assert got["follow"] >= max(got["lru"], got["arc"], got["s3fifo"]) - 0.035, (size, got)
