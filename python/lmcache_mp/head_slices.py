"""Tensor-parallel-shared chunk objects: which slice of one object a rank's KV cache is.

A tp-shared object holds every KV head of its chunk's tokens. Its rows are those of the layout's
own object with every head: for token layouts ``[S, L, T, H * D]`` bytes (H KV heads of D bytes
each; MLA ``[1, L, T, W]``, the one latent every rank holds); for opaque blocks whose heads are
their outermost dimension (vLLM's CPU cache, ``[blocks, H, block_size, ...]``) one row per block of
H heads. A rank at tensor-parallel size N holds heads ``[first, first + count)``: its bytes of a row
are one run at ``first * D`` of it. So an engine of any TP size reads and writes its own slice of
the same object, and every TP size of one engine shares it.

The split is vLLM's (and SGLang's): with N <= H each rank holds H / N heads, rank r from head
r * H / N; with N > H the heads are replicated, N / H ranks hold each, rank r head r // (N / H).
The server proves it from what the registration says (the model's KV heads, the TP size, the
layer tensor's shape and strides); a layout whose heads it cannot find, or a world made of
pipeline stages, is refused at registration.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from lmcache_mp.layout import LayoutError, LayoutSpec


@dataclass(frozen=True)
class HeadSlice:
    """A rank's heads of a tp-shared object: `count` heads from `first`, of `heads`, each
    `head_bytes` bytes of one row (a token, or a block when `rows` is "blocks")."""

    heads: int
    first: int
    count: int
    head_bytes: int
    rows: str = "tokens"

    @property
    def pitch(self) -> int:
        """Bytes of one row of one segment of one layer in the object (all heads)."""
        return self.heads * self.head_bytes

    @property
    def offset(self) -> int:
        """Where this rank's bytes start in each of the object's rows."""
        return self.first * self.head_bytes

    @property
    def cover(self) -> int:
        """The heads it writes, as bits (the object is complete when its stores cover `full`)."""
        return ((1 << self.count) - 1) << self.first

    @property
    def full(self) -> int:
        return (1 << self.heads) - 1


def _first_head(world_size: int, rank: int, local: int, num_kv_heads: int) -> int:
    if num_kv_heads <= 0:
        raise LayoutError("tp-shared chunks need the model's number of KV heads (num_kv_heads)")
    if world_size <= num_kv_heads:
        if num_kv_heads % world_size or local != num_kv_heads // world_size:
            raise LayoutError(f"a rank of {world_size} holds {local} of {num_kv_heads} KV heads; tp-shared chunks "
                              f"need {num_kv_heads} / {world_size} each, as tensor parallelism splits them")
        return rank * local
    if world_size % num_kv_heads or local != 1:
        raise LayoutError(f"{world_size} ranks over {num_kv_heads} KV heads: tp-shared chunks need each rank to "
                          f"hold one head, replicated {world_size} / {num_kv_heads} times (it holds {local})")
    return rank // (world_size // num_kv_heads)


def head_slice(spec: LayoutSpec, shape: Sequence[int], strides: Sequence[int], world_size: int, rank: int,
               num_kv_heads: int, pipeline_size: int = 1) -> tuple[LayoutSpec, HeadSlice]:
    """The layout to copy with and the slice of a tp-shared object this registration reads and
    writes; LayoutError (one line saying why) when the server cannot prove the split. `spec`:
    the layout of the registration's layer tensors (unpacked); `shape`, `strides`: one layer
    tensor's (elements)."""
    if pipeline_size != 1:
        raise LayoutError(f"tp-shared chunks need one pipeline stage (got {pipeline_size}): a stage holds only "
                          "some layers of a chunk")
    if spec.kind == "mla":  # the same latent on every rank: the whole object, whatever the TP size
        return spec, HeadSlice(heads=1, first=0, count=1, head_bytes=spec.row_bytes)
    if spec.kind in ("mha", "block_major"):
        local = int(shape[3])
        first = _first_head(world_size, rank, local, num_kv_heads)
        return spec, HeadSlice(heads=num_kv_heads, first=first, count=local, head_bytes=spec.row_bytes // local)
    if spec.kind != "opaque" or len(shape) != 4:
        raise LayoutError(f"tp-shared chunks need a layout whose heads the server can find (mha, block_major, "
                          f"mla, opaque [blocks, heads, block_size, ...]); this {spec.kind!r} one has shape "
                          f"{list(shape)}")
    # [blocks, heads, block_size, x]: which of heads and tokens lies outermost in a block's bytes
    local = int(shape[1])
    heads_stride, token_stride, inner_stride = int(strides[1]), int(strides[2]), int(strides[3])
    first = _first_head(world_size, rank, local, num_kv_heads)
    if heads_stride > token_stride and heads_stride > inner_stride:  # each head one run of the block
        return spec, HeadSlice(heads=num_kv_heads, first=first, count=local, head_bytes=spec.row_bytes // local,
                               rows="blocks")
    if token_stride >= heads_stride > inner_stride or (local == 1 and token_stride > inner_stride):
        # token-major blocks ([block_size, heads, x] in memory): token rows, each its heads side by side
        rows = dataclasses.replace(spec, rows_per_block=spec.block_size, row_bytes=spec.token_bytes,
                                   row_stride=spec.token_bytes)
        return rows, HeadSlice(heads=num_kv_heads, first=first, count=local, head_bytes=spec.token_bytes // local)
    raise LayoutError(f"tp-shared chunks need each head of an opaque block to be one run of it or of each token; "
                      f"strides {list(strides)} of shape {list(shape)} are neither")
