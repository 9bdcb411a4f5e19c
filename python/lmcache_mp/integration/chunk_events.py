"""Which of the chunks this engine stored are on the server, as announcements for KV-aware routers.

The server keeps a window of chunk events (committed, removed) with sequence numbers
(`Client.events`). The scheduler's side of the connector says which chunks it is storing and
what to announce for each (`expect`: the engine's own event objects for "stored" and
"removed"); a background thread reads the server's events of the engine's namespaces and turns
them into those announcements, which the engine publishes (`take`):

- "stored" once the chunk is on the server for every rank (one shared object for MLA);
- "removed" when any rank's object leaves it (evicted, cleared, replaced);
- after a server restart (a new session id) or events lost to the window, a "removed" for every
  chunk announced, so that a router's view never keeps chunks the server may no longer have
  (it may miss some it still has: such chunks are only announced again when stored again).

Chunks stored by another engine sharing the server are announced by that engine.

The thread reads every `interval` seconds, and at once when the engine says stores finished
(`sync_soon`); `has_news` tells the engine to keep stepping until what that read brought is
taken, so an engine that goes idle after its last request still publishes its stores.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Sequence

from lmcache_mp.errors import LMCacheMPError

logger = logging.getLogger(__name__)

STORED, REMOVED = 1, 2  # the server's event kinds


class ChunkEvents:
    def __init__(self, link, models: Sequence[str], world_size: int, *, interval: float = 0.5,
                 max_pending: int = 1 << 16, batch: int = 1024, shared: bool = False):
        """`link`: the scheduler's ClientLink; `models`: the namespace of each group; `shared`:
        this engine stores into the shared namespace of a server with tenants (its events are
        then those the server marks shared; otherwise those are other engines' copies)."""
        self.link = link
        self.shared = shared
        self.models = list(models)
        self.world_size = world_size
        self.interval = interval
        self.max_pending = max_pending
        self.batch = batch
        self._group_of = {m: i for i, m in enumerate(self.models)}
        self._lock = threading.Lock()  # the scheduler's thread and the reader's
        self._poll_lock = threading.Lock()  # one read of the server at a time
        # (group, digest) -> (stored, removed): chunks being stored, until the server has them
        self._pending: collections.OrderedDict[tuple[int, bytes], tuple[Any, Any]] = collections.OrderedDict()
        self._ranks: dict[tuple[int, bytes], set[int]] = {}  # ranks whose object is committed
        self._announced: dict[tuple[int, bytes], Any] = {}  # -> its "removed" announcement
        self._out: list[Any] = []
        self._session: bytes | None = None
        self._next = 0  # the next sequence number to read
        self.stats = {"announced_stored": 0, "announced_removed": 0, "resyncs": 0}
        self._soon = threading.Event()  # a read is wanted now
        self._reading = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lmcache-mp-events", daemon=True)
        self._thread.start()

    # ---- the engine's side ---------------------------------------------------------------

    def expect(self, group: int, digest: bytes, stored: Any, removed: Any) -> None:
        """This engine is storing the chunk: announce `stored` once the server has it, and
        `removed` when it leaves."""
        with self._lock:
            key = (group, digest)
            if key in self._announced:
                return
            self._pending[key] = (stored, removed)
            self._pending.move_to_end(key)
            while len(self._pending) > self.max_pending:  # stores the server never confirmed
                old, _ = self._pending.popitem(last=False)
                self._ranks.pop(old, None)

    def sync_soon(self) -> None:
        """Read the server's events now, on the reader's thread (stores just finished)."""
        self._soon.set()

    def has_news(self) -> bool:
        """A read asked for has not ended yet, or announcements wait to be taken."""
        return self._soon.is_set() or self._reading or bool(self._out)

    def take(self) -> list[Any]:
        with self._lock:
            out, self._out = self._out, []
        return out

    @property
    def announced(self) -> int:
        return len(self._announced)

    # ---- reading the server --------------------------------------------------------------

    def sync(self) -> bool:
        """Read every event the server has now; False if the server could not be asked."""
        with self._poll_lock:
            client = self.link.get()
            if client is None:
                return False
            try:
                while True:
                    since = self._next
                    reply = client.events(since, self.models, self.batch)
                    more = self._apply(reply, since)
                    if not more:
                        return True
            except LMCacheMPError as exc:
                logger.debug("lmcache-mp: reading the server's events failed: %s", exc)
                return False

    def _apply(self, reply, since: int) -> bool:
        """Take one reply; True if there is more to read at once."""
        with self._lock:
            if reply.session_id != self._session:
                restarted = self._session is not None
                self._session = reply.session_id
                if restarted:
                    self._resync("the server restarted")
                    self._next = 0
                    return True  # the new server's events, from its first on
            elif since < reply.first:
                self._resync(f"{reply.first - since} of its events were lost")
            names, shared = reply.models, set(getattr(reply, "shared", ()))
            for ev in reply.events:
                if (ev.model in shared) != self.shared:
                    continue  # a copy in the other namespace: not the one this engine stored
                group = self._group_of.get(names[ev.model])
                if group is None or ev.world_size != self.world_size or ev.salt:
                    continue
                key = (group, ev.digest)
                if ev.kind == STORED:
                    self._stored(key, ev.rank)
                elif ev.kind == REMOVED:
                    self._removed(key, ev.rank)
            self._next = reply.next
            return reply.next - max(since, reply.first) >= self.batch

    def _stored(self, key: tuple[int, bytes], rank: int) -> None:
        if key not in self._pending:
            return
        ranks = self._ranks.setdefault(key, set())
        ranks.add(rank)
        if rank >= 0 and len(ranks) < self.world_size:
            return
        stored, removed = self._pending.pop(key)
        del self._ranks[key]
        self._announced[key] = removed
        self._out.append(stored)
        self.stats["announced_stored"] += 1

    def _removed(self, key: tuple[int, bytes], rank: int) -> None:
        ranks = self._ranks.get(key)
        if ranks is not None:
            ranks.discard(rank)
        removed = self._announced.pop(key, None)
        if removed is not None:
            self._out.append(removed)
            self.stats["announced_removed"] += 1

    def _resync(self, why: str) -> None:
        """Forget what the server had: every announced chunk is announced removed."""
        if self._announced:
            logger.info("lmcache-mp: %s; announcing the %d chunks announced so far as removed", why,
                        len(self._announced))
        self._out.extend(self._announced.values())
        self.stats["announced_removed"] += len(self._announced)
        self.stats["resyncs"] += 1
        self._announced.clear()
        self._ranks.clear()

    def _run(self) -> None:
        while True:
            self._soon.wait(self.interval)
            if self._stop.is_set():
                return
            self._reading = True  # (before the flag goes: has_news never sees neither)
            self._soon.clear()
            try:
                self.sync()
            finally:
                self._reading = False

    def close(self) -> None:
        self._stop.set()
        self._soon.set()
        self._thread.join(timeout=5)
