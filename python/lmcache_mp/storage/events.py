"""What happened to L1's chunks, for subscribers (KV-aware routers through the engines' connectors).

A bounded window of the latest events, each with a sequence number: a chunk committed (now
visible to lookups), a chunk removed (evicted, cleared, or replaced by bytes of another
layout). L1 records an event while it holds its own lock, so recording is one slot write: no
I/O, no allocation beyond the event's tuple. Readers ask for the events since the sequence
number they have seen; what fell out of the window meanwhile is reported as lost, and the
server's session id (which changes on restart) tells a reader its numbers start over.
"""

from __future__ import annotations

import threading
from typing import Any

STORED, REMOVED = 1, 2


class EventLog:
    def __init__(self, capacity: int):
        self.capacity = max(0, int(capacity))
        self._ring: list[Any] = [None] * self.capacity
        self._next = 0  # sequence number of the next event
        self._lock = threading.Lock()

    def add(self, kind: int, key: Any) -> None:
        """Record an event (O(1); called under L1's lock)."""
        if not self.capacity:
            return
        with self._lock:
            self._ring[self._next % self.capacity] = (kind, key)
            self._next += 1

    def read(self, since: int, limit: int) -> tuple[int, int, list[tuple[int, int, Any]]]:
        """(first kept, next, events): up to `limit` events from sequence number `since` on (or
        from the first one kept, if `since` fell out of the window), as (seq, kind, key)."""
        with self._lock:
            nxt = self._next
            first = max(0, nxt - self.capacity)
            start = min(max(since, first), nxt)
            end = min(nxt, start + max(0, limit))
            ring, cap = self._ring, self.capacity
            events = [(seq, *ring[seq % cap]) for seq in range(start, end)]
        return first, nxt, events
