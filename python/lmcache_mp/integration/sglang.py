"""An SGLang HiCache storage backend on an lmcache-mp server: every SGLang instance of a node
(and through the server's L2, of other nodes) shares one cache.

Launch SGLang with::

    --enable-hierarchical-cache --page-size 64 --hicache-mem-layout page_first \\
    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
    '{"backend_name": "lmcache_mp", "module_path": "lmcache_mp.integration.sglang",
      "class_name": "LMCacheMPStorage", "interface_v1": 1, "lmcache_mp.url": "tcp://127.0.0.1:5555"}'

How pages move: the backend registers SGLang's host pool with the server for engine-side copies
(transfer="engine"): this process maps the server's L1 and copies each page between the host
pool and its slot itself, a few large memcpys per page (integration/sglang_pages.py); only keys,
page ids and slot offsets travel over the socket. A store reserves slots, copies, commits
(visible to every instance only then); a load reads where the leading pages are, copies, lets
them go. Keys: SGLang's page keys, hashed under a domain of their own, in a namespace of the
model and the pages' byte format (integration/sglang_keys.py). MHA pages are stored per
tensor-parallel rank; MLA pages, the same on every rank, once for all ranks.

A server that is away or restarting means misses (and stores that do not happen), never an
error in SGLang's threads; the client reconnects and registers again by itself.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

from lmcache_mp.errors import RequestError, ServerUnavailable
from lmcache_mp.protocol import ErrorCode
from lmcache_mp.integration.sglang_keys import namespace, page_digest, page_digests
from lmcache_mp.integration.sglang_pages import PagePlan, UnsupportedPool, plan_pages
from lmcache_mp.integration.sglang_settings import SGLangStorageSettings

logger = logging.getLogger(__name__)

_POOL_KINDS = {MHATokenToKVPoolHost: "mha", MLATokenToKVPoolHost: "mla"}


class LMCacheMPStorage(HiCacheStorage):
    """HiCache's storage tier on an lmcache-mp server (made by SGLang's `dynamic` factory)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.settings = SGLangStorageSettings.from_extra_config(storage_config.extra_config)
        c = storage_config
        if c.dcp_size > 1:
            raise UnsupportedPool("decode context parallelism (DCP) is not supported by the lmcache-mp backend")
        if c.should_split_heads:
            raise UnsupportedPool("ranks of different tensor-parallel sizes sharing pages (split heads) are not "
                                  "supported by the lmcache-mp backend")
        self.config = c
        # MLA pages are the same bytes on every TP rank: one object for all of them.
        self.world_size, self.rank = (1, 0) if c.is_mla_model else (c.tp_size, c.tp_rank)
        shard = []
        if c.pp_size > 1:
            shard.append(f"pp{c.pp_rank}of{c.pp_size}")
        if c.attn_cp_size > 1:
            shard.append(f"cp{c.attn_cp_rank}of{c.attn_cp_size}")
        self._shard = "-".join(shard)
        self.plan: PagePlan | None = None
        self.namespace = ""
        self._handle = None
        self._handle_client = None
        self._fatal: UnsupportedPool | None = None
        self.link = self.settings.make_link(f"lmcache-mp sglang tp{c.tp_rank}", on_connect=self._register)

    # ---- host pools --------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        kind = _POOL_KINDS.get(type(mem_pool_host))
        if kind is None:
            raise UnsupportedPool(f"host pools of type {type(mem_pool_host).__name__} are not supported by the "
                                  "lmcache-mp backend (MHATokenToKVPoolHost and MLATokenToKVPoolHost are)")
        if getattr(mem_pool_host, "dcp_size", 1) > 1:
            raise UnsupportedPool("a host pool of decode context parallelism (DCP) is not supported")
        # The shapes are checked now (chunk size 1 divides anything); the server's chunk size on connecting.
        self.plan = plan_pages(mem_pool_host.kv_buffer, kind=kind, layout=mem_pool_host.layout,
                               page_size=mem_pool_host.page_size, chunk_size=1)
        model = self.settings.model or (self.config.model_name or "").replace("/", "-")
        self.namespace = namespace(model, self.plan.format_tag, self._shard)
        super().register_mem_pool_host(mem_pool_host)
        logger.info("lmcache-mp sglang backend: %s pages of %d tokens (%.2f MiB, %d runs) under %r, rank %d/%d",
                    self.plan.layout, self.plan.page_size, self.plan.page_bytes / 2**20, len(self.plan.runs),
                    self.namespace, self.rank, self.world_size)
        self.link.connect(wait=self.settings.connect_timeout)
        if self._fatal is not None:
            raise self._fatal

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        if host_pool_name != PoolName.KV:
            raise UnsupportedPool(f"the lmcache-mp backend stores the KV pool only; the {host_pool_name} pool "
                                  "(Mamba, SWA, indexer and other extra states) is not supported")
        if host_pool is not getattr(self, "mem_pool_host", None):
            raise UnsupportedPool("the KV pool registered for transfers is not the backend's host pool")
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def _register(self, client) -> None:
        """On connecting (ClientLink): register the host pool's page runs for engine-side copies."""
        try:
            plan_pages(self.mem_pool_host.kv_buffer, kind=self.plan.kind, layout=self.plan.layout,
                       page_size=self.plan.page_size, chunk_size=client.chunk_size)
        except UnsupportedPool as e:
            self._fatal = e
            raise
        self._handle = client.register_kv_cache(list(self.plan.runs), model=self.namespace,
                                                world_size=self.world_size, rank=self.rank, layout="opaque",
                                                block_size=client.chunk_size, transfer="engine")
        self._handle_client = client

    def _ready(self):
        """(client, handle), or None while the server is away."""
        client = self.link.get()
        if client is None or self._handle is None or client is not self._handle_client:
            return None
        return client, self._handle

    # ---- the zero-copy interface (interface_v1) ---------------------------------------------

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """How many leading pages the server holds (for every TP rank of MHA pages)."""
        ready = self._ready()
        if ready is None or not keys:
            return 0
        client, _ = ready
        try:
            hits = client.lookup(page_digests(keys), model=self.namespace, world_size=self.world_size,
                                 timeout=self.settings.request_timeout)
        except (ServerUnavailable, RequestError) as e:
            self._failed("lookup", e)
            return 0
        self.link.report_success()
        return int(hits)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        ready = self._ready()
        if ready is None or not keys:
            return [False] * len(keys)
        client, handle = ready
        pages = self._page_ids(host_indices, len(keys))
        prefix = extra_info.prefix_keys if extra_info is not None else None
        parent = page_digest(prefix[-1]) if prefix else b""  # keeps the prompt's order in L2
        try:
            r = client.store(handle, page_digests(keys), pages, parent=parent,
                             timeout=self.settings.request_timeout).result()
        except (ServerUnavailable, RequestError) as e:
            self._failed("store", e)
            return [False] * len(keys)
        self.link.report_success()
        if r.skipped:  # the server had no room for some (which ones it does not say): none counts
            logger.debug("lmcache-mp: %d of %d pages not stored (no room on the server)", r.skipped, len(keys))
            return [False] * len(keys)
        return [True] * len(keys)

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        ready = self._ready()
        if ready is None or not keys:
            return [False] * len(keys)
        client, handle = ready
        pages = self._page_ids(host_indices, len(keys))
        try:
            loaded = client.retrieve(handle, page_digests(keys), pages,
                                     timeout=self.settings.request_timeout).result().loaded
        except (ServerUnavailable, RequestError) as e:
            self._failed("load", e)
            return [False] * len(keys)
        self.link.report_success()
        return [i < loaded for i in range(len(keys))]

    def _page_ids(self, host_indices: torch.Tensor, n: int) -> np.ndarray:
        """The page of each key: host indices are n whole pages, each page's tokens in order."""
        ps = self.plan.page_size
        idx = host_indices.detach().to("cpu", torch.int64).reshape(-1)
        if idx.numel() != n * ps:
            raise ValueError(f"{n} pages of {ps} tokens need {n * ps} host indices, got {idx.numel()}")
        rows = idx.view(n, ps)
        first = rows[:, 0]
        if bool((first % ps).any()) or (ps > 1 and not bool((rows[:, 1:] - rows[:, :-1] == 1).all())):
            raise ValueError("host indices are not whole pages")
        return (first // ps).numpy().astype(np.int32)

    # ---- the per-pool interface (SGLang's hybrid cache controller) ---------------------------

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        if pool_transfers:  # extra pools are refused at registration; nothing of theirs is stored
            return PoolTransferResult.empty()
        hits = self.batch_exists(keys, extra_info)
        return PoolTransferResult(hits, {PoolName.KV: hits} if hits else {}, list(range(1, hits + 1)))

    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, List[bool]]:
        return self._per_pool(transfers, self.batch_get_v1, extra_info)

    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, List[bool]]:
        return self._per_pool(transfers, self.batch_set_v1, extra_info)

    @staticmethod
    def _per_pool(transfers: List[PoolTransfer], op, extra_info) -> dict[str, List[bool]]:
        out = {}
        for t in transfers:
            keys = t.keys or []
            if t.name != PoolName.KV or t.host_indices is None:
                logger.error("lmcache-mp: no transfers of the %s pool (only the KV pool is stored)", t.name)
                out[t.name] = [False] * len(keys)
            else:
                out[t.name] = op(keys, t.host_indices, extra_info)
        return out

    # ---- the rest of HiCacheStorage ----------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        raise NotImplementedError("the lmcache-mp backend copies pages in place: SGLang calls batch_get_v1 "
                                  "when the extra config has \"interface_v1\": 1")

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None):
        return self.get(keys[0] if keys else "")

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        raise NotImplementedError("the lmcache-mp backend copies pages in place: SGLang calls batch_set_v1 "
                                  "when the extra config has \"interface_v1\": 1")

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        return self.set(keys[0] if keys else "")

    def clear(self) -> bool:
        """Refused: the cache is shared by every instance (and engine) on the node; one SGLang
        instance does not empty it (the server's own CLEAR does, `Client.clear()`)."""
        logger.warning("lmcache-mp: not clearing the shared cache for one SGLang instance")
        return False

    def close(self) -> None:
        client, handle = self._handle_client, self._handle
        self._handle = None
        if handle is not None and handle.closed:
            handle = None
        if client is not None and handle is not None:
            try:
                client.unregister_kv_cache(handle, timeout=min(self.settings.request_timeout, 1.0))
            except (ServerUnavailable, RequestError) as e:
                logger.debug("lmcache-mp: unregistering the host pool failed: %s", e)
        self.link.close()

    def _failed(self, what: str, e: BaseException) -> None:
        restarted = isinstance(e, RequestError) and e.code == ErrorCode.UNKNOWN_REGISTRATION
        if isinstance(e, ServerUnavailable) or restarted:
            self.link.report_failure(e)  # a miss for a while, one warning per outage
        else:
            logger.warning("lmcache-mp: a %s failed: %s", what, e)
