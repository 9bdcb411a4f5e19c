"""Checks of wire input before any work is queued: a bad field becomes a typed error reply.

Every request's cost is bounded by what it may name (protocol.MAX_*): a request over a limit is
answered with LIMIT_EXCEEDED before anything is done for it.
"""

from __future__ import annotations

import numpy as np

from lmcache_mp import protocol as p
from lmcache_mp.keys import DIGEST_BYTES, unpack_hashes
from lmcache_mp.native import request_block_ids
from lmcache_mp.server.copies.contexts import Registration
from lmcache_mp.storage.l1 import SHARED_RANK, TP_SHARED_WORLD, ObjectKey


class RequestFailure(Exception):
    def __init__(self, code: p.ErrorCode, message: str):
        super().__init__(message)
        self.code = code


def invalid(message: str) -> RequestFailure:
    return RequestFailure(p.ErrorCode.INVALID_ARGUMENT, message)


def over_limit(message: str) -> RequestFailure:
    return RequestFailure(p.ErrorCode.LIMIT_EXCEEDED, message)


def client_id(cid: bytes, required: bool = True) -> bytes:
    """A client id is 16 bytes (clients pick random ones); only a PING may go without."""
    if not cid and not required:
        return cid
    if len(cid) != p.CLIENT_ID_BYTES:
        raise invalid(f"client_id must be {p.CLIENT_ID_BYTES} bytes, got {len(cid)}")
    return cid


def world_size(n: int) -> int:
    if not 1 <= n <= p.MAX_WORLD_SIZE:
        if n > p.MAX_WORLD_SIZE:
            raise over_limit(f"world_size {n} is over the limit of {p.MAX_WORLD_SIZE}")
        raise invalid(f"world_size must be in [1, {p.MAX_WORLD_SIZE}], got {n}")
    return n


def names(model: str, salt: bytes = b"") -> None:
    if not model or len(model.encode()) > p.MAX_NAME_BYTES:
        raise invalid(f"model must be a non-empty name of at most {p.MAX_NAME_BYTES} bytes")
    if len(salt) > p.MAX_SALT_BYTES:
        raise invalid(f"salt must be at most {p.MAX_SALT_BYTES} bytes")


def count_digests(hashes: bytes) -> int:
    if len(hashes) % DIGEST_BYTES:
        raise invalid(f"hashes must be packed {DIGEST_BYTES}-byte digests, got {len(hashes)} bytes")
    n = len(hashes) // DIGEST_BYTES
    if n > p.MAX_CHUNKS:
        raise over_limit(f"{n} chunks in one request, over the limit of {p.MAX_CHUNKS}")
    return n


def digests(hashes: bytes) -> list[bytes]:
    count_digests(hashes)
    return unpack_hashes(hashes)


def lookup_cost(msg: p.Lookup) -> int:
    """Every field of a lookup checked; its cost: keys it may visit (hashes x world size)."""
    client_id(msg.client_id)
    world_size(msg.world_size)
    names(msg.model, msg.salt)
    cost = count_digests(msg.hashes) * msg.world_size
    if cost > p.MAX_LOOKUP_KEYS:
        raise over_limit(f"a lookup of {cost // msg.world_size} chunks x world size {msg.world_size} is over the "
                         f"limit of {p.MAX_LOOKUP_KEYS} keys")
    return cost


def chunk_keys(reg: Registration, hashes: bytes, salt: bytes) -> list[ObjectKey]:
    """The object keys of a request's chunks for this registration (hashes and salt checked)."""
    found = digests(hashes)
    if len(salt) > p.MAX_SALT_BYTES:
        raise invalid(f"salt must be at most {p.MAX_SALT_BYTES} bytes")
    if reg.slice is not None:  # one object of every head, for every TP size
        return [ObjectKey(reg.model, TP_SHARED_WORLD, SHARED_RANK, d, salt) for d in found]
    rank = SHARED_RANK if reg.shared else reg.rank
    return [ObjectKey(reg.model, reg.world_size, rank, d, salt) for d in found]


def parent_key(reg: Registration, parent: bytes, salt: bytes) -> ObjectKey | None:
    """The key of the chunk before a store's first (none when the store starts its prompt)."""
    if not parent:
        return None
    if len(parent) != DIGEST_BYTES:
        raise invalid(f"parent must be one {DIGEST_BYTES}-byte digest or empty, got {len(parent)} bytes")
    return chunk_keys(reg, parent, salt)[0]


def shared_keys(shared_model: str, keys: list[ObjectKey]) -> list[ObjectKey]:
    """The keys of a request's chunks in the shared namespace (server/tenancy/tenancy.py: shared_of)."""
    if not shared_model:
        raise invalid("the shared namespace is a tenants' one: it needs a server with --tenants and a tenant "
                      "with shared = \"write\"")
    return [k._replace(model=shared_model) for k in keys]


def chunk_request(reg: Registration, hashes: bytes, block_ids: bytes, salt: bytes, distinct: bool = False,
                  scratch: bytes = b""):
    """The object keys and the `[chunks, blocks per chunk]` block ids of a store or retrieve,
    every field checked against the registration (distinct: no block id twice, except the
    `scratch` ones, whose bytes nobody reads)."""
    keys = chunk_keys(reg, hashes, salt)
    try:  # one call: on a small request the checks would cost more than the rest of its path
        ids = request_block_ids(block_ids, len(keys), reg.blocks_per_chunk, reg.spec.num_blocks,
                                distinct and not scratch)
        if distinct and scratch:
            free = request_block_ids(scratch, 1, len(scratch) // 4, reg.spec.num_blocks, False)
            kept = ids[~np.isin(ids, free)]
            values, counts = np.unique(kept, return_counts=True)
            if len(values) < len(kept):
                raise ValueError(f"block id {values[counts > 1][0]} appears twice (two chunks cannot fill one block)")
    except ValueError as e:
        raise invalid(f"{e} (chunks of {reg.chunk_size} tokens, blocks of {reg.spec.block_size})") from None
    return keys, ids
