"""How L1 hands its chunks to the L2 tiers' writers and tells eviction which objects are dirty (a
part L1Store owns, built from L1's arena, lock, index and eviction policy).

Each L2 tier that takes writes has a bit (1 << its index). An object records the tiers that hold
a copy of it (`l2_copies`) and those writing it now (`l2_writing`: the tier reads its bytes, so
it is neither freed nor moved meanwhile). It is *dirty* for a tier that takes writes once it was
used (stored, looked up) `l2_admit` times, while that tier has no copy and its prefix is not lost
there (below).

Whole prefixes. A lookup in L2 is a prefix lookup: chunk k+1 is worth nothing there without
chunk k. Each object remembers the object of the chunk before it in the store that made it
(`prev`; a store that names chunks already present links them too). A writer writes an object's
unwritten predecessors first, in order, and never an object whose prefix is *lost* for its tier:
some predecessor left L1 (or failed its write) without reaching that tier (`l2_lost`, set as it
leaves). So a write that is dropped drops the rest of that prompt with it and leaves no fragment
behind. A store that names only the new chunks of a prompt says which chunk comes before its
first (`parent`: an engine storing as the prompt grows); that object is the first one's `prev`,
whether L1 still holds it or it left lately (the last DEPARTED are remembered, with the tiers that
got them). An object that leaves L1 lets go of its `prev` (every walk back stops at it: each tier
has a copy of it or lost it), so the chains of long conversations hold no dead objects.

Eviction (storage/eviction/chooser.py, told `dirty`). The victim is the least recently used
evictable object, except that among the oldest EVICTION_WINDOW ones a clean object (nothing left
to write: written, not admitted, or lost anyway) goes before a dirty one. Only when the window
holds no clean object does a dirty one leave L1 unwritten: a dropped write, counted per tier
(`on_l2_drop`), and the chunks after it in its prompt are then lost too (counted when they leave).

Writers (`l2_take`), while less than `below` bytes of L1 are free: the dirty objects from the
eviction end on, oldest first, as far as `scan` objects reach, and the whole of a prompt a batch
begins; a write-through tier also those its list of fresh objects names (`on_l2_dirty` fills it).
Writing ahead of eviction this way, while the tier keeps up, means eviction finds clean victims
and drops nothing; a write-back tier's spare bandwidth goes to the chunks nearest eviction first.
"""

from __future__ import annotations

import collections
import threading
from typing import TYPE_CHECKING, Callable

from lmcache_mp.storage.eviction.base import EvictionPolicy
from lmcache_mp.storage.l1_index import L1Index

if TYPE_CHECKING:
    from lmcache_mp.native import HostArena

MAX_CHAIN = 64  # predecessors followed (a longer unwritten run is written from there on)
SCAN = 1024  # objects a write-back pass looks at, at most (under the lock: a bounded walk)
DEPARTED = 16384  # objects that left L1 lately, kept for the stores that name them as parent


def busy(obj) -> bool:
    """Not a victim now: being moved, or an L2 write has yet to read it."""
    return obj.moving or obj.l2_writing


class L1Writeback:
    """L1's side of the L2 writes; methods with a leading underscore, and those L1Store calls
    from its own locked sections (missing, dirty, evicting, leaving, parent, admitted),
    run with L1's lock held."""

    def __init__(self, arena: HostArena, lock: threading.Lock, index: L1Index, policy: EvictionPolicy):
        self.arena = arena
        self._lock = lock
        self._index = index
        self._policy = policy
        self.wanted = 0  # bits of the tiers that take writes (0: no L2 writes; eviction is plain LRU)
        self.admit = 1
        self.on_dirty: Callable | None = None  # (obj), lock held: obj was just admitted (a write-through list)
        self.on_drop: Callable | None = None  # (dropped bits, lost bits, objects), lock held: writes given up
        self.on_evict: Callable | None = None  # (), lock held: an allocation evicted (wakes the writers)
        self._departed: collections.OrderedDict | None = None  # key -> object that left L1 (with L2 writes only)

    def attach(self, wanted: int, admit: int, on_dirty: Callable | None, on_drop: Callable | None,
               on_evict: Callable | None) -> None:
        """The tiers that take writes (bits; 0: none), the admission count and the writers' hooks."""
        with self._lock:
            self.admit = admit
            self.on_dirty, self.on_drop, self.on_evict = on_dirty, on_drop, on_evict
            self.wanted = wanted
            self._departed = collections.OrderedDict() if wanted else None

    def missing(self, obj) -> int:
        """Tiers that should receive obj and neither have it nor are writing it."""
        if obj.uses < self.admit:
            return 0
        return self.wanted & ~(obj.l2_copies | obj.l2_writing | obj.l2_lost)

    def _lost_before(self, obj, bits: int) -> int:
        """Of these tiers, those where a predecessor of obj left L1 without reaching them."""
        lost = 0
        p = obj.prev
        for _ in range(MAX_CHAIN):
            if p is None or not bits:
                break
            have = p.l2_copies | p.l2_writing
            lost |= bits & p.l2_lost & ~have
            bits &= ~(have | p.l2_lost)
            p = p.prev
        return lost

    def dirty(self, obj) -> int:
        missing = self.missing(obj)
        return missing & ~self._lost_before(obj, missing) if missing else 0

    def evicting(self, victim) -> None:
        """victim leaves L1 for room (lock held, before it is freed): count the writes it drops."""
        if not self.wanted:
            return
        missing = self.missing(victim)
        if missing and self.on_drop is not None:
            lost = self._lost_before(victim, missing)
            self.on_drop(missing & ~lost, lost, 1)
        if self.on_evict is not None:
            self.on_evict()

    def leaving(self, obj) -> None:
        """obj leaves L1 (lock held): the tiers without a copy lose it, and the chunks after it.
        It is remembered a while: the next piece of its prompt may come after it left."""
        obj.l2_lost |= self.wanted & ~obj.l2_copies
        if obj.committed and self._departed is not None:
            self._departed[obj.key] = obj
            self._departed.move_to_end(obj.key)
            if len(self._departed) > DEPARTED:
                self._departed.popitem(last=False)

    def parent(self, key, format_key: tuple):
        """(lock held) The object a store names as its parent: in L1, or one that left it lately
        (its bits say which tiers got it); None when neither is known."""
        obj = self._index.get(key)
        if obj is None and self._departed is not None:
            obj = self._departed.get(key)
        if obj is None or obj.format_key != format_key or obj.aborted:
            return None
        return obj

    def admitted(self, obj) -> None:
        if obj.uses == self.admit and self.on_dirty is not None:
            self.on_dirty(obj)

    def flush_order(self) -> list:
        """Every object L1 holds, the most valuable first: those outside the eviction order (read
        or leased now), then the reverse of that order. What a stopping server writes to its
        write-back tiers (a writer skips what a tier has, and writes predecessors first)."""
        with self._lock:
            ordered = list(self._policy.order())
            seen = {id(o) for o in ordered}
            return [o for o in self._index.at.values() if id(o) not in seen] + ordered[::-1]

    def take(self, bit: int, below: int, max_bytes: int, fresh=None, scan: int = SCAN,
                dry: bool = False) -> list:
        """For the writer of tier `bit`: the dirty objects to write now, each after its unwritten
        predecessors, up to about max_bytes (more to finish a prompt), marked as being written
        there (dry: the first one found, unmarked). While less than `below` bytes are free, those
        among the `scan` least recently used; then those `fresh` (a deque, oldest first) names;
        one of those that cannot be written yet (a predecessor is still being stored or moved)
        goes back to it."""
        st = self.arena.stats()
        free = st["free_slabs"] * st["slab_bytes"]
        out: list = []
        size = 0
        with self._lock:
            if below > free:
                last = None
                for n, obj in enumerate(self._policy.order()):
                    if n >= scan or (dry and out):
                        break
                    # past the batch size, only the rest of the prompt last taken (within reason)
                    rest = last is not None and obj.prev is last and size < 2 * max_bytes
                    if size >= max_bytes and not rest:
                        break
                    got = self._claim(obj, bit, out, dry)
                    if got > 0:
                        size += got
                        last = obj
            if fresh:
                retry: list = []
                listed = iter(list(fresh)) if dry else None
                while size < max_bytes and not (dry and out):
                    if dry:
                        obj = next(listed, None)
                    else:
                        obj = fresh.popleft() if fresh else None
                    if obj is None:
                        break
                    got = self._claim(obj, bit, out, dry)
                    if got < 0:
                        retry.append(obj)
                    size += max(got, 0)
                if retry and not dry:
                    fresh.extendleft(reversed(retry))
        return out

    def _claim(self, obj, bit: int, out: list, dry: bool) -> int:
        """Add obj, after its unwritten predecessors, to out: their bytes; 0 if there is nothing
        to write, -1 if not now (a predecessor is still being stored or moved)."""
        if not self.missing(obj) & bit or self._index.get(obj.key) is not obj or not obj.committed:
            return 0
        if obj.moving:
            return -1
        chain = [obj]
        p = obj.prev
        for _ in range(MAX_CHAIN):
            # (a request that names a chunk twice, or a parent after its own chunks, links a
            # loop: its walk ends where it comes round)
            if p is None or (p.l2_copies | p.l2_writing) & bit or p in chain:  # (identity: eq=False)
                break
            if p.l2_lost & bit or self._index.get(p.key) is not p:  # its prefix is lost there
                if not dry:
                    for o in chain:
                        o.l2_lost |= bit
                    if self.on_drop is not None:
                        self.on_drop(0, bit, len(chain))
                return 0
            if not p.committed or p.moving:
                return -1
            chain.append(p)
            p = p.prev
        size = 0
        for o in reversed(chain):
            if not dry:
                o.l2_writing |= bit
            out.append(o)
            size += o.nbytes
        return size

    def written(self, bit: int, results) -> list:
        """Tier `bit` has read these objects' bytes: (object, ok) pairs, in the order l2_take
        gave them. A failed write is not tried again: the object and the chunks after it count as
        lost there. Returns the objects written after a predecessor whose write failed (a tier
        writes a batch in parallel): they count as lost there too, so that the rest of their
        prompt is not written after them."""
        fragments = []
        with self._lock:
            for obj, ok in results:
                obj.l2_writing &= ~bit
                p = obj.prev
                if ok and p is not None and p.l2_lost & bit and not p.l2_copies & bit:
                    ok = False
                    fragments.append(obj)
                if ok:
                    obj.l2_copies |= bit
                else:
                    obj.l2_lost |= bit
        return fragments
