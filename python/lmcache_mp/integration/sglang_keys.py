"""SGLang page keys as lmcache-mp chunk digests, and the namespace their pages live in.

SGLang names each page with a key of its own (a hex digest chained over the prefix, plus its
namespace seed). The server indexes 16-byte digests, so a key is hashed once more, under a
domain of its own: no SGLang page can take the digest of a vLLM chunk (lmcache_mp.keys hashes
token ids under another domain), and the namespace (the server's "model" field) differs too.
"""

from __future__ import annotations

from typing import Sequence

import xxhash

from lmcache_mp.keys import DIGEST_BYTES

_DOMAIN = b"lmcache-mp/sglang-page/v1\0"
NAMESPACE_PREFIX = "sglang/"


def page_digest(key: str) -> bytes:
    return xxhash.xxh3_128_digest(_DOMAIN + key.encode())


def page_digests(keys: Sequence[str]) -> bytes:
    """The packed digests of these page keys, in order."""
    out = b"".join(page_digest(k) for k in keys)
    assert len(out) == DIGEST_BYTES * len(keys)
    return out


def namespace(model: str, format_tag: str, shard: str = "") -> str:
    """The server-side name of one model's pages in one byte format (and pipeline/context shard):
    only pages that mean the same bytes share it. Tensor-parallel ranks are told apart by the
    registration's rank and world size, not here."""
    parts = [model or "default", format_tag] + ([shard] if shard else [])
    return NAMESPACE_PREFIX + "/".join(parts)
