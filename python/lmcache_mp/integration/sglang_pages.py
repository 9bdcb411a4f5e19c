"""SGLang's HiCache host pools as lmcache-mp KV caches: each page one chunk object.

A host pool keeps all of its KV in one tensor whose shape its `layout` names
(`MHATokenToKVPoolHost`: ``layer_first`` ``[2, L, tokens, H, D]``, ``page_first``
``[2, tokens, L, H, D]``, ``page_first_direct`` ``[2, pages, L, page, H, D]``, ``page_head``
``[2, pages, H, page, L, D]``; `MLATokenToKVPoolHost`: ``layer_first`` ``[L, tokens, 1, D]``,
``page_first`` ``[tokens, L, 1, D]``, ``page_first_direct`` ``[pages, L, page, 1, D]``). In every
one of them a page is a few contiguous runs of bytes: one per index of the dims outside the
token (or page) axis (2L runs for MHA ``layer_first``, 2 for MHA ``page_first``, 1 for MLA
``page_first``). Each run becomes one "layer" tensor ``[pages, run]`` of an ``opaque``
registration, so a page is copied as a few large memcpys and stored as one object: the runs
back to back.

SGLang names its pages with keys of its own, one per page, so the object must be one page
whatever the server's chunk size: the registration declares blocks of ``chunk_size`` tokens
(one block per chunk). That is only bookkeeping: an opaque block is never split per token. The
bytes' meaning (model, layout, dtype, page size, shard) goes into the namespace instead
(`PagePlan.format_tag`), so pages of different formats never share a key.

No SGLang import here: the pool's tensor, layout and geometry are passed in.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from lmcache_mp.layout import is_contiguous
from lmcache_mp.protocol import MAX_LAYERS

# (attention kind, layout) -> (axis of the buffer that indexes tokens or pages, which of the two)
PAGE_AXES: dict[tuple[str, str], tuple[int, str]] = {
    ("mha", "layer_first"): (2, "tokens"),
    ("mha", "page_first"): (1, "tokens"),
    ("mha", "page_first_direct"): (1, "pages"),
    ("mha", "page_head"): (1, "pages"),
    ("mla", "layer_first"): (1, "tokens"),
    ("mla", "page_first"): (0, "tokens"),
    ("mla", "page_first_direct"): (0, "pages"),
}


class UnsupportedPool(ValueError):
    """A host pool this backend cannot store (the message says why and what would work)."""


@dataclass(frozen=True)
class PagePlan:
    """How the pages of one host pool are registered: `runs` are the layer tensors of the
    opaque registration (``[num_pages, run_elems]`` views into the pool, no copies)."""

    kind: str
    layout: str
    page_size: int
    num_pages: int
    runs: tuple
    run_bytes: int
    dtype: str

    @property
    def page_bytes(self) -> int:
        return len(self.runs) * self.run_bytes

    @property
    def format_tag(self) -> str:
        """What a stored page's bytes mean, apart from the model and the shard."""
        return f"{self.kind}.{self.layout}.{self.dtype}.page{self.page_size}.{len(self.runs)}x{self.run_bytes}"


def plan_pages(kv_buffer, *, kind: str, layout: str, page_size: int, chunk_size: int) -> PagePlan:
    """Describe a host pool's `kv_buffer` (its single KV tensor) as page runs.

    Raises UnsupportedPool for layouts without contiguous page runs (e.g. ``page_unified``),
    pools whose buffer is not what their layout says, and pages whose runs a server of this
    chunk size cannot hold as opaque blocks."""
    import torch

    if not isinstance(kv_buffer, torch.Tensor):
        raise UnsupportedPool(f"the host pool's KV buffer is a {type(kv_buffer).__name__}, not one tensor")
    if kv_buffer.device.type != "cpu":
        raise UnsupportedPool(f"the host pool lives on {kv_buffer.device}, not in host memory")
    axes = PAGE_AXES.get((kind, layout))
    if axes is None:
        known = sorted(lay for k, lay in PAGE_AXES if k == kind)
        raise UnsupportedPool(f"the {kind.upper()} host layout {layout!r} is not supported; use one of {known} "
                              "(--hicache-mem-layout)")
    if page_size <= 0:
        raise UnsupportedPool(f"page size {page_size}")
    axis, unit = axes
    if kv_buffer.dim() <= axis:
        raise UnsupportedPool(f"a {layout} {kind.upper()} buffer of shape {list(kv_buffer.shape)} has no axis {axis}")
    buf = kv_buffer
    if unit == "tokens":
        tokens = buf.shape[axis]
        if tokens % page_size:
            raise UnsupportedPool(f"the pool's {tokens} tokens are not whole pages of {page_size}")
        buf = buf.unflatten(axis, (tokens // page_size, page_size))
    num_pages = buf.shape[axis]
    inner = buf.shape[axis + 1:]
    run_elems = math.prod(inner)
    if not is_contiguous(buf.shape[axis + 1:], buf.stride()[axis + 1:]):
        raise UnsupportedPool(f"a page of this {layout} buffer (shape {list(kv_buffer.shape)}, strides "
                              f"{list(kv_buffer.stride())}) is not made of contiguous runs")
    outer = buf.shape[:axis]
    runs = []
    for index in itertools.product(*(range(size) for size in outer)):
        run = buf[index] if index else buf
        runs.append(run.view(num_pages, run_elems))  # a view: the checks above make this possible
    if len(runs) > MAX_LAYERS:
        raise UnsupportedPool(f"a page of this pool is {len(runs)} separate runs, over the {MAX_LAYERS} a "
                              "registration may have; a page_first layout keeps a page in 1-2 runs")
    run_bytes = run_elems * buf.element_size()
    if run_bytes % chunk_size:
        raise UnsupportedPool(f"a page's runs are {run_bytes} bytes, not a multiple of the server's chunk size "
                              f"{chunk_size}, as an opaque block of one chunk must be: use a larger --page-size "
                              "or a page_first layout, or a server --chunk-size that divides it")
    return PagePlan(kind=kind, layout=layout, page_size=page_size, num_pages=num_pages, runs=tuple(runs),
                    run_bytes=run_bytes, dtype=str(kv_buffer.dtype).removeprefix("torch."))

