"""Which KV-cache layout the connector asks vLLM for (vLLM 0.32+: `get_required_kvcache_layout`).

A block-outermost layout (`BLNHC`, `BLHNC`: every layer's page of a block side by side) hands the
connector per-layer views into one buffer whose blocks are single spans of 1-2 MiB; the server
moves each as one copy-engine copy, with no kernel, so an engine busy computing keeps its GPU
(docs/PERFORMANCE.md). vLLM adopts a connector's layout only if every attention backend of the
model accepts it (else it warns and takes its own first choice), and `VLLM_KV_CACHE_LAYOUT`
overrides both; so the connector asks for the first block-outermost layout the backends accept
and says in one line what it asked for and why.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)


def _accepted_layouts(vllm_config: Any) -> list[str] | None:
    """The layouts every attention backend of the model accepts, most preferred first; None when
    this vLLM cannot tell (then vLLM itself drops a layout its backends refuse)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

        return [layout.name for layout in get_supported_kv_cache_layouts(get_current_attn_backends(vllm_config))]
    except Exception as e:  # noqa: BLE001 - an older or newer vLLM: ask, vLLM decides
        logger.debug("lmcache-mp: the attention backends' KV-cache layouts are unknown (%s)", e)
        return None


def packs_blocks(name: str) -> bool:
    """Whether vLLM's layout `name` puts a block's pages of all layers side by side, each page
    one run of bytes (block-outermost and block-compact)."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[name]
    return layout.is_block_outermost and layout.is_block_compact


def choose_kv_cache_layout(vllm_config: Any) -> tuple[str | None, str]:
    """(the layout to ask vLLM for, or None for vLLM's own choice; why, for one INFO line)."""
    try:
        from vllm.v1.kv_cache_layout import KVCacheLayout
    except ImportError:
        return None, "this vLLM has no block-outermost KV-cache layouts: each layer's blocks are copied apart"
    forced = os.environ.get("VLLM_KV_CACHE_LAYOUT")
    if forced:
        how = ("each block moves as one copy" if forced in KVCacheLayout.__members__ and packs_blocks(forced)
               else "each layer's blocks are copied apart")
        return None, f"VLLM_KV_CACHE_LAYOUT={forced} decides the KV-cache layout: {how}"
    accepted = _accepted_layouts(vllm_config)
    if accepted is None:
        return "BLNHC", ("asking vLLM for the block-outermost KV-cache layout BLNHC (vLLM keeps its own if the "
                         "attention backend refuses it): each block moves as one copy")
    packed = [name for name in accepted if name in KVCacheLayout.__members__ and packs_blocks(name)]
    if not packed:
        return None, (f"the attention backend accepts only the KV-cache layouts {', '.join(accepted)}, none "
                      "block-outermost: each layer's blocks are copied apart (packing kernels on the GPU)")
    return packed[0], (f"asking vLLM for the block-outermost KV-cache layout {packed[0]}: each block of all "
                       "layers moves as one copy, with no kernel")
