"""SGLang's unified cache linker on an lmcache-mp server: pages move between SGLang's device pools
and the server's L1 with no host pool in between.

Launch SGLang with::

    --enable-unified-cache-external-linker --unified-cache-external-linker-backend dynamic \\
    --unified-cache-external-linker-config '{"linker": "LMCacheMPLinker",
        "linker_module_path": "lmcache_mp.integration.sglang_linker",
        "linker_extra_config": {"lmcache_mp.url": "tcp://127.0.0.1:5555"}}'

How it works: each device pool (the full-attention KV pool, an SWA pool, each Mamba state tensor)
is registered with the server once, as vLLM's KV caches are (CUDA IPC on the GPU, shared memory
on the CPU device); the server copies pages between them and L1 (integration/sglang_linker_pools.py),
or with ``"lmcache_mp.transfer": "engine"`` this process maps L1 and copies them itself. What a
lookup finds is leased until the load reads it (integration/sglang_linker_leases.py).
Keys are SGLang's page keys hashed as the HiCache backend hashes them (integration/sglang_keys.py);
the KV pool's pages are the HiCache backend's ``layer_first`` pages, in the same namespace, so a
linker instance and a HiCache instance with a ``layer_first`` host pool share them. A Mamba state
is one object per state tensor under the key of the page it ends at.

Loads run on a thread of their own and complete the layer counter as they land: for the whole
batch at once by default (a retrieve moves every layer of a page), or layer group by layer group
with ``"lmcache_mp.layer_groups": N`` (the KV pool then registered as N parts of consecutive layers,
integration/sglang_linker_loads.py), so that the forward starts on the first layers while the
rest arrive. A server that is away means misses
(lookup answers no length at once), loads refused or failed (SGLang recomputes or aborts those
requests) and offloads not made; never a wait longer than `lmcache_mp.request_timeout`.

One module over 450 lines: what is left here is SGLang's UnifiedCacheLinker interface itself, a
method for each of SGLang's calls, and its parts are already the modules named above.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Optional

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import LayerWiseLoadCounter, UnifiedCacheLinker

from lmcache_mp.errors import RequestError, ServerUnavailable
from lmcache_mp.integration.sglang_keys import namespace, page_digest
from lmcache_mp.integration.sglang_linker_leases import Held, HeldLeases
from lmcache_mp.integration.sglang_linker_loads import load_batch, split_requests
from lmcache_mp.integration.sglang_linker_pools import (
    KV, MAMBA, LinkerPools, PoolPart, describe_pools, page_rows, registration_geometry, slot_rows,
    split_layer_groups, total_bytes)
from lmcache_mp.integration.sglang_settings import SGLangStorageSettings
from lmcache_mp.protocol import MAX_CHUNKS, ErrorCode

logger = logging.getLogger(__name__)

MAX_BOUNDARIES = 32  # deepest lengths a lookup checks the other pools at (SGLang takes the deepest common one)
LEASED_BOUNDARIES = 4  # deepest restorable lengths whose state objects a lookup leases until the load
TRANSFER_KEY = "lmcache_mp.transfer"
# KV layer groups a load lands and completes one after another (1: one registration of the whole
# pool, whose pages are the HiCache backend's layer_first pages)
GROUPS_KEY = "lmcache_mp.layer_groups"


class LMCacheMPLinker(UnifiedCacheLinker):
    """SGLang's `UnifiedCacheLinker` on an lmcache-mp server (made by SGLang's `dynamic` factory)."""

    def __init__(self, server_args, params, *, components, extra_config=None, forward_stream=None):
        extra = dict(extra_config or {})
        # who copies: "server" (its copy engines / copy threads; the default) or "engine" (this
        # process maps L1 and copies itself, keeping its GPU work in its own context; docs/engine-copies.md)
        self.transfer = str(extra.pop(TRANSFER_KEY, "server"))
        if self.transfer not in ("server", "engine"):
            raise ValueError(f"{TRANSFER_KEY} must be 'server' or 'engine', got {self.transfer!r}")
        groups = int(extra.pop(GROUPS_KEY, 1))
        if groups < 1:
            raise ValueError(f"{GROUPS_KEY} must be at least 1, got {groups}")
        self.settings = SGLangStorageSettings.from_linker_config(extra)
        self.forward_stream = forward_stream
        self.page_size = params.page_size
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        names = {getattr(c, "name", str(c)) for c in components}
        self.layout: LinkerPools = describe_pools(kvcache, params.req_to_token_pool, names, self.page_size)
        self.layer_groups = split_layer_groups(self.layout, groups) if groups > 1 else 1
        if self.layer_groups != groups:
            logger.warning("lmcache-mp linker: %s %d: the KV pool's layers make %d group(s)", GROUPS_KEY, groups,
                           self.layer_groups)
        self.pools = {PoolName(name): parts for name, parts in self.layout.parts.items()}
        self.num_layers = self.layout.num_layers
        self.tp_rank, self.tp_size = _tp(params)
        self._mla = self.layout.attention == "mla"
        shard = []
        if getattr(params, "pp_size", 1) > 1:
            shard.append(f"pp{params.pp_rank}of{params.pp_size}")
        if getattr(params, "attn_cp_size", 1) > 1:
            shard.append(f"cp{params.attn_cp_rank}of{params.attn_cp_size}")
        model = self.settings.model or (getattr(server_args, "served_model_name", None)
                                        or getattr(server_args, "model_path", "") or "").replace("/", "-")
        self._namespaces = {id(p): namespace(model, p.tag, "-".join(shard))
                            for parts in self.layout.parts.values() for p in parts}
        self.on_cuda = self.layout.tensors()[0].device.type == "cuda"
        self._shm = []
        if not self.on_cuda and self.transfer == "server":  # the server maps CPU pools by name: into shared memory
            from lmcache_mp.integration.cpu_shm import move_to_shared_memory

            self._shm = move_to_shared_memory(self.layout.tensors())
        self.layer_done_counter = LayerWiseLoadCounter(self.num_layers)
        if PoolName.MAMBA in self.pools and hasattr(params.req_to_token_pool, "register_layer_transfer_counter"):
            params.req_to_token_pool.register_layer_transfer_counter(self.layer_done_counter)
        self._registered = None  # (client, {id(part): handle}) once registered with the connected server
        self.pending_loads: dict[str, list] = {}
        self._leases = HeldLeases(min(self.settings.request_timeout, 1.0))  # what lookups leased for their loads
        self._loads: queue.Queue = queue.Queue()
        self._offloads: queue.Queue = queue.Queue()
        self._offload_results: queue.Queue = queue.Queue()
        self.stats = {"lookups": 0, "hits": 0, "loads": 0, "failed_loads": 0, "offloads": 0, "failed_offloads": 0}
        pools = ", ".join(f"{n} ({len(ps)} part{'s' if len(ps) > 1 else ''})" for n, ps in self.layout.parts.items())
        logger.info("lmcache-mp linker: %s, %.1f MiB of device pools, %d layers, rank %d/%d, namespaces %s", pools,
                    total_bytes(self.layout) / 2**20, self.num_layers, self.tp_rank, self.tp_size,
                    sorted(set(self._namespaces.values())))
        self.link = self.settings.make_link(f"lmcache-mp sglang-linker tp{self.tp_rank}", on_connect=self._register)
        self._threads = [threading.Thread(target=self._load_loop, name=f"lmcache-mp-linker-load-tp{self.tp_rank}",
                                          daemon=True),
                         threading.Thread(target=self._offload_loop, daemon=True,
                                          name=f"lmcache-mp-linker-offload-tp{self.tp_rank}")]
        for t in self._threads:
            t.start()
        self.link.connect(wait=self.settings.connect_timeout)

    # ---- registration ------------------------------------------------------------------------

    def _rank_of(self, part: PoolPart) -> tuple[int, int]:
        """(world_size, rank) of a part's objects: MLA pages are the same on every rank."""
        if part.pool != MAMBA and self._mla:
            return 1, 0
        return self.tp_size, self.tp_rank

    def _register(self, client) -> None:
        """On connecting (ClientLink): register every pool part."""
        handles = {}
        for parts in self.layout.parts.values():
            for part in parts:
                block_size, chunk_size = registration_geometry(part, client.chunk_size)
                world_size, rank = self._rank_of(part)
                handles[id(part)] = client.register_kv_cache(
                    list(part.runs), model=self._namespaces[id(part)], world_size=world_size, rank=rank,
                    layout="opaque", block_size=block_size, chunk_size=chunk_size, transfer=self.transfer)
        self._registered = (client, handles)

    def _ready(self):
        """(client, handles), or None while the server is away."""
        client, registered = self.link.get(), self._registered
        if client is None or registered is None or registered[0] is not client:
            return None
        return registered

    def _failed(self, what: str, e: BaseException) -> None:
        restarted = isinstance(e, RequestError) and e.code == ErrorCode.UNKNOWN_REGISTRATION
        if isinstance(e, ServerUnavailable) or restarted:
            self.link.report_failure(e)
        else:
            logger.warning("lmcache-mp linker: a %s failed: %s", what, e)

    # ---- lookup ------------------------------------------------------------------------------

    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        """Every prefix length (pages of the tail) whose KV pages are all on the server for every
        rank and whose window (SWA pages, the Mamba state at its end) is there in every other pool.

        The KV pages found and the other pools' objects at the deepest lengths are leased (the
        server keeps them) until the request's load reads them, or for HELD_FOR seconds."""
        self._leases.drop(rid)
        ready = self._ready()
        by_pool = {PoolName(t.name): t for t in transfers}
        kv = by_pool.get(PoolName.KV)
        if ready is None or kv is None or not kv.keys:
            return []
        client, handles = ready
        digests = [page_digest(k) for k in kv.keys[:MAX_CHUNKS]]
        timeout = self.settings.request_timeout
        self.stats["lookups"] += 1
        kv_leases, state_leases = {}, {}
        try:
            checks = []
            for part in self.layout.parts[KV]:  # (one per layer group; all in flight at once)
                world_size, _ = self._rank_of(part)
                checks.append((part, client.lookup_async(b"".join(digests), model=self._namespaces[id(part)],
                                                         world_size=world_size, lock=True, timeout=timeout)))
            hit, error = len(digests), None
            for part, fut in checks:  # every answer taken (its lease kept for release) before any error
                try:
                    found = fut.result(timeout + 1.0)
                except Exception as e:  # noqa: BLE001 - raised below, once every lease is known
                    error = error or e
                    continue
                if found.lease:
                    kv_leases[id(part)] = found.lease
                hit = min(hit, int(found))
            if error is not None:
                raise error
            candidates = list(range(max(1, hit - MAX_BOUNDARIES + 1), hit + 1))
            windows = {}
            for name, transfer in by_pool.items():
                if name == PoolName.KV or not candidates:
                    continue
                if name not in self.pools:
                    candidates = []  # a pool this linker does not store: nothing is restorable
                    break
                windows[name] = max(1, len(transfer.keys or ()))
                missing = self._missing(client, name, windows[name], digests, candidates, lock=False)
                candidates = [p for p in candidates if p not in missing]
            # lease the deepest lengths' windows; one gone since is no longer restorable
            deepest = candidates[-LEASED_BOUNDARIES:]
            for name, window in windows.items():
                gone = self._missing(client, name, window, digests, deepest, lock=True, leases=state_leases)
                candidates = [p for p in candidates if p not in gone]
        except (ServerUnavailable, RequestError) as e:
            self._failed("lookup", e)
            self._leases.release(client, [*kv_leases.values(), *state_leases.values()])
            return []
        except TimeoutError as e:
            self._failed("lookup", ServerUnavailable(str(e) or "lookup timed out"))
            self._leases.release(client, [*kv_leases.values(), *state_leases.values()])
            return []
        except Exception:  # noqa: BLE001 - a lookup is a miss, never an error in SGLang's scheduler
            logger.exception("lmcache-mp linker: a lookup failed")
            self._leases.release(client, [*kv_leases.values(), *state_leases.values()])
            return []
        self.link.report_success()
        if candidates:
            self.stats["hits"] += 1
            self._leases.hold(rid, Held(client, kv_leases, state_leases))
            logger.debug("lmcache-mp linker: %s restorable at %s of %d pages", rid, candidates, len(digests))
        else:
            self._leases.release(client, [*kv_leases.values(), *state_leases.values()])
        return candidates

    def _missing(self, client, name, window: int, digests: list, lengths: list, *, lock: bool,
                 leases: dict | None = None) -> set:
        """The lengths at which some part of pool `name` lacks the window of objects ending there
        (all lookups in flight at once); with lock, the found ones' leases go into `leases`."""
        timeout = self.settings.request_timeout
        checks = []
        for part in self.pools[name]:
            world_size, _ = self._rank_of(part)
            for p in lengths:
                want = digests[max(0, p - window):p]
                checks.append((part, p, len(want), client.lookup_async(
                    b"".join(want), model=self._namespaces[id(part)], world_size=world_size, lock=lock,
                    timeout=timeout)))
        missing = set()
        for part, p, n, fut in checks:
            found = fut.result(timeout + 1.0)
            if leases is not None and found.lease:
                leases[(id(part), p)] = found.lease
            if int(found) < n:
                missing.add(p)
        return missing

    # ---- loads -------------------------------------------------------------------------------

    def _items(self, transfers: list[PoolTransfer], what: str, owner_only: bool = False) -> list:
        """(part, digests, rows) for every part of every transfer's pool."""
        items = []
        for t in transfers:
            if not t.keys:
                continue
            name = PoolName(t.name)
            parts = self.pools.get(name)
            if parts is None:
                raise ValueError(f"no {name} pool is registered by the lmcache-mp linker")
            if t.device_indices is None:
                raise ValueError(f"the {name} transfer has no device indices")
            rows = (slot_rows(t.device_indices) if name == PoolName.MAMBA
                    else page_rows(t.device_indices, self.page_size, f"{what} of the {name} pool"))
            if len(rows) != len(t.keys):
                raise ValueError(f"{what} of the {name} pool: {len(t.keys)} keys for {len(rows)} rows")
            digests = b"".join(page_digest(k) for k in t.keys)
            for part in parts:
                if owner_only and self._rank_of(part)[0] == 1 and self.tp_rank != 0:
                    continue  # an MLA page is written once, by rank 0
                items.append((part, digests, rows))
        return items

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        if rid in self.pending_loads:
            raise RuntimeError(f"a load of request {rid} is already queued")
        held = self._leases.take(rid)
        ready = self._ready()
        if ready is None:
            return False
        try:
            items = self._items(transfers, "a load")
        except ValueError as e:
            logger.error("lmcache-mp linker: refusing the load of %s: %s", rid, e)
            if held is not None:
                self._leases.release(held.client, held.all())
            return False
        if not items:
            return False
        leases = []  # the lease each part's read consumes; the rest is let go after the load
        if held is not None and held.client is ready[0]:
            kv_leases, state_leases = held.kv, held.states
            length = max((len(rows) for part, _, rows in items if part.pool == KV), default=0)
            leases = [kv_leases.get(id(part), 0) if part.pool == KV else state_leases.get((id(part), length), 0)
                      for part, _, _ in items]
            leases.extend(lease for lease in held.all() if lease and lease not in leases)
        self.pending_loads[rid] = (items, leases)
        return True

    def cancel_queued_load(self, rid: str) -> bool:
        cancelled = self.pending_loads.pop(rid, None)
        if cancelled is None:
            return False
        ready = self._ready()
        if ready is not None:
            self._leases.release(ready[0], cancelled[1])
        return True

    def start_layer_wise_loading(self) -> int:
        if not self.pending_loads:
            return -1
        batch, self.pending_loads = self.pending_loads, {}
        index = self.layer_done_counter.update_producer()
        self._loads.put((index, batch, self._ready_events()))
        self.stats["loads"] += len(batch)
        return index

    def _ready_events(self) -> list:
        return self.record_offload_ready() if self.on_cuda else []

    def _load_loop(self) -> None:
        while True:
            task = self._loads.get()
            try:
                if task is None:
                    return
                index, batch, events = task
                try:
                    for event in events:
                        event.synchronize()
                    self._load_batch(index, batch)
                except BaseException as e:  # noqa: BLE001 - reported through the counter
                    self.stats["failed_loads"] += 1
                    logger.warning("lmcache-mp linker: a load of %d request(s) failed: %s", len(batch), e)
                    self.layer_done_counter.fail(index, e)  # (the layers that landed stay done)
            finally:
                self._loads.task_done()

    def _load_batch(self, index: int, batch: dict) -> None:
        """Every request's objects into its slots; the counter's layers completed as their KV
        layer group lands (all at the end with one group)."""
        ready = self._ready()
        if ready is None:
            raise ServerUnavailable("the lmcache-mp server is away")
        client, handles = ready

        def landed(start: int, end: int) -> None:
            for layer in range(start, end):
                self.layer_done_counter.complete(index, layer)

        try:
            load_batch(client, handles, list(batch.values()), self.layout.group_ends, landed,
                       timeout=self.settings.request_timeout)
        except (ServerUnavailable, RequestError) as e:
            self._failed("load", e)
            raise
        finally:
            self._leases.release(client, [lease for _, leases in batch.values() for lease in leases])

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        return self.layer_done_counter.finish(counter_index)

    # ---- offloads ----------------------------------------------------------------------------

    def offload(self, transfers: list[PoolTransfer], session_id: Optional[str] = None) -> bool:
        """Queue a node's pages (and its window's states) for the server. Its result comes back
        through num_completed_offloads / pop_completed_offload, in order: True once every object
        is on the server. A lookup needs every object of a boundary, so an offload that stored
        only some of them is never a hit there."""
        if self._ready() is None:
            return False
        try:
            items = self._items(transfers, "an offload", owner_only=True)
        except ValueError as e:
            logger.error("lmcache-mp linker: refusing an offload: %s", e)
            return False
        self._offloads.put((items, self._ready_events() if items else []))
        return True

    def _offload_loop(self) -> None:
        while True:
            task = self._offloads.get()
            try:
                if task is None:
                    return
                items, events = task
                ok = True
                if items:
                    try:
                        for event in events:
                            event.synchronize()
                        ok = self._store(items)
                    except BaseException as e:  # noqa: BLE001 - a failed offload is a result, not an error
                        logger.warning("lmcache-mp linker: an offload failed: %s", e)
                        ok = False
                self.stats["offloads" if ok else "failed_offloads"] += 1
                self._offload_results.put(ok)
            finally:
                self._offloads.task_done()

    def _store(self, items: list) -> bool:
        ready = self._ready()
        if ready is None:
            return False
        client, handles = ready
        timeout = self.settings.request_timeout
        try:
            futures = [client.store(handles[id(part)], some, at, timeout=timeout)
                       for (part, _, _), some, at in split_requests(items)]
            results = [fut.result(timeout + 1.0) for fut in futures]
        except (ServerUnavailable, RequestError) as e:
            self._failed("offload", e)
            return False
        self.link.report_success()
        return all(r.skipped == 0 for r in results)

    def num_completed_offloads(self) -> int:
        return self._offload_results.qsize()

    def pop_completed_offload(self) -> bool:
        try:
            return self._offload_results.get_nowait()
        except queue.Empty:
            return False

    # ---- lifecycle ---------------------------------------------------------------------------

    def reset(self) -> None:
        self.pending_loads.clear()
        self._leases.clear()
        self._loads.join()
        self._offloads.join()
        while True:
            try:
                self._offload_results.get_nowait()
            except queue.Empty:
                break
        self.layer_done_counter.reset()

    def close(self) -> None:
        self.reset()
        for q in (self._loads, self._offloads):
            q.put(None)
        for t in self._threads:
            t.join()
        registered, self._registered = self._registered, None
        if registered is not None:
            client, handles = registered
            for handle in handles.values():
                try:
                    client.unregister_kv_cache(handle, timeout=min(self.settings.request_timeout, 1.0))
                except (ServerUnavailable, RequestError) as e:
                    logger.debug("lmcache-mp linker: unregistering a pool failed: %s", e)
                    break
        self.link.close()
        if self._shm:
            from lmcache_mp.integration.cpu_shm import release_shared_memory

            release_shared_memory(self._shm)
            self._shm = []
        logger.info("lmcache-mp linker stats: %s", self.stats)


def _tp(params) -> tuple[int, int]:
    """(rank, size) of this worker in its attention tensor-parallel group."""
    group = getattr(params, "attn_tp_cache_group", None) or getattr(params, "tp_cache_group", None)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(group=group), torch.distributed.get_world_size(group=group)
    return 0, 1
