"""A plain NumPy implementation of gather/scatter: the oracle the data plane is tested against.

It indexes each layer as a strided ``[S, num_blocks, rows, row_bytes]`` byte array and builds
``[S, L, T, W]`` objects with fancy indexing, independently of the C++ and CUDA code.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from lmcache_mp.layout import LayoutSpec


def _layer_view(buf: np.ndarray, spec: LayoutSpec) -> np.ndarray:
    if buf.dtype != np.uint8 or buf.ndim != 1 or buf.size < spec.layer_extent:
        raise ValueError("each layer buffer must be a 1-D uint8 array covering the layer's extent")
    return as_strided(
        buf,
        shape=(spec.num_segments, spec.num_blocks, spec.rows_per_block, spec.row_bytes),
        strides=(spec.segment_stride, spec.block_stride, spec.row_stride, 1),
        writeable=True,
    )


def gather_reference(layers: list[np.ndarray], spec: LayoutSpec, chunk_size: int, block_ids) -> np.ndarray:
    """Objects ``[n_chunks, object_bytes]`` (uint8) for the chunks whose blocks are block_ids."""
    bpc = chunk_size // spec.block_size
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1, bpc)
    n = ids.shape[0]
    out = np.empty((n, spec.num_segments, spec.num_layers, bpc, spec.block_bytes), dtype=np.uint8)
    if n == 0:
        return out.reshape(0, spec.object_bytes(chunk_size))
    for l, buf in enumerate(layers):
        v = _layer_view(buf, spec)[:, ids]  # [S, n, bpc, rows, row_bytes]
        out[:, :, l] = v.transpose(1, 0, 2, 3, 4).reshape(n, spec.num_segments, bpc, spec.block_bytes)
    return out.reshape(n, -1)


def scatter_reference(
    layers: list[np.ndarray], spec: LayoutSpec, chunk_size: int, block_ids, objects: np.ndarray
) -> None:
    """Write objects ``[n_chunks, >= object_bytes]`` back into the blocks block_ids."""
    bpc = chunk_size // spec.block_size
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1, bpc)
    n = ids.shape[0]
    if n == 0:
        return
    need = spec.object_bytes(chunk_size)
    obj = np.asarray(objects, dtype=np.uint8)[:, :need].reshape(
        n, spec.num_segments, spec.num_layers, bpc, spec.rows_per_block, spec.row_bytes
    )
    for l, buf in enumerate(layers):
        v = _layer_view(buf, spec)
        v[:, ids] = obj[:, :, l].transpose(1, 0, 2, 3, 4)
