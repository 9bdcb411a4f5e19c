"""Tensor-parallel-shared chunk objects: which slice of one object a rank's KV cache is.

A tp-shared object holds every KV head of its chunk's tokens, ``[S, L, T, H * D]`` bytes for a
model of H KV heads of D bytes each (MLA: ``[1, L, T, W]``, the one latent every rank holds). A
rank at tensor-parallel size N holds heads ``[first, first + count)`` of each token: its bytes of a
token are one run at ``first * D`` of the object's row. So an engine of any TP size reads and
writes its own slice of the same object, and every TP size shares it.

The split is vLLM's (and SGLang's): with N <= H each rank holds H / N heads, rank r from head
r * H / N; with N > H the heads are replicated, N / H ranks hold each, rank r head r // (N / H).
The server proves it from what the registration says (the model's KV heads, the TP size, the
layer tensor's shape); a layout whose heads it cannot find (opaque blocks), or a world made of
pipeline stages, is refused at registration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from lmcache_mp.layout import LayoutError, LayoutSpec


@dataclass(frozen=True)
class HeadSlice:
    """A rank's heads of a tp-shared object: `count` heads from `first`, of `heads`, each
    `head_bytes` bytes of a token."""

    heads: int
    first: int
    count: int
    head_bytes: int

    @property
    def pitch(self) -> int:
        """Bytes of one token of one segment of one layer in the object (all heads)."""
        return self.heads * self.head_bytes

    @property
    def offset(self) -> int:
        """Where this rank's bytes start in each of the object's token rows."""
        return self.first * self.head_bytes

    @property
    def cover(self) -> int:
        """The heads it writes, as bits (the object is complete when its stores cover `full`)."""
        return ((1 << self.count) - 1) << self.first

    @property
    def full(self) -> int:
        return (1 << self.heads) - 1


def head_slice(spec: LayoutSpec, shape: Sequence[int], world_size: int, rank: int, num_kv_heads: int,
               pipeline_size: int = 1) -> HeadSlice:
    """The slice of a tp-shared object this registration reads and writes; LayoutError (one
    line saying why) when the server cannot prove it. `spec`: the layout of the registration's
    layer tensors (unpacked), `shape`: one layer tensor's shape."""
    if pipeline_size != 1:
        raise LayoutError(f"tp-shared chunks need one pipeline stage (got {pipeline_size}): a stage holds only "
                          "some layers of a chunk")
    if spec.kind == "mla":  # the same latent on every rank: the whole object, whatever the TP size
        return HeadSlice(heads=1, first=0, count=1, head_bytes=spec.token_bytes)
    if spec.kind not in ("mha", "block_major"):
        raise LayoutError(f"tp-shared chunks need a layout whose heads the server can find (mha, block_major, or "
                          f"per-layer views of them); {spec.kind!r} blocks are opaque")
    if num_kv_heads <= 0:
        raise LayoutError("tp-shared chunks need the model's number of KV heads (num_kv_heads)")
    local, head_size = int(shape[3]), int(shape[4])
    head_bytes = spec.token_bytes // local
    if world_size <= num_kv_heads:
        if num_kv_heads % world_size or local != num_kv_heads // world_size:
            raise LayoutError(f"a rank of {world_size} holds {local} of {num_kv_heads} KV heads; tp-shared chunks "
                              f"need {num_kv_heads} / {world_size} each, as tensor parallelism splits them")
        first = rank * local
    else:
        if world_size % num_kv_heads or local != 1:
            raise LayoutError(f"{world_size} ranks over {num_kv_heads} KV heads: tp-shared chunks need each rank to "
                              f"hold one head, replicated {world_size} / {num_kv_heads} times (it holds {local})")
        first = rank // (world_size // num_kv_heads)
    if head_bytes * local != spec.token_bytes or head_size <= 0:
        raise LayoutError(f"a token of {spec.token_bytes} bytes is not {local} heads of {head_size} elements")
    return HeadSlice(heads=num_kv_heads, first=first, count=local, head_bytes=head_bytes)
