"""The containers of L1's index, built so that no single insert or delete does O(objects) work.

A CPython dict rebuilds its whole table in one go when it grows, and also every so often at a
steady size: deletes leave holes that only a rebuild reclaims. Under the L1 lock, with the GIL
held, a rebuild of a million-entry index stalled one 16-chunk store for up to 278 ms on a 2-core
machine, and every other request waited. So:

- `Shards` (bytes keys) and `OffsetShards` (integers) are dicts in SHARDS parts chosen by the
  key's hash: a rebuild touches one part.
- `Lru` is a doubly linked list threaded through the objects themselves (`older`/`newer`
  slots): parking, unparking and moving to the newest end are O(1) pointer updates, never a
  rebuild.
"""

from __future__ import annotations

from typing import Iterator

SHARDS = 64
PART_MASK = SHARDS - 1  # hash & PART_MASK: the part of a key
_EMPTY: dict = {}  # a part nothing was put in yet (never written)
_GOLDEN = 0x9E3779B97F4A7C15  # Fibonacci hashing: spreads aligned integers (arena offsets)


def spread(key: int) -> int:
    """The part of an integer key (its hash is itself, and offsets share their low bits)."""
    return (key * _GOLDEN >> 58) & PART_MASK


class Shards:
    """A mapping of bytes keys in SHARDS dicts, by hash(key): chunk digests are uniform, and
    bytes hashes are keyed per process, so a client cannot pile its keys into one part. Parts
    are made on first use: an index of a few objects costs one list, not SHARDS tables."""

    __slots__ = ("parts", "_len")

    def __init__(self):
        self.parts: list[dict] = [_EMPTY] * SHARDS
        self._len = 0

    def get(self, key, default=None):
        return self.parts[hash(key) & PART_MASK].get(key, default)

    def __setitem__(self, key, value) -> None:
        i = hash(key) & PART_MASK
        part = self.parts[i]
        if part is _EMPTY:
            part = self.parts[i] = {}
        if key not in part:
            self._len += 1
        part[key] = value

    def remove(self, key, value) -> bool:
        """Delete key if it maps to value; True if it did."""
        part = self.parts[hash(key) & PART_MASK]
        if part.get(key, _EMPTY) is not value:  # (_EMPTY: never a value)
            return False
        del part[key]
        self._len -= 1
        return True

    def __len__(self) -> int:
        return self._len

    def values(self) -> Iterator:
        for part in self.parts:
            yield from part.values()


class OffsetShards:
    """The same for integer keys (arena offsets), parted by spread(key), written out inline (a
    call per chunk costs on the store path); its length is counted when asked (rarely: status)."""

    __slots__ = ("parts",)

    def __init__(self):
        self.parts: list[dict] = [{} for _ in range(SHARDS)]

    def __setitem__(self, key: int, value) -> None:
        self.parts[(key * _GOLDEN >> 58) & PART_MASK][key] = value

    def __getitem__(self, key: int):
        return self.parts[(key * _GOLDEN >> 58) & PART_MASK][key]

    def get(self, key: int, default=None):
        return self.parts[(key * _GOLDEN >> 58) & PART_MASK].get(key, default)

    def __delitem__(self, key: int) -> None:
        del self.parts[(key * _GOLDEN >> 58) & PART_MASK][key]

    def __len__(self) -> int:
        return sum(map(len, self.parts))

    def values(self) -> Iterator:
        for part in self.parts:
            yield from part.values()


class Lru:
    """Objects with `older` and `newer` slots, least recently used first. An object is in the
    list exactly when its `newer` is not None."""

    __slots__ = ("_end", "_len")

    def __init__(self):
        self._end = _End()  # the sentinel: _end.newer is the oldest, _end.older the newest
        self._end.older = self._end.newer = self._end
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, obj) -> bool:
        return obj.newer is not None

    def to_newest(self, obj) -> None:
        """Put obj at the newest end, or move it there."""
        end = self._end
        if obj.newer is not None:
            if obj.newer is end:
                return
            obj.older.newer, obj.newer.older = obj.newer, obj.older
        else:
            self._len += 1
        last = end.older
        obj.older, obj.newer = last, end
        last.newer = end.older = obj

    def to_oldest(self, obj) -> None:
        """Put obj (not in the list) at the oldest end."""
        end = self._end
        first = end.newer
        obj.older, obj.newer = end, first
        first.older = end.newer = obj
        self._len += 1

    def insert_before(self, anchor, obj) -> None:
        """Put obj (not in the list) just older than anchor (in the list)."""
        older = anchor.older
        obj.older, obj.newer = older, anchor
        older.newer = anchor.older = obj
        self._len += 1

    def remove(self, obj) -> None:
        """Take obj out of the list (no-op if it is not in it)."""
        if obj.newer is None:
            return
        obj.older.newer, obj.newer.older = obj.newer, obj.older
        obj.older = obj.newer = None
        self._len -= 1

    def first(self, skip) -> object | None:
        """The oldest object for which skip(obj) is false, or None."""
        end = self._end
        obj = end.newer
        while obj is not end:
            if not skip(obj):
                return obj
            obj = obj.newer
        return None

    def oldest(self) -> Iterator:
        """Oldest first. The caller may remove the object it was just given, no other one, before
        asking for the next (to free many: collect them first, as islice into a list does)."""
        end = self._end
        obj = end.newer
        while obj is not end:
            nxt = obj.newer
            yield obj
            obj = nxt

    def take_all(self, other: "Lru") -> None:
        """Move every object of other to this list's newest end, in their order: O(1)."""
        if not other._len:
            return
        src, end = other._end, self._end
        first, last = src.newer, src.older
        newest = end.older
        newest.newer, first.older = first, newest
        last.newer, end.older = end, last
        self._len += other._len
        src.older = src.newer = src
        other._len = 0


class _End:
    __slots__ = ("older", "newer")
