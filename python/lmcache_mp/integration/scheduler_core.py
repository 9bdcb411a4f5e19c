"""Scheduler half of the lmcache-mp connector: lookups with leases, and per-step plans.

One module over 450 lines: every scheduler step (lookup, allocation, plan, finish) reads and
changes one request's state (`_Tracked`) in order, and its helpers already live apart
(connector_types.py, link.py, request_hints.py).
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from lmcache_mp.errors import LMCacheMPError, ServerUnavailable
from lmcache_mp.integration.connector_types import (
    STATE,
    ConnectorConfig,
    KVGroup,
    ScheduledRequest,
    StepPlan,
    Transfer,
    block_tables,
    connector_chunk_size,
    group_model_name,
)
from lmcache_mp.integration.link import ClientLink
from lmcache_mp.integration.request_hints import AT_ARRIVAL, RequestHint
from lmcache_mp.keys import chunk_hashes

logger = logging.getLogger(__name__)

MAX_WAITING_HINTS = 4096  # finished requests whose hints wait for their stores (beyond: the oldest go unsent)


@dataclass(eq=False)
class _Tracked:
    req_id: str
    token_ids: Sequence[int]  # live view: grows with generated tokens
    num_prompt_tokens: int
    salt: bytes
    generation: int
    cacheable: bool = True
    skip_load: bool = False
    skip_save: bool = False
    spans: Sequence[tuple[int, int, bytes]] = ()  # token ranges whose KV depends on more (see below)
    hashes: list[bytes] = field(default_factory=list)
    looked_up: bool = False
    asked_at: float = 0.0  # when the engine first asked for this admission's hit (time.perf_counter())
    engine_tokens: int = 0  # tokens vLLM's own prefix cache held when it asked
    hit_chunks: int = 0  # leading chunks every group has
    # Per group: leading chunks leased by our lookup and not yet loaded/released, and the id of
    # the server's lease on them.
    leased_chunks: list[int] = field(default_factory=list)
    leases: list[int] = field(default_factory=list)
    stored_chunks: int = 0  # leading chunks known to be on the server or planned to be stored
    # A store or load was ever planned: the workers then report the request finished once the
    # server answered them all, and its blocks stay allocated until then.
    has_transfers: bool = False
    tables: list[list[int]] = field(default_factory=list)  # block table per group
    pending: list[cf.Future] | None = None  # the prefix lookups (one per prefix group), while on their way
    # The state groups' lookups (boundary in chunks, group position, lookup), while on their way.
    pending_states: list[tuple[int, int, cf.Future]] | None = None
    hints: tuple[RequestHint, ...] = ()  # what the application asked of the server for it (request_hints.py)


class SchedulerCore:
    """Lookups, leases and plans. Every method is called from the scheduler's thread."""

    def __init__(self, config: ConnectorConfig, *, groups: Sequence[KVGroup] | None = None,
                 link: ClientLink | None = None):
        """`groups`: the engine's KV-cache groups (default: one full-attention group of the
        configured block size). Each group is stored, looked up and loaded in its own server
        namespace; a chunk is a hit only when every group has it."""
        self.cfg = config
        self.groups = list(groups) if groups else [KVGroup(0, block_size=config.block_size)]
        self.models = [group_model_name(config.model, self.groups, i) for i in range(len(self.groups))]
        # Groups looked up as prefixes (attention), and state groups, looked up per boundary.
        self._prefix_groups = [i for i, g in enumerate(self.groups) if g.kind != STATE]
        self._state_groups = [i for i, g in enumerate(self.groups) if g.kind == STATE]
        # A hit ends where every state group has a state: candidate boundaries below the
        # attention hit looked at, from the deepest down.
        self.state_candidates = 4
        self._block_lcm = math.lcm(*(g.block_size for g in self.groups))
        self._no_state_logged = False
        self.link = link or ClientLink(
            config.url,
            name="lmcache-mp scheduler",
            request_timeout=config.request_timeout,
            connect_timeout=config.connect_timeout,
            retry_interval=config.retry_interval,
            curve_server_key=config.curve_server_key,
            curve_client_key=config.curve_client_key,
        )
        # A block whose contents nobody reads (vLLM: the null block); see Transfer.
        self.scratch_block_id: int | None = None
        # Keeping blocks of transient groups from reuse while their stores read them (vLLM:
        # the block pool's reference counts); None: the engine never reuses them meanwhile.
        self.pin_blocks: Callable[[list[int]], None] | None = None
        self.unpin_blocks: Callable[[list[int]], None] | None = None
        self._pins: dict[int, list] = {}  # pin id -> [blocks, ranks that reported it settled]
        # Told of every chunk planned to be stored: (request id, group position, chunk index, hash).
        self.on_store_planned: Callable[[str, int, int, bytes], None] | None = None
        self._pin_ids = itertools.count(1)
        self._requests: dict[str, _Tracked] = {}
        # finished requests' hints, sent once the workers report their stores answered: (hashes, hints)
        self._hints_after_stores: dict[str, tuple[list[bytes], list[RequestHint]]] = {}
        self._pending_loads: list[Transfer] = []
        self._chunk_size: int | None = None
        self._error_logged = False
        # Releases must not block the scheduler; one thread keeps them in order.
        self._releaser = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmcache-mp-release")
        # lookup_tokens: what the server could supply (beyond the engine's own hit); hit_tokens:
        # what it did (loads planned); found_tokens: what it had. lookup_us_*: the time the
        # scheduler loop spent in lookups; answer_us_max: the longest a request waited for its
        # lookup's answer, over the steps that asked.
        self.stats = {"lookups": 0, "lookup_tokens": 0, "hit_tokens": 0, "found_tokens": 0, "store_chunks": 0,
                      "lookup_us_total": 0, "lookup_us_max": 0, "answer_us_max": 0, "hints": 0, "hint_errors": 0}
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
            cs = connector_chunk_size(self.groups, int(client.chunk_size))
            if cs != client.chunk_size:
                logger.info("lmcache-mp: chunks of %d tokens (the server's are %d; this engine's blocks are of %s "
                            "tokens%s)", cs, client.chunk_size, "/".join(sorted({str(g.block_size) for g in self.groups})),
                            ", and its states are kept at block boundaries" if self._state_groups else "")
            self._chunk_size = cs
        return client, self._chunk_size

    @property
    def async_loads(self) -> bool:
        """Loads complete outside the engine's steps (a model with state groups)."""
        return bool(self._state_groups)

    def _hashes(self, tr: _Tracked, num_chunks: int, chunk_size: int) -> list[bytes]:
        if len(tr.hashes) < num_chunks:
            n = num_chunks * chunk_size
            tokens = np.fromiter(itertools.islice(tr.token_ids, n), dtype=np.int64, count=n)
            extras: dict[int, bytes] = {}
            for start, end, what in tr.spans:  # every chunk the span overlaps depends on it
                for c in range(start // chunk_size, min(num_chunks, -(-end // chunk_size))):
                    extras[c] = extras.get(c, b"") + what + start.to_bytes(8, "little")
            tr.hashes = chunk_hashes(tokens, chunk_size, salt=tr.salt, extras=extras)
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

    def _drop_lease(self, tr: _Tracked, upto: int | None = None, group: int | None = None) -> None:
        """Release the leased chunks [0, upto) (all by default) of every group's lease (or of
        one group's); the rest is left to a load."""
        for g in range(len(tr.leased_chunks)) if group is None else (group,):
            n = tr.leased_chunks[g]
            if n and self._chunk_size:
                if upto is None or upto >= n:
                    self._release(tr.leases[g])
                elif upto > 0:
                    self._release(tr.leases[g], tr.hashes[:upto])
            tr.leased_chunks[g] = 0

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
        skip_load: bool = False,
        skip_save: bool = False,
        spans: Sequence[tuple[int, int, bytes]] = (),
        hints: Sequence[RequestHint] = (),
    ) -> int | None:
        """Tokens beyond `num_computed_tokens` the server can supply: whole chunks, never the
        last token. Repeated calls for one admission (`generation`) reuse the first lookup.
        None while the lookup's answer has not come (the server may be loading chunks from its
        L2 tier): the engine asks again at a later step instead of waiting.

        `salt`: what all of the request's KV depends on besides its tokens (LoRA adapter, cache
        salt); `spans`: (start, end, what) token ranges whose KV depends on `what` too (an
        image behind placeholder tokens): the chunks they overlap, and all later ones, get other
        keys. `cacheable=False`: neither looked up nor stored; `skip_load` / `skip_save`: one
        of the two only. `hints`: what the application asks of the server for this request's
        chunks (docs/hints.md): a prefetch before its lookup, the others once it finished."""
        tr = self._requests.get(req_id)
        if tr is None or tr.generation != generation:
            if tr is not None:  # re-admitted after preemption
                self._forget_lookup(tr)
                self._drop_lease(tr)
                tr.generation = generation
                tr.looked_up = False
                tr.hit_chunks = 0
                tr.hashes = []
                tr.leases, tr.leased_chunks = [], []
            else:
                tr = _Tracked(
                    req_id=req_id,
                    token_ids=token_ids,
                    num_prompt_tokens=len(token_ids) if num_prompt_tokens is None else num_prompt_tokens,
                    salt=salt,
                    generation=generation,
                    cacheable=cacheable,
                    skip_load=skip_load,
                    skip_save=skip_save,
                    spans=tuple(spans),
                    hints=tuple(hints) if cacheable else (),
                )
                self._requests[req_id] = tr
        if not tr.looked_up:
            if tr.hints and self.cfg.loads and not tr.skip_load:
                self._send_hints(tr, (len(tr.token_ids) - 1), [h for h in tr.hints if h.action in AT_ARRIVAL])
            tr.looked_up = True
            tr.asked_at = time.perf_counter()
            tr.engine_tokens = num_computed_tokens
            self._lookup(tr)
        if tr.pending is not None and not self._lookup_done(tr):
            return None
        if tr.pending_states is not None and not self._states_done(tr):
            return None
        if tr.asked_at:
            us = int((time.perf_counter() - tr.asked_at) * 1e6)
            self.stats["answer_us_max"] = max(self.stats["answer_us_max"], us)
            tr.asked_at = 0.0
        return self._external_tokens(tr, num_computed_tokens)

    def _lookup(self, tr: _Tracked) -> None:
        if not tr.cacheable or tr.skip_load or not self.cfg.loads:
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
        tr.leases, tr.leased_chunks = [0] * len(self.groups), [0] * len(self.groups)
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

    def _lookup_done(self, tr: _Tracked) -> bool:
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
        cs, max_chunks = self._chunk_size, len(tr.hashes)
        n = max(0, min(min(int(f) for f in found), max_chunks))
        tr.hit_chunks = n
        for gi, f in zip(self._prefix_groups, found):
            tr.leases[gi], tr.leased_chunks[gi] = f.lease, n
            if n == 0:  # a group that found more than all the others
                self._release(f.lease)
            elif int(f) > n:
                self._release(f.lease, tr.hashes[n : int(f)])
        tr.stored_chunks = n
        if self._state_groups and n:
            self._lookup_states(tr)
            return True
        self._count_found(tr)
        return True

    def _count_found(self, tr: _Tracked) -> None:
        cs = self._chunk_size
        self.stats["found_tokens"] += tr.hit_chunks * cs
        self.stats["lookup_tokens"] += max(0, len(tr.hashes) * cs - tr.engine_tokens)
        self._log_hits()

    def _lookup_states(self, tr: _Tracked) -> None:
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

    def _states_done(self, tr: _Tracked) -> bool:
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
                    self._release(f.lease)
        n = tr.hit_chunks
        if best < n:
            for gi in self._prefix_groups:
                if best == 0:
                    self._release(tr.leases[gi])
                else:
                    self._release(tr.leases[gi], tr.hashes[best:n])
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
                self._release(f.result().lease)

        for fut in lookups:
            fut.add_done_callback(landed)

    def _forget_lookup(self, tr: _Tracked) -> None:
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

    def _external_tokens(self, tr: _Tracked, num_computed_tokens: int) -> int:
        if not tr.hit_chunks or not self._chunk_size:
            return 0
        n = tr.hit_chunks * self._chunk_size - num_computed_tokens
        n -= n % self._block_lcm if n > 0 else 0
        if n <= 0:
            self._drop_lease(tr)  # vLLM already has all of it
            return 0
        return n

    def _set_tables(self, tr: _Tracked, ids) -> None:
        tables = block_tables(ids) or []
        tr.tables = [list(tables[g.index]) if g.index < len(tables) else [] for g in self.groups]

    def on_allocated(self, req_id: str, block_ids: Sequence, num_external_tokens: int) -> None:
        """Blocks are allocated (`block_ids`: one table per group, or one flat table); plan the
        load of the `num_external_tokens` accepted."""
        tr = self._requests.get(req_id)
        if tr is None:
            return
        self._set_tables(tr, block_ids)
        if num_external_tokens <= 0 or not tr.hit_chunks or not self._chunk_size:
            self._drop_lease(tr)
            return
        cs, hit = self._chunk_size, tr.hit_chunks
        start = hit * cs - num_external_tokens  # first token to load = tokens the engine holds
        first = start // cs if start >= 0 else 0
        planned = []
        for gi, g in enumerate(self.groups):
            bs, table = g.block_size, tr.tables[gi]
            bpc = cs // bs
            unfit = start < 0 or len(table) < hit * bpc
            if not unfit and g.kind == STATE and table[hit * bpc - 1] == self.scratch_block_id:
                unfit = True  # (vLLM gives the block of the boundary's state a block of its own)
            if unfit:
                logger.error("lmcache-mp: request %s: %d external tokens do not fit its %d blocks of group %d; "
                             "not loading", req_id, num_external_tokens, len(table), g.index)
                self._drop_lease(tr)
                # Loads with no chunks: the worker reports these blocks as failed, so the
                # engine recomputes the tokens it was promised.
                for gj, tj in enumerate(tr.tables):
                    b = self.groups[gj].block_size
                    bad = [x for x in tj[max(start, 0) // b : -(-hit * cs // b)] if x != self.scratch_block_id]
                    self._pending_loads.append(Transfer(req_id=req_id, hashes=[], block_ids=bad, group=gj))
                tr.has_transfers = True
                return
            scratch = self.scratch_block_id
            c0 = first
            if g.kind == STATE:  # the state at the hit's end alone: it summarises every token before
                c0 = hit - 1
            elif g.transient and scratch is not None:
                # Blocks of tokens the group no longer reads are the scratch block (vLLM's null
                # block): chunks of nothing else need no load for this group.
                while c0 < hit and all(b == scratch for b in table[c0 * bpc : (c0 + 1) * bpc]):
                    c0 += 1
            blocks = table[c0 * bpc : hit * bpc]
            held = start // bs - c0 * bpc  # blocks of chunk c0 the engine holds already
            if held > 0 and scratch is not None:
                blocks[:held] = [scratch] * held
            planned.append((gi, c0, blocks))
        for gi, c0, blocks in planned:
            self._drop_lease(tr, upto=c0, group=gi)  # the load consumes the lease on chunks [c0, hit)
            if c0 >= hit:
                continue
            scratch = self.scratch_block_id
            self._pending_loads.append(
                Transfer(req_id=req_id, hashes=tr.hashes[c0:hit], block_ids=blocks,
                         num_scratch_blocks=sum(b == scratch for b in blocks) if scratch is not None else 0,
                         lease=tr.leases[gi], group=gi, scratch_block=scratch)
            )
            tr.has_transfers = True
        self.stats["hit_tokens"] += num_external_tokens
        if not self._first_hit_logged:
            self._first_hit_logged = True
            logger.info("lmcache-mp: first cache hit: loading %d of the %d prompt tokens of request %s from the server "
                        "(vLLM's own prefix cache held %d)", num_external_tokens, tr.num_prompt_tokens, req_id,
                        tr.engine_tokens)

    def build_plan(self, scheduled: Iterable[ScheduledRequest], preempted: Iterable[str] = ()) -> StepPlan:
        self._block_left = self.cfg.lookup_block  # the engine's next step starts its own budget
        plan = StepPlan(loads=self._pending_loads, preempted=list(preempted), async_loads=self.async_loads)
        self._pending_loads = []
        for rid in plan.preempted:
            tr = self._requests.get(rid)
            if tr is not None:
                tr.tables = [[] for _ in self.groups]
        client, _ = self._client()  # (a producer that never looks up learns the chunk size here)
        cs, client_ok = self._chunk_size, client is not None
        if not cs:
            return plan
        for s in scheduled:
            tr = self._requests.get(s.req_id)
            if tr is None or not tr.cacheable or tr.skip_save or not self.cfg.stores:
                continue
            if s.block_ids is not None:
                self._set_tables(tr, s.block_ids)
            elif s.resumed:
                self._set_tables(tr, s.new_block_ids or ())
            elif s.new_block_ids:
                new = block_tables(s.new_block_ids)
                for g, table in zip(self.groups, tr.tables):
                    if g.index < len(new):
                        table.extend(new[g.index])
            computed = s.num_computed_tokens + s.num_new_tokens
            limit = len(tr.token_ids) if self.cfg.store_decode else tr.num_prompt_tokens
            end = min(computed, limit, len(tr.token_ids)) // cs
            if s.boundary_states and client_ok:
                plan.stores += self._plan_state_stores(tr, s.boundary_states, end)
            if end <= tr.stored_chunks or not client_ok:
                continue
            stores = self._plan_stores(tr, tr.stored_chunks, end)
            if stores is None:
                continue  # block tables not known yet
            plan.stores += stores
            self.stats["store_chunks"] += end - tr.stored_chunks
            tr.stored_chunks = end
            tr.has_transfers = True
        return plan

    def _plan_stores(self, tr: _Tracked, begin: int, end: int) -> list[Transfer] | None:
        """The stores of chunks [begin, end), one per group; None if a table is too short."""
        cs = self._chunk_size
        hashes = self._hashes(tr, end, cs)
        scratch = self.scratch_block_id
        out = []
        for gi, g in enumerate(self.groups):
            if g.kind == STATE:
                continue  # (stored where the engine names a state: _plan_state_stores)
            bs = g.block_size
            bpc = cs // bs
            table = tr.tables[gi]
            if len(table) < end * bpc:
                return None
            chunks = range(begin, end)
            if g.transient and scratch is not None:
                # A chunk's blocks of tokens outside the window at its end are never read after
                # a hit there (nor later); they may be freed already (the scratch block then
                # stands in). A chunk whose window lost a block cannot be stored for this group.
                chunks = [c for c in chunks
                          if scratch not in table[g.first_needed_token((c + 1) * cs) // bs : (c + 1) * bpc]]
                if len(chunks) < end - begin:
                    logger.debug("lmcache-mp: request %s: %d chunks of group %d lost blocks of their window before "
                                 "they could be stored", tr.req_id, end - begin - len(chunks), g.index)
            if not chunks:
                continue
            blocks = [b for c in chunks for b in table[c * bpc : (c + 1) * bpc]]
            t = Transfer(req_id=tr.req_id, hashes=[hashes[c] for c in chunks], block_ids=blocks, group=gi,
                         scratch_block=scratch, parent=hashes[chunks[0] - 1] if chunks[0] else b"")
            if self.on_store_planned is not None:
                for c in chunks:
                    self.on_store_planned(tr.req_id, gi, c, hashes[c])
            if g.transient and self.pin_blocks is not None:
                # vLLM frees these blocks as the window moves on, maybe before the store read them.
                real = [b for b in blocks if b != scratch]
                t.pin = next(self._pin_ids)
                self.pin_blocks(real)
                self._pins[t.pin] = [real, 0]
            out.append(t)
        return out

    def _plan_state_stores(self, tr: _Tracked, states: Iterable[tuple[int, int, int]], end: int) -> list[Transfer]:
        """Stores of the states this step computes at chunk boundaries within the first `end`
        chunks ((group index, block id, boundary) as the engine names them), each under the key
        of the chunk that ends at its boundary. The engine frees or reuses such a block from the
        next step on: it stays pinned until every rank's store is over."""
        cs, scratch = self._chunk_size, self.scratch_block_id
        out = []
        for index, block, boundary in states:
            gi = next((i for i in self._state_groups if self.groups[i].index == index), None)
            if gi is None or boundary <= 0 or boundary % cs or boundary // cs > end or block == scratch:
                continue
            c = boundary // cs - 1
            hashes = self._hashes(tr, c + 1, cs)
            t = Transfer(req_id=tr.req_id, hashes=[hashes[c]], block_ids=[block], group=gi, scratch_block=scratch,
                         parent=hashes[c - 1] if c else b"")
            if self.on_store_planned is not None:
                self.on_store_planned(tr.req_id, gi, c, hashes[c])
            if self.pin_blocks is not None:
                t.pin = next(self._pin_ids)
                self.pin_blocks([block])
                self._pins[t.pin] = [[block], 0]
            out.append(t)
            tr.has_transfers = True
        return out

    def stores_settled(self, reports: Mapping[int, int]) -> None:
        """Workers report pinned stores settled (pin id -> ranks reporting); once every rank
        did, the store's blocks are unpinned."""
        for pin, n in reports.items():
            entry = self._pins.get(pin)
            if entry is None:
                continue
            entry[1] += n
            if entry[1] >= self.cfg.world_size:
                del self._pins[pin]
                if self.unpin_blocks is not None:
                    self.unpin_blocks(entry[0])

    @property
    def pinned_stores(self) -> int:
        return len(self._pins)

    def request_finished(self, req_id: str) -> bool:
        """Forget the request; True if stores or loads were planned: keep its blocks until the
        workers report it finished (the server then writes none of them any more)."""
        tr = self._requests.pop(req_id, None)
        if tr is None:
            return False
        self._forget_lookup(tr)
        self._drop_lease(tr)
        later = [h for h in tr.hints if h.action not in AT_ARRIVAL]
        if later and tr.stored_chunks and self._chunk_size:
            hashes = self._hashes(tr, tr.stored_chunks, self._chunk_size)
            if tr.has_transfers:  # (their chunks are on the server once the workers say the stores are over)
                if len(self._hints_after_stores) >= MAX_WAITING_HINTS:
                    self._hints_after_stores.pop(next(iter(self._hints_after_stores)))
                self._hints_after_stores[req_id] = (hashes, later)
            else:
                self._send(hashes, later)
        return tr.has_transfers

    @property
    def hints_waiting(self) -> int:
        """Finished requests whose hints wait for the workers to report their stores over."""
        return len(self._hints_after_stores)

    def stores_finished(self, req_ids: Iterable[str]) -> None:
        """The workers report these finished requests' stores answered: send their hints now."""
        for req_id in req_ids:
            waiting = self._hints_after_stores.pop(req_id, None)
            if waiting is not None:
                self._send(*waiting)

    def _send_hints(self, tr: _Tracked, num_tokens: int, hints: Sequence[RequestHint]) -> None:
        client, cs = self._client()
        if client is not None and hints and num_tokens >= cs:
            self._send(self._hashes(tr, num_tokens // cs, cs), hints)

    def _send(self, hashes: list[bytes], hints: Sequence[RequestHint]) -> None:
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
                                          ttl=h.ttl, priority=h.priority, timeout=self.cfg.lookup_timeout)
                except LMCacheMPError as exc:
                    self.stats["hint_errors"] += 1
                    logger.debug("lmcache-mp: a hint was not sent: %s", exc)
                    return
                self.stats["hints"] += 1
                f.add_done_callback(answered)

    def flush_releases(self, timeout: float | None = None) -> None:
        """Wait until the releases queued so far reached the server."""
        self._releaser.submit(lambda: None).result(timeout)

    def close(self) -> None:
        # Closing the client says goodbye to the server, which drops every lease we still hold,
        # so queued releases are moot; a running one must end before its socket is closed.
        self._requests.clear()
        self._releaser.shutdown(wait=True, cancel_futures=True)
        self.link.close()
