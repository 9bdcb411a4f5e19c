"""CPU gather/scatter against the NumPy reference, over random layouts, dtypes and block ids."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvgen import kv_cases

from lmcache_mp.native import cpu_gather, cpu_scatter
from transfer_reference import gather_reference, scatter_reference

POISON = 0xA5


def _chunking(data, spec, distinct: bool):
    bpc = data.draw(st.integers(1, max(1, min(4, spec.num_blocks // 2))), label="blocks per chunk")
    chunk_size = bpc * spec.block_size
    max_chunks = spec.num_blocks // bpc if distinct else 4
    n = data.draw(st.integers(0, max(0, min(4, max_chunks))), label="chunks")
    if distinct:
        ids = data.draw(st.permutations(range(spec.num_blocks)), label="ids")[: n * bpc]
    else:
        ids = data.draw(st.lists(st.integers(0, spec.num_blocks - 1), min_size=n * bpc, max_size=n * bpc))
    return chunk_size, n, np.array(ids, dtype=np.int64)


def _objects(n, obj_bytes, slack=64):
    """Poisoned object buffers with a guard region after each object."""
    buf = np.full((max(n, 1), obj_bytes + slack), POISON, dtype=np.uint8)
    return buf, np.array([buf[i].ctypes.data for i in range(n)], dtype=np.uint64)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=kv_cases(), data=st.data())
def test_gather_matches_reference(case, data):
    spec = case.spec
    chunk_size, n, ids = _chunking(data, spec, distinct=False)
    obj_bytes = spec.object_bytes(chunk_size)
    objs, ptrs = _objects(n, obj_bytes)
    before = [b.copy() for b in case.buffers]
    cpu_gather(spec.native(case.ptrs), chunk_size, ids, ptrs, obj_bytes + 64)
    want = gather_reference(case.buffers, spec, chunk_size, ids)
    assert np.array_equal(objs[:n, :obj_bytes], want)
    assert (objs[:n, obj_bytes:] == POISON).all(), "wrote past the object"
    for b, old in zip(case.buffers, before):
        assert np.array_equal(b, old), "gather modified the cache"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=kv_cases(), data=st.data())
def test_scatter_matches_reference_and_touches_nothing_else(case, data):
    spec = case.spec
    chunk_size, n, ids = _chunking(data, spec, distinct=True)
    obj_bytes = spec.object_bytes(chunk_size)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    objs = rng.integers(0, 256, size=(max(n, 1), obj_bytes), dtype=np.uint8)
    ptrs = np.array([objs[i].ctypes.data for i in range(n)], dtype=np.uint64)
    # poison the whole cache, padding included: every byte the scatter must not write stays POISON
    for b in case.buffers:
        b[:] = POISON
    expected = [b.copy() for b in case.buffers]
    scatter_reference(expected, spec, chunk_size, ids, objs[:n])
    cpu_scatter(spec.native(case.ptrs), chunk_size, ids, ptrs, obj_bytes)
    for got, want in zip(case.buffers, expected):
        assert np.array_equal(got, want)


@settings(max_examples=60, deadline=None)
@given(case=kv_cases(), data=st.data())
def test_round_trip(case, data):
    spec = case.spec
    chunk_size, n, ids = _chunking(data, spec, distinct=True)
    obj_bytes = spec.object_bytes(chunk_size)
    objs, ptrs = _objects(n, obj_bytes)
    layout = spec.native(case.ptrs)
    cpu_gather(layout, chunk_size, ids, ptrs, obj_bytes)
    snapshot = gather_reference(case.buffers, spec, chunk_size, ids)
    for b in case.buffers:
        b[:] = 0
    cpu_scatter(layout, chunk_size, ids, ptrs, obj_bytes)
    assert np.array_equal(gather_reference(case.buffers, spec, chunk_size, ids), snapshot)


def _simple_case():
    from kvgen import KVCase

    from lmcache_mp.layout import infer_layout

    nb, bs, w = 8, 4, 16
    spec = infer_layout((2, nb, bs, 1, w), (nb * bs * w, bs * w, w, w, 1), 1, "uint8", 2)
    bufs = [np.arange(2 * nb * bs * w, dtype=np.uint8) for _ in range(2)]
    return KVCase(spec=spec, buffers=bufs, keep=bufs)


@pytest.mark.parametrize(
    "ids,n_objs,cap,match",
    [
        ([0, 1, 2, 8], 2, None, "block id 8 at position 3 is out of range"),
        ([0, 1, 2, -1], 2, None, "block id -1"),
        ([0, 1, 2], 2, None, "expected 4 block ids"),
        ([0, 1, 2, 3], 2, 100, "too small"),
    ],
)
@pytest.mark.parametrize("fn", [cpu_gather, cpu_scatter])
def test_bad_requests_raise_and_write_nothing(fn, ids, n_objs, cap, match):
    case = _simple_case()
    chunk_size = 2 * case.spec.block_size
    obj_bytes = case.spec.object_bytes(chunk_size)
    objs, ptrs = _objects(n_objs, obj_bytes)
    objs_before = objs.copy()
    cache_before = [b.copy() for b in case.buffers]
    with pytest.raises(ValueError, match=match):
        fn(case.spec.native(case.ptrs), chunk_size, ids, ptrs, obj_bytes if cap is None else cap)
    assert np.array_equal(objs, objs_before)
    for b, old in zip(case.buffers, cache_before):
        assert np.array_equal(b, old)


def test_chunk_size_must_be_whole_blocks():
    case = _simple_case()
    objs, ptrs = _objects(1, 4096)
    with pytest.raises(ValueError, match="multiple of the block size"):
        cpu_gather(case.spec.native(case.ptrs), 6, [0, 1], ptrs, 4096)


def test_float_block_ids_rejected():
    case = _simple_case()
    objs, ptrs = _objects(1, 4096)
    with pytest.raises(ValueError, match="integers"):
        cpu_gather(case.spec.native(case.ptrs), 8, [0.0, 1.0], ptrs, 4096)


# ---- a rank's slice of tensor-parallel-shared objects (docs/tensor-parallel.md) ------------------


def _sliced(data, spec):
    """An object row pitch wider than the layout's rows and this cache's offset in each row."""
    pitch = spec.row_bytes * data.draw(st.integers(1, 3), label="ranks") + data.draw(st.integers(0, 8), label="pad")
    offset = data.draw(st.integers(0, pitch - spec.row_bytes), label="offset")
    return pitch, offset


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=kv_cases(), data=st.data())
def test_a_slice_of_wider_object_rows_is_gathered_and_scattered_row_by_row(case, data):
    """Each row's bytes land at `offset` of a `pitch`-byte row of the object and nothing else of
    the object is written; a scatter reads them back from there."""
    spec = case.spec
    chunk_size, n, ids = _chunking(data, spec, distinct=True)
    pitch, offset = _sliced(data, spec)
    layout = spec.native(case.ptrs)
    layout.object_row_pitch, layout.object_row_offset = pitch, offset
    layout.validate()
    rows = spec.num_segments * spec.num_layers * chunk_size // spec.block_size * spec.rows_per_block
    obj_bytes = rows * pitch
    assert layout.object_bytes(chunk_size) == obj_bytes
    objs, ptrs = _objects(n, obj_bytes)
    cpu_gather(layout, chunk_size, ids, ptrs, obj_bytes)
    dense = gather_reference(case.buffers, spec, chunk_size, ids).reshape(n, rows, spec.row_bytes)
    want = np.full((n, rows, pitch), POISON, dtype=np.uint8)
    want[:, :, offset:offset + spec.row_bytes] = dense
    assert np.array_equal(objs[:n, :obj_bytes].reshape(n, rows, pitch), want)
    assert (objs[:n, obj_bytes:] == POISON).all(), "wrote past the object"
    for b in case.buffers:
        b[:] = 0
    cpu_scatter(layout, chunk_size, ids, ptrs, obj_bytes)
    assert np.array_equal(gather_reference(case.buffers, spec, chunk_size, ids).reshape(n, rows, spec.row_bytes), dense)


def test_a_slice_that_does_not_fit_its_object_row_is_refused():
    case = _simple_case()
    layout = case.spec.native(case.ptrs)
    layout.object_row_pitch, layout.object_row_offset = case.spec.row_bytes + 4, 8
    with pytest.raises(ValueError, match="does not fit an object row"):
        layout.validate()
    layout.object_row_pitch = 0
    with pytest.raises(ValueError, match="needs an object row pitch"):
        layout.validate()
