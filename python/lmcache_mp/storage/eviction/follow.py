"""`follow`: the live cache evicts as whichever candidate policy is winning at its size.

No single policy wins on every traffic (docs/eviction.md): frequency with admission (the adaptive
policy) wins where reuse is rare and late (a conversation service), ARC and S3-FIFO where a few
long sessions must survive the gap between their turns (agentic coding), LRU where everything
reused soon fits. This policy runs them all and follows the winner:

- **Miniature caches** (SHARDS, Waldspurger et al., FAST '15): keys whose digest falls in a
  sampled fraction R of the hash space are replayed on one small cache per candidate, each of R x
  the live cache's size (the objects it held when it last evicted). Only reads and stores of the
  live cache reach them (admissions and uses, never lookups), so a client cannot game the choice.
  R is at most 1 and chosen so that a miniature holds about MINI_OBJECTS objects: small caches
  are simulated in full. Each miniature's hits are counted with exponential decay; the leader is
  the candidate with the most, by a margin over the current leader (no flapping on ties).
- **Follow the leader**: every candidate keeps its own metadata for every live object (a shadow
  node each), so a switch carries the resident set with it: the new leader already knows the
  frequency, recency and queue of every chunk. The victim is the leader's; the others are told it
  was dropped (it enters their ghosts), so each candidate's view stays the live cache's content.

Candidate order breaks ties: the adaptive policy first.

Costs: every call is O(1) amortised (each candidate's call, and at most R of the calls again on
the miniatures; a change of R happens at most a few times and drops the keys no longer sampled).
History: each candidate's ghosts, and each miniature's objects and ghosts, all bounded and
reported in stats(). The guarantees of base.py hold: the leader sees only parked objects, a
request's chunks reach every candidate in prefix order, one order over every size.
"""

from __future__ import annotations

import collections
import itertools
from typing import Iterator, Sequence

from lmcache_mp.storage.eviction.adaptive import AdaptivePolicy
from lmcache_mp.storage.eviction.arc import ArcPolicy
from lmcache_mp.storage.eviction.base import GHOST_BYTES, EvictionPolicy
from lmcache_mp.storage.eviction.lru import LruPolicy
from lmcache_mp.storage.eviction.s3fifo import S3FifoPolicy
from lmcache_mp.storage.index import Lru

FILLS = 7  # the live cache's size is the median of its fill at this many latest first evictions
MINI_OBJECTS = 16384  # objects a miniature cache holds (at most; R = 1 below)
DOOMED_SCAN = 64  # doomed objects looked at per batch (held ones are skipped)
RATE_STEP = 1.5  # R is lowered only when the wanted rate is this much lower
DECAY = 0.5  # of the miniatures' hit counts, once every DECAY_EVERY x miniature size sampled accesses
DECAY_EVERY = 32
MIN_WINDOW = 1024
WINDOW_HITS = 16384  # ... and once the best has this many (a window long enough to tell them apart)
NOISE = 9.0  # ... and by 3 standard deviations of the difference (squared)
LEAD = 0.003  # a challenger leads once its decayed hits exceed the leader's by this share of the decayed accesses


class UseLruPolicy(LruPolicy):
    """LRU whose recency comes from reads and stores only: a held object keeps its place in the
    list (skipped while held), so neither a lookup's park nor a lease's release moves it."""

    name = "lru"

    def __init__(self):
        super().__init__()
        self._parked = 0
        self._last = None  # the object used last

    def use(self, obj) -> None:
        before, last, self._last = obj.prev, self._last, obj
        if before is not None and before is last and before.newer is not None:
            # a read in prefix order (as a server's reads go): just behind the chunk before it,
            # so that the prompt still goes from its end
            self._list.remove(obj)
            self._list.insert_before(before, obj)
        else:
            self._list.to_newest(obj)

    def admit(self, objs: Sequence, lead=None, last: bool = True) -> None:
        super().admit(objs, lead, last)
        for obj in objs:
            obj.queue = 0
        self._parked += len(objs)

    def park(self, obj) -> None:
        if obj.queue:
            obj.queue = 0
            self._parked += 1

    def unpark(self, obj) -> None:
        if not obj.queue:
            obj.queue = 1
            self._parked -= 1

    def remove(self, obj) -> None:
        self.unpark(obj)
        self._list.remove(obj)
        self.resident -= 1

    def order(self) -> Iterator:
        return (obj for obj in self._list.oldest() if not obj.queue)

    def __len__(self) -> int:
        return self._parked


# (The first must unlink held objects from its lists, as every policy but UseLruPolicy does: its
# nodes tell which live objects are parked.)
CANDIDATES: tuple[type[EvictionPolicy], ...] = (AdaptivePolicy, ArcPolicy, S3FifoPolicy, UseLruPolicy)


class Shadow:
    """One candidate's node for one live object (the slots base.py names, and the object)."""

    __slots__ = ("obj", "key", "prev", "older", "newer", "queue", "freq", "stamp", "since")

    def __init__(self, obj, key, prev):
        self.obj, self.key, self.prev = obj, key, prev
        self.older = self.newer = None
        self.queue = self.freq = self.stamp = self.since = 0


class Miniature:
    """One candidate replayed on the sampled keys, in a cache of `capacity` objects. While every
    key is sampled, `doomed` holds the live objects whose keys it evicted (and has not stored
    again), oldest first: the live cache evicts those first when this candidate leads, so that its
    content becomes the miniature's.

    leased: a read's chunks are held while it is used, in prefix order, and parked again deepest
    first, as a server's reads are (follow.py: its live cache takes the miniature's victims, so
    the miniature must be the candidate as the server runs it); else each is used and parked
    where it is, the last first (switch.py's estimates: S3-FIFO then keeps a chunk read in its
    place, and the race picked better: on agentic coding's first 1,500 requests at 4,000 blocks
    0.570 served against 0.537)."""

    __slots__ = ("policy", "held", "capacity", "hits", "doomed", "live", "leased")

    def __init__(self, policy: EvictionPolicy, live: dict, leased: bool = False):
        self.policy, self.held, self.capacity, self.hits = policy, {}, 0, 0.0
        self.doomed: collections.OrderedDict = collections.OrderedDict()
        self.live = live  # key -> live object, while every key is sampled (else empty)
        self.leased = leased

    def access(self, keys: Sequence, lead=None, last: bool = True, parent=None) -> None:
        """One request's sampled keys, in prefix order: the leading held ones are hits (a
        lookup's; the first only where the sampled chunk before it is held), the held ones are
        read as `leased` says, the others stored after room is made (lead, last: as the live
        cache's admit says; parent: the key of the sampled chunk before the first, which the
        new ones continue)."""
        held, pol = self.held, self.policy
        new, present, prev = [], [], None if parent is None else held.get(parent)
        run = True  # the hits: the leading chunks held, after a prefix held (a lookup's)
        for key in keys:
            obj = held.get(key)
            if obj is None:
                obj = Shadow(None, key, prev)
                new.append(obj)
                run = False
            else:
                if run and (present or obj.prev is None or held.get(obj.prev.key) is obj.prev):
                    self.hits += 1
                else:
                    run = False
                present.append(obj)
            prev = obj
        if new:
            cap = self.capacity
            while cap and pol.resident and pol.resident + len(new) > cap:
                self._evict()
            doomed, live = self.doomed, self.live
            for obj in new:
                held[obj.key] = obj
                if doomed:
                    doomed.pop(live.get(obj.key), None)
            pol.admit(new, lead, last)
        present = [obj for obj in present if held.get(obj.key) is obj]
        if self.leased:
            for obj in present:
                pol.unpark(obj)
                pol.use(obj)
            for obj in reversed(present):
                pol.park(obj)
        else:
            for obj in reversed(present):
                pol.use(obj)
                pol.park(obj)

    def _evict(self) -> None:
        victim = next(self.policy.candidates())
        self.policy.evicted(victim)
        self.policy.remove(victim)
        del self.held[victim.key]
        obj = self.live.get(victim.key)
        if obj is not None:
            self.doomed[obj] = None

    def drop_unsampled(self, sampled) -> None:
        """Forget the keys no longer sampled (R went down). A chunk kept now follows the nearest
        chunk still sampled before it, against which its first hit is checked (it named one
        forgotten here, and prompts stored before R went down never hit again: docs/eviction.md,
        2026-12-08)."""
        for key in [k for k in self.held if not sampled(k)]:
            self.policy.remove(self.held.pop(key))
        for obj in self.held.values():
            p = obj.prev
            while p is not None and not sampled(p.key):
                p = p.prev
            obj.prev = p

    def resize(self, capacity: int) -> None:
        self.capacity = capacity
        while capacity and self.policy.resident > capacity:
            self._evict()


class LeaderRace:
    """The candidates' miniatures racing: each sampled request replayed on every miniature, their
    hits decayed (by `decay`, once `decay_every` x a miniature's size sampled accesses, at least
    `min_window`, have passed and the best has `window_hits`), and the sum of the squared
    differences of two candidates' hits per call (their hits are correlated, mostly the same
    chunks: the noise is where they differ)."""

    def __init__(self, minis: list, *, decay: float, decay_every: int, min_window: int, window_hits: int,
                 noise: float, lead: float):
        self.minis = minis
        self.decay, self.decay_every, self.min_window, self.window_hits = decay, decay_every, min_window, window_hits
        self.noise, self.lead = noise, lead
        self.accesses = 0  # sampled, since the last decay
        self.seen = 0.0  # sampled accesses, decayed as the hits are
        self.warm = 0  # sampled accesses since the live cache first evicted
        self.var = [[0.0] * i for i in range(len(minis))]  # of the difference of two candidates' hits

    def record(self, keys: Sequence, lead=None, last: bool = True, parent=None) -> None:
        """One request's sampled keys, replayed on every miniature (lead, last, parent: Miniature.access)."""
        minis = self.minis
        gained = []
        for mini in minis:
            before = mini.hits
            mini.access(keys, lead, last, parent)
            gained.append(mini.hits - before)
        var = self.var
        for i, gi in enumerate(gained):
            for j in range(i):
                var[i][j] += (gi - gained[j]) ** 2
        self.accesses += len(keys)
        self.seen += len(keys)
        self.warm += len(keys)
        window = max(self.min_window, self.decay_every * minis[0].capacity)
        if self.accesses >= window and max(mini.hits for mini in minis) >= self.window_hits:
            self.accesses = 0
            self.seen *= self.decay
            for i, mini in enumerate(minis):
                mini.hits *= self.decay
                var[i] = [v * self.decay for v in var[i]]

    def ahead_of(self, leader: int) -> int | None:
        """The candidate with the most hits, once it is ahead of the leader by `lead` of the
        decayed accesses and by sqrt(noise) standard deviations of the difference, after at least
        a miniature's size of accesses since the cache filled; else None."""
        minis = self.minis
        best = max(range(len(minis)), key=lambda i: (minis[i].hits, -i))
        if best == leader or self.warm < minis[0].capacity:
            return None
        ahead = minis[best].hits - minis[leader].hits
        if ahead > self.lead * self.seen and ahead * ahead > self.noise * self.var[max(best, leader)][min(best, leader)]:
            return best
        return None

    def restart(self) -> None:
        """The first eviction: until now every candidate held everything."""
        self.seen = self.accesses = self.warm = 0
        for mini in self.minis:
            mini.hits = 0.0


def _hash(key) -> float:
    return int.from_bytes(key.digest[4:8], "little") / 4294967296.0


class FollowPolicy(EvictionPolicy):
    name = "follow"

    def __init__(self, candidates: Sequence[type[EvictionPolicy]] = CANDIDATES):
        super().__init__()
        self._live = [c() for c in candidates]
        self._by_key: dict = {}  # key -> live object, while every key is sampled (rate 1)
        self._mini = [Miniature(c(), self._by_key, leased=True) for c in candidates]
        self._race = LeaderRace(self._mini, decay=DECAY, decay_every=DECAY_EVERY, min_window=MIN_WINDOW,
                                window_hits=WINDOW_HITS, noise=NOISE, lead=LEAD)
        self._shadows: dict = {}  # live object -> its shadow in each candidate
        self.leader = 0
        self.switches = 0
        self.rate = 1.0  # share of the hash space sampled
        self._capacity = 0  # objects held when the live cache last evicted
        self._fills: collections.deque = collections.deque()  # objects held at the latest first evictions
        self._fresh = True
        self._used = None
        self._reads: list = []  # keys read since the last other call: one read, in prefix order

    # ---- the live cache ------------------------------------------------------------------------

    def admit(self, objs: Sequence, lead=None, last: bool = True) -> None:
        if not objs:
            return
        self._flush()
        self.resident += len(objs)
        self._fresh = True
        shadows = self._shadows
        before = shadows.get(objs[0].prev) if objs[0].prev is not None else None
        made = []
        for i, pol in enumerate(self._live):
            prev = before[i] if before is not None else None
            mine = []
            for obj in objs:
                prev = Shadow(obj, obj.key, prev)
                mine.append(prev)
            made.append(mine)
        mirror = self.rate == 1.0
        for j, obj in enumerate(objs):
            shadows[obj] = tuple(m[j] for m in made)
            if mirror:
                self._by_key[obj.key] = obj
        for pol, mine in zip(self._live, made):
            pol.admit(mine, lead, last)
        self._sample([obj.key for obj in objs])

    def use(self, obj) -> None:
        self._used = obj  # (a park of it that follows is the use's, not a lookup's)
        shadows = self._shadows[obj]
        for pol, s in zip(self._live, shadows):
            pol.use(s)
        self._reads.append(obj.key)

    def park(self, obj) -> None:
        self._flush()
        shadows = self._shadows[obj]
        if shadows[0].newer is not None and obj is not self._used:  # parked already: a lookup hit
            return
        self._used = None
        for pol, s in zip(self._live, shadows):
            pol.park(s)

    def unpark(self, obj) -> None:
        shadows = self._shadows.get(obj)
        if shadows is not None:
            for pol, s in zip(self._live, shadows):
                pol.unpark(s)

    def _flush(self) -> None:
        """A read's keys reach the miniatures as one request, as replay() makes it: a server uses a
        read's chunks one at a time in prefix order and parks them again once it ends (one
        request a chunk, a miniature's prompts would go from their first chunk)."""
        if self._reads:
            keys, self._reads = list(dict.fromkeys(self._reads)), []  # (a key read twice: once)
            self._sample(keys)

    def evicted(self, obj) -> None:
        self._flush()
        if self._fresh:  # the first eviction since an admission: the cache was as full as it gets
            self._fresh = False
            fills = self._fills
            fills.append(self.resident)
            if len(fills) > FILLS:
                fills.popleft()
            cap = sorted(fills)[len(fills) // 2]  # (a median: one store larger than the cache is no size)
            if cap != self._capacity:
                self._capacity = cap
                self._fit()
        shadows = self._shadows[obj]
        for i, (pol, s) in enumerate(zip(self._live, shadows)):
            if i == self.leader:
                pol.evicted(s)
            else:
                pol.dropped(s)

    def remove(self, obj) -> None:
        shadows = self._shadows.pop(obj, None)
        if shadows is not None:
            for pol, s in zip(self._live, shadows):
                pol.remove(s)
            self.resident -= 1
            if self._by_key.get(obj.key) is obj:
                del self._by_key[obj.key]
                for mini in self._mini:
                    mini.doomed.pop(obj, None)

    def candidates(self) -> Iterator:
        return self._follow(self._live[self.leader].candidates())

    def order(self) -> Iterator:
        return self._follow(self._live[self.leader].order())

    def _follow(self, shadows: Iterator) -> Iterator:
        """First what the leader's miniature no longer holds (parked, oldest first, at most
        DOOMED_SCAN of them), then the leader's own order (each object once)."""
        doomed = self._mini[self.leader].doomed
        given = set()
        if doomed:
            for obj in list(itertools.islice(doomed, DOOMED_SCAN)):
                if obj in doomed and self._shadows[obj][0].newer is not None:  # (parked)
                    given.add(obj)
                    yield obj
        for s in shadows:
            if s.obj not in given:
                yield s.obj

    def __len__(self) -> int:
        return len(self._live[self.leader])

    # ---- the miniatures ----------------------------------------------------------------------------

    def _sample(self, keys: Sequence) -> None:
        rate = self.rate
        got = [k for k in keys if _hash(k) < rate] if rate < 1.0 else list(keys)
        if not got:
            return
        self._race.record(got)
        self._choose()

    def _choose(self) -> None:
        best = self._race.ahead_of(self.leader)
        if best is not None:
            self.leader = best
            self.switches += 1

    def _fit(self) -> None:
        """The miniatures' size follows the live cache's; the sampled share only ever shrinks."""
        cap = self._capacity
        if not self._mini[0].capacity:  # the first eviction: until now every candidate held everything
            self._race.restart()
        want = min(1.0, MINI_OBJECTS / cap) if cap else 1.0
        rate = self.rate
        if want * RATE_STEP <= rate or (want < rate and want < 1.0 and rate == 1.0):
            self.rate = rate = want
            self._by_key.clear()  # (sampled keys only: no mirror)
            for mini in self._mini:
                mini.doomed.clear()
                mini.drop_unsampled(lambda k: _hash(k) < rate)
        mini_cap = max(1, round(rate * cap))
        if mini_cap != self._mini[0].capacity:
            for mini in self._mini:
                mini.resize(mini_cap)

    def stats(self) -> dict:
        keys = 0
        for pol in self._live:
            keys += pol.stats()["history_keys"]
        for mini in self._mini:
            keys += len(mini.held) + mini.policy.stats()["history_keys"]
        return {"policy": self.name, "history_keys": keys, "history_bytes": keys * GHOST_BYTES,
                "leader": self._live[self.leader].name, "switches": self.switches,
                "sample_rate": round(self.rate, 4), "miniature_objects": self._mini[0].capacity,
                "miniature_hits": {p.name: round(m.hits, 1) for p, m in zip(self._live, self._mini)}}
