"""What the SGLang linker's lookups leased on the server, kept until the request's load reads it.

SGLang looks a request up when it matches the prompt and loads it when the request is admitted
to a batch, possibly much later; other traffic may evict pages in between, and a load that falls
short makes SGLang abort the request (it does not recompute it). So a lookup takes leases
(`lock=True`): on the KV pages it found and on the other pools' objects at its deepest lengths.
A load passes them to its reads (each read consumes its use) and lets the rest go; a request
cancelled lets them go; one that never loads leaves them to the server's TTL.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from lmcache_mp.errors import RequestError, ServerUnavailable

logger = logging.getLogger(__name__)

HELD_FOR = 25.0  # seconds a lookup's leases are kept for its load here (the server's default TTL is 30)


@dataclass(frozen=True)
class Held:
    """One lookup's leases: per part id on the KV pages (one part per layer group), and per
    (part id, length) on a state window."""

    client: Any
    kv: dict
    states: dict = field(default_factory=dict)
    when: float = field(default_factory=time.monotonic)

    def all(self) -> list[int]:
        return [*self.kv.values(), *self.states.values()]


class HeldLeases:
    def __init__(self, release_timeout: float, hold_for: float = HELD_FOR):
        self.release_timeout = release_timeout
        self.hold_for = hold_for
        self._held: dict[str, Held] = {}
        self._lock = threading.Lock()

    def hold(self, rid: str, held: Held) -> None:
        with self._lock:
            self._held[rid] = held

    def take(self, rid: str) -> Held | None:
        with self._lock:
            return self._held.pop(rid, None)

    def drop(self, rid: str) -> None:
        """Let go of a request's leases; forget those older than hold_for (the server ends them)."""
        now = time.monotonic()
        with self._lock:
            held = self._held.pop(rid, None)
            for old in [r for r, h in self._held.items() if now - h.when > self.hold_for]:
                del self._held[old]
        if held is not None:
            self.release(held.client, held.all())

    def clear(self) -> None:
        with self._lock:
            self._held.clear()  # (the server ends those leases by their TTL)

    def release(self, client, leases: Iterable[int]) -> None:
        for lease in set(leases):
            if lease:
                try:
                    client.release(lease=lease, timeout=self.release_timeout)
                except (ServerUnavailable, RequestError) as e:
                    logger.debug("lmcache-mp linker: releasing a lease failed: %s", e)
                    return
