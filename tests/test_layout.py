import pytest

from lmcache_mp.layout import LayoutError, infer_layout


def test_mha_flash_attention_layout():
    # [2, NB, BS, H, D] contiguous, bf16
    s = infer_layout((2, 100, 16, 8, 128), (100 * 16 * 1024, 16 * 1024, 1024, 128, 1), 2, "bfloat16", 32)
    assert s.kind == "mha" and s.num_segments == 2 and s.num_blocks == 100 and s.block_size == 16
    assert s.token_bytes == 8 * 128 * 2
    assert s.segment_stride == 100 * 16 * 1024 * 2 and s.block_stride == 16 * 1024 * 2
    assert s.object_bytes(256) == 2 * 32 * 256 * 2048  # [S, L, T, W]


def test_block_major_layout():
    s = infer_layout((100, 2, 16, 8, 128), (2 * 16 * 1024, 16 * 1024, 1024, 128, 1), 2, "bfloat16", 4)
    assert s.kind == "block_major"
    assert s.block_stride == 2 * 16 * 1024 * 2 and s.segment_stride == 16 * 1024 * 2


def test_mla_layout():
    s = infer_layout((50, 64, 576), (64 * 576, 576, 1), 2, "bfloat16", 61)
    assert s.kind == "mla" and s.num_segments == 1 and s.token_bytes == 1152
    assert s.object_bytes(256) == 61 * 256 * 1152


def test_vllm_cpu_layout_is_opaque_whole_blocks():
    # [NB, H, BS, 2*D]: tokens of a block are not contiguous rows, so blocks are copied whole
    s = infer_layout((10, 2, 32, 64), (2 * 32 * 64, 32 * 64, 64, 1), 4, "float32", 2)
    assert s.kind == "opaque" and s.rows_per_block == 1 and s.block_size == 32
    assert s.block_bytes == 2 * 32 * 64 * 4 and s.token_bytes == 2 * 64 * 4
    assert s.format_key()[0] == "opaque"


def test_opaque_blocks_may_pack_their_dims_in_any_dense_order():
    # vLLM 0.32 on CUDA: logical [NB, H, BS, 2D] over memory [NB, BS, H, 2D]
    nb, h, bs, d2 = 10, 2, 32, 64
    hnd = infer_layout((nb, h, bs, d2), (h * bs * d2, bs * d2, d2, 1), 2, "bfloat16", 2)
    nhd = infer_layout((nb, h, bs, d2), (h * bs * d2, d2, h * d2, 1), 2, "bfloat16", 2)
    assert nhd.kind == "opaque" and nhd.block_size == bs and nhd.block_bytes == hnd.block_bytes
    assert nhd.block_stride == hnd.block_stride == h * bs * d2 * 2
    # The same bytes mean different things: never copied from one into the other.
    assert hnd.format_key() != nhd.format_key()
    with pytest.raises(LayoutError, match="densely packed"):  # a gap inside each block
        infer_layout((nb, h, bs, d2), (2 * h * bs * d2, 2 * d2, 2 * h * d2, 1), 2, "bfloat16", 2)
    with pytest.raises(LayoutError, match="densely packed"):  # heads overlap
        infer_layout((nb, h, bs, d2), (h * bs * d2, d2 // 2, h * d2, 1), 2, "bfloat16", 2)


def test_format_key_is_shared_by_token_layouts_with_equal_object_format():
    a = infer_layout((2, 10, 16, 2, 8), (10 * 16 * 16, 16 * 16, 16, 8, 1), 2, "bfloat16", 3)
    b = infer_layout((10, 2, 32, 2, 8), (2 * 32 * 16, 32 * 16, 16, 8, 1), 2, "bfloat16", 3)
    assert a.format_key() == b.format_key()  # same [2, L, T, W] bytes, other block size
    c = infer_layout((2, 10, 16, 2, 8), (10 * 16 * 16, 16 * 16, 16, 8, 1), 2, "float16", 3)
    assert a.format_key() != c.format_key()


@pytest.mark.parametrize(
    "shape,strides,kind,match",
    [
        ((2, 2, 16, 8, 128), (4096, 2048, 128, 16, 1), "auto", "pass layout"),
        ((2, 10, 16, 8, 128), (20480, 2048, 128, 1, 8), "auto", "contiguous"),  # heads not contiguous
        ((2, 10), (10, 1), "auto", "no KV layout"),
        ((3, 10, 16, 8, 128), (1, 1, 1, 1, 1), "mha", "size 2"),
        ((10, 16, 64), (1024, 64, 1), "weird", "unknown layout"),
        ((10, 0, 64), (1024, 64, 1), "auto", "positive"),
        ((10, 16, 64), (1024, -64, 1), "auto", "negative"),
    ],
)
def test_bad_layouts_raise_clear_errors(shape, strides, kind, match):
    with pytest.raises(LayoutError, match=match):
        infer_layout(shape, strides, 2, "bfloat16", 2, kind)


def test_overlapping_rows_rejected_by_native_validation():
    # block stride smaller than a block: blocks would overlap, scatter would corrupt neighbours
    s = infer_layout((10, 16, 64), (512, 64, 1), 2, "bfloat16", 1)
    with pytest.raises(ValueError, match="overlap"):
        s.native([4096])
