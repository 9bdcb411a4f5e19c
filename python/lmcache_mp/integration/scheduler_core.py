"""Scheduler half of the lmcache-mp connector: lookups with leases, and per-step plans."""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from lmcache_mp.errors import LMCacheMPError, ServerUnavailable
from lmcache_mp.integration.connector_types import ConnectorConfig, ScheduledRequest, StepPlan, Transfer
from lmcache_mp.integration.link import ClientLink
from lmcache_mp.keys import chunk_hashes

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Tracked:
    req_id: str
    token_ids: Sequence[int]  # live view: grows with generated tokens
    num_prompt_tokens: int
    salt: bytes
    generation: int
    cacheable: bool = True
    hashes: list[bytes] = field(default_factory=list)
    looked_up: bool = False
    hit_chunks: int = 0
    leased_chunks: int = 0  # leading chunks leased by our lookup and not yet loaded/released
    lease: int = 0  # the server's id of that lease
    stored_chunks: int = 0  # leading chunks known to be on the server or planned to be stored
    # A store or load was ever planned: the workers then report the request finished once the
    # server answered them all, and its blocks stay allocated until then.
    has_transfers: bool = False
    block_ids: list[int] = field(default_factory=list)
    pending: cf.Future | None = None  # the lookup, while its answer is on its way


class SchedulerCore:
    """Lookups, leases and plans. Every method is called from the scheduler's thread."""

    def __init__(self, config: ConnectorConfig, *, link: ClientLink | None = None):
        self.cfg = config
        self.link = link or ClientLink(
            config.url,
            name="lmcache-mp scheduler",
            request_timeout=config.request_timeout,
            connect_timeout=config.connect_timeout,
            retry_interval=config.retry_interval,
        )
        # A block whose contents nobody reads (vLLM: the null block); see Transfer.
        self.scratch_block_id: int | None = None
        self._requests: dict[str, _Tracked] = {}
        self._pending_loads: list[Transfer] = []
        self._chunk_size: int | None = None
        self._bad_chunk_size_logged = False
        self._error_logged = False
        # Releases must not block the scheduler; one thread keeps them in order.
        self._releaser = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmcache-mp-release")
        self.stats = {"lookups": 0, "lookup_tokens": 0, "hit_tokens": 0, "load_tokens": 0, "store_chunks": 0,
                      "lookup_us_total": 0, "lookup_us_max": 0}  # time the scheduler loop spent in lookups
        self._hits_logged: tuple[float, int, int] | None = None
        self._first_hit_logged = False
        self._block_left = config.lookup_block  # what this step may still wait for lookups, all together

    def start(self) -> None:
        self.link.connect(wait=self.cfg.connect_timeout)

    @property
    def chunk_size(self) -> int | None:
        return self._chunk_size

    def _client(self):
        """(client, chunk_size) when usable, else (None, None)."""
        client = self.link.get()
        if client is None:
            return None, None
        if self._chunk_size is None:
            cs = int(client.chunk_size)
            if cs <= 0 or cs % self.cfg.block_size:
                if not self._bad_chunk_size_logged:
                    logger.error(
                        "lmcache-mp: server chunk size %d is not a multiple of the engine block size %d; "
                        "the cache stays unused",
                        cs,
                        self.cfg.block_size,
                    )
                    self._bad_chunk_size_logged = True
                return None, None
            self._chunk_size = cs
        return client, self._chunk_size

    def _hashes(self, tr: _Tracked, num_chunks: int, chunk_size: int) -> list[bytes]:
        if len(tr.hashes) < num_chunks:
            n = num_chunks * chunk_size
            tokens = np.fromiter(itertools.islice(tr.token_ids, n), dtype=np.int64, count=n)
            tr.hashes = chunk_hashes(tokens, chunk_size, salt=tr.salt)
        return tr.hashes[:num_chunks]

    def _release(self, lease: int, hashes: list[bytes] | None = None, client=None) -> None:
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

    def _drop_lease(self, tr: _Tracked, upto: int | None = None) -> None:
        """Release the leased chunks [0, upto) (all by default); the rest is left to a load."""
        if tr.leased_chunks and self._chunk_size:
            if upto is None or upto >= tr.leased_chunks:
                self._release(tr.lease)
            elif upto > 0:
                self._release(tr.lease, tr.hashes[:upto])
        tr.leased_chunks = 0

    # ---- engine hooks ---------------------------------------------------------------------

    def num_new_matched_tokens(
        self,
        req_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        *,
        num_prompt_tokens: int | None = None,
        salt: bytes = b"",
        generation: int = 0,
        cacheable: bool = True,
    ) -> int | None:
        """Tokens beyond `num_computed_tokens` the server can supply: whole chunks, never the
        last token. Repeated calls for one admission (`generation`) reuse the first lookup.
        None while the lookup's answer has not come (the server may be loading chunks from its
        L2 tier): the engine asks again at a later step instead of waiting."""
        tr = self._requests.get(req_id)
        if tr is None or tr.generation != generation:
            if tr is not None:  # re-admitted after preemption
                self._forget_lookup(tr)
                self._drop_lease(tr)
                tr.generation = generation
                tr.looked_up = False
                tr.hit_chunks = 0
                tr.hashes = []
            else:
                tr = _Tracked(
                    req_id=req_id,
                    token_ids=token_ids,
                    num_prompt_tokens=len(token_ids) if num_prompt_tokens is None else num_prompt_tokens,
                    salt=salt,
                    generation=generation,
                    cacheable=cacheable,
                )
                self._requests[req_id] = tr
        if not tr.looked_up:
            tr.looked_up = True
            self._lookup(tr)
        if tr.pending is not None and not self._lookup_done(tr):
            return None
        return self._external_tokens(tr, num_computed_tokens)

    def _lookup(self, tr: _Tracked) -> None:
        if not tr.cacheable:
            return
        client, cs = self._client()
        if client is None:
            return
        max_chunks = (len(tr.token_ids) - 1) // cs
        if max_chunks <= 0:
            return
        hashes = self._hashes(tr, max_chunks, cs)
        tr.hashes = hashes  # what the answer counts against
        self.stats["lookups"] += 1
        try:
            tr.pending = client.lookup_async(hashes, model=self.cfg.model, world_size=self.cfg.world_size,
                                             lock=True, timeout=self.cfg.lookup_timeout)
        except ServerUnavailable as exc:
            self.link.report_failure(exc)

    def _lookup_done(self, tr: _Tracked) -> bool:
        """Take the lookup's answer if it comes within what is left of this step's lookup_block
        (most come in one round trip); False if it is still on its way. The budget is the step's,
        not each request's: a server that stops answering costs a step lookup_block once, however
        many requests wait for their lookups."""
        t0 = time.perf_counter()
        try:
            found = tr.pending.result(timeout=max(0.0, self._block_left))
        except cf.TimeoutError:
            return False
        except ServerUnavailable as exc:
            # Should the lookup still land, its lease (whose id we never learn) ends with its
            # TTL or when the server stops hearing from us.
            self.link.report_failure(exc)
            return True
        except LMCacheMPError as exc:
            if not self._error_logged:
                logger.warning("lmcache-mp: lookup rejected (%s); treating as a miss", exc)
                self._error_logged = True
            return True
        finally:
            us = int((time.perf_counter() - t0) * 1e6)
            self._block_left -= us / 1e6
            self.stats["lookup_us_total"] += us
            self.stats["lookup_us_max"] = max(self.stats["lookup_us_max"], us)
            if tr.pending is not None and tr.pending.done():
                tr.pending = None
        self.link.report_success()
        cs, max_chunks = self._chunk_size, len(tr.hashes)
        n = max(0, min(int(found), max_chunks))
        self.stats["hit_tokens"] += n * cs
        self.stats["lookup_tokens"] += max_chunks * cs
        if n and not self._first_hit_logged:
            self._first_hit_logged = True
            logger.info("lmcache-mp: first cache hit: %d of the %d prompt tokens of request %s are on the server",
                        n * cs, len(tr.token_ids), tr.req_id)
        self._log_hits()
        tr.hit_chunks = n
        tr.leased_chunks = n
        tr.lease = found.lease
        tr.stored_chunks = n
        return True

    def _forget_lookup(self, tr: _Tracked) -> None:
        """A lookup still on its way is no longer wanted: drop its lease once it lands."""
        fut, tr.pending = tr.pending, None
        if fut is None:
            return

        def landed(f: cf.Future) -> None:
            if not f.cancelled() and f.exception() is None:
                self._release(f.result().lease)

        fut.add_done_callback(landed)

    def _log_hits(self, every: float = 30.0) -> None:
        """One INFO line at most every `every` seconds: how much of the looked-up prompts hit."""
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
            logger.info("lmcache-mp: %d of %d looked-up prompt tokens were cached (%.1f%%) in the last %.0f s",
                        hit, seen, 100.0 * hit / seen, now - t0)
        self._hits_logged = (now, self.stats["hit_tokens"], self.stats["lookup_tokens"])

    def _external_tokens(self, tr: _Tracked, num_computed_tokens: int) -> int:
        if not tr.hit_chunks or not self._chunk_size:
            return 0
        n = tr.hit_chunks * self._chunk_size - num_computed_tokens
        n -= n % self.cfg.block_size if n > 0 else 0
        if n <= 0:
            self._drop_lease(tr)  # vLLM already has all of it
            return 0
        return n

    def on_allocated(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Blocks are allocated; plan the load of the `num_external_tokens` accepted."""
        tr = self._requests.get(req_id)
        if tr is None:
            return
        tr.block_ids = list(block_ids)
        if num_external_tokens <= 0 or not tr.hit_chunks or not self._chunk_size:
            self._drop_lease(tr)
            return
        cs, bs = self._chunk_size, self.cfg.block_size
        hit_end = tr.hit_chunks * cs
        start = hit_end - num_external_tokens  # first token to load = tokens the engine holds
        first = start // cs if start >= 0 else 0
        bpc = cs // bs
        blocks = tr.block_ids[first * bpc : tr.hit_chunks * bpc]
        if start < 0 or len(blocks) != (tr.hit_chunks - first) * bpc:
            logger.error(
                "lmcache-mp: request %s: %d external tokens do not fit its %d blocks; not loading",
                req_id,
                num_external_tokens,
                len(tr.block_ids),
            )
            self._drop_lease(tr)
            # A load with no chunks: the worker reports these blocks as failed, so the
            # engine recomputes the tokens it was promised.
            bad = tr.block_ids[max(start, 0) // bs : -(-hit_end // bs)]
            self._pending_loads.append(Transfer(req_id=req_id, hashes=[], block_ids=bad))
            tr.has_transfers = True
            return
        scratch = start // bs - first * bpc
        if scratch and self.scratch_block_id is not None:
            blocks[:scratch] = [self.scratch_block_id] * scratch
        else:
            scratch = 0
        self._pending_loads.append(
            Transfer(req_id=req_id, hashes=tr.hashes[first : tr.hit_chunks], block_ids=blocks,
                     num_scratch_blocks=scratch, lease=tr.lease)
        )
        tr.has_transfers = True
        self.stats["load_tokens"] += num_external_tokens
        self._drop_lease(tr, upto=first)  # the load consumes the lease on chunks [first, hit)

    def build_plan(self, scheduled: Iterable[ScheduledRequest], preempted: Iterable[str] = ()) -> StepPlan:
        self._block_left = self.cfg.lookup_block  # the engine's next step starts its own budget
        plan = StepPlan(loads=self._pending_loads, preempted=list(preempted))
        self._pending_loads = []
        cs = self._chunk_size
        for rid in plan.preempted:
            tr = self._requests.get(rid)
            if tr is not None:
                tr.block_ids = []
        if not cs:
            return plan
        bpc = cs // self.cfg.block_size
        client_ok = self.link.get() is not None
        for s in scheduled:
            tr = self._requests.get(s.req_id)
            if tr is None or not tr.cacheable:
                continue
            if s.block_ids is not None:
                tr.block_ids = list(s.block_ids)
            elif s.resumed:
                tr.block_ids = list(s.new_block_ids or ())
            elif s.new_block_ids:
                tr.block_ids.extend(s.new_block_ids)
            computed = s.num_computed_tokens + s.num_new_tokens
            limit = len(tr.token_ids) if self.cfg.store_decode else tr.num_prompt_tokens
            end = min(computed, limit, len(tr.token_ids)) // cs
            if end <= tr.stored_chunks or not client_ok:
                continue
            blocks = tr.block_ids[tr.stored_chunks * bpc : end * bpc]
            if len(blocks) != (end - tr.stored_chunks) * bpc:
                continue  # block table not known yet
            hashes = self._hashes(tr, end, cs)
            plan.stores.append(Transfer(req_id=s.req_id, hashes=hashes[tr.stored_chunks : end], block_ids=blocks))
            self.stats["store_chunks"] += end - tr.stored_chunks
            tr.stored_chunks = end
            tr.has_transfers = True
        return plan

    def request_finished(self, req_id: str) -> bool:
        """Forget the request; True if stores or loads were planned: keep its blocks until the
        workers report it finished (the server then writes none of them any more)."""
        tr = self._requests.pop(req_id, None)
        if tr is None:
            return False
        self._forget_lookup(tr)
        self._drop_lease(tr)
        return tr.has_transfers

    def flush_releases(self, timeout: float | None = None) -> None:
        """Wait until the releases queued so far reached the server."""
        self._releaser.submit(lambda: None).result(timeout)

    def close(self) -> None:
        # Closing the client says goodbye to the server, which drops every lease we still hold,
        # so queued releases are moot; a running one must end before its socket is closed.
        self._requests.clear()
        self._releaser.shutdown(wait=True, cancel_futures=True)
        self.link.close()
