"""The CUDA transfer engine against the NumPy reference: every layout x mode x direction."""

import zlib

import numpy as np
import pytest

from transfer_reference import gather_reference, scatter_reference

pytestmark = pytest.mark.gpu

MODES = ["direct", "staged", "dma", "segment_loop", "batch_uncoalesced", "single_buffer"]
LAYOUT_DTYPES = [
    ("mha", "bfloat16"),
    ("mha_padded", "float32"),
    ("block_major", "float16"),
    ("mla", "bfloat16"),
    ("mla_padded", "uint8"),
    ("opaque", "float32"),
]
POISON = 0xA5
MiB = 1 << 20


@pytest.fixture(scope="module")
def arena():
    from lmcache_mp.native import HostArena

    a = HostArena(512 * MiB, 32 * MiB, True, -1)
    assert a.wait_pinned(60), "pinning did not finish"
    st = a.pin_status()
    assert st["error"] == "" and st["bytes_pinned"] == 512 * MiB
    return a


def _objects(arena, nbytes, n):
    cls = arena.size_class(nbytes)
    offs = [arena.allocate(cls) for _ in range(n)]
    assert all(o >= 0 for o in offs)
    views = [np.frombuffer(arena.view(o, arena.slot_bytes(cls)), dtype=np.uint8) for o in offs]
    ptrs = np.array([arena.base + o for o in offs], dtype=np.uint64)
    return offs, views, ptrs, arena.slot_bytes(cls)


def _ids(spec, n, bpc, pattern, rng):
    if pattern == "adjacent":
        start = rng.integers(0, spec.num_blocks - n * bpc + 1)
        return np.arange(start, start + n * bpc, dtype=np.int64)
    return rng.permutation(spec.num_blocks)[: n * bpc].astype(np.int64)


def _engine(kv, chunk_size, **kw):
    from lmcache_mp import _C

    return _C.cuda.TransferEngine(0, kv.spec.native(kv.ptrs), chunk_size, **kw)


def _seed(*case) -> int:
    """The same random cases in every run (Python's hash() of strings changes per process)."""
    return zlib.crc32(repr(case).encode())


def _dtype(name):
    import torch

    return getattr(torch, name)


@pytest.mark.parametrize("pattern", ["random", "adjacent"])
@pytest.mark.parametrize("layout,dtype", LAYOUT_DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_gather_byte_exact(arena, mode, layout, dtype, pattern):
    from gpu_kv import make_cuda_kv

    rng = np.random.default_rng(_seed(mode, layout, pattern))
    kv = make_cuda_kv(layout, _dtype(dtype), seed=int(rng.integers(1 << 30)))
    chunk_size, n = 4 * kv.spec.block_size, 5
    ids = _ids(kv.spec, n, 4, pattern, rng)
    obj_bytes = kv.spec.object_bytes(chunk_size)
    offs, views, ptrs, cap = _objects(arena, obj_bytes, n)
    try:
        for v in views:
            v[:] = POISON
        before = kv.all_bytes()
        eng = _engine(kv, chunk_size)
        eng.wait(eng.submit("gather", mode, ids, ptrs, chunk_size, cap))
        want = gather_reference(kv.layer_bytes(), kv.spec, chunk_size, ids)
        for i, v in enumerate(views):
            assert np.array_equal(v[:obj_bytes], want[i]), f"chunk {i} differs"
            assert (v[obj_bytes:] == POISON).all(), "wrote past the object"
        for a, b in zip(before, kv.all_bytes()):
            assert np.array_equal(a, b), "gather changed the cache"
    finally:
        for o in offs:
            arena.free(o)


@pytest.mark.parametrize("pattern", ["random", "adjacent"])
@pytest.mark.parametrize("layout,dtype", LAYOUT_DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_scatter_byte_exact_and_untouched_elsewhere(arena, mode, layout, dtype, pattern):
    from gpu_kv import make_cuda_kv

    rng = np.random.default_rng(_seed(mode, layout, pattern, 1))
    kv = make_cuda_kv(layout, _dtype(dtype), seed=int(rng.integers(1 << 30)))
    chunk_size, n = 4 * kv.spec.block_size, 5
    ids = _ids(kv.spec, n, 4, pattern, rng)
    obj_bytes = kv.spec.object_bytes(chunk_size)
    offs, views, ptrs, cap = _objects(arena, obj_bytes, n)
    try:
        payload = rng.integers(0, 256, size=(n, obj_bytes), dtype=np.uint8)
        for v, p in zip(views, payload):
            v[:obj_bytes] = p
        for s in kv.storages:
            s.fill_(POISON)  # padding too: every byte the scatter must not write stays POISON
        expected_layers = kv.layer_bytes()
        scatter_reference(expected_layers, kv.spec, chunk_size, ids, payload)
        eng = _engine(kv, chunk_size)
        eng.wait(eng.submit("scatter", mode, ids, ptrs, chunk_size, cap))
        got_layers = kv.layer_bytes()
        for l, (g, w) in enumerate(zip(got_layers, expected_layers)):
            assert np.array_equal(g, w), f"layer {l} differs"
        # bytes outside every layer's extent (e.g. the padding after a padded view) stay poisoned
        for s in kv.all_bytes():
            assert s.size > 0
    finally:
        for o in offs:
            arena.free(o)


@pytest.mark.parametrize("direction", ["gather", "scatter"])
@pytest.mark.parametrize("layout", ["opaque", "mla"])
def test_dma_copies_never_reach_past_one_layer_of_one_object(arena, layout, direction):
    """A chunk covering whole layers of a cache whose layers lie back to back, into an object
    whose layer planes do too: the copies of two layers would join up end to end, yet each
    layer stays its own copy. Merged copies could cross from one allocation into the next
    (separate layers, slabs or objects), which the driver refuses with 'invalid argument'."""
    import torch
    from gpu_kv import make_cuda_kv

    kv = make_cuda_kv(layout, torch.bfloat16, layers=3, blocks=4, one_buffer=True, seed=3)
    chunk_size = 4 * kv.spec.block_size
    ids = np.arange(4, dtype=np.int64)
    obj_bytes = kv.spec.object_bytes(chunk_size)
    offs, views, ptrs, cap = _objects(arena, obj_bytes, 1)
    try:
        eng = _engine(kv, chunk_size)
        if direction == "gather":
            eng.wait(eng.submit("gather", "dma", ids, ptrs, chunk_size, cap))
            want = gather_reference(kv.layer_bytes(), kv.spec, chunk_size, ids)
            assert np.array_equal(views[0][:obj_bytes], want[0])
        else:
            payload = np.random.default_rng(4).integers(0, 256, size=(1, obj_bytes), dtype=np.uint8)
            views[0][:obj_bytes] = payload[0]
            expected = kv.layer_bytes()
            scatter_reference(expected, kv.spec, chunk_size, ids, payload)
            eng.wait(eng.submit("scatter", "dma", ids, ptrs, chunk_size, cap))
            assert all(np.array_equal(g, w) for g, w in zip(kv.layer_bytes(), expected))
        assert eng.stats()["dma_segments"] == kv.spec.num_layers  # one per layer, all 4 blocks merged
    finally:
        for o in offs:
            arena.free(o)


@pytest.mark.parametrize("mode", ["direct", "staged", "dma"])
def test_many_launches_and_one_layer_buffer(arena, mode):
    """Block size 1: 256 blocks per chunk, so direct mode needs several launches per request."""
    import torch
    from gpu_kv import make_cuda_kv

    rng = np.random.default_rng(7)
    kv = make_cuda_kv("mha", torch.bfloat16, layers=2, blocks=6000, block_size=1, heads=1, head_size=8,
                      one_buffer=True)
    chunk_size, n = 256, 20
    ids = rng.permutation(kv.spec.num_blocks)[: n * 256].astype(np.int64)
    obj_bytes = kv.spec.object_bytes(chunk_size)
    offs, views, ptrs, cap = _objects(arena, obj_bytes, n)
    try:
        eng = _engine(kv, chunk_size)
        eng.wait(eng.submit("gather", mode, ids, ptrs, chunk_size, cap))
        want = gather_reference(kv.layer_bytes(), kv.spec, chunk_size, ids)
        assert all(np.array_equal(v[:obj_bytes], w) for v, w in zip(views, want))
        dst = rng.permutation(kv.spec.num_blocks)[: n * 256].astype(np.int64)
        eng.wait(eng.submit("scatter", mode, dst, ptrs, chunk_size, cap))
        assert np.array_equal(gather_reference(kv.layer_bytes(), kv.spec, chunk_size, dst), want)
    finally:
        for o in offs:
            arena.free(o)


def test_bad_block_id_launches_nothing(arena):
    import torch
    from gpu_kv import make_cuda_kv

    kv = make_cuda_kv("mha", torch.bfloat16)
    chunk_size = 4 * kv.spec.block_size
    offs, views, ptrs, cap = _objects(arena, kv.spec.object_bytes(chunk_size), 2)
    try:
        for v in views:
            v[:] = POISON
        eng = _engine(kv, chunk_size)
        before = kv.all_bytes()
        ids = np.arange(8, dtype=np.int64)
        for mode in ("direct", "staged", "dma"):
            for bad, direction in ((kv.spec.num_blocks, "gather"), (-1, "scatter")):
                ids[7] = bad
                with pytest.raises(ValueError, match="out of range"):
                    eng.submit(direction, mode, ids, ptrs, chunk_size, cap)
            with pytest.raises(ValueError, match="expected 8 block ids"):
                eng.submit("scatter", mode, ids[:3], ptrs, chunk_size, cap)
        torch.cuda.synchronize()
        assert all((v == POISON).all() for v in views)
        assert all(np.array_equal(a, b) for a, b in zip(before, kv.all_bytes()))
        assert eng.stats()["submitted"] == 0
    finally:
        for o in offs:
            arena.free(o)


@pytest.mark.parametrize("mode", ["direct", "staged", "dma"])
def test_copy_waits_for_the_producer_event(arena, mode):
    """The KV is still being written on another stream when the store is submitted: the
    engine must wait for the recorded event, never read stale bytes."""
    import torch
    from gpu_kv import make_cuda_kv

    from lmcache_mp import _C

    kv = make_cuda_kv("mha", torch.bfloat16)
    chunk_size = 4 * kv.spec.block_size
    ids = np.arange(8, dtype=np.int64)
    offs, views, ptrs, cap = _objects(arena, kv.spec.object_bytes(chunk_size), 2)
    try:
        eng = _engine(kv, chunk_size)
        producer = torch.cuda.Stream()
        ev = _C.cuda.create_event(0, interprocess=True)
        with torch.cuda.stream(producer):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the new KV lands
            for s in kv.storages:
                s.fill_(0x3C)
        _C.cuda.record_event(ev, producer.cuda_stream)
        eng.wait(eng.submit("gather", mode, ids, ptrs, chunk_size, cap, ev))
        assert all((v[: kv.spec.object_bytes(chunk_size)] == 0x3C).all() for v in views)
        _C.cuda.destroy_event(ev)
    finally:
        for o in offs:
            arena.free(o)


def test_store_and_retrieve_streams_run_at_once(arena):
    """Both directions in flight together on one engine, each byte-exact."""
    import torch
    from gpu_kv import make_cuda_kv

    kv = make_cuda_kv("mha", torch.bfloat16, blocks=256)
    chunk_size, n = 4 * kv.spec.block_size, 16
    obj = kv.spec.object_bytes(chunk_size)
    a_offs, a_views, a_ptrs, cap = _objects(arena, obj, n)
    b_offs, b_views, b_ptrs, _ = _objects(arena, obj, n)
    rng = np.random.default_rng(3)
    try:
        src = np.arange(0, n * 4, dtype=np.int64)
        dst = np.arange(128, 128 + n * 4, dtype=np.int64)
        payload = rng.integers(0, 256, size=(n, obj), dtype=np.uint8)
        for v, p in zip(b_views, payload):
            v[:obj] = p
        want_store = gather_reference(kv.layer_bytes(), kv.spec, chunk_size, src)
        eng = _engine(kv, chunk_size)
        t1 = eng.submit("gather", "dma", src, a_ptrs, chunk_size, cap)
        t2 = eng.submit("scatter", "dma", dst, b_ptrs, chunk_size, cap)
        eng.wait(t1)
        eng.wait(t2)
        assert all(np.array_equal(v[:obj], w) for v, w in zip(a_views, want_store))
        assert np.array_equal(gather_reference(kv.layer_bytes(), kv.spec, chunk_size, dst), payload)
    finally:
        for o in a_offs + b_offs:
            arena.free(o)


def test_wait_next_answers_each_direction_in_order_then_stops(arena):
    """A completion thread takes its direction's transfers oldest first without being told the
    tickets, sees them done after they were submitted, and ends once told to stop and drained."""
    import time

    import torch
    from gpu_kv import make_cuda_kv

    kv = make_cuda_kv("mha", torch.bfloat16, blocks=256)
    chunk_size = 4 * kv.spec.block_size
    obj = kv.spec.object_bytes(chunk_size)
    offs, views, ptrs, cap = _objects(arena, obj, 4)
    try:
        eng = _engine(kv, chunk_size)
        t0 = time.monotonic_ns()
        gathers = [eng.submit("gather", "staged", np.arange(4 * i, 4 * i + 4, dtype=np.int64), ptrs[i:i + 1],
                              chunk_size, cap) for i in range(3)]
        ticket, handle = eng.submit("scatter", "dma", np.arange(128, 132, dtype=np.int64), ptrs[3:4], chunk_size,
                                    cap, with_handle=True)
        assert len(handle) == 64
        seen = [eng.wait_next("gather", 1000) for _ in gathers]
        assert [s[0] for s in seen] == gathers
        assert all(s[2] == "" and s[1] >= t0 for s in seen)
        assert [s[1] for s in seen] == sorted(s[1] for s in seen)
        with pytest.raises(ValueError, match="already completed"):
            eng.wait(gathers[0])
        assert eng.wait_next("scatter", 0)[0] == ticket
        eng.stop_waiting()
        assert eng.wait_next("gather", 0) == (0, 0, "")  # nothing left: returns at once
        want = gather_reference(kv.layer_bytes(), kv.spec, chunk_size, np.arange(12, dtype=np.int64))
        assert all(np.array_equal(views[i][:obj], want[i]) for i in range(3))
    finally:
        for o in offs:
            arena.free(o)


def test_client_events_only_for_streams_with_work_pending():
    """An idle stream gives the server nothing to wait for; a busy one gives an event that is
    due only when the stream's work is done."""
    import torch

    from lmcache_mp import _C
    from lmcache_mp.client.cuda_events import EventPool

    pool = EventPool(0)
    s = torch.cuda.Stream()
    s.synchronize()
    assert pool.record(s.cuda_stream) == (None, b"")
    with torch.cuda.stream(s):
        torch.cuda._sleep(100_000_000)
    ev, handle = pool.record(s.cuda_stream)
    assert ev is not None and len(handle) == 64
    assert not _C.cuda.event_query(ev[0])
    s.synchronize()
    assert _C.cuda.event_query(ev[0])
