"""SGLang's device pools, as the unified cache linker sees them, described as lmcache-mp registrations.

A linker moves pages straight between SGLang's device pools and the server, so each pool is
registered with the server as vLLM's KV caches are (CUDA tensors over IPC; CPU tensors in shared
memory) and the server copies. Every pool is a list of *runs*: ``[rows, row_elems]`` views into
SGLang's own buffers, no copies. A row is what one key names:

- **KV** (the full-attention pool): a page of ``page_size`` token rows of every layer, K layers
  then V layers for MHA, one latent run per layer for MLA. Those are exactly the runs of a page of
  HiCache's ``layer_first`` host layout, so the page is the same object in the same namespace as
  the HiCache backend's (`sglang_pages.PagePlan.format_tag`).
- **SWA** (the window layers' pool of a sliding-window hybrid): the same as KV, its own namespace.
- **MAMBA**: one state slot (row) per layer, one registration per state tensor (the temporal SSM
  state, then each convolution state: their rows differ in size and dtype), keyed by the page key
  of the boundary the state summarises.

With ``lmcache_mp.layer_groups`` over 1 the KV pool is registered as that many parts instead, each
the runs of a range of its layers (`split_layer_groups`), so that a load lands, and completes,
group by group in layer order. Such a part's page is an object of its own, in a namespace of its
own: pages shared with HiCache instances need the single part.

No SGLang import here: the pools are read through their attributes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from lmcache_mp.integration.sglang_pages import UnsupportedPool
from lmcache_mp.protocol import MAX_LAYERS

KV, SWA, MAMBA = "kv", "swa", "mamba"  # SGLang's PoolName values


@dataclass(frozen=True)
class PoolPart:
    """One registration: `runs` are ``[rows, row_elems]`` views, one per layer (and K/V)."""

    pool: str  # KV, SWA or MAMBA
    tag: str  # the bytes' format, part of the namespace
    runs: tuple
    rows_are_pages: bool  # KV/SWA: a row is a page of `page_size` token slots; MAMBA: a state slot
    row_bytes: int
    group: int = -1  # KV: its layer group (LinkerPools.group_ends); -1: read before every group

    @property
    def object_bytes(self) -> int:
        """Bytes of one row's object (every run's row)."""
        return self.row_bytes * len(self.runs)


@dataclass
class LinkerPools:
    """Every pool of one SGLang worker: parts by pool name, and the model's layers (the layer
    counter's size)."""

    parts: dict[str, list[PoolPart]] = field(default_factory=dict)
    num_layers: int = 0
    page_size: int = 1
    attention: str = "mha"  # of the KV pool: "mha" or "mla" (MLA pages are the same on every rank)
    kv_layers: tuple = ()  # the layer counter's index of each layer of the KV pool, in pool order
    # per KV group, the counter's layers [previous end, end) it completes (with the ungrouped parts)
    group_ends: tuple = ()

    def tensors(self) -> list:
        return [run for parts in self.parts.values() for part in parts for run in part.runs]


def _dtype(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def _page_runs(buffers, page_size: int, what: str) -> tuple[tuple, int]:
    """``[tokens, ...]`` per-layer buffers as ``[pages, page_elems]`` views."""
    runs = []
    for buf in buffers:
        tokens = buf.shape[0]
        if tokens % page_size:
            raise UnsupportedPool(f"the {what} pool's {tokens} token rows are not whole pages of {page_size}")
        if not buf.is_contiguous():
            raise UnsupportedPool(f"a layer of the {what} pool (shape {list(buf.shape)}, strides "
                                  f"{list(buf.stride())}) is not contiguous")
        runs.append(buf.view(tokens // page_size, -1))
    if not runs:
        raise UnsupportedPool(f"the {what} pool has no layers")
    sizes = {(r.shape[1], r.dtype) for r in runs}
    if len(sizes) != 1:
        raise UnsupportedPool(f"the {what} pool's layers differ in page size or dtype: {sorted(map(str, sizes))}")
    return tuple(runs), runs[0].shape[1] * runs[0].element_size()


def _attention_part(pool_name: str, dev, page_size: int) -> tuple[PoolPart, str]:
    """The part of an MHA (k_buffer/v_buffer) or MLA (kv_buffer) device pool, and its kind."""
    if getattr(dev, "k_scale_buffer", None) is not None or getattr(dev, "native_k_scale_buffer", None) is not None:
        raise UnsupportedPool(f"the {pool_name} pool keeps KV scales (scaled fp8/fp4 KV): not supported yet")
    if hasattr(dev, "k_buffer") and hasattr(dev, "v_buffer"):
        kind, buffers = "mha", [*dev.k_buffer, *dev.v_buffer]
    elif isinstance(getattr(dev, "kv_buffer", None), (list, tuple)):
        kind, buffers = "mla", list(dev.kv_buffer)
    else:
        raise UnsupportedPool(f"the {pool_name} pool is a {type(dev).__name__}: neither MHA (k_buffer, v_buffer) "
                              "nor MLA (kv_buffer per layer)")
    runs, run_bytes = _page_runs(buffers, page_size, pool_name)
    tag = f"{kind}.layer_first.{_dtype(runs[0])}.page{page_size}.{len(runs)}x{run_bytes}"
    if pool_name != KV:
        tag = f"{pool_name}.{tag}"
    return PoolPart(pool=pool_name, tag=tag, runs=runs, rows_are_pages=True, row_bytes=run_bytes), kind


def _mamba_parts(req_to_token_pool) -> list[PoolPart]:
    pool = getattr(req_to_token_pool, "mamba_pool", None)
    if pool is None:
        raise UnsupportedPool("a MAMBA component without a Mamba pool in req_to_token_pool")
    for side in ("mamba_ckpt_pool",):
        if getattr(req_to_token_pool, side, None) is not None:
            raise UnsupportedPool("int8 Mamba checkpoints are not supported yet")
    for side in ("short_conv_pool", "ngram_pool"):
        if getattr(getattr(req_to_token_pool, side, None), "enabled", False):
            raise UnsupportedPool(f"Mamba side states ({side}) are not supported yet")
    cache = pool.mamba_cache
    layers = range(pool.num_mamba_layers)
    parts = []
    for i, state in enumerate((cache.temporal, *cache.conv)):
        if state.numel() == 0:  # conv-only models carry an empty temporal state
            continue
        runs = []
        for layer in layers:
            rows = state[layer]
            if not rows.is_contiguous():
                raise UnsupportedPool(f"Mamba state {i} of layer {layer} is not contiguous")
            runs.append(rows.view(rows.shape[0], -1))
        row_bytes = runs[0].shape[1] * runs[0].element_size()
        shape = "x".join(str(d) for d in state.shape[2:])
        parts.append(PoolPart(pool=MAMBA, tag=f"mamba.state{i}.{_dtype(state)}.{shape}.{len(runs)}x{row_bytes}",
                              runs=tuple(runs), rows_are_pages=False, row_bytes=row_bytes))
    if not parts:
        raise UnsupportedPool("the Mamba pool holds no state")
    return parts


def describe_pools(kvcache, req_to_token_pool, components: set[str], page_size: int) -> LinkerPools:
    """The pools of a worker whose tree has these components ("FULL", "SWA", "MAMBA").

    Supported: plain MHA and MLA pools; FULL + MAMBA over an MHA or MLA full-attention pool
    (HybridLinearKVPool); FULL + SWA (+ MAMBA) over SWAKVPool. Anything else is refused with the
    reason, at start-up."""
    unknown = set(components) - {"FULL", "SWA", "MAMBA"}
    if unknown or "FULL" not in components:
        raise UnsupportedPool(f"tree components {sorted(components)}: the lmcache-mp linker supports FULL, with SWA "
                              "and MAMBA beside it")
    out = LinkerPools(page_size=page_size)
    start = getattr(kvcache, "start_layer", 0) or 0
    layers: set[int] = set()
    if "SWA" in components:
        if not (hasattr(kvcache, "full_kv_pool") and hasattr(kvcache, "swa_kv_pool")):
            raise UnsupportedPool(f"an SWA component over a {type(kvcache).__name__}, not an SWA KV pool")
        full, out.attention = _attention_part(KV, kvcache.full_kv_pool, page_size)
        swa, _ = _attention_part(SWA, kvcache.swa_kv_pool, page_size)
        out.parts[KV], out.parts[SWA] = [full], [swa]
        layers.update(gid - start for gid in getattr(kvcache, "layers_mapping", {}))
    elif hasattr(kvcache, "full_kv_pool"):  # HybridLinearKVPool: attention layers beside Mamba layers
        full, out.attention = _attention_part(KV, kvcache.full_kv_pool, page_size)
        out.parts[KV] = [full]
        layers.update(gid - start for gid in getattr(kvcache, "full_attention_layer_id_mapping", {}))
    else:
        if getattr(kvcache, "swa_kv_pool", None) is not None:
            raise UnsupportedPool(f"a {type(kvcache).__name__} with a sliding-window pool but no SWA component")
        full, out.attention = _attention_part(KV, kvcache, page_size)
        out.parts[KV] = [full]
        layers.update(range(getattr(kvcache, "layer_num", 0) or 0))
    if "MAMBA" in components:
        out.parts[MAMBA] = _mamba_parts(req_to_token_pool)
        layers.update(gid - start for gid in getattr(req_to_token_pool, "mamba_map", {}) or {})
    out.num_layers = max(layers) + 1 if layers else len(out.parts[KV][0].runs)
    out.kv_layers = _kv_layers(kvcache, out, start)
    out.parts[KV][0] = replace(out.parts[KV][0], group=0)
    out.group_ends = (out.num_layers,)
    for parts in out.parts.values():
        for part in parts:
            if len(part.runs) > MAX_LAYERS:
                raise UnsupportedPool(f"the {part.pool} pool has {len(part.runs)} runs per row, over the "
                                      f"{MAX_LAYERS} a registration may have")
    return out


def _kv_layers(kvcache, pools: LinkerPools, start: int) -> tuple:
    """The counter's layer of each layer of the KV pool (model layer minus the pool's first)."""
    (part,) = pools.parts[KV]
    n = len(part.runs) // (2 if pools.attention == "mha" else 1)
    if hasattr(kvcache, "full_kv_pool") and hasattr(kvcache, "swa_kv_pool"):
        mapping = {idx: gid for gid, (idx, is_swa) in getattr(kvcache, "layers_mapping", {}).items() if not is_swa}
    elif hasattr(kvcache, "full_kv_pool"):
        mapping = {idx: gid for gid, idx in getattr(kvcache, "full_attention_layer_id_mapping", {}).items()}
    else:
        return tuple(range(n))
    if sorted(mapping) != list(range(n)):
        return tuple(range(n))
    return tuple(mapping[i] - start for i in range(n))


def split_layer_groups(pools: LinkerPools, groups: int) -> int:
    """Register the KV pool as `groups` parts of consecutive layers (as even as can be) instead of
    one; returns the number of groups made (1: the pool's layers cannot be split in order)."""
    (full,) = pools.parts[KV]
    n = len(pools.kv_layers)
    groups = max(1, min(groups, n))
    if groups == 1 or list(pools.kv_layers) != sorted(pools.kv_layers):
        return 1
    mha = pools.attention == "mha"
    parts, ends = [], []
    for g in range(groups):
        a, b = g * n // groups, (g + 1) * n // groups
        runs = full.runs[a:b] + (full.runs[n + a:n + b] if mha else ())
        parts.append(replace(full, tag=f"{full.tag}.layers{a}-{b - 1}", runs=runs, group=g))
        ends.append(pools.num_layers if g == groups - 1 else pools.kv_layers[b])  # up to the next group's first
    pools.parts[KV] = parts
    pools.group_ends = tuple(ends)
    return groups


def registration_geometry(part: PoolPart, server_chunk_size: int) -> tuple[int, int]:
    """(block_size, chunk_size) of the opaque registration of a part, one row per chunk.

    Pages whose runs the server's chunk size divides are registered as the HiCache backend
    registers its pages (blocks of the server's chunk size), so the two share objects; other
    rows (state slots, odd page sizes) as one-"token" blocks and chunks of their own."""
    if part.rows_are_pages and part.row_bytes % server_chunk_size == 0:
        return server_chunk_size, 0
    return 1, 1


def page_rows(indices, page_size: int, what: str):
    """The rows (pages) of whole, aligned pages of token slots, as int32."""
    import numpy as np
    import torch

    idx = indices.detach().to("cpu", torch.int64).reshape(-1)
    if idx.numel() % page_size:
        raise ValueError(f"{what}: {idx.numel()} slots are not whole pages of {page_size}")
    rows = idx.view(-1, page_size)
    first = rows[:, 0]
    if bool((first % page_size).any()) or (page_size > 1 and not bool((rows[:, 1:] - rows[:, :-1] == 1).all())):
        raise ValueError(f"{what}: the slots are not whole aligned pages")
    return (first // page_size).numpy().astype(np.int32)


def slot_rows(indices):
    import numpy as np
    import torch

    return indices.detach().to("cpu", torch.int64).reshape(-1).numpy().astype(np.int32)


def total_bytes(pools: LinkerPools) -> int:
    return sum(math.prod(r.shape) * r.element_size() for r in pools.tensors())
