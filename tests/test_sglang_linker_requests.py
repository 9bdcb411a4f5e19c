"""How the SGLang linker cuts a call's pages into the requests it sends (no SGLang needed)."""

from __future__ import annotations

from types import SimpleNamespace

from lmcache_mp.integration import sglang_linker_loads as loads
from lmcache_mp.keys import DIGEST_BYTES

MIB = 1 << 20


def test_requests_carry_about_request_bytes_each():
    assert loads.request_size(8 * MIB, 64) == 4  # 64 pages of 8 MiB: 16 requests of 32 MiB
    assert loads.request_size(8 * MIB, 1) == 4  # (one page: one request of it)
    assert loads.request_size(64 * MIB, 3) == 1  # objects larger than a request: one each
    assert loads.request_size(4096, 100_000) == loads.BATCH  # small objects: at most BATCH a request


def test_a_huge_call_is_at_most_max_requests_requests():
    n = 100 * loads.MAX_REQUESTS
    size = loads.request_size(8 * MIB, n)
    assert -(-n // size) <= loads.MAX_REQUESTS


def test_requests_of_covers_every_object_once_in_order():
    part = SimpleNamespace(object_bytes=8 * MIB)
    n = 10
    digests = b"".join(i.to_bytes(DIGEST_BYTES, "little") for i in range(n))
    rows = list(range(100, 100 + n))
    sent = list(loads.requests_of(part, digests, rows))
    assert [len(at) for _, at in sent] == [4, 4, 2]
    assert b"".join(d for d, _ in sent) == digests and [r for _, at in sent for r in at] == rows
    assert [len(at) for _, at in loads.requests_of(part, digests, rows, 64)] == [10]  # a size given
