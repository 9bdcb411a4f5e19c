"""vLLM's KV events for the chunks the connector stores: BlockStored / BlockRemoved, medium "CPU".

vLLM publishes what the connector's `take_events` returns through its own publisher (ZeroMQ,
`--kv-events-config`), from the scheduler: one publisher per engine, whatever the number of
ranks. A chunk is announced as the blocks vLLM would announce for the same tokens: vLLM's own
block hashes (`request.block_hashes`, at vLLM's hash block size), the parent block's hash, the
chunk's token ids, the LoRA adapter, the KV-cache group. Routers that index vLLM's GPU blocks
by hash therefore find the server's copies under the same keys.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored

from lmcache_mp.integration.connector_types import CHUNKED_LOCAL, SLIDING_WINDOW, KVGroup

try:
    from vllm.distributed.kv_events import MEDIUM_CPU
except ImportError:  # pragma: no cover - older vLLM
    MEDIUM_CPU = "CPU"

try:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
except ImportError:  # pragma: no cover - older vLLM
    def maybe_convert_block_hash(h):
        return h

_SPEC_KIND = {SLIDING_WINDOW: "sliding_window", CHUNKED_LOCAL: "chunked_local_attention"}


def chunk_events(request: Any, chunk: int, chunk_size: int, hash_block_size: int,
                 group: KVGroup) -> tuple[BlockStored, BlockRemoved] | None:
    """The (stored, removed) events of chunk `chunk` of `request` in `group`; None when vLLM has
    not hashed its blocks (yet)."""
    per_chunk = chunk_size // hash_block_size
    first = chunk * per_chunk
    hashes = list(getattr(request, "block_hashes", ())[first : first + per_chunk])
    if len(hashes) < per_chunk:
        return None
    block_hashes = [maybe_convert_block_hash(h) for h in hashes]
    parent = maybe_convert_block_hash(request.block_hashes[first - 1]) if first else None
    lora = getattr(request, "lora_request", None)
    stored = BlockStored(
        block_hashes=block_hashes,
        parent_block_hash=parent,
        token_ids=list(request.all_token_ids[chunk * chunk_size : (chunk + 1) * chunk_size]),
        block_size=hash_block_size,
        lora_id=getattr(lora, "lora_int_id", None) if lora is not None else None,
        medium=MEDIUM_CPU,
        lora_name=getattr(lora, "lora_name", None) if lora is not None else None,
        group_idx=group.index,
        kv_cache_spec_kind=_SPEC_KIND.get(group.kind, "full_attention"),
        kv_cache_spec_sliding_window=group.window if group.kind == SLIDING_WINDOW else None,
    )
    removed = BlockRemoved(block_hashes=block_hashes, medium=MEDIUM_CPU, group_idx=group.index)
    return stored, removed
