"""Lookup results and the leases a client holds.

`lookup(lock=True)` answers with a `LookupResult`: the number of leading chunks found (it is an
int) and the id of the lease protecting them. Pass the id to the retrieves that read them (any
process may: tensor-parallel workers carry the scheduler's lease) and to `release`.
`release(hashes, model=...)` without a lease id finds this client's own leases on those chunks
here, from what its lookups returned, so the server never scans for them.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


class LookupResult(int):
    """Leading chunks present (an int), with `.lease`: the lease on them (0 if none was taken),
    and `.from_l2`: how many of them were found in the L2 tiers, after L1's prefix."""

    lease: int
    from_l2: int

    def __new__(cls, hits: int, lease: int = 0, from_l2: int = 0) -> "LookupResult":
        obj = super().__new__(cls, hits)
        obj.lease = lease
        obj.from_l2 = from_l2
        return obj

    @property
    def hits(self) -> int:
        return int(self)

    def __repr__(self) -> str:
        return f"LookupResult(hits={int(self)}, lease={self.lease})"


@dataclass
class _Held:
    model: str
    world_size: int
    salt: bytes
    digests: frozenset
    expires: float


class HeldLeases:
    """The leases this client opened and has not released, until their TTL (thread-safe)."""

    def __init__(self, ttl: float):
        self.ttl = ttl if ttl > 0 else 30.0
        self._lock = threading.Lock()
        self._held: dict[int, _Held] = {}

    def add(self, lease: int, model: str, world_size: int, salt: bytes, digests: list[bytes]) -> None:
        now = time.monotonic()
        with self._lock:
            self._prune(now)
            self._held[lease] = _Held(model, world_size, salt, frozenset(digests), now + self.ttl)

    def _prune(self, now: float) -> None:
        for lease in [k for k, h in self._held.items() if h.expires <= now]:
            del self._held[lease]

    def matching(self, model: str, world_size: int, salt: bytes, digests: list[bytes]) -> list[tuple[int, list]]:
        """(lease, the given digests it covers) for each of our leases on these chunks."""
        want = set(digests)
        with self._lock:
            self._prune(time.monotonic())
            return [(lease, [d for d in digests if d in h.digests]) for lease, h in self._held.items()
                    if h.model == model and h.world_size == world_size and h.salt == salt and want & h.digests]

    def forget(self, lease: int) -> None:
        with self._lock:
            self._held.pop(lease, None)
