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


def _items(counts, object_bytes=8 * MIB):
    part = SimpleNamespace(object_bytes=object_bytes)
    out, first = [], 0
    for n in counts:
        digests = b"".join(i.to_bytes(DIGEST_BYTES, "little") for i in range(first, first + n))
        out.append((part, digests, list(range(first, first + n)), f"lease {len(out)}"))
        first += n
    return out


def test_split_requests_covers_every_object_once_in_order():
    items = _items([10, 3])
    sent = list(loads.split_requests(items))
    assert [(item[3], len(at)) for item, _, at in sent] == [("lease 0", 4), ("lease 0", 4), ("lease 0", 2),
                                                            ("lease 1", 3)]
    for item in items:
        mine = [(d, at) for it, d, at in sent if it is item]
        assert b"".join(d for d, _ in mine) == item[1] and [r for _, at in mine for r in at] == item[2]
    assert [len(at) for _, _, at in loads.split_requests(items, 64)] == [10, 3]  # a size given


def test_a_batch_of_many_loads_stays_within_the_servers_queue():
    """Many requests' loads in one batch: at most MAX_REQUESTS requests beyond one per item (the
    server refuses more than 1,024 queued a registration)."""
    items = _items([64] * 200)
    sent = list(loads.split_requests(items))
    assert sum(len(at) for _, _, at in sent) == 64 * 200
    assert len(sent) <= loads.MAX_REQUESTS + len(items)
