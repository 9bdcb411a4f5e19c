"""The adaptive policy (the first candidate of switch.py and follow.py): frequency with ageing, whole
prompts, and an admission share learned from the traffic.

Measured on a production service's conversation trace (docs/eviction.md), a prefix cache differs
from a generic cache in three ways this policy uses:

- Most new chunks are never used again (three in four there), and the gap to the next use of those
  that are is long: hundreds of requests. An LRU smaller than that gap evicts nearly every chunk
  before its reuse. Holding *some* prompts long beats holding every prompt briefly: new chunks
  are admitted in full for a share of the prompts only (a prompt's chunks share one fate: the lot
  is drawn from the digest of its first new chunk), the others are the next to go. The share is
  learned: a sample of new keys (1 in SAMPLE_RATE, at most SAMPLE_KEYS) records when each was
  stored and when it was next used, which gives the distribution F of first-reuse gaps; admitted
  chunks live about T (measured as they leave); the share moves towards the T that maximises the
  hits per held chunk and time, F(T) / T, and is 1 when everything fits. The last chunk of a
  store is a class of its own (in conversations its tokens change in the next turn; where they do
  not, it learns the same share as the others).
- A chunk used again is worth more the more it was used: priority = L + min(uses + 1, MAX_VALUE),
  where L is the priority of the last victim (GreedyDual / LFU with dynamic ageing), so what was
  used often long ago ages out. Uses of evicted keys are remembered (ghosts, GHOSTS_PER_OBJECT per
  object held) and resume when the chunk comes back.
- Only reads and stores count as uses, never lookups: a client that repeats lookups of its own
  chunks does not raise them over anyone else's.

Priorities are integers within MAX_VALUE of L, so the parked objects sit in MAX_VALUE + 1 FIFO
buckets (a request's deeper chunks nearer eviction): every call is O(1).
"""

from __future__ import annotations

import collections
import math
from typing import Iterator, Sequence

from lmcache_mp.storage.eviction.base import GHOST_BYTES, EvictionPolicy, Ghosts, ghost_limit
from lmcache_mp.storage.index import Lru

MAX_VALUE = 16
SAMPLE_RATE = 8  # 1 in this many new keys is followed to its next use
SAMPLE_KEYS = 65536
GAP_BINS = 96  # first-reuse gaps in quarter-octaves of the policy's clock
DECAY = 0.95  # of the gap histograms, at each adaptation
STEP = 1.2  # factor by which an admission share moves at each adaptation
MIN_SHARE = 0.02
LIFETIME_WEIGHT = 0.01  # of each departing admitted chunk in the lifetime average

# Classes of new chunks (obj.queue & CLASS): within a store, the last of a store. (Telling the
# chunks of a store that continues a prompt from those of a new prompt changed nothing measured.)
INNER, LAST = 0, 1
CLASSES = (INNER, LAST)
CLASS = 1
LUCKY = 2  # (bit of obj.queue) admitted in full


def _bin(gap: int) -> int:
    return min(GAP_BINS - 1, int(4 * math.log2(max(gap, 1))))


class AdaptivePolicy(EvictionPolicy):
    name = "adaptive"

    def __init__(self):
        super().__init__()
        self._buckets = [Lru() for _ in range(MAX_VALUE + 1)]
        self._parked = 0
        self._base = 0  # L
        self.clock = 0  # admissions and uses
        self._ghosts = Ghosts()
        self._sampled: collections.OrderedDict = collections.OrderedDict()  # key -> (class, clock stored)
        self._gaps = [[0.0] * GAP_BINS for _ in CLASSES]
        self._new = [0.0 for _ in CLASSES]  # sampled new keys, per class (decayed as the gaps are)
        self.share = [1.0 for _ in CLASSES]  # admission share, per class
        self._lifetime = [0.0 for _ in CLASSES]  # clock ticks an admitted new chunk stays, per class
        self._next_adapt = 1024

    # ---- buckets ---------------------------------------------------------------------------

    def _bucket(self, priority: int) -> Lru:
        return self._buckets[priority % (MAX_VALUE + 1)]

    def park(self, obj) -> None:
        if obj.newer is None:
            obj.stamp = max(obj.stamp, self._base)
            self._bucket(obj.stamp).to_newest(obj)
            self._parked += 1

    def unpark(self, obj) -> None:
        if obj.newer is not None:
            self._bucket(obj.stamp).remove(obj)
            self._parked -= 1

    def order(self) -> Iterator:
        for p in range(self._base, self._base + MAX_VALUE + 1):
            yield from self._bucket(p).oldest()

    def __len__(self) -> int:
        return self._parked

    # ---- events ----------------------------------------------------------------------------

    def admit(self, objs: Sequence, lead=None, last: bool = True) -> None:
        if not objs:
            return
        self.resident += len(objs)
        lot = int.from_bytes((lead or objs[0]).key.digest[:2], "little") / 65536
        end = len(objs) - 1
        for i in range(end, -1, -1):
            obj = objs[i]
            self._tick()
            key = obj.key
            uses = self._ghosts.pop(key)
            self._seen(key)
            if uses is not None:  # used before it was evicted: its uses resume
                obj.freq = uses + 1
                obj.queue = 0
                value = _value(obj.freq)
            else:
                cls = LAST if last and i == end else INNER
                obj.freq = 0
                lucky = lot < min(self.share[cls], self.share[INNER])
                obj.queue = cls | (LUCKY if lucky else 0)
                value = 1 if lucky else 0
                if _sampled(key) and key not in self._sampled:
                    self._sampled[key] = (cls, self.clock)
                    self._new[cls] += 1
                    if len(self._sampled) > SAMPLE_KEYS:
                        self._sampled.popitem(last=False)
            obj.since = self.clock
            obj.stamp = self._base + value
            self.park(obj)

    def use(self, obj) -> None:
        self._tick()
        self._seen(obj.key)
        obj.freq += 1
        obj.queue = 0
        parked = obj.newer is not None
        self.unpark(obj)
        obj.stamp = self._base + _value(obj.freq)
        if parked:
            self.park(obj)

    def evicted(self, obj) -> None:
        self._base = max(self._base, obj.stamp)
        self.dropped(obj)

    def dropped(self, obj) -> None:
        """(L stays: it is the priority of this policy's own last victim.)"""
        if obj.queue & LUCKY:
            cls = obj.queue & CLASS
            age = self.clock - obj.since
            self._lifetime[cls] += LIFETIME_WEIGHT * (age - self._lifetime[cls]) if self._lifetime[cls] else age
        self._ghosts.add(obj.key, obj.freq, ghost_limit(self.resident))

    # ---- learning the admission share --------------------------------------------------------

    def _tick(self) -> None:
        self.clock += 1
        if self.clock >= self._next_adapt:
            self._next_adapt = self.clock + max(1024, self.resident)
            self._adapt()

    def _seen(self, key) -> None:
        """key is used or stored again: if it is a sampled new key, its first-reuse gap."""
        if self._sampled:
            got = self._sampled.pop(key, None)
            if got is not None:
                self._gaps[got[0]][_bin(self.clock - got[1])] += 1

    def _reused_by(self, cls: int, t: float) -> float:
        """F(t): the share of the class's new chunks used again within t ticks."""
        return sum(self._gaps[cls][:_bin(int(t)) + 1]) / self._new[cls] if self._new[cls] else 0.0

    def _adapt(self) -> None:
        density = []
        for cls in CLASSES:
            t = self._lifetime[cls]
            density.append(self._reused_by(cls, t) / t if t else 0.0)
        best = max(density)
        for cls in CLASSES:
            t = self._lifetime[cls]
            if not t:
                continue
            here = density[cls]
            if here < 0.25 * best or self._reused_by(cls, 1.3 * t) / (1.3 * t) > 1.02 * here:
                self.share[cls] = max(MIN_SHARE, self.share[cls] / STEP)  # hold fewer, longer
            elif self._reused_by(cls, t / 1.3) / (t / 1.3) > 1.02 * here:
                self.share[cls] = min(1.0, self.share[cls] * STEP)  # hold more, shorter
        for cls in CLASSES:
            self._gaps[cls] = [g * DECAY for g in self._gaps[cls]]
            self._new[cls] *= DECAY

    def stats(self) -> dict:
        keys = len(self._ghosts) + len(self._sampled)
        return {"policy": self.name, "history_keys": keys, "history_bytes": keys * GHOST_BYTES,
                "admission_share": [round(s, 3) for s in self.share], "base": self._base}


def _value(uses: int) -> int:
    """Of a chunk used `uses` times (an admitted new chunk: 1, a chunk not admitted: 0): a chunk
    used again is worth well more than a new one (measured: +3 served more than +1 or +2)."""
    return min(uses + 3, MAX_VALUE)


def _sampled(key) -> bool:
    return key.digest[-1] % SAMPLE_RATE == 0
