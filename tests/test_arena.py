import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_mp.native import HostArena

MiB = 1 << 20


def test_exhaustion_and_reuse():
    a = HostArena(4 * MiB, MiB)
    c = a.size_class(300 * 1024)  # slot 300 KiB -> 3 per slab
    offs = [a.allocate(c) for _ in range(12)]
    assert all(o >= 0 for o in offs) and len(set(offs)) == 12
    assert a.allocate(c) == -1  # full
    a.free(offs[5])
    assert a.allocate(c) == offs[5]  # the freed slot is reused
    for o in offs:
        a.free(o)
    assert a.stats()["free_slabs"] == 4 and a.stats()["objects"] == 0


def test_empty_slabs_return_to_the_pool_for_other_classes():
    a = HostArena(2 * MiB, MiB)
    small, big = a.size_class(100 * 1024), a.size_class(MiB)
    s = [a.allocate(small) for _ in range(20)]
    assert all(o >= 0 for o in s)
    assert a.allocate(big) == -1  # both slabs hold small objects
    for o in s[:10]:
        a.free(o)
    assert a.allocate(big) >= 0  # one slab emptied and went back


def test_objects_are_aligned_and_disjoint_and_writable():
    a = HostArena(8 * MiB, 2 * MiB)
    c = a.size_class(12345)
    slot = a.slot_bytes(c)
    assert slot >= 12345 and slot % 256 == 0
    offs = sorted(a.allocate(c) for _ in range(100))
    assert all(o % 256 == 0 for o in offs)
    assert all(b - a_ >= slot for a_, b in zip(offs, offs[1:]))
    for i, o in enumerate(offs):
        np.frombuffer(a.view(o, 12345), dtype=np.uint8)[:] = i % 251
    for i, o in enumerate(offs):
        assert (np.frombuffer(a.view(o, 12345), dtype=np.uint8) == i % 251).all()


def test_bad_frees_and_sizes_raise():
    a = HostArena(2 * MiB, MiB)
    c = a.size_class(4096)
    o = a.allocate(c)
    with pytest.raises(ValueError, match="not the start"):
        a.free(o + 256)
    a.free(o)
    with pytest.raises(ValueError, match="already freed|not an allocated"):
        a.free(o)
    with pytest.raises(ValueError, match="outside"):
        a.free(10 * MiB)
    with pytest.raises(ValueError, match="does not fit in a slab"):
        a.size_class(2 * MiB)
    with pytest.raises(ValueError, match="smaller than one slab"):
        HostArena(MiB // 2, MiB)


def test_arena_memory_is_shared_memory_another_process_can_map():
    import os

    a = HostArena(2 * MiB, MiB)
    c = a.size_class(4096)
    o = a.allocate(c)
    np.frombuffer(a.view(o, 4096), dtype=np.uint8)[:] = 7
    with open(f"/proc/{os.getpid()}/fd/{a.fd}", "rb") as f:  # what another process would open
        f.seek(o)
        assert f.read(4096) == b"\x07" * 4096


def test_concurrent_allocate_and_free():
    a = HostArena(16 * MiB, MiB)
    c = a.size_class(64 * 1024)  # 16 slots per slab, 256 in all
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        mine = []
        try:
            for _ in range(3000):
                if mine and rng.random() < 0.5:
                    a.free(mine.pop(rng.integers(len(mine))))
                else:
                    o = a.allocate(c)
                    if o >= 0:
                        mine.append(o)
            for o in mine:
                a.free(o)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    st_ = a.stats()
    assert st_["objects"] == 0 and st_["bytes_allocated"] == 0 and st_["free_slabs"] == 16


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["alloc", "free"]), st.integers(0, 2), st.integers(0, 10**6)),
                    max_size=200))
def test_allocator_against_a_model(ops):
    """No two live objects overlap; frees of live objects always succeed; usage adds up."""
    a = HostArena(4 * MiB, MiB)
    classes = [a.size_class(s) for s in (1000, 70 * 1024, 300 * 1024)]
    live: dict[int, int] = {}  # offset -> slot bytes
    for op, k, pick in ops:
        if op == "alloc":
            o = a.allocate(classes[k])
            if o >= 0:
                size = a.slot_bytes(classes[k])
                for lo, sz in live.items():
                    assert o + size <= lo or lo + sz <= o, "overlapping objects"
                live[o] = size
        elif live:
            o = sorted(live)[pick % len(live)]
            a.free(o)
            del live[o]
        assert a.stats()["bytes_allocated"] == sum(live.values())
