"""S3-FIFO (Yang et al., SOSP '23): new objects enter a small FIFO (10 % of the objects held);
one that leaves it having been used again moves to the main FIFO, else its key goes to a ghost
FIFO (as many keys as objects held). A key found among the ghosts enters the main FIFO directly.
Main re-inserts an object with uses left (2 bits: at most 3), taking one, and evicts one with none.

Held objects (read, leased) are in neither FIFO meanwhile and come back at the tail of theirs."""

from __future__ import annotations

import itertools
from typing import Iterator, Sequence

from lmcache_mp.storage.eviction.base import GHOST_BYTES, EvictionPolicy, Ghosts
from lmcache_mp.storage.index import Lru

SMALL, MAIN = 1, 2
SMALL_SHARE = 0.1
MAX_FREQ = 3


class S3FifoPolicy(EvictionPolicy):
    name = "s3fifo"

    def __init__(self):
        super().__init__()
        self._q = {SMALL: Lru(), MAIN: Lru()}
        self._ghosts = Ghosts()

    def admit(self, objs: Sequence, lead=None, last: bool = True) -> None:
        self.resident += len(objs)
        for obj in reversed(objs):
            obj.queue = MAIN if self._ghosts.pop(obj.key) is not None else SMALL
            obj.freq = 0
            self._q[obj.queue].to_newest(obj)

    def use(self, obj) -> None:
        if obj.freq < MAX_FREQ:
            obj.freq += 1

    def park(self, obj) -> None:
        if obj.newer is None:  # (a parked object keeps its place: FIFO)
            self._q[obj.queue].to_newest(obj)

    def unpark(self, obj) -> None:
        if obj.newer is not None:
            self._q[obj.queue].remove(obj)

    def evicted(self, obj) -> None:
        if obj.queue == SMALL:
            self._ghosts.add(obj.key, 0, max(1, self.resident))

    def candidates(self) -> Iterator:
        """Small's head while small holds its share (those used again move to main), then main's
        (those with uses left go round again, one use fewer)."""
        small, main = self._q[SMALL], self._q[MAIN]
        if len(small) >= SMALL_SHARE * self.resident or not len(main):
            for obj in small.oldest():
                if obj.freq:
                    small.remove(obj)
                    obj.queue, obj.freq = MAIN, 0
                    main.to_newest(obj)
                else:
                    yield obj
        for _ in range(MAX_FREQ + 1):  # every pass takes a use from each object it passes over
            passed = 0
            for obj in main.oldest():
                if obj.freq:
                    obj.freq -= 1
                    main.to_newest(obj)
                    passed += 1
                    if passed >= len(main):
                        break
                else:
                    yield obj
        yield from small.oldest()

    def order(self) -> Iterator:
        return itertools.chain(self._q[SMALL].oldest(), self._q[MAIN].oldest())

    def __len__(self) -> int:
        return len(self._q[SMALL]) + len(self._q[MAIN])

    def stats(self) -> dict:
        return {"policy": self.name, "history_keys": len(self._ghosts),
                "history_bytes": len(self._ghosts) * GHOST_BYTES,
                "small": len(self._q[SMALL]), "main": len(self._q[MAIN])}
