"""Where L1 finds its objects: by key, one index per namespace (model, world size, rank, salt),
and by arena offset. The containers are storage/index.py's; L1's lock is held around every call."""

from __future__ import annotations

from lmcache_mp.storage.index import PART_MASK, OffsetShards, Shards
from lmcache_mp.storage.objects import SHARED_RANK, TP_SHARED_WORLD, L1Object, ObjectKey

SLICE = 256  # keys (lookups: key visits x ranks) per hold of L1's lock

_NO_SPACE = Shards()  # the index of a namespace with no objects (never written)
EMPTY = _NO_SPACE.parts  # the parts of a namespace with no objects


def space_of(key: ObjectKey) -> tuple:
    return (key.model, key.world_size, key.rank, key.salt)


class L1Index:
    def __init__(self):
        # (model, world_size, rank, salt) -> digest -> object: a lookup walks one index per rank
        self.spaces: dict[tuple, Shards] = {}
        self.at = OffsetShards()  # arena offset -> object

    def get(self, key: ObjectKey) -> L1Object | None:
        space = self.spaces.get(space_of(key))  # (a namespace's index goes when it empties)
        return None if space is None else space.parts[hash(key.digest) & PART_MASK].get(key.digest)

    def put(self, obj: L1Object) -> None:
        space = self.spaces.get(space_of(obj.key))
        if space is None:
            space = self.spaces[space_of(obj.key)] = Shards()
        space[obj.key.digest] = obj
        self.at[obj.offset] = obj

    def remove(self, obj: L1Object) -> None:
        space = self.spaces.get(space_of(obj.key))
        if space is not None and space.remove(obj.key.digest, obj) and not space:
            del self.spaces[space_of(obj.key)]
        del self.at[obj.offset]

    def moved(self, obj: L1Object, old: int) -> None:
        """obj's bytes are at obj.offset now, no longer at old."""
        del self.at[old]
        self.at[obj.offset] = obj

    def parts_of(self, space: tuple) -> list:
        index = self.spaces.get(space)
        return EMPTY if index is None else index.parts

    def namespace(self, model: str, world_size: int, salt: bytes, tp_shared: bool = False) -> tuple[list, list[list]]:
        """The index parts of a namespace: its objects shared by every rank, and each rank's
        (tp_shared: its tp-shared objects, which every rank of any TP size reads, and no rank's)."""
        if tp_shared:
            return self.parts_of((model, TP_SHARED_WORLD, SHARED_RANK, salt)), []
        return (self.parts_of((model, world_size, SHARED_RANK, salt)),
                [self.parts_of((model, world_size, r, salt)) for r in range(world_size)])

    @staticmethod
    def found(shared: list, ranks: list[list], part: int, digest: bytes, world_size: int) -> list:
        """[(object, ranks it serves)] of a chunk present for every rank, else []."""
        obj = shared[part].get(digest)
        if obj is not None and obj.committed:
            return [(obj, world_size)]
        found = []
        for space in ranks:
            obj = space[part].get(digest)
            if obj is None or not obj.committed:
                return []
            found.append((obj, 1))
        return found
