"""LRU: the least recently used object goes first. A lookup hit, a read and a store of a chunk
already held all make it the most recent. A request's deeper chunks are older than its shallower
ones, and new chunks go just behind the chunk before them when that one is parked (they have its
recency: they are worth nothing without it), so a prompt is evicted from its end."""

from __future__ import annotations

from typing import Iterator, Sequence

from lmcache_mp.storage.eviction.base import EvictionPolicy
from lmcache_mp.storage.index import Lru


class LruPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self):
        super().__init__()
        self._list = Lru()

    def admit(self, objs: Sequence, lead=None, last: bool = True) -> None:
        self.resident += len(objs)
        anchor = objs[0].prev if objs else None
        if anchor is not None and anchor.newer is not None:
            for obj in objs:
                self._list.insert_before(anchor, obj)
                anchor = obj
        else:
            for obj in reversed(objs):
                self._list.to_newest(obj)

    def park(self, obj) -> None:
        self._list.to_newest(obj)

    def unpark(self, obj) -> None:
        self._list.remove(obj)

    def order(self) -> Iterator:
        return self._list.oldest()

    def __len__(self) -> int:
        return len(self._list)
