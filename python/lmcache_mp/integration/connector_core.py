"""Engine-agnostic core of the lmcache-mp KV connector: request tracking, load/store plans, and
their execution through `lmcache_mp.Client`. No engine imports; `vllm.py` adapts it to vLLM.

Two halves, as engines split them:

- `SchedulerCore` (one per engine, beside the scheduler) looks up each new prompt's full chunks
  on the server, leasing the hits, tells the scheduler how many tokens it can supply, and turns
  every scheduling step into a `StepPlan`: chunks to load into newly allocated blocks, and
  newly computed full chunks to store.
- `WorkerCore` (one per rank, beside the KV cache) registers the rank's KV cache with the
  server and executes plans: loads before the forward pass (waited for), stores after it (not
  waited for; the engine keeps the blocks alive until `finished()` reports the request).

Token positions map to blocks as the engine's paged cache does: block `i` of a request holds
tokens `[i * block_size, (i + 1) * block_size)`; a chunk is `chunk_size // block_size` blocks.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import logging
import time
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from lmcache_mp.errors import LMCacheMPError, ServerUnavailable
from lmcache_mp.integration.link import ClientLink
from lmcache_mp.keys import chunk_hashes

logger = logging.getLogger(__name__)

DEFAULT_URL = "tcp://127.0.0.1:5555"
CONFIG_PREFIX = "lmcache_mp."


def _as_bool(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return bool(v)


@dataclass
class ConnectorConfig:
    """Settings of both halves. Engine extra-config keys are `lmcache_mp.<field>`."""

    url: str = DEFAULT_URL
    model: str = "default"
    block_size: int = 16
    world_size: int = 1
    lookup_timeout: float = 0.2  # longest the scheduler waits for one lookup
    request_timeout: float = 10.0  # client default for other calls
    connect_timeout: float = 2.0  # how long start-up waits for the first connection
    retry_interval: float = 5.0  # least time between connection attempts / after a failure
    load_timeout: float = 30.0  # longest a forward pass waits for its loads
    flush_timeout: float = 30.0  # longest shutdown (or a preemption) waits for stores in flight
    store_decode: bool = False  # also store chunks completed by generated tokens

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None, **base: Any) -> "ConnectorConfig":
        """Build from engine-provided `base` values overridden by `lmcache_mp.*` keys."""
        cfg = cls(**base)
        types = {f.name: f.type for f in fields(cls)}
        for key, value in (extra or {}).items():
            if not key.startswith(CONFIG_PREFIX):
                continue
            name = key[len(CONFIG_PREFIX) :]
            if name not in types:
                raise ValueError(f"unknown lmcache-mp connector setting {key!r}")
            current = getattr(cfg, name)
            if isinstance(current, bool):
                value = _as_bool(value)
            elif isinstance(current, int):
                value = int(value)
            elif isinstance(current, float):
                value = float(value)
            else:
                value = str(value)
            setattr(cfg, name, value)
        if cfg.block_size <= 0 or cfg.world_size <= 0:
            raise ValueError("block_size and world_size must be positive")
        return cfg


# ---- plans (scheduler -> workers; plain data, picklable) ----------------------------------------


@dataclass
class Transfer:
    """Chunks of one request and the blocks they occupy, in token order.

    `block_ids` has `len(hashes) * blocks_per_chunk` entries. For a load, the first
    `num_scratch_blocks` of them are a scratch block: the engine already holds those tokens
    (a local prefix hit ending inside the first chunk), so their bytes are written where
    nothing reads them."""

    req_id: str
    hashes: list[bytes]
    block_ids: list[int]
    num_scratch_blocks: int = 0


@dataclass
class StepPlan:
    loads: list[Transfer] = field(default_factory=list)
    stores: list[Transfer] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.stores or self.preempted)


@dataclass
class ScheduledRequest:
    """One request in one scheduling step, as the scheduler-side core needs to see it."""

    req_id: str
    num_computed_tokens: int  # tokens whose KV existed before this step (hits included)
    num_new_tokens: int  # tokens whose KV this step computes (no speculative tokens)
    block_ids: Sequence[int] | None = None  # the request's whole block table, if known
    new_block_ids: Sequence[int] | None = None  # else: blocks added this step...
    resumed: bool = False  # ...which replace the table (resumed after preemption)


# ---- scheduler side ---------------------------------------------------------------------------


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
    stored_chunks: int = 0  # leading chunks known to be on the server or planned to be stored
    has_stores: bool = False  # a store was ever planned (the workers then report it finished)
    block_ids: list[int] = field(default_factory=list)


class SchedulerCore:
    """Lookups, leases and plans. Every method is called from the scheduler's thread."""

    def __init__(self, config: ConnectorConfig, *, link: ClientLink | None = None):
        self.cfg = config
        self.link = link or ClientLink(
            config.url,
            name="lmcache-mp scheduler",
            request_timeout=config.request_timeout,
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
        self.stats = {"lookups": 0, "hit_tokens": 0, "load_tokens": 0, "store_chunks": 0}

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

    def _release(self, hashes: list[bytes]) -> None:
        if not hashes:
            return
        client = self.link.client
        if client is None:
            return

        def run():
            try:
                client.release(hashes, model=self.cfg.model, world_size=self.cfg.world_size)
            except LMCacheMPError as exc:
                logger.debug("lmcache-mp: release failed: %s", exc)

        self._releaser.submit(run)

    def _drop_lease(self, tr: _Tracked, upto: int | None = None) -> None:
        """Release the leased chunks [0, upto) (all by default); the rest is left to a load."""
        if tr.leased_chunks and self._chunk_size:
            n = tr.leased_chunks if upto is None else min(upto, tr.leased_chunks)
            self._release(tr.hashes[:n])
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
    ) -> int:
        """Tokens beyond `num_computed_tokens` the server can supply: whole chunks, never the
        last token. Repeated calls for one admission (`generation`) reuse the first lookup."""
        tr = self._requests.get(req_id)
        if tr is None or tr.generation != generation:
            if tr is not None:  # re-admitted after preemption
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
        self.stats["lookups"] += 1
        try:
            n = int(
                client.lookup(
                    hashes,
                    model=self.cfg.model,
                    world_size=self.cfg.world_size,
                    lock=True,
                    timeout=self.cfg.lookup_timeout,
                )
            )
        except ServerUnavailable as exc:
            self.link.report_failure(exc)
            self._release(hashes)  # in case the lookup lands late and leases them
            return
        except LMCacheMPError as exc:
            if not self._error_logged:
                logger.warning("lmcache-mp: lookup rejected (%s); treating as a miss", exc)
                self._error_logged = True
            return
        self.link.report_success()
        n = max(0, min(n, max_chunks))
        tr.hit_chunks = n
        tr.leased_chunks = n
        tr.stored_chunks = n

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
            return
        scratch = start // bs - first * bpc
        if scratch and self.scratch_block_id is not None:
            blocks[:scratch] = [self.scratch_block_id] * scratch
        else:
            scratch = 0
        self._pending_loads.append(
            Transfer(req_id=req_id, hashes=tr.hashes[first : tr.hit_chunks], block_ids=blocks, num_scratch_blocks=scratch)
        )
        self.stats["load_tokens"] += num_external_tokens
        self._drop_lease(tr, upto=first)  # the load consumes the leases of chunks [first, hit)

    def build_plan(self, scheduled: Iterable[ScheduledRequest], preempted: Iterable[str] = ()) -> StepPlan:
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
            tr.has_stores = True
        return plan

    def request_finished(self, req_id: str) -> bool:
        """Forget the request; True if stores were planned (keep its blocks until the workers
        report it finished)."""
        tr = self._requests.pop(req_id, None)
        if tr is None:
            return False
        self._drop_lease(tr)
        return tr.has_stores

    def close(self) -> None:
        for tr in self._requests.values():
            self._drop_lease(tr)
        self._requests.clear()
        self._releaser.shutdown(wait=True)
        self.link.close()


# ---- worker side ------------------------------------------------------------------------------


class WorkerCore:
    """Executes plans on one rank's KV cache. Called from the engine's execution thread."""

    def __init__(
        self,
        config: ConnectorConfig,
        *,
        rank: int = 0,
        layout: str = "auto",
        link: ClientLink | None = None,
    ):
        self.cfg = config
        self.rank = rank
        self.layout = layout
        self.link = link or ClientLink(
            config.url,
            name=f"lmcache-mp worker {rank}",
            request_timeout=config.request_timeout,
            retry_interval=config.retry_interval,
            on_connect=self._register,
        )
        self._tensors: list = []
        self._shared: list = []
        self._handle = None
        self._handle_client = None
        self._stores: dict[str, list[cf.Future]] = {}  # req -> store futures not yet reported
        self._with_stores: set[str] = set()  # requests that had a store planned
        self._finishing: set[str] = set()
        self._loading: list[tuple[Transfer, cf.Future | None]] = []
        self._load_errors: set[int] = set()
        self._store_failures = 0
        self._store_failure_logged = False
        self.stats = {"loaded_chunks": 0, "failed_load_chunks": 0, "stored_chunks": 0, "store_errors": 0}

    # ---- registration ---------------------------------------------------------------------

    def register_kv_caches(self, tensors: Sequence) -> None:
        """Take the rank's per-layer KV tensors (CPU ones move into shared memory in place)."""
        tensors = list(tensors)
        if not tensors:
            raise ValueError("no KV-cache tensors to register")
        if tensors[0].device.type == "cpu":
            from lmcache_mp.integration.cpu_shm import move_to_shared_memory

            self._shared = move_to_shared_memory(tensors)
        self._tensors = tensors
        self.link.connect(wait=self.cfg.connect_timeout)

    def _register(self, client) -> None:
        if not self._tensors:
            raise RuntimeError("KV caches are not known yet")
        self._handle = client.register_kv_cache(
            self._tensors,
            model=self.cfg.model,
            world_size=self.cfg.world_size,
            rank=self.rank,
            layout=self.layout,
        )
        self._handle_client = client

    def _client(self):
        client = self.link.get()
        if client is None or self._handle is None:
            return None
        return client

    # ---- loads ----------------------------------------------------------------------------

    def start_loads(self, plan: StepPlan) -> None:
        client = self._client() if plan.loads else None
        for t in plan.loads:
            fut = None
            if client is not None and t.hashes:
                try:
                    fut = client.retrieve(self._handle, t.hashes, t.block_ids)
                except LMCacheMPError as exc:
                    self._note_failure(exc)
            self._loading.append((t, fut))

    def wait_loads(self) -> None:
        """Block until this step's loads landed; record the blocks of every chunk not loaded."""
        if not self._loading:
            return
        deadline = time.monotonic() + self.cfg.load_timeout
        loading, self._loading = self._loading, []
        for t, fut in loading:
            loaded = 0
            if fut is not None:
                try:
                    loaded = int(fut.result(timeout=max(0.0, deadline - time.monotonic())).loaded)
                except cf.TimeoutError:
                    self.link.report_failure(ServerUnavailable("load timed out"))
                except LMCacheMPError as exc:
                    self._note_failure(exc)
            n = len(t.hashes)
            loaded = max(0, min(loaded, n))
            self.stats["loaded_chunks"] += loaded
            if loaded < n or not n:
                self.stats["failed_load_chunks"] += n - loaded
                bpc = len(t.block_ids) // n if n else 0
                self._load_errors.update(t.block_ids[max(loaded * bpc, t.num_scratch_blocks) :])
                logger.debug("lmcache-mp: request %s loaded %d of %d chunks", t.req_id, loaded, n)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- stores ---------------------------------------------------------------------------

    def start_stores(self, plan: StepPlan) -> None:
        client = self._client() if plan.stores else None
        for t in plan.stores:
            self._with_stores.add(t.req_id)
            if client is None:
                continue
            try:
                fut = client.store(self._handle, t.hashes, t.block_ids)
            except LMCacheMPError as exc:
                self._store_failed(exc)
                continue
            self.stats["stored_chunks"] += len(t.hashes)
            self._stores.setdefault(t.req_id, []).append(fut)

    def _store_failed(self, exc: BaseException) -> None:
        self.stats["store_errors"] += 1
        if isinstance(exc, ServerUnavailable):
            self.link.report_failure(exc)
        elif not self._store_failure_logged:
            logger.warning("lmcache-mp: store failed (%s); further failures are logged at debug level", exc)
            self._store_failure_logged = True
        else:
            logger.debug("lmcache-mp: store failed: %s", exc)

    def _note_failure(self, exc: BaseException) -> None:
        if isinstance(exc, ServerUnavailable):
            self.link.report_failure(exc)
        else:
            logger.warning("lmcache-mp: transfer rejected: %s", exc)

    def _reap(self, futures: list[cf.Future]) -> None:
        for fut in futures:
            exc = fut.exception() if fut.done() and not fut.cancelled() else None
            if exc is not None:
                self._store_failed(exc)

    def wait_stores(self, req_ids: Iterable[str], timeout: float | None = None) -> None:
        """Block until the stores of these requests finished (their blocks may then change)."""
        deadline = time.monotonic() + (self.cfg.flush_timeout if timeout is None else timeout)
        for rid in req_ids:
            futures = self._stores.pop(rid, [])
            if futures:
                cf.wait(futures, timeout=max(0.0, deadline - time.monotonic()))
                self._reap(futures)

    def handle_preemptions(self, plan: StepPlan) -> None:
        if plan.preempted:
            self.wait_stores(plan.preempted)

    def finished(self, finished_req_ids: Iterable[str]) -> set[str]:
        """Requests that finished and whose stores are all done (each reported once)."""
        self._finishing.update(r for r in finished_req_ids if r in self._with_stores)
        done = set()
        for rid in self._finishing:
            futures = self._stores.get(rid, ())
            if all(f.done() for f in futures):
                done.add(rid)
        for rid in done:
            self._reap(self._stores.pop(rid, []))
            self._with_stores.discard(rid)
        self._finishing -= done
        return done

    def close(self) -> None:
        pending = [f for fs in self._stores.values() for f in fs]
        if pending:
            cf.wait(pending, timeout=self.cfg.flush_timeout)
        self._stores.clear()
        client, handle = self._handle_client, self._handle
        self._handle = None
        if client is not None and handle is not None:
            try:
                client.unregister_kv_cache(handle)
            except Exception as exc:  # noqa: BLE001 - best effort at shutdown
                logger.debug("lmcache-mp: unregister failed: %s", exc)
        self.link.close()
        if self._shared:
            from lmcache_mp.integration.cpu_shm import release_shared_memory

            release_shared_memory(self._shared)
            self._shared = []
