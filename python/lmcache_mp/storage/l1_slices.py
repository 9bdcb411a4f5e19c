"""The tp-shared objects of L1 that are still being filled (a part L1Store owns, built from L1's
lock, clock and counters, and what abandoning an object means to L1).

A tp-shared object holds one chunk for every rank of any TP size; each rank stores its slice (the
heads `cover`, of `heads_full`). Several stores fill one object: a store writes its heads unless
another writes or wrote any of them, and the object is committed once every head has landed.
One whose other slices never come is dropped once none is being written and none landed for
`ttl` seconds (drop()); its slices are never served.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from lmcache_mp.storage.objects import L1Object

logger = logging.getLogger(__name__)


class TpSharedSlices:
    def __init__(self, lock: threading.Lock, clock: Callable[[], float], counters: dict,
                 abandon: Callable[[L1Object], list]):
        """counters: L1's (drops are counted there); abandon(obj): (lock held) obj's store is
        abandoned and obj leaves L1; returns the waiters to tell."""
        self._lock = lock
        self._clock = clock
        self.counters = counters
        self._abandon = abandon
        self._filling: set[L1Object] = set()  # some slices have not landed
        self.ttl = 10.0

    # ---- with L1's lock held ------------------------------------------------------------------

    def opened(self, obj: L1Object, cover: int, full: int) -> None:
        """A new object, of which a store writes the heads `cover`."""
        obj.heads_full, obj.heads_writing, obj.touched = full, cover, self._clock()
        self._filling.add(obj)

    def join(self, obj: L1Object, cover: int) -> bool:
        """Whether a store writes the heads `cover` into obj (False: another writes or wrote
        one of them, and the chunk counts as present)."""
        if (obj.heads_landed | obj.heads_writing) & cover:
            return False
        obj.heads_writing |= cover
        obj.touched = self._clock()
        return True

    def abandoned(self, obj: L1Object, cover: int) -> bool:
        """A store of the heads `cover` failed: whether obj goes (no other slice is left)."""
        obj.heads_writing &= ~cover
        return not (obj.heads_landed or obj.heads_writing)

    def discard(self, obj: L1Object) -> None:
        """obj left L1."""
        self._filling.discard(obj)

    # ---- taking L1's lock ---------------------------------------------------------------------

    def land(self, objs: list[L1Object], cover: int) -> list[L1Object]:
        """A store's heads `cover` landed: the objects it completes (the rest wait for theirs)."""
        done = []
        with self._lock:
            now = self._clock()
            for obj in objs:
                obj.heads_writing &= ~cover
                obj.heads_landed |= cover
                obj.touched = now
                if obj.heads_landed == obj.heads_full and not obj.heads_writing:
                    self._filling.discard(obj)
                    done.append(obj)
        return done

    def drop(self, now: float | None = None) -> int:
        """Drop objects whose other slices never came: none written now, none landed for ttl
        seconds. Their slices are never served; returns how many went."""
        waiters = []
        with self._lock:
            cutoff = (self._clock() if now is None else now) - self.ttl
            stale = [o for o in self._filling if not o.heads_writing and o.touched <= cutoff]
            for obj in stale:
                waiters += self._abandon(obj)
            self.counters["partial_dropped"] += len(stale)
        for fn in waiters:
            fn(False)
        if stale:
            logger.info("dropped %d tp-shared chunks whose other ranks' slices never came", len(stale))
        return len(stale)
