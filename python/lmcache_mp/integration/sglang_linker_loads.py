"""The SGLang linker's loads: a batch's retrieves, and the layer counter completed as they land.

No SGLang import here (benchmarks without SGLang use it as the linker does).

A batch is every loading request's objects of every pool part. The parts that are not a KV layer
group (`PoolPart.group` -1: Mamba states, an SWA window) are read first, with the first groups;
the KV pool's groups follow in layer order, at most `IN_FLIGHT` of them at a time: when group g
has landed (and the ungrouped parts), the layers up to `group_ends[g]` are reported done and the
next group is asked for. With one group (the default registration) the whole batch is one step
and every layer completes when everything landed.

Why a bounded window rather than every group at once: the server runs each registration's
requests on a worker of its own, so groups asked for together are copied side by side and land
together, which is no earlier for the first layers than one retrieve of everything; one group at
a time leaves the copy idle for a round trip between groups. Measured in docs/sglang.md.
"""

from __future__ import annotations

from typing import Callable

from lmcache_mp.keys import DIGEST_BYTES

IN_FLIGHT = 2  # KV layer groups asked for at once
BATCH = 4096  # objects per request, at most (a node of page size 1 may hold 100k pages)
# A store or retrieve of more bytes is sent as several of about this size, all in flight at once:
# the server then plans and answers one while the copy engines move another. 64 pages of 8 MiB
# moved at 0.85x / 0.87x memcpy (offload / load) as one request, 0.90x / 0.92x as requests of
# 128 MiB, 0.94x / 0.94x as requests of 32 MiB (NVIDIA H100, PCIe Gen5, 2026-12-07; docs/sglang.md).
REQUEST_BYTES = 32 << 20
MAX_REQUESTS = 64  # of one call, beyond one per item (the server queues 1,024 a registration)


def request_size(object_bytes: int, objects: int) -> int:
    """Objects per request of `object_bytes` each, in a call of `objects` objects in all."""
    by_bytes = max(1, REQUEST_BYTES // max(1, object_bytes))
    return min(BATCH, max(by_bytes, -(-objects // MAX_REQUESTS)))


def batches(digests: bytes, rows, size: int = BATCH):
    """(packed digests, rows) of at most `size` objects each."""
    for start in range(0, len(rows), size):
        yield digests[start * DIGEST_BYTES:(start + size) * DIGEST_BYTES], rows[start:start + size]


def split_requests(items, size: int | None = None):
    """Every item's objects as the requests they are sent in: (item, packed digests, rows) each.
    items: ``(part, packed digests, rows, ...)``; size: objects per request (None: request_size,
    so a call is at most MAX_REQUESTS requests beyond one per item)."""
    total = sum(len(item[2]) for item in items)
    for item in items:
        part, digests, rows = item[:3]
        for some, at in batches(digests, rows, size or request_size(part.object_bytes, total)):
            yield item, some, at


def load_batch(client, handles: dict, requests, group_ends, on_layers: Callable[[int, int], None] | None, *,
               timeout: float, in_flight: int = IN_FLIGHT, batch: int | None = None) -> None:
    """Retrieve every request's objects into their rows and report layers as their groups land.

    requests: ``[(items, leases)]``, items ``[(part, packed digests, rows)]``, leases the lookup
    lease each item's read consumes (0: none); handles: the registration of each part, by
    ``id(part)``; on_layers(start, end): layers [start, end) landed. Raises when a read fails or
    finds fewer objects than asked for (later groups are then not asked for); on return or raise,
    no retrieve it issued still writes. batch: objects per retrieve (None: request_size)."""
    steps: dict[int, list] = {}
    for items, leases in requests:
        for i, (part, digests, rows) in enumerate(items):
            lease = leases[i] if i < len(leases) else 0
            steps.setdefault(part.group, []).append((part, digests, rows, lease))
    ungrouped = steps.pop(-1, [])
    futures: dict[int, list] = {}

    def ask(step: int, items: list) -> None:
        out = futures.setdefault(step, [])
        for (part, _, _, lease), some, at in split_requests(items, batch):
            out.append((part, len(at), client.retrieve(handles[id(part)], some, at, lease=lease, timeout=timeout)))

    def landed(step: int) -> None:
        for part, n, fut in futures.get(step, ()):
            loaded = fut.result(timeout + 1.0).loaded
            if loaded < n:
                raise RuntimeError(f"the {part.pool} pool's load found {loaded} of {n} objects on the server")

    groups = len(group_ends)
    try:
        ask(-1, ungrouped)
        for g in range(min(in_flight, groups)):
            ask(g, steps.get(g, []))
        landed(-1)
        start = 0
        for g in range(groups):
            landed(g)
            if g + in_flight < groups:
                ask(g + in_flight, steps.get(g + in_flight, []))
            if on_layers is not None and group_ends[g] > start:
                on_layers(start, group_ends[g])
            start = max(start, group_ends[g])
    finally:  # nothing may still write into the slots once this returns
        for issued in futures.values():
            for _, _, fut in issued:
                if not fut.done():
                    try:
                        fut.result(timeout + 1.0)
                    except BaseException:  # noqa: BLE001
                        pass
