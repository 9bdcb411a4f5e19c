"""Scheduler half of the lmcache-mp connector: per-step plans of loads and stores.

SchedulerCore keeps each request's state (tracked_request.py) and owns its parts, each built from
the collaborators it names: the lookups and the leases they open (scheduler_lookups.py) and the
application's hints (scheduler_hints.py). Itself it plans the loads of what a lookup found once
the engine allocated blocks, and the stores of what each step computed.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from typing import Callable, Iterable, Mapping, Sequence

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
from lmcache_mp.integration.request_hints import RequestHint
from lmcache_mp.integration.scheduler_hints import HintSender
from lmcache_mp.integration.scheduler_lookups import SchedulerLookups
from lmcache_mp.integration.tracked_request import TrackedRequest

logger = logging.getLogger(__name__)


class SchedulerCore:
    """Requests and their plans. Every method is called from the scheduler's thread."""

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
        self._block_lcm = math.lcm(*(g.block_size for g in self.groups))
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
        self._requests: dict[str, TrackedRequest] = {}
        self._pending_loads: list[Transfer] = []
        self._chunk_size: int | None = None
        # lookup_tokens: what the server could supply (beyond the engine's own hit); hit_tokens:
        # what it did (loads planned); found_tokens: what it had. lookup_us_*: the time the
        # scheduler loop spent in lookups; answer_us_max: the longest a request waited for its
        # lookup's answer, over the steps that asked.
        self.stats = {"lookups": 0, "lookup_tokens": 0, "hit_tokens": 0, "found_tokens": 0, "store_chunks": 0,
                      "lookup_us_total": 0, "lookup_us_max": 0, "answer_us_max": 0, "hints": 0, "hint_errors": 0}
        self._first_hit_logged = False
        self.lookups = SchedulerLookups(config, self.models, self._prefix_groups, self._state_groups, self.link,
                                        self.stats, client=self._client, chunk_size=lambda: self._chunk_size)
        self.hints = HintSender(config, self.models, self._prefix_groups, self.stats, client=self._client)

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
                self.lookups.forget(tr)
                self.lookups.drop_lease(tr)
                tr.generation = generation
                tr.looked_up = False
                tr.hit_chunks = 0
                tr.hashes = []
                tr.leases, tr.leased_chunks = [], []
            else:
                tr = TrackedRequest(
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
            self.hints.arrived(tr)
            tr.looked_up = True
            tr.asked_at = time.perf_counter()
            tr.engine_tokens = num_computed_tokens
            self.lookups.lookup(tr)
        if not self.lookups.answered(tr):
            return None
        if tr.asked_at:
            us = int((time.perf_counter() - tr.asked_at) * 1e6)
            self.stats["answer_us_max"] = max(self.stats["answer_us_max"], us)
            tr.asked_at = 0.0
        return self._external_tokens(tr, num_computed_tokens)

    def _external_tokens(self, tr: TrackedRequest, num_computed_tokens: int) -> int:
        if not tr.hit_chunks or not self._chunk_size:
            return 0
        n = tr.hit_chunks * self._chunk_size - num_computed_tokens
        n -= n % self._block_lcm if n > 0 else 0
        if n <= 0:
            self.lookups.drop_lease(tr)  # vLLM already has all of it
            return 0
        return n

    def _set_tables(self, tr: TrackedRequest, ids) -> None:
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
            self.lookups.drop_lease(tr)
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
                self.lookups.drop_lease(tr)
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
            self.lookups.drop_lease(tr, upto=c0, group=gi)  # the load consumes the lease on chunks [c0, hit)
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
        self.lookups.new_step()
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

    def _plan_stores(self, tr: TrackedRequest, begin: int, end: int) -> list[Transfer] | None:
        """The stores of chunks [begin, end), one per group; None if a table is too short."""
        cs = self._chunk_size
        hashes = tr.chunk_keys(end, cs)
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

    def _plan_state_stores(self, tr: TrackedRequest, states: Iterable[tuple[int, int, int]], end: int) -> list[Transfer]:
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
            hashes = tr.chunk_keys(c + 1, cs)
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
        self.lookups.forget(tr)
        self.lookups.drop_lease(tr)
        self.hints.finished(tr, self._chunk_size)
        return tr.has_transfers

    @property
    def hints_waiting(self) -> int:
        """Finished requests whose hints wait for the workers to report their stores over."""
        return self.hints.waiting

    def stores_finished(self, req_ids: Iterable[str]) -> None:
        """The workers report these finished requests' stores answered: send their hints now."""
        self.hints.stores_finished(req_ids)

    def flush_releases(self, timeout: float | None = None) -> None:
        """Wait until the releases queued so far reached the server."""
        self.lookups.flush_releases(timeout)

    def close(self) -> None:
        # Closing the client says goodbye to the server, which drops every lease we still hold,
        # so queued releases are moot; a running one must end before its socket is closed.
        self._requests.clear()
        self.lookups.close()
        self.link.close()
