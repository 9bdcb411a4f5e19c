"""How L1 memory moves between object sizes (a part L1Store owns, built from L1's arena, lock and
index, the victim chooser and what evicting or moving an object means to L1).

Objects stay contiguous and inside one pinned slab (one DMA per chunk, no
re-pinning), so the arena hands out same-size slots from slabs of one size each (O(log slabs),
no fragmentation inside a size). A size that needs memory when none is free evicts LRU victims
until either its own slot frees, or another size holds a slab's worth of free slots: then that
size's emptiest slab is drained, its live objects are *moved* (a memcpy inside the arena, done
without the lock) into the size's other free slots, and the empty slab changes size. Moving
instead of evicting the slab's objects means nothing newer than an LRU victim is ever dropped;
the price is memory held idle as free slots, less than one slab per size (see `size_stats`).
Segregated slabs were chosen over one extent or buddy allocator because those need contiguous
holes, which LRU order does not produce without evicting hot neighbours.

Bound: while nothing in them is being read or written, every size holds fewer than one slab of
free slots (a slab's worth is what makes it give one up), plus slot rounding and slab tails:
`size_stats` shows all three per size, and tests/test_l1_sizes.py checks the bound against a
plain LRU by bytes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from lmcache_mp.storage.l1_index import L1Index
from lmcache_mp.storage.objects import L1Object
from lmcache_mp.storage.eviction.chooser import VictimChooser
from lmcache_mp.storage.eviction.quotas import PRESSURE

if TYPE_CHECKING:
    from lmcache_mp.native import HostArena

MAX_MOVES = 3  # slab moves one allocation may try (a move is abandoned when a reader arrives)


@dataclass
class SlabMove:
    """Objects of a draining slab and the free slots of their size they are copied to."""

    slab: int
    objects: list  # the L1Objects of the slab
    dst: list[int]
    nbytes: int


class SlabMoves:
    """Allocation across sizes for L1Store; every method but size_stats runs with L1's lock held."""

    def __init__(self, arena: HostArena, lock: threading.Lock, index: L1Index, chooser: VictimChooser,
                 evict: Callable[[L1Object, str], None], moved: Callable[[L1Object, int], None], counters: dict, evicted: dict[int, int]):
        """chooser: L1's victims (storage/eviction/chooser.py); evict(victim, cause): it leaves L1;
        moved(obj, old offset): obj's bytes were copied to its new slot (obj.offset); counters:
        L1's, where moves are counted; evicted: objects evicted per size class (L1 counts them)."""
        self.arena = arena
        self._lock = lock
        self._index = index
        self._chooser = chooser
        self._evict = evict
        self._moved = moved
        self.counters = counters
        self._evicted = evicted

    def allocate(self, cls: int, may_move: bool, owner: int = -1) -> int | SlabMove:
        """A slot of class cls: its offset, -1 when nothing evictable is left, or a slab move
        the caller runs without the lock (then asks again). owner: the tenant storing (Quotas):
        past its l1_max it evicts its own objects first; it never evicts another's below l1_min."""
        donors = None  # listed only when the arena has no free slot of cls (not the usual case)
        while True:
            if owner >= 0 and not self._chooser.fit_cap(owner, self.arena.slot_bytes(cls), self._evict):
                return -1
            off = self.arena.allocate(cls)
            if off >= 0:
                return off
            if donors is None:
                donors = [c for c in range(self.arena.num_classes) if c != cls]
            for donor in donors if may_move else ():
                move = self._plan(donor)
                if move is not None:
                    return move
            victim = self._chooser.victim(owner)
            if victim is None or (not may_move and victim.size_class != cls):
                return -1  # nothing to evict, or only victims whose memory could not reach cls
            self._evict(victim, PRESSURE)
            donors = [victim.size_class] if victim.size_class != cls else []

    def _plan(self, cls: int) -> SlabMove | None:
        """When class cls holds a slab's worth of free slots, drain its emptiest slab whose
        objects may move (committed, not being read), reserving the slots they go to."""
        if self.arena.free_slots(cls) < self.arena.slots_per_slab(cls):
            return None
        for slab in self.arena.drain_candidates(cls, 4):
            objs = [self._index.at[off] for off in self.arena.slab_objects(slab)]
            if any(o.moving or o.readers or o.l2_writing or not o.committed for o in objs):
                continue
            self.arena.drain(slab)
            dst = [self.arena.allocate(cls) for _ in objs]  # never the draining slab
            if min(dst, default=0) < 0:  # cannot happen with the free count above; stay safe
                for off in dst:
                    if off >= 0:
                        self.arena.free(off)
                self.arena.undrain(slab)
                return None
            for o in objs:
                o.moving = True
            return SlabMove(slab, objs, dst, objs[0].nbytes)
        return None

    def _finish(self, move: SlabMove, copied: bool) -> None:
        """Point each object at its copy and free its old slot, unless a reader arrived during
        the copy (it reads the old slot, which therefore stays)."""
        for obj, dst in zip(move.objects, move.dst):
            obj.moving = False
            if copied and obj.readers == 0:
                old = obj.offset
                obj.offset = dst
                self._index.moved(obj, old)
                self._moved(obj, old)
                self.arena.free(old)
                self.counters["moved"] += 1
            else:
                self.arena.free(dst)
        self.arena.undrain(move.slab)  # no-op once the slab emptied and went back to the pool
        self.counters["slab_moves"] += 1

    def run(self, move: SlabMove) -> None:
        """Copy the objects of a draining slab with the lock released (called with it held)."""
        copied = False
        self._lock.release()
        try:
            self.arena.move_objects([o.offset for o in move.objects], move.dst, move.nbytes)
            copied = True
        finally:
            self._lock.acquire()
            self._finish(move, copied)

    def size_stats(self) -> list[dict]:
        """Per object size: slabs held, objects, and where the held bytes go. bytes_free are free
        slots only this size can use (fewer than one slab's worth, except while a slab cannot
        move because an object in it is being read or written); bytes_fragmented is slot
        rounding (< 256 B per object) and slab tails (< one slot per slab)."""
        slab = self.arena.slab_bytes
        with self._lock:
            evicted = dict(self._evicted)
        out = []
        for cls, c in enumerate(self.arena.class_stats()):
            held = c["slabs"] * slab
            used = c["objects"] * c["object_bytes"]
            free = c["free_slots"] * c["slot_bytes"]
            out.append({"object_bytes": c["object_bytes"], "slot_bytes": c["slot_bytes"],
                        "slots_per_slab": c["slots_per_slab"], "slabs": c["slabs"], "objects": c["objects"],
                        "bytes_used": used, "bytes_free": free, "bytes_fragmented": held - used - free,
                        "evicted": evicted.get(cls, 0)})
        return out
