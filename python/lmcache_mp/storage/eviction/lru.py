"""LRU: the least recently used object goes first. A lookup hit, a read and a store of a chunk
already held all make it the most recent; a request's deeper chunks are older than its shallower
ones, so a prompt is evicted from its end."""

from __future__ import annotations

from typing import Iterator, Sequence

from lmcache_mp.storage.eviction.base import EvictionPolicy
from lmcache_mp.storage.index import Lru


class LruPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self):
        super().__init__()
        self._list = Lru()

    def admit(self, objs: Sequence) -> None:
        self.resident += len(objs)
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
