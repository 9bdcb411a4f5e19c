"""vLLM's KV-cache groups as the connector's `KVGroup`s, or a clear refusal at start-up.

A chunk stored under a prefix's hash must be the KV those tokens produce, whatever request reads
it. That holds for attention whose KV of a token depends on the tokens up to it only: full
attention (MLA included), sliding windows and chunked local attention (of which vLLM frees the
blocks of old tokens, so only the blocks still in the window are stored and loaded). It does not
hold, or the blocks do not hold per-token KV, for the kinds refused here; an engine configured
with one of those fails to start with a message naming the group, instead of computing with
wrong KV.

Recurrent states (Mamba2, Gated DeltaNet: vLLM's MambaSpec groups) are cached as STATE groups
when vLLM keeps them at block boundaries (prefix caching on, its "align" mode): the block of
boundary N holds the state after N tokens, one page per layer, stored where vLLM names a
boundary state and loaded into the block of the hit's boundary. Other state kinds (Mamba1,
short convolutions, plain linear attention) and speculative decoding's extra state blocks are
refused: their restore has not been shown to give the engine's own output.
"""

from __future__ import annotations

from typing import Any

from lmcache_mp.integration.connector_types import CHUNKED_LOCAL, FULL, SLIDING_WINDOW, STATE, KVGroup

SUPPORTED = ("full attention, MLA, sliding-window and chunked local attention, Mamba2 and Gated DeltaNet states "
             "(with prefix caching)")
STATE_KINDS = ("MAMBA2", "GDN_ATTN")  # vLLM's MambaAttentionBackendEnum names whose restore is tested


class UnsupportedKVCache(ValueError):
    pass


def _kind(spec: Any) -> tuple[str, int]:
    """(kind, window) of one layer's (or one group's) spec; UnsupportedKVCache otherwise."""
    from vllm.v1 import kv_cache_interface as kv

    name = type(spec).__name__
    refused = {
        "RSWASpec": "it frees blocks inside the prompt and expects its null block to stay zero",
        "SinkFullAttentionSpec": "its sink blocks are not KV of the prompt's tokens",
        "CrossAttentionSpec": "its KV comes from the encoder input, not from the prompt's tokens",
        "EncoderOnlyAttentionSpec": "an encoder keeps no KV cache between steps",
        "CircularBufferSpec": "its single block per request is rewritten in place",
        "HiddenStateCacheSpec": "it holds hidden states for drafting, not KV",
    }
    if name in refused:
        raise UnsupportedKVCache(f"{name}: {refused[name]}")
    if name.startswith("HiSparse"):
        raise UnsupportedKVCache(f"{name}: its blocks live in a separate host pool")
    if isinstance(spec, kv.UniformTypeKVCacheSpecs):
        kinds = {_kind(s) for s in spec.kv_cache_specs.values()}
        if len(kinds) != 1:
            raise UnsupportedKVCache(f"{name}: its layers keep different tokens ({sorted(kinds)})")
        return kinds.pop()
    if not isinstance(spec, kv.AttentionSpec):
        raise UnsupportedKVCache(f"{name}: not an attention KV cache")
    if getattr(spec, "tokens_per_state", 1) != 1:
        raise UnsupportedKVCache(f"{name}: one state covers {spec.tokens_per_state} tokens")
    if not getattr(spec, "prefix_cacheable", True):
        raise UnsupportedKVCache(f"{name}: vLLM does not cache its blocks by prefix either")
    if getattr(spec, "non_causal", False):
        raise UnsupportedKVCache(f"{name}: non-causal attention makes a token's KV depend on later tokens")
    if isinstance(spec, kv.SlidingWindowSpec):
        return SLIDING_WINDOW, int(spec.sliding_window)
    if isinstance(spec, kv.ChunkedLocalAttentionSpec):
        return CHUNKED_LOCAL, int(spec.attention_chunk_size)
    if isinstance(spec, kv.FullAttentionSpec):
        # With vLLM's hybrid manager off, sliding-window layers are FullAttentionSpec with a
        # window: vLLM then keeps every block, so they are stored as full attention.
        return FULL, 0
    raise UnsupportedKVCache(f"{name}: an attention kind this connector does not know")


def _state_detail(spec: Any) -> str:
    """What a MambaSpec group's pages hold, as part of its namespace ("GDN_ATTN:3x512:bfloat16,
    2x128x128:float32"); UnsupportedKVCache for a state this connector does not restore."""
    kind = getattr(getattr(spec, "mamba_type", None), "name", str(getattr(spec, "mamba_type", "")))
    if kind not in STATE_KINDS:
        raise UnsupportedKVCache(f"MambaSpec ({kind}): restoring this state kind is not tested "
                                 f"(supported: {', '.join(STATE_KINDS)})")
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "align":
        raise UnsupportedKVCache(
            f"MambaSpec ({kind}): vLLM keeps no state at block boundaries in its '{mode}' mode, so no prefix "
            "of this model can be stored or restored: start vLLM with --enable-prefix-caching")
    if getattr(spec, "num_speculative_blocks", 0):
        raise UnsupportedKVCache(f"MambaSpec ({kind}): speculative decoding's extra state blocks are not restored")
    states = ",".join("x".join(str(d) for d in shape) + ":" + str(dtype).removeprefix("torch.")
                      for shape, dtype in zip(spec.shapes, spec.dtypes))
    return f"{kind}:{states}:page{spec.page_size_bytes}"


def kv_groups(kv_cache_config: Any, default_block_size: int) -> list[KVGroup]:
    """The groups the connector stores and loads: every group vLLM transfers; one full group of
    `default_block_size` when vLLM gives no config. UnsupportedKVCache names the first group
    that cannot be cached."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups:
        return [KVGroup(0, FULL, default_block_size)]
    out = []
    for i, group in enumerate(groups):
        if not getattr(group, "enable_kv_transfer", True):
            continue  # rebuilt by vLLM from another group after a load
        spec = group.kv_cache_spec
        detail = ""
        try:
            if type(spec).__name__ == "MambaSpec":
                (kind, window), detail = (STATE, 0), _state_detail(spec)
            else:
                kind, window = _kind(spec)
        except UnsupportedKVCache as exc:
            layers = ", ".join(group.layer_names[:3]) + (", ..." if len(group.layer_names) > 3 else "")
            raise UnsupportedKVCache(
                f"lmcache-mp cannot cache KV-cache group {i} ({layers}): {exc}. Supported: {SUPPORTED}. "
                "Remove the kv-transfer config to serve this model without the cache."
            ) from None
        out.append(KVGroup(i, kind, int(spec.block_size), window, detail))
    if not out:
        raise UnsupportedKVCache("lmcache-mp: vLLM transfers none of this model's KV-cache groups")
    return out

