"""Which object a store evicts next, and whose: the one victim chooser of L1 and the disk tier.

The eviction policy (base.py) orders the parked objects; the chooser walks that order and
applies what the policy does not know:

- Quotas (quotas.py). A store of an owner past its cap evicts that owner's own objects first
  (`fit_cap`); a store that needs room passes over other owners' objects that would fall below
  their floor (`victim(owner)`). Both look through at most QUOTA_SCAN candidates.
- Busy objects (L1: being moved, or an L2 write has yet to read them) are never victims.
- Clean before dirty (L1 with L2 writes, `prefer_clean`): among the oldest EVICTION_WINDOW
  candidates, an object with nothing left to write goes before a dirty one; only when the window
  holds no clean object does a dirty one go (its write is dropped).

The chooser runs under its store's lock.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterator

from lmcache_mp.storage.eviction.base import EvictionPolicy
from lmcache_mp.storage.eviction.quotas import Quotas

QUOTA_SCAN = 16384  # candidates a store of an owner looks through past others' protected objects
EVICTION_WINDOW = 64  # oldest evictable objects looked through for a clean one before a dirty one goes


class VictimChooser:
    def __init__(self, policy: EvictionPolicy, quotas: Quotas | None = None,
                 busy: Callable[[object], bool] | None = None):
        """busy(obj): obj may not be evicted now (None: every parked object may be)."""
        self.policy = policy
        self.quotas = quotas
        self._busy = busy
        self._dirty: Callable[[object], int] | None = None

    def prefer_clean(self, dirty: Callable[[object], int] | None) -> None:
        """dirty(obj): what is left to write of obj (0: clean); None: no writes, plain order."""
        self._dirty = dirty

    def victim(self, owner: int = -1, own_only: bool = False):
        """The object to evict next, or None when nothing is evictable. owner: the owner that needs
        the room: objects of others below their floor are passed over (own_only: only its own
        objects), within QUOTA_SCAN candidates."""
        candidates = self.policy.candidates()
        if owner >= 0 and self.quotas is not None:
            candidates = self._allowed(candidates, owner, own_only)
        busy = self._busy
        if busy is not None:
            candidates = (obj for obj in candidates if not busy(obj))
        dirty = self._dirty
        if dirty is None:
            return next(candidates, None)
        first = None
        for seen, obj in enumerate(candidates, 1):
            if not dirty(obj):
                return obj
            if first is None:
                first = obj
            if seen >= EVICTION_WINDOW:
                break
        return first

    def _allowed(self, candidates: Iterator, owner: int, own_only: bool) -> Iterator:
        quotas = self.quotas
        for obj in itertools.islice(candidates, QUOTA_SCAN):
            if obj.owner == owner if own_only else not quotas.protected(obj.owner, obj.nbytes, owner):
                yield obj

    def fit_cap(self, owner: int, nbytes: int, evict: Callable[[object, str], None]) -> bool:
        """Make `nbytes` more of this owner fit its cap by evicting its own objects (evict(victim,
        cause), which removes it); False when its own objects run out first."""
        quotas = self.quotas
        while quotas.over_max(owner, nbytes):
            victim = self.victim(owner, own_only=True)
            if victim is None:
                return False
            evict(victim, quotas.cap)
        return True

    def evicted(self, victim, cause: str) -> None:
        """The store evicts victim (before removing it): the policy may remember it, its owner
        counts it."""
        self.policy.evicted(victim)
        if self.quotas is not None and victim.owner >= 0:
            self.quotas.evicted[victim.owner][cause] += 1
