"""`switch`: one candidate policy runs the live cache; sampled miniature caches say which.

follow.py runs every candidate on every live chunk (a node each) and every miniature on every
key, about 7x one policy's work a chunk. This policy runs only the leader on the live objects
(their own slots, as when that policy is picked by name) and the miniatures on a sampled share
RATE of the hash space, so a chunk costs one policy and RATE x the candidates' miniatures:

- **Miniatures** (SHARDS, as in follow.py): keys whose digest falls in the sampled share are
  replayed, reads and stores only (never lookups), on one cache per candidate of RATE x the live
  cache's size (at most MINI_OBJECTS objects). The leader changes as follow.py's does: by a
  margin of the decayed accesses and by 1.5 standard deviations of the difference. They run
  their candidate as the live cache does: a read reaches them as one request, a store with the
  live store's lot and its parent, and their hits are a lookup's (the leading chunks held).
- **A switch hands the live objects to the new leader**, O(objects held): the parked ones in the
  old leader's order (its next victims stay the new one's), the held ones held; the chunks read
  or stored again since they were stored are used once more in the new one (its frequency); the
  part of ARC or S3-FIFO for chunks used again (T2, main) takes the share the new leader's
  miniature has there (the chunks farthest from eviction); a new adaptive leader starts from the
  admission share its miniature learned, ARC from its miniature's target p (scaled). A switch
  waits until as many reads and stores as objects held have passed since the last one: the
  hand-over is O(1) amortised.

The guarantees of base.py hold as under the leader (it sees only parked objects; a request's
chunks reach it in prefix order), and a lookup that parks a parked object moves nothing."""

from __future__ import annotations

import collections
from typing import Iterator, Sequence

from lmcache_mp.storage.eviction.adaptive import AdaptivePolicy
from lmcache_mp.storage.eviction.arc import T1, T2, ArcPolicy
from lmcache_mp.storage.eviction.base import GHOST_BYTES, EvictionPolicy
from lmcache_mp.storage.eviction.follow import CANDIDATES, FILLS, LeaderRace, Miniature, UseLruPolicy
from lmcache_mp.storage.eviction.s3fifo import MAIN, SMALL, S3FifoPolicy

RATE = 0.25  # share of the hash space the miniatures replay
MINI_OBJECTS = 16384  # objects a miniature holds, at most (the share shrinks for larger caches)
DECAY = 0.5  # of the miniatures' hits, once every DECAY_EVERY x a miniature's size sampled accesses
DECAY_EVERY = 32
MIN_WINDOW = 256
WINDOW_HITS = 2048  # ... and once the best has this many
# A challenger leads once ahead by sqrt(NOISE) standard deviations of the difference and by LEAD
# of the decayed sampled accesses. (Four were needed while the miniatures misjudged the adaptive
# policy, before they drew a store's lot and read a read as the live cache does: three switched the
# conversation trace at 2,000 blocks to S3-FIFO, through the server. Swept since: docs/eviction.md.)
NOISE = 2.25
LEAD = 0.003
THRESHOLD = 1 << 32
PARENT_STEPS = 64  # a store's first sampled chunk continues its nearest sampled ancestor this near
READ_PIECE = 128  # sampled keys of a read that reach the miniatures in one call, at most


def _point(key) -> int:
    return int.from_bytes(key.digest[4:8], "little")


def _frequent_share(pol: EvictionPolicy) -> float:
    """The share of pol's objects in its part for those used again (0: it has none)."""
    if isinstance(pol, ArcPolicy):
        t1, t2 = pol._t[T1], pol._t[T2]
        return len(t2) / (len(t1) + len(t2)) if len(t1) + len(t2) else 0.0
    if isinstance(pol, S3FifoPolicy):
        small, main = pol._q[SMALL], pol._q[MAIN]
        return len(main) / (len(small) + len(main)) if len(small) + len(main) else 0.0
    return 0.0


def _parked(pol: EvictionPolicy, obj) -> bool:
    return not obj.queue if isinstance(pol, UseLruPolicy) else obj.newer is not None


class SwitchPolicy(EvictionPolicy):
    name = "switch"

    def __init__(self, candidates: Sequence[type[EvictionPolicy]] = CANDIDATES, rate: float = RATE):
        super().__init__()
        self._kinds = tuple(candidates)
        self._mini = [Miniature(c(), {}) for c in candidates]
        self._race = LeaderRace(self._mini, decay=DECAY, decay_every=DECAY_EVERY, min_window=MIN_WINDOW,
                                window_hits=WINDOW_HITS, noise=NOISE, lead=LEAD)
        self._pol = candidates[0]()
        self._objs: dict = {}  # live object -> used since it was stored: what a new leader is handed
        self.leader = 0
        self.switches = 0
        self.max_rate = rate
        self.rate = rate
        self._below = int(rate * THRESHOLD)
        self._capacity = 0
        self._fills: collections.deque = collections.deque()
        self._fresh = True
        self._calm = 0  # live reads and stores since the last switch
        self._used = None
        self._read_lead = self._read_parent = None
        self._reads: list = []  # the sampled keys of the read going on

    # ---- the live cache: the leader's own calls ---------------------------------------------

    def admit(self, objs: Sequence, lead=None, last: bool = True) -> None:
        if not objs:
            return
        self.resident += len(objs)
        self._fresh = True
        live = self._objs
        for obj in objs:
            live[obj] = False
        self._pol.admit(objs, lead, last)
        self._calm += len(objs)
        self._flush()
        below = self._below
        got = [obj.key for obj in objs if _point(obj.key) < below]
        if got:  # (the lot of the live store; its last chunk's class only where it is sampled)
            self._sample(got, lead or objs[0], last and _point(objs[-1].key) < below, self._sampled_parent(objs[0]))

    def use(self, obj) -> None:
        if obj.prev is None or obj.prev is not self._used:  # (a read goes in prefix order: this begins one)
            self._flush()
            self._read_lead, self._read_parent = obj, None
        self._used = obj  # (a park of it that follows is the use's, not a lookup's)
        self._pol.use(obj)
        self._objs[obj] = True
        self._calm += 1
        if _point(obj.key) < self._below:
            self._reads.append(obj.key)
            if len(self._reads) >= READ_PIECE:
                self._flush()

    def park(self, obj) -> None:
        self._flush()
        if obj is not self._used and _parked(self._pol, obj):  # parked already: a lookup hit
            return
        self._used = None
        self._pol.park(obj)

    def unpark(self, obj) -> None:
        self._pol.unpark(obj)

    def evicted(self, obj) -> None:
        if self._fresh:  # the first eviction since an admission: the cache was as full as it gets
            self._fresh = False
            fills = self._fills
            fills.append(self.resident)
            if len(fills) > FILLS:
                fills.popleft()
            cap = sorted(fills)[len(fills) // 2]
            if cap != self._capacity:
                self._capacity = cap
                self._fit()
        self._pol.evicted(obj)

    def dropped(self, obj) -> None:
        self._pol.dropped(obj)

    def remove(self, obj) -> None:
        if self._objs.pop(obj, None) is not None:
            self._pol.remove(obj)
            self.resident -= 1

    def candidates(self) -> Iterator:
        return self._pol.candidates()

    def order(self) -> Iterator:
        return self._pol.order()

    def __len__(self) -> int:
        return len(self._pol)

    # ---- a new leader --------------------------------------------------------------------------

    def _switch(self, to: int) -> None:
        old = self._pol
        order = list(old.order())  # parked, the next victim first
        parked = set(order)
        reused = [obj for obj, used in self._objs.items() if used]
        held = [obj for obj in self._objs if obj not in parked]
        for obj in self._objs:
            obj.older = obj.newer = None
            obj.queue = obj.freq = obj.stamp = obj.since = 0
        new = self._kinds[to]()
        taught = self._mini[to].policy
        if isinstance(new, AdaptivePolicy):
            new.share = list(taught.share)
        elif isinstance(new, ArcPolicy):
            new._p = taught._p / self.rate
        for obj in order:  # each the newest in turn: the old order stays
            new.admit((obj,))
        lru = isinstance(new, UseLruPolicy)
        for obj in reversed(held):  # (a read's chunks, held while the switch comes)
            new.admit((obj,))
            new.unpark(obj)
            if lru:  # in use now: the most recent, the shallowest last (else they would be the
                new.use(obj)  # oldest, the first to go once parked: LRU's recency is its uses)
        promote = set(reused)  # into the part of the chunks used again (ARC's T2, S3-FIFO's main)
        share = _frequent_share(taught)
        if share:
            promote.update(order[len(order) - round(share * len(order)):])
        if isinstance(new, S3FifoPolicy):
            small, main = new._q[SMALL], new._q[MAIN]
            for obj in held:
                if obj in promote:
                    obj.queue = MAIN
            for obj in order:
                if obj in promote:
                    small.remove(obj)
                    obj.queue = MAIN
                    main.to_newest(obj)
            for obj in reused:
                new.use(obj)
        elif not isinstance(new, UseLruPolicy):
            for obj in held:
                if obj in promote:
                    new.use(obj)
            for obj in order:
                if obj in promote:
                    new.use(obj)
                    new.park(obj)
        self._pol = new
        self.leader = to
        self.switches += 1
        self._calm = 0
        self._used = None

    # ---- the miniatures ----------------------------------------------------------------------------

    def _flush(self) -> None:
        """The sampled chunks of the read that ended reach the miniatures as one request (in one
        call, they go from their end in every miniature, as they do in the live cache; a
        miniature that stores them draws the read's lot, for inner chunks); a long read in
        pieces of READ_PIECE, each continuing the one before (a call holds L1's lock)."""
        if self._reads:
            keys, self._reads = self._reads, []
            self._sample(keys, self._read_lead, False, self._read_parent)
            self._read_parent = keys[-1]

    def _sampled_parent(self, obj):
        """The key of the nearest sampled chunk before obj in its prompt (None past PARENT_STEPS)."""
        below = self._below
        p = obj.prev
        for _ in range(PARENT_STEPS):
            if p is None:
                return None
            if _point(p.key) < below:
                return p.key
            p = p.prev
        return None

    def _sample(self, keys: Sequence, lead, last: bool, parent=None) -> None:
        self._race.record(keys, lead, last, parent)
        self._choose()

    def _choose(self) -> None:
        if self._calm < self.resident:  # (a switch at most once per turnover of the live cache)
            return
        best = self._race.ahead_of(self.leader)
        if best is not None:
            self._switch(best)

    def _fit(self) -> None:
        """The miniatures' size follows the live cache's; the sampled share only ever shrinks."""
        cap = self._capacity
        if not self._mini[0].capacity:  # the first eviction: until now every candidate held everything
            self._race.restart()
        want = min(self.max_rate, MINI_OBJECTS / cap) if cap else self.max_rate
        if want * 1.5 <= self.rate:
            self.rate = rate = want
            self._below = below = int(rate * THRESHOLD)
            for mini in self._mini:
                mini.drop_unsampled(lambda k: _point(k) < below)
        size = max(1, round(self.rate * cap))
        if size != self._mini[0].capacity:
            for mini in self._mini:
                mini.resize(size)

    def stats(self) -> dict:
        keys = self._pol.stats()["history_keys"] + len(self._objs)
        for mini in self._mini:
            keys += len(mini.held) + mini.policy.stats()["history_keys"]
        return {"policy": self.name, "history_keys": keys, "history_bytes": keys * GHOST_BYTES,
                "leader": self._pol.name, "switches": self.switches, "sample_rate": round(self.rate, 4),
                "miniature_objects": self._mini[0].capacity,
                "miniature_hits": {p.policy.name: round(p.hits, 1) for p in self._mini}}
