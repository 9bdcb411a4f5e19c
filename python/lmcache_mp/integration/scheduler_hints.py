"""The application's hints of a request, sent by the scheduler (a part SchedulerCore owns, built
from the connector's settings, the server models of the prefix groups, the scheduler's stats and
what its client is now; docs/hints.md). A prefetch goes before the request's lookup; the others
once it finished, on the chunks it stored, and only after the workers report those stores
answered (at most MAX_WAITING_HINTS finished requests wait so; beyond, the oldest go unsent).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
from typing import Callable, Iterable, Sequence

from lmcache_mp.errors import LMCacheMPError
from lmcache_mp.integration.connector_types import ConnectorConfig
from lmcache_mp.integration.request_hints import AT_ARRIVAL, RequestHint
from lmcache_mp.integration.tracked_request import TrackedRequest

logger = logging.getLogger(__name__)

MAX_WAITING_HINTS = 4096  # finished requests whose hints wait for their stores (beyond: the oldest go unsent)


class HintSender:
    """Every method is called from the scheduler's thread."""

    def __init__(self, config: ConnectorConfig, models: Sequence[str], prefix_groups: Sequence[int], stats: dict,
                 client: Callable[[], tuple]):
        """models: the server model of each KV group; prefix_groups: the groups hints go to;
        stats: the scheduler's (hints sent and failed are counted there); client(): (client,
        chunk size) when usable, else (None, None)."""
        self.cfg = config
        self.models = models
        self._prefix_groups = prefix_groups
        self.stats = stats
        self._client = client
        # finished requests' hints, sent once the workers report their stores answered: (hashes, hints)
        self._after_stores: dict[str, tuple[list[bytes], list[RequestHint]]] = {}

    def arrived(self, tr: TrackedRequest) -> None:
        """Before the request's lookup: its hints sent at arrival (a prefetch), on its prompt."""
        if tr.hints and self.cfg.loads and not tr.skip_load:
            hints = [h for h in tr.hints if h.action in AT_ARRIVAL]
            client, cs = self._client()
            num_tokens = len(tr.token_ids) - 1
            if client is not None and hints and num_tokens >= cs:
                self.send(tr.chunk_keys(num_tokens // cs, cs), hints)

    def finished(self, tr: TrackedRequest, chunk_size: int | None) -> None:
        """The request finished: its other hints, on the chunks it stored, now or once the
        workers report its stores answered (when it had any)."""
        later = [h for h in tr.hints if h.action not in AT_ARRIVAL]
        if later and tr.stored_chunks and chunk_size:
            hashes = tr.chunk_keys(tr.stored_chunks, chunk_size)
            if tr.has_transfers:  # (their chunks are on the server once the workers say the stores are over)
                if len(self._after_stores) >= MAX_WAITING_HINTS:
                    self._after_stores.pop(next(iter(self._after_stores)))
                self._after_stores[tr.req_id] = (hashes, later)
            else:
                self.send(hashes, later)

    @property
    def waiting(self) -> int:
        """Finished requests whose hints wait for the workers to report their stores over."""
        return len(self._after_stores)

    def stores_finished(self, req_ids: Iterable[str]) -> None:
        """The workers report these finished requests' stores answered: send their hints now."""
        for req_id in req_ids:
            waiting = self._after_stores.pop(req_id, None)
            if waiting is not None:
                self.send(*waiting)

    def send(self, hashes: list[bytes], hints: Sequence[RequestHint]) -> None:
        """Each hint on the leading chunks it names, for every prefix group; not waited for: a
        hint that fails is counted and logged at DEBUG, and changes nothing else."""
        client, cs = self._client()
        if client is None:
            return

        def answered(f: cf.Future) -> None:
            if f.exception() is not None:
                self.stats["hint_errors"] += 1
                logger.debug("lmcache-mp: a hint failed: %s", f.exception())

        for h in hints:
            n = len(hashes) if h.tokens is None else min(len(hashes), h.tokens // cs)
            if n <= 0:
                continue
            for gi in self._prefix_groups:
                try:
                    f = client.hint_async(h.action, hashes[:n], model=self.models[gi], world_size=self.cfg.world_size,
                                          ttl=h.ttl, priority=h.priority, timeout=self.cfg.lookup_timeout,
                                          tp_shared=self.cfg.tp_shared)  # (the objects its lookups find)
                except LMCacheMPError as exc:
                    self.stats["hint_errors"] += 1
                    logger.debug("lmcache-mp: a hint was not sent: %s", exc)
                    return
                self.stats["hints"] += 1
                f.add_done_callback(answered)
