"""Random KV-cache geometries as NumPy buffers, shared by the data-plane tests."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from lmcache_mp.layout import LayoutSpec, infer_layout

DTYPES = {1: "uint8", 2: "bfloat16", 4: "float32"}


@dataclass
class KVCase:
    spec: LayoutSpec
    buffers: list[np.ndarray]  # one uint8 buffer per layer, starting at the layer's base
    keep: list[np.ndarray]  # the backing arrays

    @property
    def ptrs(self) -> list[int]:
        return [b.ctypes.data for b in self.buffers]


@st.composite
def kv_cases(draw, kinds=("mha", "block_major", "mla", "opaque"), max_blocks=24):
    kind = draw(st.sampled_from(kinds))
    esize = draw(st.sampled_from([1, 2, 4]))
    layers = draw(st.integers(1, 4))
    nb = draw(st.integers(2, max_blocks))
    bs = draw(st.sampled_from([1, 2, 4, 8, 16]))
    heads = draw(st.integers(1, 3))
    hd = draw(st.sampled_from([1, 3, 8, 16]))
    pad_tok = draw(st.sampled_from([0, 0, 1, 5]))  # extra elements between tokens: non-contiguous rows
    pad_blk = draw(st.sampled_from([0, 0, 7]))  # extra elements between blocks
    shared_buffer = draw(st.booleans())  # layers as views into one allocation
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "opaque":
        pad_tok = 0
    W = heads * hd  # elements per token row
    tok = W + pad_tok
    if kind == "mha":
        blk = bs * tok + pad_blk
        shape, strides = (2, nb, bs, heads, hd), (nb * blk, blk, tok, hd, 1)
        elems = 2 * nb * blk
    elif kind == "block_major":
        seg = bs * tok
        blk = 2 * seg + pad_blk
        shape, strides = (nb, 2, bs, heads, hd), (blk, seg, tok, hd, 1)
        elems = nb * blk
    elif kind == "mla":
        blk = bs * tok + pad_blk
        shape, strides = (nb, bs, W), (blk, tok, 1)
        elems = nb * blk
    else:  # vLLM CPU style [NB, H, BS, 2*D]
        inner = heads * bs * 2 * hd
        blk = inner + pad_blk
        shape, strides = (nb, heads, bs, 2 * hd), (blk, bs * 2 * hd, 2 * hd, 1)
        elems = nb * blk
    spec = infer_layout(shape, strides, esize, DTYPES[esize], layers, kind)
    layer_bytes = elems * esize
    keep, buffers = [], []
    if shared_buffer:
        big = rng.integers(0, 256, size=layers * layer_bytes + 64, dtype=np.uint8)
        keep.append(big)
        buffers = [big[16 + i * layer_bytes: 16 + (i + 1) * layer_bytes] for i in range(layers)]
    else:
        for _ in range(layers):
            b = rng.integers(0, 256, size=layer_bytes, dtype=np.uint8)
            keep.append(b)
            buffers.append(b)
    return KVCase(spec=spec, buffers=buffers, keep=keep)
