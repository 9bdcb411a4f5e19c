"""What L1 does for the application's hints (server/hints.py; a part L1Store owns, built from
L1's lock, index and eviction policy, and what parking, freeing and pausing mean to L1): find a
prompt's objects without using them, count uses of them (a pin or a priority), and free them
(a drop, or a demote once L2 holds them). Each method takes L1's lock and works in slices of at
most SLICE objects."""

from __future__ import annotations

import threading
from typing import Callable, Sequence

from lmcache_mp.storage.eviction.base import EvictionPolicy
from lmcache_mp.storage.index import PART_MASK
from lmcache_mp.storage.l1_index import SLICE, L1Index
from lmcache_mp.storage.objects import L1Object


class L1Hints:
    def __init__(self, lock: threading.Lock, index: L1Index, policy: EvictionPolicy, pause: Callable[[], None],
                 park: Callable[[L1Object], None], evictable: Callable[[L1Object], bool],
                 free: Callable[[L1Object], None]):
        """pause(): let a waiting thread take the lock; park(obj): obj may be evicted again if
        nothing holds it; evictable(obj): nothing holds it; free(obj): it leaves L1."""
        self._lock = lock
        self._index = index
        self._policy = policy
        self._pause = pause
        self._park = park
        self._evictable = evictable
        self._free = free

    def prefix_objects(self, model: str, world_size: int, digests: Sequence[bytes], salt: bytes = b"",
                       tp_shared: bool = False) -> tuple[int, list[L1Object]]:
        """(leading chunks present for every rank or shared, their objects in prefix order);
        nothing is leased, used or counted: the caller names the objects again to act on them.
        tp_shared: of tp-shared chunks (as lookup)."""
        out: list[L1Object] = []
        chunks = 0
        with self._lock:
            shared, ranks = self._index.namespace(model, world_size, salt, tp_shared)
            for i, digest in enumerate(digests):
                if i and i % SLICE == 0:
                    self._pause()
                    shared, ranks = self._index.namespace(model, world_size, salt, tp_shared)
                found = self._index.found(shared, ranks, hash(digest) & PART_MASK, digest, world_size)
                if not found:
                    break
                chunks += 1
                out.extend(obj for obj, _ in found)
        return chunks, out

    def retain(self, objs: Sequence[L1Object], uses: int) -> int:
        """Count `uses` more uses of each object still held with the eviction policy, as reads
        would (nothing is read or leased); returns how many objects."""
        n = 0
        with self._lock:
            for i, obj in enumerate(objs):
                if i and i % SLICE == 0:
                    self._pause()
                if self._index.get(obj.key) is not obj or not obj.committed:
                    continue
                self._policy.unpark(obj)
                for _ in range(uses):
                    self._policy.use(obj)
                self._park(obj)
                n += 1
        return n

    def drop_objects(self, objs: Sequence[L1Object], written_only: bool = False) -> tuple[int, int]:
        """Free these objects, deepest first, where nothing holds them (no read, lease, store,
        move or L2 write); written_only: only those an L2 tier holds a copy of. Returns (objects
        freed, their bytes)."""
        freed = nbytes = 0
        with self._lock:
            for i, obj in enumerate(reversed(objs)):
                if i and i % SLICE == 0:
                    self._pause()
                if self._index.get(obj.key) is not obj or not self._evictable(obj) or (written_only and not obj.l2_copies):
                    continue
                self._free(obj)
                freed += 1
                nbytes += obj.nbytes
        return freed, nbytes