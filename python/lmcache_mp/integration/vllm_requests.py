"""What of a vLLM request goes into its chunk keys, and the per-request policy it asks for.

Keys must differ wherever the KV differs for the same token ids:
- the LoRA adapter and the cache salt (`cache_salt`, per tenant): all of the request's chunks;
- a multimodal input (image, audio, ...): its placeholder tokens are the same for every image,
  so the chunks its placeholders overlap, and every later chunk, are keyed by its content hash
  too, while chunks before it stay shareable with text-only prompts of the same prefix.
Prompt embeddings have no token ids that stand for them: such requests are not cached.

Per request, `kv_transfer_params` (vLLM's `SamplingParams(extra_args={"kv_transfer_params":
{...}})`) may ask `{"lmcache_mp.skip_save": true}` (nothing of this request is stored) or
`{"lmcache_mp.skip_load": true}` (it is not looked up); hints for the server (pin, retain, ...) are
request_hints.py's.
"""

from __future__ import annotations

from typing import Any

SKIP_SAVE, SKIP_LOAD = "lmcache_mp.skip_save", "lmcache_mp.skip_load"


def salt(request: Any) -> bytes:
    parts = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append("lora:" + str(getattr(lora, "lora_name", None) or getattr(lora, "lora_int_id", "")))
    cache_salt = getattr(request, "cache_salt", None)
    if cache_salt:
        parts.append("salt:" + str(cache_salt))
    return "\0".join(parts).encode() if parts else b""


def spans(request: Any) -> list[tuple[int, int, bytes]]:
    """(start, end, content hash) of every multimodal input's placeholder tokens."""
    out = []
    for feature in getattr(request, "mm_features", None) or ():
        pos = feature.mm_position
        ident = getattr(feature, "identifier", None) or getattr(feature, "mm_hash", None)
        out.append((int(pos.offset), int(pos.offset) + int(pos.length), f"{feature.modality}:{ident}".encode()))
    return out


def cacheable(request: Any) -> bool:
    return getattr(request, "prompt_embeds", None) is None


def asks(request: Any, key: str) -> bool:
    params = getattr(request, "kv_transfer_params", None)
    value = params.get(key) if isinstance(params, dict) else None
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)
