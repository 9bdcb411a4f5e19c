"""The scheduler's lookups and the leases they open (a part SchedulerCore owns, built from the
connector's settings, the engine's KV groups and their server models, the client link, the
scheduler's stats and what its client and chunk size are now).

A request's prefix groups are looked up once per admission, without waiting: the engine asks
again at a later step while the answer is on its way, and a step waits for answers at most
`lookup_block` seconds, all requests together. With state groups, the hit then ends at the
deepest boundary (of the last `state_candidates`) where every state group has a state. Each
lookup leases what it found; what no load consumes is released off the scheduler's thread, in
order, by one thread.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from typing import Callable, Iterable, Sequence

from lmcache_mp.errors import LMCacheMPError, ServerUnavailable
from lmcache_mp.integration.connector_types import ConnectorConfig
from lmcache_mp.integration.link import ClientLink
from lmcache_mp.integration.tracked_request import TrackedRequest

logger = logging.getLogger(__name__)


class SchedulerLookups:
    """Every method is called from the scheduler's thread."""

    def __init__(self, config: ConnectorConfig, models: Sequence[str], prefix_groups: Sequence[int],
                 state_groups: Sequence[int], link: ClientLink, stats: dict, client: Callable[[], tuple],
                 chunk_size: Callable[[], int | None]):
        """models: the server model of each KV group; prefix_groups, state_groups: the groups
        looked up as prefixes (attention) and per boundary (states); stats: the scheduler's
        (lookups, tokens found, time spent are counted there); client(): (client, chunk size)
        when usable, else (None, None); chunk_size(): the connector's, once known."""
        self.cfg = config
        self.models = models
        self._prefix_groups = prefix_groups
        self._state_groups = state_groups
        self.link = link
        self.stats = stats
        self._client = client
        self._chunk_size = chunk_size
        # A hit ends where every state group has a state: candidate boundaries below the
        # attention hit looked at, from the deepest down.
        self.state_candidates = 4
        self._no_state_logged = False
        self._error_logged = False
        self._hits_logged: tuple[float, int, int] | None = None
        self._block_left = config.lookup_block  # what this step may still wait for lookups, all together
        # Releases must not block the scheduler; one thread keeps them in order.
        self._releaser = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmcache-mp-release")

    def new_step(self) -> None:
        """The engine's next step starts its own budget of waiting for answers."""
        self._block_left = self.cfg.lookup_block

    def answered(self, tr: TrackedRequest) -> bool:
        """Whether the request's lookups answered (taking answers that come within the step's
        budget); False while one is on its way."""
        if tr.pending is not None and not self._lookup_done(tr):
            return False
        return tr.pending_states is None or self._states_done(tr)

    def release(self, lease: int, hashes: list[bytes] | None = None, client=None) -> None:
        """Drop what is left of a lease (on these chunks only, if given), off the scheduler's thread."""
        if not lease:
            return
        client = client or self.link.get()
        if client is None:
            return  # the server drops leases of a client that goes away, or at their TTL

        def run():
            try:
                # Short timeout: a lease we fail to drop only lives until its TTL or our goodbye.
                client.release(hashes, lease=lease, timeout=max(1.0, self.cfg.lookup_timeout))
            except LMCacheMPError as exc:
                logger.debug("lmcache-mp: release failed: %s", exc)

        self._releaser.submit(run)

    def drop_lease(self, tr: TrackedRequest, upto: int | None = None, group: int | None = None) -> None:
        """Release the leased chunks [0, upto) (all by default) of every group's lease (or of
        one group's); the rest is left to a load."""
        for g in range(len(tr.leased_chunks)) if group is None else (group,):
            n = tr.leased_chunks[g]
            if n and self._chunk_size():
                if upto is None or upto >= n:
                    self.release(tr.leases[g])
                elif upto > 0:
                    self.release(tr.leases[g], tr.hashes[:upto])
            tr.leased_chunks[g] = 0

    def lookup(self, tr: TrackedRequest) -> None:
        if not tr.cacheable or tr.skip_load or not self.cfg.loads:
            return
        client, cs = self._client()
        if client is None:
            return
        max_chunks = (len(tr.token_ids) - 1) // cs
        if max_chunks <= 0:
            return
        hashes = tr.chunk_keys(max_chunks, cs)
        tr.hashes = hashes  # what the answer counts against
        self.stats["lookups"] += 1
        tr.leases, tr.leased_chunks = [0] * len(self.models), [0] * len(self.models)
        pending = []
        try:
            for gi in self._prefix_groups:
                pending.append(client.lookup_async(hashes, model=self.models[gi], world_size=self.cfg.world_size,
                                                   lock=True, timeout=self.cfg.lookup_timeout,
                                                   tp_shared=self.cfg.tp_shared))
        except ServerUnavailable as exc:
            self._abandon(pending)
            self.link.report_failure(exc)
            return
        tr.pending = pending
        if not self._prefix_groups:  # states only: every boundary of the prompt may be one
            tr.pending = None
            tr.hit_chunks = max_chunks
            self._lookup_states(tr)

    def _lookup_done(self, tr: TrackedRequest) -> bool:
        """Take the lookup's answer if it comes within what is left of this step's lookup_block
        (most come in one round trip); False if it is still on its way. The budget is the step's,
        not each request's: a server that stops answering costs a step lookup_block once, however
        many requests wait for their lookups."""
        t0 = time.perf_counter()
        pending = tr.pending
        try:
            found = [fut.result(timeout=max(0.0, self._block_left - (time.perf_counter() - t0))) for fut in pending]
        except cf.TimeoutError:
            return False
        except ServerUnavailable as exc:
            # Should the lookup still land, its lease (whose id we never learn) ends with its
            # TTL or when the server stops hearing from us.
            tr.pending = None
            self._abandon(pending)
            self.link.report_failure(exc)
            return True
        except LMCacheMPError as exc:
            tr.pending = None
            self._abandon(pending)
            if not self._error_logged:
                logger.warning("lmcache-mp: lookup rejected (%s); treating as a miss", exc)
                self._error_logged = True
            return True
        finally:
            us = int((time.perf_counter() - t0) * 1e6)
            self._block_left -= us / 1e6
            self.stats["lookup_us_total"] += us
            self.stats["lookup_us_max"] = max(self.stats["lookup_us_max"], us)
        tr.pending = None
        self.link.report_success()
        max_chunks = len(tr.hashes)
        n = max(0, min(min(int(f) for f in found), max_chunks))
        tr.hit_chunks = n
        for gi, f in zip(self._prefix_groups, found):
            tr.leases[gi], tr.leased_chunks[gi] = f.lease, n
            if n == 0:  # a group that found more than all the others
                self.release(f.lease)
            elif int(f) > n:
                self.release(f.lease, tr.hashes[n : int(f)])
        tr.stored_chunks = n
        if self._state_groups and n:
            self._lookup_states(tr)
            return True
        self._count_found(tr)
        return True

    def _count_found(self, tr: TrackedRequest) -> None:
        cs = self._chunk_size()
        self.stats["found_tokens"] += tr.hit_chunks * cs
        self.stats["lookup_tokens"] += max(0, len(tr.hashes) * cs - tr.engine_tokens)
        self._log_hits()

    def _lookup_states(self, tr: TrackedRequest) -> None:
        """Look up the states at the deepest boundaries of the attention hit (each a lookup of
        one chunk's key in each state group: a state is kept only where the engine named one)."""
        client = self.link.get()
        n = tr.hit_chunks
        pending: list[tuple[int, int, cf.Future]] = []
        try:
            if client is None:
                raise ServerUnavailable("no connection")
            for b in range(n, max(0, n - self.state_candidates), -1):
                for gi in self._state_groups:
                    pending.append((b, gi, client.lookup_async([tr.hashes[b - 1]], model=self.models[gi],
                                                               world_size=self.cfg.world_size, lock=True,
                                                               timeout=self.cfg.lookup_timeout)))
        except ServerUnavailable as exc:
            self._abandon(f for _, _, f in pending)
            self.link.report_failure(exc)
            pending = []
        tr.pending_states = pending

    def _states_done(self, tr: TrackedRequest) -> bool:
        """Take the state lookups' answers (within what is left of this step's lookup_block): the
        hit ends at the deepest boundary every state group has, attention leases are cut there."""
        t0 = time.perf_counter()
        pending = tr.pending_states
        try:
            found = [fut.result(timeout=max(0.0, self._block_left - (time.perf_counter() - t0)))
                     for _, _, fut in pending]
        except cf.TimeoutError:
            return False
        except LMCacheMPError as exc:
            found = None
            if isinstance(exc, ServerUnavailable):
                self.link.report_failure(exc)
        finally:
            self._block_left -= time.perf_counter() - t0
        tr.pending_states = None
        if found is None:
            self._abandon(f for _, _, f in pending)
            best = 0
        else:
            have: dict[int, int] = {}
            for (b, _, _), f in zip(pending, found):
                have[b] = have.get(b, 0) + (int(f) > 0)
            best = max((b for b, k in have.items() if k == len(self._state_groups)), default=0)
            for (b, gi, _), f in zip(pending, found):
                if b == best:
                    tr.leases[gi], tr.leased_chunks[gi] = f.lease, best
                elif f.lease:
                    self.release(f.lease)
        n = tr.hit_chunks
        if best < n:
            for gi in self._prefix_groups:
                if best == 0:
                    self.release(tr.leases[gi])
                else:
                    self.release(tr.leases[gi], tr.hashes[best:n])
                tr.leased_chunks[gi] = best
            if best == 0:  # (why a hybrid gets no hit: said once at INFO)
                (logger.debug if self._no_state_logged else logger.info)(
                    "lmcache-mp: request %s: %d chunks found, but no boundary within the last %d of them where every "
                    "state group has a state: a miss (vLLM keeps one state per prompt, at its last block boundary)",
                    tr.req_id, n, self.state_candidates)
                self._no_state_logged = True
        tr.hit_chunks = best
        self._count_found(tr)
        return True

    def _abandon(self, lookups: Iterable[cf.Future]) -> None:
        """Lookups no longer wanted: drop their leases once they land."""

        def landed(f: cf.Future) -> None:
            if not f.cancelled() and f.exception() is None:
                self.release(f.result().lease)

        for fut in lookups:
            fut.add_done_callback(landed)

    def forget(self, tr: TrackedRequest) -> None:
        """A lookup still on its way is no longer wanted: drop its lease once it lands."""
        pending, tr.pending = tr.pending, None
        if pending:
            self._abandon(pending)
        states, tr.pending_states = tr.pending_states, None
        if states:
            self._abandon(f for _, _, f in states)

    def _log_hits(self, every: float = 30.0) -> None:
        """One INFO line at most every `every` seconds: how much of what the server could supply
        it did."""
        now = time.monotonic()
        last = self._hits_logged
        if last is None:
            self._hits_logged = (now, 0, 0)
            return
        t0, hit0, seen0 = last
        if now - t0 < every:
            return
        hit, seen = self.stats["hit_tokens"] - hit0, self.stats["lookup_tokens"] - seen0
        if seen:
            logger.info("lmcache-mp: loaded %d of the %d prompt tokens looked up beyond vLLM's own prefix cache hits "
                        "(%.1f%%) in the last %.0f s", hit, seen, 100.0 * hit / seen, now - t0)
        self._hits_logged = (now, self.stats["hit_tokens"], self.stats["lookup_tokens"])

    def flush_releases(self, timeout: float | None = None) -> None:
        """Wait until the releases queued so far reached the server."""
        self._releaser.submit(lambda: None).result(timeout)

    def close(self) -> None:
        """A running release ends before the client's socket is closed; queued ones are moot (the
        server drops every lease of a client that says goodbye)."""
        self._releaser.shutdown(wait=True, cancel_futures=True)
