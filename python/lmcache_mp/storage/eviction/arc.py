"""ARC (Megiddo and Modha, FAST '03): a list of objects used once (T1) and one of objects used
again (T2), each with a list of the keys it evicted lately (B1, B2). A miss on a key of B1 says T1
was too short: its target size p grows; one on B2 shrinks it. The victim comes from T1 while T1 is
longer than p, else from T2.

The store, not the policy, decides when room is needed, so the capacity c of the textbook
algorithm is the number of objects held when the store last evicted. Held objects (read,
leased) are in neither list meanwhile and come back at the recent end of theirs."""

from __future__ import annotations

import collections
import itertools
from typing import Iterator, Sequence

from lmcache_mp.storage.eviction.base import GHOST_BYTES, EvictionPolicy
from lmcache_mp.storage.index import Lru

T1, T2 = 1, 2


class ArcPolicy(EvictionPolicy):
    name = "arc"

    def __init__(self):
        super().__init__()
        self._t = {T1: Lru(), T2: Lru()}
        self._b1: collections.OrderedDict = collections.OrderedDict()
        self._b2: collections.OrderedDict = collections.OrderedDict()
        self._p = 0.0
        self._c = 0
        self._from_b2 = False  # the latest admission came from B2 (the textbook's tie rule)

    def admit(self, objs: Sequence, lead=None, last: bool = True) -> None:
        self.resident += len(objs)
        c = max(self._c, self.resident)
        b1, b2 = self._b1, self._b2
        for obj in reversed(objs):
            key = obj.key
            self._from_b2 = False
            if key in b1:
                self._p = min(c, self._p + max(len(b2) / len(b1), 1.0))
                del b1[key]
                obj.queue = T2
            elif key in b2:
                self._p = max(0.0, self._p - max(len(b1) / len(b2), 1.0))
                del b2[key]
                obj.queue = T2
                self._from_b2 = True
            else:
                obj.queue = T1
                if len(self._t[T1]) + len(b1) >= c and b1:
                    b1.popitem(last=False)
                elif len(self._t[T1]) + len(b1) + len(self._t[T2]) + len(b2) >= 2 * c and b2:
                    b2.popitem(last=False)
            self._t[obj.queue].to_newest(obj)

    def use(self, obj) -> None:
        if obj.queue == T1:
            parked = obj.newer is not None
            self._t[T1].remove(obj)
            obj.queue = T2
            if parked:
                self._t[T2].to_newest(obj)

    def park(self, obj) -> None:
        self._t[obj.queue].to_newest(obj)

    def unpark(self, obj) -> None:
        if obj.newer is not None:
            self._t[obj.queue].remove(obj)

    def evicted(self, obj) -> None:
        self._c = c = max(self._c, self.resident)
        b1, b2 = self._b1, self._b2
        (b1 if obj.queue == T1 else b2)[obj.key] = None
        if len(b1) + len(b2) > 2 * c:  # (the textbook trims at admission; this bounds it always)
            (b1 if len(b1) > len(b2) else b2).popitem(last=False)

    def _t1_first(self) -> bool:
        n1 = len(self._t[T1])
        return n1 > 0 and (n1 > self._p or (self._from_b2 and n1 == int(self._p)))

    def order(self) -> Iterator:
        first, second = (T1, T2) if self._t1_first() else (T2, T1)
        return itertools.chain(self._t[first].oldest(), self._t[second].oldest())

    def __len__(self) -> int:
        return len(self._t[T1]) + len(self._t[T2])

    def stats(self) -> dict:
        keys = len(self._b1) + len(self._b2)
        return {"policy": self.name, "history_keys": keys, "history_bytes": keys * GHOST_BYTES,
                "t1": len(self._t[T1]), "t2": len(self._t[T2]), "p": round(self._p, 1)}
