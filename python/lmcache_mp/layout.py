"""KV-cache layouts: from a layer tensor's shape and strides to the geometry the data plane copies.

Supported (shapes in elements, any dtype):

- ``mha``:          vLLM flash-attention ``[2, num_blocks, block_size, num_heads, head_size]``
- ``block_major``:  ``[num_blocks, 2, block_size, num_heads, head_size]``
- ``mla``:          ``[num_blocks, block_size, head_dim]``
- ``opaque``:       ``[num_blocks, ...]`` with each block packed in an engine-specific order, e.g.
  vLLM's CPU cache ``[num_blocks, num_heads, block_size, 2 * head_size]``; copied whole. The
  dims of a block may lie in memory in any order that packs them densely: vLLM 0.32's CUDA
  caches are that same logical shape over blocks stored token-major (``[NB, BS, H, 2D]``).
- ``packed`` (never asked for: found by `describe_layers`): per-layer views of any kind above
  into one block-outermost buffer, where one block of every layer lies side by side (vLLM's
  ``BLNHC``/``BLHNC`` layouts). The registration is then one cache whose block is one gap-free
  span of all layers' pages, moved whole: a chunk is ``chunk_size / block_size`` copies.

Token layouts may be strided (padding between tokens, blocks or K/V) as long as the bytes of one
token of one layer are contiguous. Host objects are ``[S, L, T, W]`` bytes (DESIGN.md); a packed
cache's are its blocks' spans one after the other (``[1, 1, T, W]`` with W the span's bytes per
token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

KINDS = ("mha", "block_major", "mla", "opaque")  # what a caller may name; "packed" is found, not named


class LayoutError(ValueError):
    """A KV-cache tensor that no supported layout describes."""


@dataclass(frozen=True)
class LayoutSpec:
    """Geometry of a registered KV cache, without its addresses. Strides are in bytes."""

    kind: str
    dtype: str
    num_layers: int
    num_blocks: int
    block_size: int
    num_segments: int
    segment_stride: int
    block_stride: int
    rows_per_block: int
    row_bytes: int
    row_stride: int
    # opaque only: the block's dims in memory order, outermost first, as (dim, size); what the
    # bytes of a block mean, so it is part of the format key.
    block_order: tuple[tuple[int, int], ...] = ()
    # packed only: one layer's spec (what each page of the span holds), and the registration
    # index of the layer whose page comes k-th in the span.
    layer: "LayoutSpec | None" = None
    layer_order: tuple[int, ...] = ()

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one segment of one layer."""
        return self.rows_per_block * self.row_bytes

    @property
    def token_bytes(self) -> int:
        """W: bytes of one token of one segment of one layer."""
        return self.block_bytes // self.block_size

    @property
    def model_layers(self) -> int:
        """The model's layers this cache holds (a packed cache is one span of all of them)."""
        return len(self.layer_order) if self.kind == "packed" else self.num_layers

    @property
    def page_bytes(self) -> int | None:
        """Bytes of one block of one layer (every segment) when they are one gap-free run that
        starts at the block's address; None otherwise."""
        if self.rows_per_block > 1 and self.row_stride != self.row_bytes:
            return None
        if self.num_segments > 1 and self.segment_stride != self.block_bytes:
            return None
        return self.num_segments * self.block_bytes

    @property
    def segment_bytes(self) -> int:
        """The contiguous bytes of one copy-engine copy: a block of one segment of one layer, or
        a row where rows have gaps (adjacent blocks may merge into larger copies, not counted)."""
        return self.block_bytes if self.rows_per_block == 1 or self.row_stride == self.row_bytes else self.row_bytes

    def addressed_layers(self) -> list[int]:
        """The registration's layers whose addresses the data plane takes: every layer, or for
        a packed cache the one whose page starts the span."""
        return [self.layer_order[0]] if self.kind == "packed" else list(range(self.num_layers))

    @property
    def layer_extent(self) -> int:
        """Bytes from a layer's base address to one past the last byte the layout touches."""
        return (
            (self.num_segments - 1) * self.segment_stride
            + (self.num_blocks - 1) * self.block_stride
            + (self.rows_per_block - 1) * self.row_stride
            + self.row_bytes
        )

    def object_bytes(self, chunk_size: int) -> int:
        return self.num_segments * self.num_layers * chunk_size * self.token_bytes

    def format_key(self) -> tuple:
        """What the bytes of a host object mean. Objects are only ever copied into a cache whose
        key is equal: token layouts share the [S, L, T, W] format whatever their block size or
        strides; opaque blocks are only meaningful to the same block size and packing."""
        if self.kind == "opaque":
            return ("opaque", self.block_size, self.num_layers, self.token_bytes, self.dtype, self.block_order)
        if self.kind == "packed":  # the span: pages in layer_order, each as its layer's layout packs it
            page = self.layer
            return ("packed", self.block_size, self.layer_order, page.num_segments, page.block_bytes, self.dtype,
                    page.block_order)
        return ("tokens", self.num_segments, self.num_layers, self.token_bytes, self.dtype)

    def native(self, layer_ptrs: Sequence[int]):
        """The C++ descriptor with these layer addresses."""
        from lmcache_mp import native

        if len(layer_ptrs) != self.num_layers:
            raise LayoutError(f"expected {self.num_layers} layer addresses, got {len(layer_ptrs)}")
        n = native.KVLayout()
        n.layer_ptrs = [int(p) for p in layer_ptrs]
        n.num_blocks = self.num_blocks
        n.block_size = self.block_size
        n.num_segments = self.num_segments
        n.segment_stride = self.segment_stride
        n.block_stride = self.block_stride
        n.rows_per_block = self.rows_per_block
        n.row_bytes = self.row_bytes
        n.row_stride = self.row_stride
        n.validate()
        return n


def is_contiguous(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether the (element) dims are C-contiguous, ignoring dims of size 1."""
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _check_contiguous(shape: Sequence[int], strides: Sequence[int], what: str) -> None:
    if not is_contiguous(shape, strides):
        raise LayoutError(f"{what} must be contiguous (shape {list(shape)}, strides {list(strides)})")


def _dense_order(shape: Sequence[int], strides: Sequence[int], what: str) -> tuple[tuple[int, int], ...]:
    """The dims (of size > 1) in memory order, outermost first, as (dim, size); raise unless
    they pack densely, in whatever order: then the bytes form one gap-free run."""
    dims = sorted(((st, i, sz) for i, (sz, st) in enumerate(zip(shape, strides)) if sz != 1), reverse=True)
    expected = 1
    for st, _, sz in reversed(dims):
        if st != expected:
            raise LayoutError(f"{what} must be densely packed (shape {list(shape)}, strides {list(strides)})")
        expected *= sz
    return tuple((i, sz) for _, i, sz in dims)


def _guess_kind(shape: Sequence[int]) -> str:
    if len(shape) == 5:
        if shape[0] == 2 and shape[1] != 2:
            return "mha"
        if shape[1] == 2 and shape[0] != 2:
            return "block_major"
        raise LayoutError(f"shape {list(shape)} could be 'mha' or 'block_major': pass layout= explicitly")
    if len(shape) == 3:
        return "mla"
    if len(shape) == 4:
        return "opaque"
    raise LayoutError(f"no KV layout has {len(shape)} dimensions (shape {list(shape)})")


def infer_layout(
    shape: Sequence[int],
    strides: Sequence[int],
    element_size: int,
    dtype: str,
    num_layers: int,
    kind: str = "auto",
    block_size: int | None = None,
) -> LayoutSpec:
    """Describe one layer tensor (all layers must share shape, strides and dtype).

    `strides` are in elements, as torch and numpy-divided-by-itemsize report them. For `opaque`
    layouts `block_size` defaults to dim 2 (vLLM's CPU cache ``[NB, H, BS, 2*D]``).
    """
    shape = [int(s) for s in shape]
    strides = [int(s) for s in strides]
    if len(shape) != len(strides):
        raise LayoutError(f"shape {shape} and strides {strides} differ in length")
    if any(s <= 0 for s in shape):
        raise LayoutError(f"every dimension must be positive, got shape {shape}")
    if any(s < 0 for s in strides):
        raise LayoutError(f"negative strides are not supported, got {strides}")
    if element_size <= 0 or num_layers <= 0:
        raise LayoutError("element_size and num_layers must be positive")
    if kind == "auto":
        kind = _guess_kind(shape)
    if kind not in KINDS:
        raise LayoutError(f"unknown layout {kind!r}; expected one of {KINDS} or 'auto'")
    e = element_size
    common = dict(kind=kind, dtype=dtype, num_layers=num_layers)
    if kind in ("mha", "block_major"):
        if len(shape) != 5:
            raise LayoutError(f"layout {kind!r} needs 5 dimensions, got shape {shape}")
        seg_dim, blk_dim = (0, 1) if kind == "mha" else (1, 0)
        if shape[seg_dim] != 2:
            raise LayoutError(f"layout {kind!r} needs size 2 (K, V) in dim {seg_dim}, got shape {shape}")
        _check_contiguous(shape[3:], strides[3:], "the heads x head_size of one token")
        row_bytes = shape[3] * shape[4] * e
        return LayoutSpec(
            **common,
            num_blocks=shape[blk_dim],
            block_size=shape[2],
            num_segments=2,
            segment_stride=strides[seg_dim] * e,
            block_stride=strides[blk_dim] * e,
            rows_per_block=shape[2],
            row_bytes=row_bytes,
            row_stride=strides[2] * e if shape[2] > 1 else row_bytes,
        )
    if kind == "mla":
        if len(shape) != 3:
            raise LayoutError(f"layout 'mla' needs 3 dimensions, got shape {shape}")
        _check_contiguous(shape[2:], strides[2:], "the head_dim of one token")
        row_bytes = shape[2] * e
        return LayoutSpec(
            **common,
            num_blocks=shape[0],
            block_size=shape[1],
            num_segments=1,
            segment_stride=0,
            block_stride=strides[0] * e,
            rows_per_block=shape[1],
            row_bytes=row_bytes,
            row_stride=strides[1] * e if shape[1] > 1 else row_bytes,
        )
    # opaque: whole blocks, each one gap-free run of bytes
    if len(shape) < 2:
        raise LayoutError(f"layout 'opaque' needs at least 2 dimensions, got shape {shape}")
    order = _dense_order(shape[1:], strides[1:], "an opaque block")
    bs = block_size if block_size is not None else (shape[2] if len(shape) > 2 else 1)
    block_bytes = math.prod(shape[1:]) * e
    if bs <= 0 or block_bytes % bs:
        raise LayoutError(f"block of {block_bytes} bytes cannot hold {bs} tokens evenly")
    return LayoutSpec(
        **common,
        num_blocks=shape[0],
        block_size=bs,
        num_segments=1,
        segment_stride=0,
        block_stride=strides[0] * e,
        rows_per_block=1,
        row_bytes=block_bytes,
        row_stride=block_bytes,
        block_order=order,
    )


def describe_kind(spec: LayoutSpec) -> str:
    """The layout's kind for people: a packed cache says what its pages are."""
    if spec.kind == "packed":
        return f"packed {spec.layer.kind} (block-outermost, {spec.row_bytes} bytes per block)"
    return spec.kind


def pack_layers(spec: LayoutSpec, offsets: Sequence[int]) -> LayoutSpec | None:
    """`spec`'s layers, at these byte offsets of one allocation, as one packed cache, when they
    are views into a block-outermost buffer: each layer's page of a block is one gap-free run,
    the pages of one block lie side by side with no gap (in any order of the layers), and the
    block stride leaves room for all of them. None when they are not (a per-layer cache)."""
    n, page = len(offsets), spec.page_bytes
    if n < 2 or page is None or spec.block_stride < n * page:
        return None
    order = tuple(sorted(range(n), key=lambda i: offsets[i]))
    first = offsets[order[0]]
    if any(offsets[i] != first + k * page for k, i in enumerate(order)):
        return None
    span = n * page
    return LayoutSpec(kind="packed", dtype=spec.dtype, num_layers=1, num_blocks=spec.num_blocks,
                      block_size=spec.block_size, num_segments=1, segment_stride=0, block_stride=spec.block_stride,
                      rows_per_block=1, row_bytes=span, row_stride=span, layer=spec, layer_order=order)


def describe_layers(layers: Sequence[Any], kind: str = "auto", block_size: int | None = None) -> LayoutSpec:
    """The layout of a registration's layer tensors, as server and client both derive it. Each
    layer has .shape, .strides (elements), .dtype, .element_size and .memory (.kind, .handle or
    .name: the allocation; .offset: where the tensor starts in it). Every layer must share one
    shape, strides and dtype; views into one block-outermost allocation become a packed cache."""
    if not layers:
        raise LayoutError("a KV cache needs at least one layer tensor")
    first = layers[0]
    for i, layer in enumerate(layers):
        if (list(layer.shape), list(layer.strides), layer.dtype, layer.element_size) != (
            list(first.shape), list(first.strides), first.dtype, first.element_size,
        ):
            raise LayoutError(f"layer {i} differs from layer 0 in shape, strides or dtype")
    spec = infer_layout(first.shape, first.strides, first.element_size, first.dtype, len(layers), kind,
                        block_size=block_size)

    def allocation(m) -> tuple:
        return (m.kind, m.handle if m.kind == "cuda_ipc" else m.name)

    # memory the server cannot name (a client's private memory) has no offsets to compare
    if any(layer.memory.kind not in ("shm", "cuda_ipc") for layer in layers):
        return spec
    if len({allocation(layer.memory) for layer in layers}) != 1:
        return spec
    return pack_layers(spec, [int(layer.memory.offset) for layer in layers]) or spec
