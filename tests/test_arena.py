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


def test_allocation_fills_the_fullest_slab_so_emptier_ones_drain():
    a = HostArena(4 * MiB, MiB)
    c = a.size_class(256 * 1024)  # 4 slots per slab
    offs = [a.allocate(c) for _ in range(12)]  # three full slabs
    slab = lambda o: o // MiB  # noqa: E731
    a.free(offs[0])  # slab 0: 3 objects
    for o in offs[4:7]:
        a.free(o)  # slab 1: 1 object
    assert a.drain_candidates(c, 4) == [slab(offs[4]), slab(offs[0])]  # emptiest first
    assert slab(a.allocate(c)) == slab(offs[0])  # the fuller of the two takes the new object
    assert a.free_slots(c) == 3 and a.class_stats()[0]["free_slots"] == 3


def test_a_drained_slab_takes_no_objects_and_returns_to_the_pool_when_emptied():
    a = HostArena(2 * MiB, MiB)
    small, big = a.size_class(256 * 1024), a.size_class(MiB)
    offs = [a.allocate(small) for _ in range(8)]
    for o in offs[1:4] + offs[5:7]:
        a.free(o)  # slab 0 holds offs[0], slab 1 holds offs[4] and offs[7]
    assert a.free_slots(small) == 5 and a.slots_per_slab(small) == 4
    (emptiest, _) = a.drain_candidates(small, 4)
    assert a.slab_objects(emptiest) == [offs[0]]
    a.drain(emptiest)
    assert a.free_slots(small) == 2  # a draining slab's free slots are not offered
    np.frombuffer(a.view(offs[0], 1000), dtype=np.uint8)[:] = 42
    dst = a.allocate(small)
    assert dst // MiB != emptiest
    a.move_objects([offs[0]], [dst], 1000)
    assert (np.frombuffer(a.view(dst, 1000), dtype=np.uint8) == 42).all()
    a.free(offs[0])
    assert a.stats()["free_slabs"] == 1 and a.class_stats()[0]["slabs"] == 1
    assert a.allocate(big) == emptiest * MiB  # the slab changed size
    a.undrain(emptiest)  # no-op: it left the class
    assert a.class_stats()[1]["objects"] == 1 and a.free_slots(small) == 1


def test_undrain_gives_the_slab_back_to_its_class():
    a = HostArena(2 * MiB, MiB)
    c = a.size_class(256 * 1024)
    offs = [a.allocate(c) for _ in range(6)]
    s = offs[5] // MiB
    a.drain(s)
    with pytest.raises(ValueError, match="draining"):
        a.drain(s)
    assert a.free_slots(c) == 0 and a.allocate(c) == -1
    a.undrain(s)
    assert a.free_slots(c) == 2 and a.allocate(c) >= 0


def test_move_objects_checks_its_offsets():
    a = HostArena(2 * MiB, MiB)
    c = a.size_class(4096)
    x, y = a.allocate(c), a.allocate(c)
    with pytest.raises(ValueError, match="not an allocated|not the start"):
        a.move_objects([x], [y + 8 * 4096], 4096)
    with pytest.raises(ValueError, match="do not fit"):
        a.move_objects([x], [y], 8192)
    with pytest.raises(ValueError, match="sources"):
        a.move_objects([x], [], 4096)


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["alloc", "free", "drain", "undrain"]), st.integers(0, 2),
                              st.integers(0, 10**6)), max_size=200))
def test_allocator_against_a_model(ops):
    """No two live objects overlap; frees of live objects always succeed; a draining slab takes
    no objects; per-class counts add up."""
    a = HostArena(4 * MiB, MiB)
    classes = [a.size_class(s) for s in (1000, 70 * 1024, 300 * 1024)]
    live: dict[int, int] = {}  # offset -> class
    draining: set[int] = set()
    for op, k, pick in ops:
        if op == "alloc":
            o = a.allocate(classes[k])
            if o >= 0:
                size = a.slot_bytes(classes[k])
                assert o // MiB not in draining
                for lo, c in live.items():
                    assert o + size <= lo or lo + a.slot_bytes(c) <= o, "overlapping objects"
                live[o] = classes[k]
        elif op == "free" and live:
            o = sorted(live)[pick % len(live)]
            a.free(o)
            del live[o]
            if not any(x // MiB == o // MiB for x in live):
                draining.discard(o // MiB)  # emptied: back in the pool
        elif op == "drain":
            cands = a.drain_candidates(classes[k], 4)
            if cands:
                s = cands[pick % len(cands)]
                assert sorted(a.slab_objects(s)) == sorted(x for x in live if x // MiB == s)
                a.drain(s)
                draining.add(s)
        elif op == "undrain" and draining:
            s = sorted(draining)[pick % len(draining)]
            a.undrain(s)
            draining.discard(s)
        assert a.stats()["bytes_allocated"] == sum(a.slot_bytes(c) for c in live.values())
        for cls, cs in zip(classes, a.class_stats()):
            mine = [o for o, c in live.items() if c == cls]
            slabs = {o // MiB for o in mine}
            assert cs["objects"] == len(mine) and cs["slabs"] == len(slabs)
            open_slabs = slabs - draining
            assert cs["free_slots"] == sum(cs["slots_per_slab"] - sum(o // MiB == s for o in mine) for s in open_slabs)


def test_an_unpinned_arena_is_faulted_in_ahead_of_use_without_changing_a_byte():
    """A first touch of a page costs its allocation and zeroing (a store into never-used L1 ran at
    1/30 of its speed): the arena's pages are faulted in by its background thread, and bytes
    already written stay as they are."""
    import time

    a = HostArena(64 << 20, 1 << 20, False, -1)
    cls = a.size_class(4096)
    off = a.allocate(cls)
    np.frombuffer(a.view(off, 4096), np.uint8)[:] = 7
    deadline = time.monotonic() + 60
    while not a.pin_status()["faulting_done"]:
        assert time.monotonic() < deadline, a.pin_status()
        time.sleep(0.01)
    st = a.pin_status()
    assert st["bytes_faulted"] == a.capacity and not st["error"], st
    assert (np.frombuffer(a.view(off, 4096), np.uint8) == 7).all()
    # the whole arena is resident: mincore over its mapping
    assert resident_bytes(a) == a.capacity


def resident_bytes(arena) -> int:
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    n = arena.capacity // page
    vec = (ctypes.c_ubyte * n)()
    base = ctypes.c_void_p(np.frombuffer(arena.view(0, 1), np.uint8).ctypes.data)
    assert libc.mincore(base, ctypes.c_size_t(arena.capacity), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) * page


def test_a_stopping_server_gives_an_unpinned_arenas_memory_back_and_a_file_keeps_its_bytes(tmp_path):
    """At a server's stop the kernel frees the arena's pages (a few tenths of a second a GiB here):
    done before the server says it stopped, not during the process's exit. The mapping stays
    valid; an arena file (--l1-persist) keeps its bytes for the next server."""
    import time

    a = HostArena(16 << 20, 1 << 20, False, -1)
    while not a.pin_status()["faulting_done"]:
        time.sleep(0.01)
    off = a.allocate(a.size_class(4096))
    np.frombuffer(a.view(off, 4096), np.uint8)[:] = 9
    assert resident_bytes(a) == a.capacity
    assert a.release_memory()
    assert resident_bytes(a) == 0
    assert (np.frombuffer(a.view(off, 4096), np.uint8) == 0).all()  # still mapped: zeros, no fault
    kept = HostArena(16 << 20, 1 << 20, False, -1, str(tmp_path / "arena"))
    np.frombuffer(kept.view(0, 4096), np.uint8)[:] = 5
    assert not kept.release_memory()
    assert (np.frombuffer(kept.view(0, 4096), np.uint8) == 5).all()
