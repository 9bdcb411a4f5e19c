import gc
import mmap
import os
import struct
import threading

import numpy as np
import pytest
import xxhash

from lmcache_mp import _C
from lmcache_mp.native import HostArena

KiB, MiB = 1 << 10, 1 << 20
HDR = 4096
FMT = b"fp16:[2,32,256,1024]"


def _direct_io_works(d) -> bool:
    """Whether the filesystem under d takes an O_DIRECT write (tmpfs refuses it)."""
    p = os.path.join(d, "probe")
    try:
        fd = os.open(p, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
    except OSError:
        return False
    try:
        buf = mmap.mmap(-1, 4096)  # page-aligned
        os.pwrite(fd, buf, 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(p)


def _aligned(n: int) -> np.ndarray:
    raw = np.zeros(n + 4096, np.uint8)
    off = (-raw.ctypes.data) % 4096
    return raw[off : off + n]


def _unaligned(n: int) -> np.ndarray:
    raw = np.zeros(n + 4096 + 1, np.uint8)
    off = (-raw.ctypes.data) % 4096 + 1  # 1 past an aligned address
    return raw[off : off + n]


def _rand(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _path(root, key: bytes) -> str:
    name = _C.DiskStore.name_of(key)
    return os.path.join(root, name[:2], name + ".kv")


def _put(s, key: bytes, arr: np.ndarray, fmt: bytes = FMT) -> bool:
    return s.put([key], [fmt], [arr.ctypes.data], [arr.nbytes])[0]


def _get(s, key: bytes, n: int, fmt: bytes = FMT, capacity=None):
    out = np.zeros(n, np.uint8)
    r = s.get([key], [fmt], [out.ctypes.data], [n if capacity is None else capacity])[0]
    return r, out


def _files(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


# ---- XXH64 and names --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_xxh64_matches_reference(seed):
    for n in [0, 1, 3, 4, 7, 8, 31, 32, 33, 100, 1000, (1 << 20) + 5]:
        data = _rand(n, n).tobytes()
        assert _C.xxh64(data, seed) == xxhash.xxh64_intdigest(data, seed), n
    big = _rand(100_003, 7)
    want = xxhash.xxh64_intdigest(big.tobytes(), seed)
    assert _C.xxh64(big, seed) == want  # NumPy array
    assert _C.xxh64(memoryview(big.tobytes()), seed) == want
    assert _C.xxh64(big.tobytes()) == xxhash.xxh64_intdigest(big.tobytes(), 0)  # default seed 0


def test_xxh64_rejects_non_buffers():
    with pytest.raises(TypeError):
        _C.xxh64("text is not a buffer")


def test_name_of_is_two_xxh64_in_hex():
    for key in [b"", b"k", bytes(range(256)) * 3]:
        want = f"{xxhash.xxh64_intdigest(key, 0):016x}{xxhash.xxh64_intdigest(key, 1):016x}"
        assert _C.DiskStore.name_of(key) == want


def test_file_layout_matches_the_format(tmp_path):
    s = _C.DiskStore(str(tmp_path), 1 << 30)
    key, payload = b"model/layer\x00chunk-7", _rand(10_000, 3)
    assert _put(s, key, payload)
    blob = open(_path(tmp_path, key), "rb").read()
    assert len(blob) == HDR + payload.nbytes
    hdr = blob[:HDR]
    assert hdr[:8] == b"LMCMPKV1"
    version, header_bytes, nbytes, checksum, klen, flen, hsum = struct.unpack_from("<IIQQIIQ", hdr, 8)
    assert (version, header_bytes, nbytes, klen, flen) == (1, HDR, payload.nbytes, len(key), len(FMT))
    assert checksum == xxhash.xxh64_intdigest(payload.tobytes(), 0)
    assert hsum == xxhash.xxh64_intdigest(hdr[:40] + bytes(8) + hdr[48:], 0)
    assert hdr[48 : 48 + klen] == key and hdr[48 + klen : 48 + klen + flen] == FMT
    assert hdr[48 + klen + flen :] == bytes(HDR - 48 - klen - flen)
    assert blob[HDR:] == payload.tobytes()
    assert _files(tmp_path) == [os.path.relpath(_path(tmp_path, key), tmp_path)]  # no temp file left


# ---- put / get --------------------------------------------------------------------------------


def test_put_get_aligned_arena_buffers_use_direct_io(tmp_path):
    arena = HostArena(1 << 26, 1 << 24, False, -1)
    n = MiB
    cls = arena.size_class(n)
    src = [arena.allocate(cls) for _ in range(3)]
    dst = [arena.allocate(cls) for _ in range(3)]
    ptrs = [arena.base + off for off in src + dst]
    if any(p % 4096 for p in ptrs):  # the arena does not promise page alignment: use our own buffers
        bufs = [_aligned(n) for _ in range(6)]
        views, ptrs = bufs, [b.ctypes.data for b in bufs]
    else:
        views = [np.frombuffer(arena.view(off, n), np.uint8) for off in src + dst]
    for i in range(3):
        views[i][:] = _rand(n, i)
    keys = [b"a%d" % i for i in range(3)]

    s = _C.DiskStore(str(tmp_path / "store"), 1 << 30, io_threads=3)
    assert s.put(keys, [FMT] * 3, ptrs[:3], [n] * 3) == [True] * 3
    assert s.get(keys, [FMT] * 3, ptrs[3:], [n] * 3) == [n] * 3
    for i in range(3):
        assert np.array_equal(views[i], views[3 + i])
    st = s.stats()
    assert st["writes"] == 3 and st["reads"] == 3
    assert st["write_bytes"] == 3 * n and st["read_bytes"] == 3 * n
    assert st["write_seconds"] > 0 and st["read_seconds"] > 0
    assert st["direct_writes"] + st["buffered_writes"] == 3
    assert st["direct_reads"] + st["buffered_reads"] == 3
    if _direct_io_works(tmp_path):
        assert st["direct_writes"] == 3 and st["direct_reads"] == 3
    assert st["objects"] == 3 and st["bytes_used"] == 3 * (HDR + n)
    assert st["errors"] == st["corrupt"] == 0 and st["last_error"] == ""


def test_put_get_unaligned_buffers_are_buffered(tmp_path):
    s = _C.DiskStore(str(tmp_path), 1 << 30)
    sizes = [1, 4095, 100_000, 3 * MiB + 17]
    srcs = []
    for i, n in enumerate(sizes):
        a = _unaligned(n)
        assert a.ctypes.data % 4096 == 1
        a[:] = _rand(n, 100 + i)
        srcs.append(a)
    keys = [b"u%d" % i for i in range(len(sizes))]
    assert s.put(keys, [FMT] * 4, [a.ctypes.data for a in srcs], sizes) == [True] * 4
    outs = [_unaligned(n) for n in sizes]
    assert s.get(keys, [FMT] * 4, [o.ctypes.data for o in outs], sizes) == sizes
    for a, o in zip(srcs, outs):
        assert np.array_equal(a, o)
    # An aligned pointer with a size that is not a multiple of 4096 is buffered too.
    a = _aligned(8192 + 100)
    a[:] = _rand(a.nbytes, 9)
    assert _put(s, b"odd-size", a)
    r, out = _get(s, b"odd-size", a.nbytes)
    assert r == a.nbytes and np.array_equal(out, a)
    st = s.stats()
    assert st["buffered_writes"] == st["writes"] == 5 and st["direct_writes"] == 0
    assert st["buffered_reads"] == st["reads"] == 5 and st["direct_reads"] == 0


def test_empty_payload(tmp_path):
    s = _C.DiskStore(str(tmp_path), 1 << 20)
    assert s.put([b"empty"], [FMT], [0], [0]) == [True]
    assert s.lookup([b"empty"]) == [(0, FMT)]
    assert s.get([b"empty"], [FMT], [0], [0]) == [0]
    assert os.path.getsize(_path(tmp_path, b"empty")) == HDR


def test_get_result_codes_and_lookup(tmp_path):
    s = _C.DiskStore(str(tmp_path), 1 << 30)
    data = _rand(50_000, 1)
    assert _put(s, b"k", data)
    assert s.lookup([b"k", b"nope"]) == [(50_000, FMT), None]
    assert _get(s, b"k", 50_000, fmt=b"other")[0] == -2
    assert _get(s, b"k", 50_000, capacity=49_999)[0] == -3
    assert _get(s, b"nope", 10)[0] == -1
    r, out = _get(s, b"k", 60_000, capacity=60_000)  # a larger capacity is fine
    assert r == 50_000 and np.array_equal(out[:50_000], data)
    st = s.stats()
    assert st["reads"] == 1 and st["errors"] == 0 and st["corrupt"] == 0


def test_bad_arguments_raise_value_error(tmp_path):
    s = _C.DiskStore(str(tmp_path), 1 << 20)
    a = _rand(10, 0)
    with pytest.raises(ValueError, match="equal lengths"):
        s.put([b"a", b"b"], [FMT], [a.ctypes.data], [10])
    with pytest.raises(ValueError, match="equal lengths"):
        s.get([b"a"], [FMT], [a.ctypes.data, a.ctypes.data], [10])
    with pytest.raises(ValueError, match="negative"):
        s.put([b"a"], [FMT], [a.ctypes.data], [-1])
    with pytest.raises(ValueError, match="null"):
        s.get([b"a"], [FMT], [0], [10])
    with pytest.raises(ValueError):
        _C.DiskStore(str(tmp_path / "x"), -1)
    with pytest.raises(ValueError):
        _C.DiskStore(str(tmp_path / "x"), 1 << 20, io_threads=0)
    assert s.stats()["writes"] == 0 and s.stats()["reads"] == 0


def test_oversized_key_and_format_fail_the_item_only(tmp_path):
    s = _C.DiskStore(str(tmp_path), 1 << 20)
    a = _rand(100, 0)
    ok = s.put([b"k" * 4000, b"fine"], [b"f" * 49, FMT], [a.ctypes.data] * 2, [100, 100])
    assert ok == [False, True]
    assert s.lookup([b"k" * 4000]) == [None]
    # Exactly full is allowed: 4096 - 48 bytes of key and format.
    assert s.put([b"k" * 4000], [b"f" * 48], [a.ctypes.data], [100]) == [True]
    assert s.stats()["rejected"] == 1 and s.stats()["errors"] == 0


def test_replacing_a_key_keeps_one_file_and_the_accounting(tmp_path):
    s = _C.DiskStore(str(tmp_path), 1 << 30)
    a, b = _rand(30_000, 1), _rand(7_000, 2)
    assert _put(s, b"k", a) and _put(s, b"k", b, fmt=b"v2")
    assert s.lookup([b"k"]) == [(7_000, b"v2")]
    r, out = _get(s, b"k", 7_000, fmt=b"v2")
    assert r == 7_000 and np.array_equal(out, b)
    st = s.stats()
    assert st["objects"] == 1 and st["bytes_used"] == HDR + 7_000
    assert len(_files(tmp_path)) == 1


def test_same_key_many_times_in_one_batch(tmp_path):
    # Items of a batch run in parallel: the puts of one key race each other.
    s = _C.DiskStore(str(tmp_path), 1 << 30, io_threads=4)
    versions = [np.full(100_000 + 4096 * i, i, np.uint8) for i in range(8)]
    assert s.put([b"k"] * 8, [b"v%d" % i for i in range(8)], [v.ctypes.data for v in versions],
                 [v.nbytes for v in versions]) == [True] * 8
    (found,) = s.lookup([b"k"])
    i = int(found[1][1:])
    assert found[0] == versions[i].nbytes
    r, out = _get(s, b"k", versions[i].nbytes, fmt=found[1])
    assert r == versions[i].nbytes and np.array_equal(out, versions[i])
    assert s.stats()["bytes_used"] == HDR + versions[i].nbytes and len(_files(tmp_path)) == 1


def test_remove(tmp_path):
    s = _C.DiskStore(str(tmp_path), 1 << 30)
    a = _rand(5000, 0)
    for k in [b"a", b"b", b"c"]:
        assert _put(s, k, a)
    assert s.remove([b"a", b"c", b"missing"]) == 2
    assert s.lookup([b"a", b"b", b"c"]) == [None, (5000, FMT), None]
    assert not os.path.exists(_path(tmp_path, b"a")) and os.path.exists(_path(tmp_path, b"b"))
    assert s.stats()["bytes_used"] == HDR + 5000 and s.stats()["objects"] == 1
    assert _get(s, b"a", 5000)[0] == -1


# ---- capacity and LRU -------------------------------------------------------------------------


def test_lru_eviction_by_bytes(tmp_path):
    n = 8192
    cap = 3 * (HDR + n)
    s = _C.DiskStore(str(tmp_path), cap)
    data = {k: _rand(n, i) for i, k in enumerate([b"a", b"b", b"c", b"d"])}
    for k in [b"a", b"b", b"c"]:
        assert _put(s, k, data[k])
        assert s.stats()["bytes_used"] <= cap
    assert _get(s, b"a", n)[0] == n  # a becomes the most recently used: b is now the oldest
    assert _put(s, b"d", data[b"d"])
    st = s.stats()
    assert st["evictions"] == 1 and st["bytes_used"] == cap and st["objects"] == 3
    assert s.lookup([b"a", b"b", b"c", b"d"]) == [(n, FMT), None, (n, FMT), (n, FMT)]
    assert not os.path.exists(_path(tmp_path, b"b"))
    for k in [b"a", b"c", b"d"]:
        r, out = _get(s, k, n)
        assert r == n and np.array_equal(out, data[k])
    # A batch larger than the capacity: never over it, the batch's survivors are readable.
    more = {b"m%d" % i: _rand(n, 50 + i) for i in range(6)}
    ok = s.put(list(more), [FMT] * 6, [v.ctypes.data for v in more.values()], [n] * 6)
    assert ok == [True] * 6
    st = s.stats()
    assert st["bytes_used"] <= cap and st["objects"] == 3 and len(_files(tmp_path)) == 3
    for k, v in more.items():
        if s.lookup([k])[0] is not None:
            r, out = _get(s, k, n)
            assert r == n and np.array_equal(out, v)


def test_item_larger_than_capacity_fails_without_evicting(tmp_path):
    s = _C.DiskStore(str(tmp_path), 2 * (HDR + 1000))
    small, big = _rand(1000, 0), _rand(2 * HDR + 2000, 1)
    assert _put(s, b"small", small)
    assert not _put(s, b"big", big)
    st = s.stats()
    assert st["evictions"] == 0 and st["objects"] == 1 and st["rejected"] == 1
    assert "capacity" in st["last_error"] and st["errors"] == 0
    assert s.lookup([b"big"]) == [None]


# ---- restart and crash leftovers --------------------------------------------------------------


def test_warm_restart_recovers_objects_and_lru_order(tmp_path):
    n = 20_000
    data = {b"k%d" % i: _rand(n, i) for i in range(4)}
    s = _C.DiskStore(str(tmp_path), 1 << 30)
    for k, v in data.items():
        assert _put(s, k, v)
    del s
    gc.collect()

    s = _C.DiskStore(str(tmp_path), 1 << 30)
    st = s.stats()
    assert st["objects"] == 4 and st["bytes_used"] == 4 * (HDR + n) and st["dropped_at_scan"] == 0
    assert st["scan_seconds"] >= 0
    assert s.lookup(list(data)) == [(n, FMT)] * 4
    for k, v in data.items():
        r, out = _get(s, k, n)
        assert r == n and np.array_equal(out, v)
    del s
    gc.collect()

    # The order of modification times is the LRU order: a smaller capacity at the next start
    # evicts the oldest files.
    for age, k in enumerate([b"k2", b"k0", b"k3", b"k1"]):
        os.utime(_path(tmp_path, k), (1_000_000 + age, 1_000_000 + age))
    s = _C.DiskStore(str(tmp_path), 2 * (HDR + n))
    st = s.stats()
    assert st["evictions"] == 2 and st["objects"] == 2 and st["bytes_used"] == 2 * (HDR + n)
    assert s.lookup([b"k0", b"k1", b"k2", b"k3"]) == [None, (n, FMT), None, (n, FMT)]
    assert not os.path.exists(_path(tmp_path, b"k2")) and not os.path.exists(_path(tmp_path, b"k0"))


def test_corrupt_payload_is_detected_and_dropped(tmp_path):
    s = _C.DiskStore(str(tmp_path), 1 << 30)
    data, other = _rand(40_000, 1), _rand(40_000, 2)
    assert _put(s, b"bad", data) and _put(s, b"good", other)
    p = _path(tmp_path, b"bad")
    with open(p, "r+b") as f:
        f.seek(HDR + 12_345)
        b = f.read(1)
        f.seek(HDR + 12_345)
        f.write(bytes([b[0] ^ 0x40]))
    assert _get(s, b"bad", 40_000)[0] == -4
    assert not os.path.exists(p)
    assert _get(s, b"bad", 40_000)[0] == -1
    st = s.stats()
    assert st["corrupt"] == 1 and st["errors"] == 0 and st["objects"] == 1
    assert st["bytes_used"] == HDR + 40_000 and "checksum" in st["last_error"]
    r, out = _get(s, b"good", 40_000)
    assert r == 40_000 and np.array_equal(out, other)


def test_truncated_file_found_on_read_is_corrupt(tmp_path):
    s = _C.DiskStore(str(tmp_path), 1 << 30)
    assert _put(s, b"k", _rand(40_000, 1))
    os.truncate(_path(tmp_path, b"k"), HDR + 100)
    assert _get(s, b"k", 40_000)[0] == -4
    assert s.stats()["corrupt"] == 1 and not os.path.exists(_path(tmp_path, b"k"))


def test_scan_drops_bad_files_and_leftovers(tmp_path):
    n = 10_000
    s = _C.DiskStore(str(tmp_path), 1 << 30)
    data = {k: _rand(n, i) for i, k in enumerate([b"keep1", b"keep2", b"trunc", b"garbage", b"moved"])}
    for k, v in data.items():
        assert _put(s, k, v)
    del s
    gc.collect()

    os.truncate(_path(tmp_path, b"trunc"), HDR + n - 1)  # short file
    with open(_path(tmp_path, b"garbage"), "r+b") as f:  # header no longer checks out
        f.seek(60)
        f.write(b"\xff" * 16)
    # A valid file under the name of another key.
    wrong = _path(tmp_path, b"someone-else")
    os.makedirs(os.path.dirname(wrong), exist_ok=True)
    os.rename(_path(tmp_path, b"moved"), wrong)
    # A crash mid-write leaves a temp file.
    leftover = _path(tmp_path, b"keep1") + ".tmp.x"
    with open(leftover, "wb") as f:
        f.write(b"partial")
    # Files that are not the store's are left alone.
    foreign = tmp_path / "README"
    foreign.write_text("not an object")

    s = _C.DiskStore(str(tmp_path), 1 << 30)
    st = s.stats()
    assert st["dropped_at_scan"] == 4
    assert st["objects"] == 2 and st["bytes_used"] == 2 * (HDR + n)
    for p in [_path(tmp_path, b"trunc"), _path(tmp_path, b"garbage"), wrong, leftover]:
        assert not os.path.exists(p)
    assert foreign.exists()
    assert s.lookup([b"trunc", b"garbage", b"moved", b"someone-else"]) == [None] * 4
    for k in [b"keep1", b"keep2"]:
        r, out = _get(s, k, n)
        assert r == n and np.array_equal(out, data[k])


# ---- errors -----------------------------------------------------------------------------------


def test_unwritable_target_fails_the_item_and_is_counted(tmp_path):
    s = _C.DiskStore(str(tmp_path), 1 << 30)
    blocked = b"blocked"
    prefix = _C.DiskStore.name_of(blocked)[:2]
    (tmp_path / prefix).write_bytes(b"a file where the subdirectory should be")
    other = next(b"o%d" % i for i in range(1000) if _C.DiskStore.name_of(b"o%d" % i)[:2] != prefix)
    a = _rand(20_000, 5)
    assert s.put([blocked, other], [FMT] * 2, [a.ctypes.data] * 2, [a.nbytes] * 2) == [False, True]
    st = s.stats()
    assert st["errors"] == 1 and st["writes"] == 1
    assert prefix in st["last_error"] and "directory" in st["last_error"].lower()
    assert st["bytes_used"] == HDR + a.nbytes  # the failed item's reservation was given back
    assert s.lookup([blocked]) == [None]
    r, out = _get(s, other, a.nbytes)
    assert r == a.nbytes and np.array_equal(out, a)
    # The store still fills to its capacity afterwards: nothing leaked from the accounting.
    s2 = _C.DiskStore(str(tmp_path / "s2"), 2 * (HDR + a.nbytes))
    (tmp_path / "s2" / prefix).write_bytes(b"x")
    assert not _put(s2, blocked, a)
    assert _put(s2, other, a) and _put(s2, other + b"2", a)
    assert s2.stats()["evictions"] == 0


def test_constructor_on_a_regular_file_raises(tmp_path):
    f = tmp_path / "not-a-dir"
    f.write_bytes(b"x")
    with pytest.raises(RuntimeError, match="not a directory"):
        _C.DiskStore(str(f), 1 << 20)
    with pytest.raises(RuntimeError):
        _C.DiskStore(str(f / "below"), 1 << 20)


def test_constructor_creates_parents(tmp_path):
    d = tmp_path / "a" / "b" / "c"
    s = _C.DiskStore(d, 1 << 20)  # os.PathLike works too
    assert d.is_dir() and s.stats()["objects"] == 0 and s.stats()["capacity"] == 1 << 20


# ---- concurrency ------------------------------------------------------------------------------


def test_threads_put_and_get_concurrently(tmp_path):
    s = _C.DiskStore(str(tmp_path), 1 << 30, io_threads=4)
    errors = []

    def worker(t: int) -> None:
        try:
            for round_ in range(5):
                keys = [b"t%d-r%d-%d" % (t, round_, i) for i in range(4)]
                # Even threads: aligned buffers of whole pages (direct I/O); odd: unaligned ones.
                sizes = [(16 + i) * 4096 if t % 2 == 0 else 50_000 + 333 * i + t for i in range(4)]
                make = _aligned if t % 2 == 0 else _unaligned
                srcs = [make(n) for n in sizes]
                for i, a in enumerate(srcs):
                    a[:] = _rand(a.nbytes, 1000 * t + 10 * round_ + i)
                ok = s.put(keys, [FMT] * 4, [a.ctypes.data for a in srcs], sizes)
                assert ok == [True] * 4
                outs = [make(n) for n in sizes]
                got = s.get(keys, [FMT] * 4, [o.ctypes.data for o in outs], sizes)
                assert got == sizes
                for a, o in zip(srcs, outs):
                    assert np.array_equal(a, o)
        except Exception as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    st = s.stats()
    assert st["objects"] == 80 and st["writes"] == 80 and st["reads"] == 80
    assert st["errors"] == 0 and st["corrupt"] == 0
