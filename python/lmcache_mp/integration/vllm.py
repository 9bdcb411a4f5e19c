"""vLLM V1 KV connector backed by the lmcache-mp server.

    from vllm.config import KVTransferConfig
    KVTransferConfig(
        kv_connector="LMCacheMPConnector",
        kv_connector_module_path="lmcache_mp.integration.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"lmcache_mp.url": "tcp://127.0.0.1:5555"},
    )

Extra-config keys (all optional): `lmcache_mp.url` (default tcp://127.0.0.1:5555),
`lmcache_mp.model` (default: the served model name; engines sharing a cache must agree),
`lmcache_mp.lookup_timeout` (seconds, default 2), `lmcache_mp.store_decode` (default false),
and the other `ConnectorConfig` fields. Unless `lmcache_mp.recompute_on_load_error` is false, the
connector sets vLLM's `kv_load_failure_policy` to "recompute": a chunk that cannot be loaded
is computed again instead of failing the request. An absent server costs no wait (lookups are
immediate misses until the connector's clients find it back, by themselves); a slow one at most
one lookup timeout per retry interval.

`kv_role` kv_both / kv_producer (stores only) / kv_consumer (loads only). Hybrid models keep
vLLM's hybrid KV-cache manager (SupportsHMA): every KV-cache group is stored and loaded on its
own (vllm_specs.py says which kinds; the others are refused at start-up). With vLLM's KV events
on, the chunks this engine stored are announced (vllm_events.py, chunk_events.py); its counters
reach vLLM's stats (vllm_stats.py); what of a request enters its keys: vllm_requests.py.

This module is a thin adapter: the logic is in `connector_core` (see
docs/vllm-connector-notes.md for the vLLM interface it follows).

One module over 450 lines: what is left is vLLM's connector interface itself, a method for each of
vLLM's calls, each handing over to connector_core; its helpers are the vllm_*.py modules above.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from lmcache_mp.integration.connector_core import (
    ConnectorConfig,
    ScheduledRequest,
    SchedulerCore,
    StepPlan,
    WorkerCore,
)
from lmcache_mp.integration import vllm_requests
from lmcache_mp.integration.request_hints import request_hints
from lmcache_mp.integration.chunk_events import ChunkEvents
from lmcache_mp.integration.connector_types import STATE
from lmcache_mp.integration.vllm_specs import kv_groups
from lmcache_mp.protocol import TP_SHARED_WORLD

try:  # vLLM's hybrid memory allocator: one block table per KV-cache group
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # pragma: no cover - older vLLM: one group only
    SupportsHMA = object  # type: ignore[misc,assignment]

try:  # what workers send back to the scheduler each step
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # pragma: no cover - older vLLM: no pins (window groups need 0.32)
    KVConnectorWorkerMetadata = object  # type: ignore[misc,assignment]

try:  # the label vLLM's metrics give our hits
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    _HIT_SOURCE = CacheHitSource.HOST
except ImportError:  # pragma: no cover - older vLLM
    _HIT_SOURCE = None

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def _log_through_vllm() -> None:
    """vLLM configures its own logger tree only, so our INFO lines (connections, hit rates)
    would vanish. Unless the application configured lmcache_mp's logging itself, send it
    through vLLM's handlers: same format, same level."""
    ours, theirs = logging.getLogger("lmcache_mp"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False


_log_through_vllm()

_LAYOUT_REASONS_LOGGED: set[str] = set()

__all__ = ["LMCacheMPConnector", "LMCacheMPConnectorMetadata", "LMCacheMPWorkerMetadata"]


class LMCacheMPConnectorMetadata(KVConnectorMetadata):
    """One step's plan, sent from the scheduler to every worker."""

    def __init__(self, plan: StepPlan):
        self.plan = plan

    def __repr__(self) -> str:
        p = self.plan
        return f"LMCacheMPConnectorMetadata(loads={len(p.loads)}, stores={len(p.stores)}, preempted={len(p.preempted)})"


class LMCacheMPWorkerMetadata(KVConnectorWorkerMetadata):
    """From the workers to the scheduler, summed over ranks: stores of pinned blocks that are
    over (pin id -> ranks)."""

    def __init__(self, settled: dict[int, int]):
        self.settled = settled

    def aggregate(self, other: "LMCacheMPWorkerMetadata") -> "LMCacheMPWorkerMetadata":
        merged = dict(self.settled)
        for pin, n in getattr(other, "settled", {}).items():
            merged[pin] = merged.get(pin, 0) + n
        return LMCacheMPWorkerMetadata(merged)


def _total_kv_heads(vllm_config: "VllmConfig") -> int:
    """The model's KV heads (all ranks'; 0 when the engine does not say): what proves the head
    split of tp-shared chunks."""
    try:
        return int(vllm_config.model_config.get_total_num_kv_heads())
    except (AttributeError, TypeError, ValueError):
        return 0


def _served_model_name(vllm_config: "VllmConfig") -> str:
    mc = vllm_config.model_config
    name = getattr(mc, "served_model_name", None) or mc.model
    if isinstance(name, (list, tuple)):
        name = name[0] if name else mc.model
    return str(name)


class LMCacheMPConnector(KVConnectorBase_V1, SupportsHMA):
    """Prefix cache in the lmcache-mp server: loads hits before the forward pass, stores new
    full prompt chunks after it. Synchronous loads (asynchronous for models with recurrent
    states: their requests wait until the load is over); asynchronous stores. Every KV-cache
    group of a hybrid model (vLLM's hybrid memory allocator) is stored and loaded in its own
    namespace; a state group's states where vLLM names them (boundary_state_offloads)."""

    if _HIT_SOURCE is not None:
        _cache_hit_source = _HIT_SOURCE

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        pc = vllm_config.parallel_config
        self._tp = int(pc.tensor_parallel_size)
        self._pp = int(pc.pipeline_parallel_size)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        kv_role = str(getattr(self._kv_transfer_config, "kv_role", "kv_both") or "kv_both")
        if kv_role not in ("kv_both", "kv_producer", "kv_consumer"):
            raise ValueError(f"lmcache-mp: kv_role {kv_role!r} is not one of kv_both, kv_producer, kv_consumer")
        self._cfg = ConnectorConfig.from_extra_config(
            extra,
            model=_served_model_name(vllm_config),
            block_size=int(vllm_config.cache_config.block_size),
            world_size=self._tp * self._pp,
            num_kv_heads=_total_kv_heads(vllm_config),
            pipeline_size=self._pp,
            loads=kv_role != "kv_producer",  # a producer only stores
            stores=kv_role != "kv_consumer",  # a consumer only loads
        )
        self._use_mla = bool(getattr(vllm_config.model_config, "use_mla", False))
        # Refuses, at start-up, groups whose KV cannot be cached by prefix (Mamba state, ...).
        self._groups = kv_groups(kv_cache_config, self._cfg.block_size)
        self._scheduler: SchedulerCore | None = None
        self._worker: WorkerCore | None = None
        self._events: ChunkEvents | None = None
        self._deltas = None  # what this side's counters gained since it last reported them
        self._requests: dict[str, Any] = {}  # with KV events: the requests being scheduled
        # The server shares an MLA object among all ranks of a (model, world size); pipeline
        # stages hold different layers, so they must not share.
        self._disabled = self._use_mla and self._pp > 1
        if self._disabled:
            logger.error("lmcache-mp: MLA models with pipeline parallelism are not supported; the cache stays unused")
        if role == KVConnectorRole.SCHEDULER:
            self._prefer_recompute()
            self._scheduler = SchedulerCore(self._cfg, groups=self._groups)
            if not self._disabled:
                self._scheduler.start()
                self._start_events(vllm_config, kv_cache_config)
        else:
            rank = self._rank()
            self._worker = WorkerCore(
                self._cfg,
                rank=rank,
                layout="mla" if self._use_mla else "auto",
                # MLA: every TP rank holds the same bytes; the first rank of the stage stores them.
                stores=not self._use_mla or rank % self._tp == 0,
                groups=self._groups,
            )
        logger.info(
            "lmcache-mp connector (%s): server %s, model %r, world size %d, %s%s",
            role.name.lower(),
            self._cfg.url,
            self._cfg.model,
            self._cfg.world_size,
            {"kv_both": "loads and stores", "kv_producer": "stores only", "kv_consumer": "loads only"}[kv_role],
            "" if len(self._groups) == 1 else ", KV-cache groups " + ", ".join(g.describe() for g in self._groups),
        )

    def _start_events(self, vllm_config: "VllmConfig", kv_cache_config: Any) -> None:
        """With vLLM's KV events on, announce the chunks this engine stores (medium "CPU") and
        their removal from the server, through vLLM's own publisher (take_events)."""
        events_config = getattr(vllm_config, "kv_events_config", None)
        if events_config is None or not events_config.enable_kv_cache_events:
            return
        self._hash_block_size = int(getattr(kv_cache_config, "hash_block_size", None) or self._cfg.block_size)
        world = TP_SHARED_WORLD if self._cfg.tp_shared else self._cfg.world_size  # tp-shared: one object, any TP
        self._events = ChunkEvents(self._scheduler.link, self._scheduler.models, world,
                                   interval=self._cfg.kv_events_interval, shared=self._cfg.store_shared)
        self._scheduler.on_store_planned = self._store_planned
        logger.info("lmcache-mp: publishing KV events of the chunks this engine stores (medium CPU)")

    def _store_planned(self, req_id: str, group: int, chunk: int, digest: bytes) -> None:
        from lmcache_mp.integration.vllm_events import chunk_events

        request, cs = self._requests.get(req_id), self._scheduler.chunk_size
        if request is None or not cs or cs % self._hash_block_size:
            return
        made = chunk_events(request, chunk, cs, self._hash_block_size, self._groups[group])
        if made is not None:
            self._events.expect(group, digest, *made)

    def take_events(self):
        return self._events.take() if self._events is not None else ()

    # ==== stats (both sides) ===================================================================

    def get_kv_connector_stats(self):
        from lmcache_mp.integration.vllm_stats import Deltas, LMCacheMPStats

        core = self._worker if self._worker is not None else self._scheduler
        if core is None:
            return None
        if self._deltas is None:
            self._deltas = Deltas(core.stats)
        data = self._deltas.take()
        return LMCacheMPStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        from lmcache_mp.integration.vllm_stats import LMCacheMPStats

        return LMCacheMPStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]):
        from lmcache_mp.integration.vllm_stats import LMCacheMPPromMetrics

        return LMCacheMPPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def _prefer_recompute(self) -> None:
        """A cache that lost a chunk must not fail the request: vLLM's default policy for load
        errors is "fail"; switch it to "recompute" unless configured otherwise. The scheduler
        reads the policy right after creating its connector."""
        ktc = self._kv_transfer_config
        if self._cfg.recompute_on_load_error and getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
            try:
                ktc.kv_load_failure_policy = "recompute"
                logger.info("lmcache-mp: kv_load_failure_policy set to 'recompute'")
            except Exception as exc:  # noqa: BLE001 - frozen config: keep vLLM's policy
                logger.warning("lmcache-mp: cannot set kv_load_failure_policy=recompute (%s)", exc)

    def _rank(self) -> int:
        """This worker's rank among the engine's tp * pp ranks."""
        try:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

            return get_pp_group().rank_in_group * self._tp + get_tensor_model_parallel_rank()
        except Exception:  # noqa: BLE001 - groups not initialised (single process)
            return int(getattr(self._vllm_config.parallel_config, "rank", 0)) % (self._tp * self._pp)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        """vLLM 0.32+: a block-outermost layout where the attention backends take one, so that
        each block moves as one copy-engine copy (integration/vllm_layout.py)."""
        from lmcache_mp.integration.vllm_layout import choose_kv_cache_layout

        layout, why = choose_kv_cache_layout(vllm_config)
        if why not in _LAYOUT_REASONS_LOGGED:  # vLLM asks more than once
            _LAYOUT_REASONS_LOGGED.add(why)
            logger.info("lmcache-mp: %s", why)
        return layout

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33+: sleep mode unmaps and remaps the KV cache the server has mapped (CUDA
        IPC); vLLM refuses the combination at start-up instead."""
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped store is only a later cache miss

    # ==== worker side ==========================================================================

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        # vLLM 0.32 hands every backend's cache over as one [blocks, heads, tokens, K+V] view per
        # layer; blocks are copied whole ("opaque", what "auto" picks for 4-D). MLA caches have
        # one head: drop that dim to get the token layout [blocks, tokens, dim]. In a
        # block-outermost layout the views of a group are one buffer: the server finds that and
        # moves each block of all the group's layers as one span ("packed").
        assert self._worker is not None
        if self._disabled:
            return

        def layers(names) -> list:
            tensors = [kv_caches[n] for n in names if n in kv_caches]
            if self._use_mla:
                tensors = [t.squeeze(1) if t.dim() == 4 and t.shape[1] == 1 else t for t in tensors]
            return tensors

        def pages(names) -> list:
            # A state layer's block is a raw page (conv state, SSM state, padding up to the page
            # size shared with attention): the whole page, as bytes, is what is copied.
            import torch

            out = []
            for t in layers(names):
                t = t[0] if isinstance(t, (list, tuple)) else t
                size, page = t.element_size(), t.stride(0) * t.element_size()
                raw = torch.empty(0, dtype=torch.uint8, device=t.device)
                out.append(raw.set_(t.untyped_storage(), t.storage_offset() * size, (t.shape[0], page), (page, 1)))
            return out

        config = self._kv_cache_config
        if config is None or not getattr(config, "kv_cache_groups", None):
            self._worker.register_kv_caches(layers(kv_caches))
            return
        per_group = [(pages if g.kind == STATE else layers)(config.kv_cache_groups[g.index].layer_names)
                     for g in self._groups]
        for g, tensors in zip(self._groups, per_group):
            if not tensors:
                raise ValueError(f"lmcache-mp: vLLM handed over no KV cache for the layers of group {g.index}")
        self._worker.register_kv_caches(per_group if len(per_group) > 1 else per_group[0])

    def _plan(self) -> StepPlan | None:
        meta = self._connector_metadata
        return meta.plan if isinstance(meta, LMCacheMPConnectorMetadata) else None

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, LMCacheMPConnectorMetadata):
            self._worker.handle_preemptions(kv_connector_metadata.plan)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        plan = self._plan()
        if self._worker is None or plan is None or not plan.loads:
            return
        if plan.async_loads:  # reported through get_transfer_results once over
            self._worker.start_async_loads(plan)
            return
        # Synchronous loads: vLLM calls this before the forward pass of any step that has
        # them, and the pass must see the bytes.
        self._worker.start_loads(plan)
        self._worker.wait_loads()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole chunks are stored after the forward pass, in wait_for_save

    def wait_for_save(self) -> None:
        plan = self._plan()
        if self._worker is not None and plan is not None and plan.stores:
            self._worker.start_stores(plan)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        done = self._worker.finished(finished_req_ids)
        loaded, _ = self._worker.finished_loads()
        return (done or None), (loaded or None)

    def get_transfer_results(self, finished_req_ids: set[str]):
        """As get_finished, with the asynchronous loads that did not load all (vLLM then
        recomputes those requests: a model of several KV-cache groups cannot be told blocks)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        if self._worker is None:
            return KVConnectorTransferResults()
        done = self._worker.finished(finished_req_ids)
        loaded, failed = self._worker.finished_loads()
        return KVConnectorTransferResults(finished_sending=done, finished_recving=loaded, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> "LMCacheMPWorkerMetadata | None":
        settled = self._worker.take_settled_pins() if self._worker is not None else []
        if not settled:
            return None
        return LMCacheMPWorkerMetadata({pin: 1 for pin in settled})

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._events is not None:
            self._events.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # ==== scheduler side =======================================================================

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        if self._scheduler is None:
            return
        null_block = getattr(gpu_block_pool, "null_block", None)
        if null_block is not None:
            self._scheduler.scratch_block_id = int(null_block.block_id)
        if hasattr(gpu_block_pool, "touch") and hasattr(gpu_block_pool, "free_blocks"):
            # vLLM frees a window group's blocks of old tokens as the request runs; a reference
            # of ours keeps such a block from reuse until the store that reads it is over.
            blocks = gpu_block_pool.blocks
            self._scheduler.pin_blocks = lambda ids: gpu_block_pool.touch([blocks[b] for b in ids])
            self._scheduler.unpin_blocks = lambda ids: gpu_block_pool.free_blocks([blocks[b] for b in ids])

    def has_pending_push_work(self) -> bool:
        """Pinned blocks are given back, KV events published and finished requests' hints sent
        (once their stores are over) only as steps run: keep the engine stepping until then."""
        if self._scheduler is None:
            return False
        return (self._scheduler.pinned_stores > 0 or self._scheduler.hints_waiting > 0
                or (self._events is not None and self._events.has_news()))

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if self._scheduler is not None and isinstance(meta, LMCacheMPWorkerMetadata):
            self._scheduler.stores_settled(meta.settled)
        if self._scheduler is not None and getattr(connector_output, "finished_sending", None):
            self._scheduler.stores_finished(connector_output.finished_sending)
        if self._events is not None and getattr(connector_output, "finished_sending", None):
            # Those requests' stores are on the server: announce them within a step, even if the
            # engine has nothing else to do (it steps until has_news is over).
            self._events.sync_soon()

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        if self._disabled:
            return 0, False
        if self._events is not None:
            self._requests[request.request_id] = request
        n = self._scheduler.num_new_matched_tokens(
            request.request_id,
            request.all_token_ids,
            num_computed_tokens,
            num_prompt_tokens=request.num_prompt_tokens,
            salt=vllm_requests.salt(request),
            generation=int(getattr(request, "num_preemptions", 0)),
            cacheable=vllm_requests.cacheable(request),
            skip_load=vllm_requests.asks(request, vllm_requests.SKIP_LOAD),
            skip_save=vllm_requests.asks(request, vllm_requests.SKIP_SAVE),
            spans=vllm_requests.spans(request),
            hints=request_hints(request),
        )
        return n, bool(n) and self._scheduler.async_loads

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.on_allocated(request.request_id, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._scheduler is not None
        so = scheduler_output
        spec = so.scheduled_spec_decode_tokens or {}
        state = getattr(so, "kv_connector_block_state", None)

        def tables(req_id: str):  # every group's whole table, where vLLM offers it
            return state.get_block_ids(req_id) if state is not None else None

        offers = dict(getattr(state, "boundary_state_offloads", None) or {})  # states computed this step

        scheduled: list[ScheduledRequest] = []
        for new in so.scheduled_new_reqs:
            rid = new.req_id
            block_ids = tables(rid)
            scheduled.append(
                ScheduledRequest(
                    req_id=rid,
                    num_computed_tokens=new.num_computed_tokens,
                    num_new_tokens=so.num_scheduled_tokens.get(rid, 0) - len(spec.get(rid, ())),
                    block_ids=block_ids if block_ids is not None else (new.block_ids or ([],)),
                    boundary_states=offers.pop(rid, ()),
                )
            )
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            scheduled.append(
                ScheduledRequest(
                    req_id=rid,
                    num_computed_tokens=cached.num_computed_tokens[i],
                    num_new_tokens=so.num_scheduled_tokens.get(rid, 0) - len(spec.get(rid, ())),
                    block_ids=tables(rid),
                    new_block_ids=cached.new_block_ids[i] or None,
                    resumed=rid in cached.resumed_req_ids,
                    boundary_states=offers.pop(rid, ()),
                )
            )
        for rid, states in offers.items():  # states of requests not scheduled in this step
            scheduled.append(ScheduledRequest(req_id=rid, num_computed_tokens=max(b for _, _, b in states),
                                              num_new_tokens=0, boundary_states=states))
        plan = self._scheduler.build_plan(scheduled, so.preempted_req_ids or ())
        return LMCacheMPConnectorMetadata(plan)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        self._requests.pop(request.request_id, None)
        return self._scheduler.request_finished(request.request_id), None

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """What vLLM calls instead of request_finished when the connector supports HMA: True
        keeps every group's blocks until the workers report the request's transfers over."""
        return self.request_finished(request, block_ids[0] if block_ids else [])
