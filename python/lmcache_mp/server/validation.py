"""Checks of wire input before any work is queued: a bad field becomes a typed error reply."""

from __future__ import annotations

import numpy as np

from lmcache_mp import protocol as p
from lmcache_mp.keys import DIGEST_BYTES
from lmcache_mp.server.contexts import Registration
from lmcache_mp.storage.l1 import SHARED_RANK, ObjectKey

MAX_CHUNKS_PER_REQUEST = 1 << 16


class RequestFailure(Exception):
    def __init__(self, code: p.ErrorCode, message: str):
        super().__init__(message)
        self.code = code


def invalid(message: str) -> RequestFailure:
    return RequestFailure(p.ErrorCode.INVALID_ARGUMENT, message)


def chunk_request(reg: Registration, hashes: bytes, block_ids: bytes, salt: bytes):
    """The object keys and the `[chunks, blocks per chunk]` block ids of a store or retrieve,
    every field checked against the registration."""
    if len(hashes) % DIGEST_BYTES:
        raise invalid(f"hashes must be packed {DIGEST_BYTES}-byte digests, got {len(hashes)} bytes")
    n = len(hashes) // DIGEST_BYTES
    if n > MAX_CHUNKS_PER_REQUEST:
        raise invalid(f"too many chunks in one request ({n} > {MAX_CHUNKS_PER_REQUEST})")
    if len(salt) > 256:
        raise invalid("salt must be at most 256 bytes")
    try:
        ids = p.unpack_block_ids(block_ids)
    except ValueError as e:
        raise invalid(str(e)) from None
    if len(ids) != n * reg.blocks_per_chunk:
        raise invalid(f"{n} chunks of {reg.chunk_size} tokens need {n * reg.blocks_per_chunk} block ids "
                      f"(blocks of {reg.spec.block_size}), got {len(ids)}")
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= reg.spec.num_blocks):
        bad = int(ids[(ids < 0) | (ids >= reg.spec.num_blocks)][0])
        raise invalid(f"block id {bad} is out of range [0, {reg.spec.num_blocks})")
    rank = SHARED_RANK if reg.shared else reg.rank
    keys = [ObjectKey(reg.model, reg.world_size, rank, hashes[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES], salt)
            for i in range(n)]
    return keys, ids.astype(np.int64).reshape(n, reg.blocks_per_chunk)


def lookup_digests(msg) -> list[bytes]:
    """The digests of a lookup or release, with its world size checked."""
    if len(msg.hashes) % DIGEST_BYTES:
        raise invalid(f"hashes must be packed {DIGEST_BYTES}-byte digests, got {len(msg.hashes)} bytes")
    if not 1 <= msg.world_size <= 4096:
        raise invalid(f"world_size must be in [1, 4096], got {msg.world_size}")
    h = msg.hashes
    return [h[i:i + DIGEST_BYTES] for i in range(0, len(h), DIGEST_BYTES)]
