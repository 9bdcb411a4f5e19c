"""The containers of L1's index (storage/index.py): a dict in parts, and an LRU list threaded
through the objects. L1's own tests (test_l1_store, test_l1_sizes) use them through L1Store;
these pin down their contracts."""

from __future__ import annotations

import os
import random

from lmcache_mp.storage.index import SHARDS, Lru, OffsetShards, Shards, spread


class Obj:
    __slots__ = ("name", "older", "newer")

    def __init__(self, name):
        self.name = name
        self.older = self.newer = None


def test_shards_behave_as_a_dict_for_bytes_and_integer_keys():
    rng = random.Random(1)
    for shards, make in ((Shards(), lambda: os.urandom(16)), (OffsetShards(), lambda: rng.randrange(1 << 40) * 4096)):
        ref = {}
        keys = [make() for _ in range(5000)]
        for i, k in enumerate(keys):
            shards[k] = ref[k] = i
        for k in keys[:100]:
            shards[k] = ref[k] = -1  # an overwrite is not a new entry
        for k in keys[::3]:
            if isinstance(shards, Shards):
                assert not shards.remove(k, "another value") and shards.remove(k, ref[k])
            else:
                del shards[k]
            del ref[k]
        assert len(shards) == len(ref)
        assert sorted(shards.values()) == sorted(ref.values())
        for k in keys:
            if k in ref:
                assert shards[k] == ref[k] if isinstance(shards, OffsetShards) else shards.get(k) == ref[k]
            elif isinstance(shards, Shards):
                assert shards.get(k, "absent") == "absent" and not shards.remove(k, None)


def test_aligned_integer_keys_spread_over_every_part():
    """Arena offsets are multiples of large powers of two: they must not share one part."""
    for align in (256, 1 << 20, 1 << 25):
        used = {spread(i * align) for i in range(4096)}
        assert len(used) == SHARDS, (align, len(used))


def test_an_index_of_few_objects_makes_few_tables():
    shards = Shards()
    assert len({id(p) for p in shards.parts}) == 1  # one shared empty table until written
    shards[b"k"] = 1
    assert len({id(p) for p in shards.parts}) == 2
    assert shards.remove(b"k", 1)
    assert not shards and shards.get(b"k") is None


def test_lru_keeps_use_order_and_moves_in_place():
    lru = Lru()
    objs = [Obj(i) for i in range(6)]
    for o in objs:
        lru.to_newest(o)
    lru.to_newest(objs[2])  # used again
    lru.to_newest(objs[5])  # already the newest: stays
    lru.remove(objs[0])
    lru.remove(objs[0])  # not in it: no-op
    assert [o.name for o in lru.oldest()] == [1, 3, 4, 2, 5]
    assert len(lru) == 5 and objs[1] in lru and objs[0] not in lru
    assert objs[0].older is None and objs[0].newer is None  # nothing kept alive by the list


def test_lru_iteration_allows_removing_the_object_just_given():
    lru = Lru()
    objs = [Obj(i) for i in range(5)]
    for o in objs:
        lru.to_newest(o)
    seen = []
    for o in lru.oldest():
        seen.append(o.name)
        if o.name % 2 == 0:
            lru.remove(o)
    assert seen == [0, 1, 2, 3, 4]
    assert [o.name for o in lru.oldest()] == [1, 3] and len(lru) == 2
    for o in list(lru.oldest()):
        lru.remove(o)
    assert len(lru) == 0 and list(lru.oldest()) == []


def test_lru_matches_a_reference_under_random_operations():
    rng = random.Random(7)
    lru, ref = Lru(), []
    objs = [Obj(i) for i in range(50)]
    for _ in range(5000):
        o = rng.choice(objs)
        if rng.random() < 0.7:
            lru.to_newest(o)
            if o in ref:
                ref.remove(o)
            ref.append(o)
        else:
            lru.remove(o)
            if o in ref:
                ref.remove(o)
        assert len(lru) == len(ref)
    assert list(lru.oldest()) == ref
