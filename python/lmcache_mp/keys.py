"""Chunk keys: one 16-byte digest per full chunk of tokens, chained over the whole prefix.

Digest i covers tokens [0, (i+1) * chunk_size): it hashes digest i-1 together with chunk i's
tokens, so two requests share a key only when they share everything before it. XXH3-128 over the
little-endian uint32 token ids; one hash call per chunk, no per-token Python work.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np
import xxhash

DIGEST_BYTES = 16
_DOMAIN = b"lmcache-mp/chunk/v1\0"


def chunk_hashes(token_ids: Sequence[int] | np.ndarray, chunk_size: int, salt: bytes = b"",
                 extras: Mapping[int, bytes] | None = None) -> list[bytes]:
    """Digests of every full chunk of token_ids (a trailing partial chunk has none).

    `salt` starts the chain, so the same tokens under different salts (tenants, adapters,
    sampling-independent model variants) never share keys. `extras[i]`: what else chunk i's KV
    depends on (e.g. the image behind its placeholder tokens); it enters chunk i's digest, and
    through the chain every later one.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {tokens.shape}")
    if tokens.dtype.kind not in "iu" and tokens.size:
        raise ValueError(f"token ids must be integers, got dtype {tokens.dtype}")
    n = tokens.shape[0] // chunk_size
    if n == 0:
        if tokens.size and tokens.min() < 0:
            raise ValueError("token ids must be in [0, 2**32)")
        return []
    tokens = tokens[: n * chunk_size]
    if tokens.dtype != np.dtype("<u4"):
        if tokens.size and (tokens.min() < 0 or tokens.max() > 0xFFFFFFFF):
            raise ValueError("token ids must be in [0, 2**32)")
        tokens = tokens.astype("<u4")
    raw = memoryview(np.ascontiguousarray(tokens)).cast("B")
    step = chunk_size * 4
    prev = xxhash.xxh3_128_digest(_DOMAIN + bytes(salt))
    out = []
    for i in range(n):
        h = xxhash.xxh3_128(prev)
        h.update(raw[i * step : (i + 1) * step])
        if extras and i in extras:
            h.update(extras[i])
        prev = h.digest()
        out.append(prev)
    return out


def pack_hashes(hashes: bytes | Iterable[bytes]) -> bytes:
    """Concatenate digests for the wire, checking each is DIGEST_BYTES long."""
    if isinstance(hashes, (bytes, bytearray, memoryview)):
        packed = bytes(hashes)
    else:
        parts = list(hashes)
        for h in parts:
            if len(h) != DIGEST_BYTES:
                raise ValueError(f"each chunk hash must be {DIGEST_BYTES} bytes, got {len(h)}")
        packed = b"".join(parts)
    if len(packed) % DIGEST_BYTES:
        raise ValueError(f"packed hashes must be a multiple of {DIGEST_BYTES} bytes, got {len(packed)}")
    return packed


def unpack_hashes(packed: bytes) -> list[bytes]:
    if len(packed) % DIGEST_BYTES:
        raise ValueError(f"packed hashes must be a multiple of {DIGEST_BYTES} bytes, got {len(packed)}")
    return [packed[i : i + DIGEST_BYTES] for i in range(0, len(packed), DIGEST_BYTES)]
