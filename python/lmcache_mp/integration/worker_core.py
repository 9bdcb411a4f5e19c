"""Worker half of the lmcache-mp connector: registers one rank's KV cache and executes plans."""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import logging
import threading
import time
import weakref
from typing import Iterable, Sequence

from lmcache_mp.errors import LMCacheMPError, ServerUnavailable
from lmcache_mp.integration.connector_types import (
    STATE,
    ConnectorConfig,
    KVGroup,
    StepPlan,
    Transfer,
    connector_chunk_size,
    group_model_name,
)
from lmcache_mp.integration.link import ClientLink

logger = logging.getLogger(__name__)

_live_workers: "weakref.WeakSet[WorkerCore]" = weakref.WeakSet()


@atexit.register
def _close_live_workers() -> None:
    # An engine that exits without shutdown() still gets its stores in flight delivered
    # (bounded by flush_timeout) and its shared-memory files removed.
    for worker in list(_live_workers):
        worker.close()


class WorkerCore:
    """Executes plans on one rank's KV cache. Called from the engine's execution thread."""

    def __init__(
        self,
        config: ConnectorConfig,
        *,
        rank: int = 0,
        layout: str = "auto",
        stores: bool = True,
        groups: Sequence[KVGroup] | None = None,
        link: ClientLink | None = None,
    ):
        """`stores=False`: this rank issues no stores (another rank stores the same bytes, as
        with MLA under tensor parallelism) but still reports requests finished. `groups`: the
        engine's KV-cache groups, as the scheduler's core has them (default: one group)."""
        self.cfg = config
        self.groups = list(groups) if groups else [KVGroup(0, block_size=config.block_size)]
        self.models = [group_model_name(config.model, self.groups, i) for i in range(len(self.groups))]
        self.rank = rank
        self.layout = layout
        self.issues_stores = stores
        self.link = link or ClientLink(
            config.url,
            name=f"lmcache-mp worker {rank}",
            request_timeout=config.request_timeout,
            connect_timeout=config.connect_timeout,
            retry_interval=config.retry_interval,
            on_connect=self._register,
            curve_server_key=config.curve_server_key,
            curve_client_key=config.curve_client_key,
        )
        self._tensors: list[list] = []  # per group
        self._shared: list = []
        self._handles: list | None = None  # per group
        self._handle_client = None
        self._blocks_per_block = [1] * len(self.groups)
        self._pinned: list[tuple[int, cf.Future | None]] = []  # stores the scheduler pinned blocks for
        self._stores: dict[str, list[cf.Future]] = {}  # req -> store futures not yet reported
        # req -> loads given up on at their deadline whose answer has not come: the server may
        # still be writing their blocks, so the request is not reported finished before it does
        self._unsettled: dict[str, list[cf.Future]] = {}
        self._delayed: set[str] = set()  # requests that had a store or load planned
        self._finishing: set[str] = set()
        self._loading: list[tuple[Transfer, cf.Future | None]] = []
        # req -> its asynchronous loads (transfer, future, when started), until finished_loads
        self._async_loads: dict[str, list[tuple[Transfer, cf.Future | None, float]]] = {}
        self._load_deadline = 0.0
        self._load_errors: set[int] = set()
        self._store_failure_logged = False
        self._load_failure_logged = False
        self._short_load_logged = False
        self._register_failure_logged = False
        # Cumulative. Loads: chunks, bytes and the time the engine waited for them; stores: chunks
        # sent, then (as the server answers) chunks and bytes it stored, stores answered, their time.
        self.stats = {"loaded_chunks": 0, "failed_load_chunks": 0, "loaded_bytes": 0, "loads": 0,
                      "load_seconds": 0.0, "stored_chunks": 0, "stored_bytes": 0, "stores": 0,
                      "store_seconds": 0.0, "store_errors": 0}
        self._stats_lock = threading.Lock()  # answers of stores are counted on the client's thread
        self._closed = False
        _live_workers.add(self)

    # ---- registration ---------------------------------------------------------------------

    def register_kv_caches(self, tensors: Sequence) -> None:
        """Take the rank's per-layer KV tensors (CPU ones move into shared memory in place): one
        list per group, or one flat list for an engine of one group."""
        tensors = list(tensors)
        per_group = [list(t) for t in tensors] if tensors and isinstance(tensors[0], (list, tuple)) else [tensors]
        if len(per_group) != len(self.groups) or not all(per_group):
            raise ValueError(f"{len(self.groups)} KV-cache groups need one non-empty list of tensors each")
        flat = [t for group in per_group for t in group]
        if flat[0].device.type == "cpu":
            from lmcache_mp.integration.cpu_shm import move_to_shared_memory

            self._shared = move_to_shared_memory(flat)
        self._tensors = per_group
        self.link.connect(wait=self.cfg.connect_timeout)

    def _register(self, client) -> None:
        if not self._tensors:
            raise RuntimeError("KV caches are not known yet")
        handles, per_block = [], []
        cs = connector_chunk_size(self.groups, client.chunk_size)
        try:
            for g, model, tensors in zip(self.groups, self.models, self._tensors):
                state = g.kind == STATE  # a state group's tensors are its pages, one per block (opaque)
                handle = client.register_kv_cache(
                    tensors,
                    model=model,
                    world_size=self.cfg.world_size,
                    rank=self.rank,
                    layout="opaque" if state else self.layout,
                    block_size=g.block_size if state else None,
                    transfer=self.cfg.transfer,
                    chunk_size=0 if cs == client.chunk_size else cs,
                    # a state's pages hold no heads to split: they stay the rank's own
                    tp_shared=self.cfg.tp_shared and not state,
                    num_kv_heads=self.cfg.num_kv_heads,
                    pipeline_size=self.cfg.pipeline_size,
                )
                handles.append(handle)
                per_block.append(self._kernel_blocks_per_block(handle.block_size, g.block_size))
        except (LMCacheMPError, ValueError) as exc:
            if not isinstance(exc, ServerUnavailable) and not self._register_failure_logged:
                logger.error("lmcache-mp: registering the KV cache of rank %d failed: %s", self.rank, exc)
                self._register_failure_logged = True
            raise
        self._handles, self._handle_client, self._blocks_per_block = handles, client, per_block
        logger.info("lmcache-mp: rank %d's KV cache registered: %s", self.rank,
                    "; ".join(f"{h.layout}, {h.transfer_mode} copies" for h in handles))

    def _kernel_blocks_per_block(self, kernel: int, block_size: int) -> int:
        """vLLM splits each block of its block table into several kernel blocks when the
        attention kernel needs smaller ones; the registered tensors then hold kernel blocks."""
        if kernel <= 0 or kernel > block_size or block_size % kernel:
            raise ValueError(f"the KV cache's blocks of {kernel} tokens do not divide the engine's "
                             f"block size {block_size}")
        if kernel != block_size:
            logger.info("lmcache-mp: rank %d's KV cache holds kernel blocks of %d tokens, %d per block of %d",
                        self.rank, kernel, block_size // kernel, block_size)
        return block_size // kernel

    def _tensor_block_ids(self, block_ids: Sequence[int], group: int = 0) -> Sequence[int]:
        """The engine's block ids as ids of the registered tensors' blocks."""
        n = self._blocks_per_block[group]
        if n == 1:
            return block_ids
        return [b * n + j for b in block_ids for j in range(n)]

    def _client(self):
        client = self.link.get()
        if client is None or self._handles is None:
            return None
        return client

    # ---- loads ----------------------------------------------------------------------------

    def start_loads(self, plan: StepPlan) -> None:
        client = self._client() if plan.loads else None
        # The server starts no copy after this deadline, the moment we stop waiting.
        self._load_started = time.monotonic()
        self._load_deadline = self._load_started + self.cfg.load_timeout
        for t in plan.loads:
            self._delayed.add(t.req_id)
            fut = None
            if client is not None and t.hashes:
                scratch = None if t.scratch_block is None else self._tensor_block_ids([t.scratch_block], t.group)
                try:
                    fut = client.retrieve(self._handles[t.group], t.hashes,
                                          self._tensor_block_ids(t.block_ids, t.group), lease=t.lease,
                                          deadline=self._load_deadline, scratch_blocks=scratch)
                except (LMCacheMPError, ValueError) as exc:
                    self._note_failure(exc, slow=False)
            self._loading.append((t, fut))

    def wait_loads(self) -> None:
        """Block until this step's loads landed or their deadline passed; record the blocks of
        every chunk not loaded (the engine recomputes them)."""
        if not self._loading:
            return
        deadline = self._load_deadline
        loading, self._loading = self._loading, []
        for t, fut in loading:
            loaded, answered = 0, False
            if fut is not None:
                t0 = time.monotonic()
                try:
                    loaded = int(fut.result(timeout=max(0.0, deadline - t0)).loaded)
                    answered = True
                except cf.TimeoutError:
                    # A copy that started before the deadline may still be writing (a stalled
                    # server): the request keeps its blocks until the server answers. While it
                    # runs the engine recomputes the same KV into them.
                    self._unsettled.setdefault(t.req_id, []).append(fut)
                    self.link.report_failure(ServerUnavailable("load timed out"))
                except Exception as exc:  # noqa: BLE001 - any failure is a miss, never a crash
                    self._note_failure(exc, slow=time.monotonic() - t0 > 1.0)
            if not self._count_load(t, loaded, answered):
                bpc = len(t.block_ids) // len(t.hashes) if t.hashes else 0
                self._load_errors.update(b for b in t.block_ids[loaded * bpc :] if b != t.scratch_block)
        self.stats["load_seconds"] += time.monotonic() - self._load_started

    def start_async_loads(self, plan: StepPlan) -> None:
        """Start this step's loads without waiting: their requests wait outside the engine's
        steps until `finished_loads` reports them (a hybrid model's state must be in its slot
        before the step that reads it begins, so it is never loaded in the step itself)."""
        self.start_loads(plan)
        loading, self._loading = self._loading, []
        for t, fut in loading:
            self._async_loads.setdefault(t.req_id, []).append((t, fut, self._load_started))

    def finished_loads(self) -> tuple[set[str], set[str]]:
        """(requests whose asynchronous loads are over, those of them that did not load all):
        a request is reported once every load of it was answered, never before (the server may
        be writing its blocks until then)."""
        done, failed = set(), set()
        for rid, loads in list(self._async_loads.items()):
            if not all(fut is None or fut.done() for _, fut, _ in loads):
                continue
            del self._async_loads[rid]
            done.add(rid)
            for t, fut, started in loads:
                loaded, answered = 0, False
                if fut is not None:
                    try:
                        loaded, answered = int(fut.result().loaded), True
                    except Exception as exc:  # noqa: BLE001 - any failure is a miss, never a crash
                        self._note_failure(exc, slow=False)
                if not self._count_load(t, loaded, answered):
                    failed.add(rid)
            self.stats["load_seconds"] += time.monotonic() - min(started for _, _, started in loads)
        return done, failed

    def _count_load(self, t: Transfer, loaded: int, answered: bool) -> bool:
        """Count a load's outcome; True when it loaded every chunk it asked for."""
        n = len(t.hashes)
        loaded = max(0, min(loaded, n))
        self.stats["loaded_chunks"] += loaded
        self.stats["loaded_bytes"] += loaded * (self._handles[t.group].object_bytes if self._handles else 0)
        self.stats["loads"] += 1
        if loaded == n and n:
            return True
        self.stats["failed_load_chunks"] += n - loaded
        if answered and not self._short_load_logged:  # an answer, shorter than the lookup said
            self._short_load_logged = True
            logger.warning("lmcache-mp: request %s loaded %d of the %d chunks its lookup found; the rest are "
                           "recomputed (the server's log says why; further short loads at debug level)",
                           t.req_id, loaded, n)
        else:
            logger.debug("lmcache-mp: request %s loaded %d of %d chunks", t.req_id, loaded, n)
        return False

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- stores ---------------------------------------------------------------------------

    def start_stores(self, plan: StepPlan) -> None:
        client = self._client() if plan.stores and self.issues_stores else None
        for t in plan.stores:
            self._delayed.add(t.req_id)
            fut = None
            if client is not None:
                try:
                    # The server starts no copy after the deadline and keeps none that ended after
                    # it, so a store's blocks go back to vLLM at the latest then (finished()).
                    fut = client.store(self._handles[t.group], t.hashes, self._tensor_block_ids(t.block_ids, t.group),
                                       timeout=self.cfg.store_timeout, parent=t.parent,
                                       shared=self.cfg.store_shared)
                except (LMCacheMPError, ValueError) as exc:
                    self._store_failed(exc)
                else:
                    self.stats["stored_chunks"] += len(t.hashes)
                    self._stores.setdefault(t.req_id, []).append(fut)
                    fut.add_done_callback(self._count_store(self._handles[t.group].object_bytes))
            if t.pin:
                self._pinned.append((t.pin, fut))

    def _count_store(self, object_bytes: int):
        t0 = time.monotonic()

        def answered(fut: cf.Future) -> None:
            if fut.cancelled() or fut.exception() is not None:
                return
            with self._stats_lock:
                self.stats["stored_bytes"] += fut.result().stored * object_bytes
                self.stats["stores"] += 1
                self.stats["store_seconds"] += time.monotonic() - t0

        return answered

    def take_settled_pins(self) -> list[int]:
        """Pins of stores that are over (answered, failed or never sent) since the last call:
        the scheduler may let their blocks be reused once every rank reported them."""
        if not self._pinned:
            return []
        done, waiting = [], []
        for pin, fut in self._pinned:
            if fut is None or fut.done():
                done.append(pin)
            else:
                waiting.append((pin, fut))
        self._pinned = waiting
        return done

    def _store_failed(self, exc: BaseException) -> None:
        # Stores fail fast when the server is away and cost the engine nothing, so they never
        # pause the link; the scheduler's lookups notice outages.
        self.stats["store_errors"] += 1
        if not self._store_failure_logged:
            logger.warning("lmcache-mp: store failed (%s); further failures are logged at debug level", exc)
            self._store_failure_logged = True
        else:
            logger.debug("lmcache-mp: store failed: %s", exc)

    def _note_failure(self, exc: BaseException, slow: bool) -> None:
        """A load failed. Only a slow failure (the forward pass waited for it) pauses the link."""
        if slow and isinstance(exc, ServerUnavailable):
            self.link.report_failure(exc)
        elif not self._load_failure_logged:
            logger.warning("lmcache-mp: load failed (%s); further failures are logged at debug level", exc)
            self._load_failure_logged = True
        else:
            logger.debug("lmcache-mp: load failed: %s", exc)

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
        """Requests that finished and whose stores and loads the server has all answered (each
        reported once): only then may the engine give their blocks to another request."""
        self._finishing.update(r for r in finished_req_ids if r in self._delayed)
        done = set()
        for rid in self._finishing:
            if (all(f.done() for f in self._stores.get(rid, ())) and all(f.done() for f in self._unsettled.get(rid, ()))
                    and rid not in self._async_loads):
                done.add(rid)
        for rid in done:
            self._reap(self._stores.pop(rid, []))
            self._unsettled.pop(rid, None)
            self._delayed.discard(rid)
        self._finishing -= done
        return done

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        pending = [f for fs in self._stores.values() for f in fs]
        if pending:
            cf.wait(pending, timeout=self.cfg.flush_timeout)
        self._stores.clear()
        client, handles = self._handle_client, self._handles
        self._handles = None
        for handle in handles if client is not None and handles else ():
            try:
                client.unregister_kv_cache(handle)
            except Exception as exc:  # noqa: BLE001 - best effort at shutdown
                logger.debug("lmcache-mp: unregister failed: %s", exc)
        self.link.close()
        if self._shared:
            from lmcache_mp.integration.cpu_shm import release_shared_memory

            release_shared_memory(self._shared)
            self._shared = []
