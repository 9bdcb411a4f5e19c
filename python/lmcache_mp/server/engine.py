"""MPCacheEngine: registrations, store, retrieve, lookup and leases over the L1 host arena.

Requests arrive from the transport with a `reply` callable. The socket thread only does what is
cheap and bounded: handshakes, pings, status, small lookups, the checks of scalar fields, and
small stores and retrieves of an idle registration (on the GPU these only enqueue the copy).
Other work on a registration (opening it, larger requests, unregister) runs on that
registration's worker thread, in order. On the GPU a completion thread replies once the bytes
have landed, so one registration keeps several requests in flight; replies leave from the
thread that has them.
Everything else that grows with its input (large lookups, releases, clear, lease expiry,
forgetting a client) runs on one housekeeping thread, a slice at a time (see storage/l1.py), so
no request keeps the socket thread or the L1 lock for more than a few milliseconds.
With an L2 tier (storage/l2), lookups continue into it and a lookup with lock waits for its L2
chunks to be loaded (a delayed reply); a retrieve of chunks only L2 holds loads them on the L2
reader thread and then runs again on its registration's worker. `clear` empties L1 only.

Its parts: registrations.py (registering KV caches), server_copies.py (stores and retrieves the
server copies), engine_copies.py (those the engine copies itself), lookups.py (lookups, leases).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from typing import Callable


from lmcache_mp import protocol as p
from lmcache_mp._version import __version__
from lmcache_mp.config import ServerConfig, format_size
from lmcache_mp.native import HostArena, set_cpu_threads
from lmcache_mp.server.copies.contexts import IpcEventCache, IpcMemoryCache
from lmcache_mp.server.copies.devices import gpu_numa_node, resolve_device
from lmcache_mp.server.ops.gc_pauses import GCPauses, made_long_lived
from lmcache_mp.server.registry import event_feed
from lmcache_mp.server import validation as check
from lmcache_mp.server.validation import RequestFailure
from lmcache_mp.server.copies.engine_copies import EngineCopies
from lmcache_mp.server.registry.lookups import LookupHandling
from lmcache_mp.server.registry.process_watch import ProcessWatch
from lmcache_mp.processes import own_pid_namespace
from lmcache_mp.server.copies.server_copies import ServerCopies
from lmcache_mp.server.registry.registrations import Entry, RegistrationHandling
from lmcache_mp.server.request import Reply
from lmcache_mp.server.copies.workers import SerialWorker
from lmcache_mp.storage.events import EventLog
from lmcache_mp.storage.l1 import L1Store
from lmcache_mp.storage.l1_journal import L1Journal
from lmcache_mp.storage.l2.tiers import L2Tiers
from lmcache_mp.storage.tenant_quotas import SEP, L1Quotas
from lmcache_mp.server.tenancy.tenancy import Tenancy, TenantState, shown
from lmcache_mp.server.tenancy.tenants_file import SHARED
from lmcache_mp.server.tenancy.shares import TenantHandling

logger = logging.getLogger(__name__)



class MPCacheEngine(RegistrationHandling, ServerCopies, EngineCopies, LookupHandling, TenantHandling):
    def __init__(self, config: ServerConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.session_id = secrets.token_bytes(16)
        if config.cpu_threads:
            set_cpu_threads(config.cpu_threads)
        pin = self.device == "cuda"
        numa = config.numa_node if config.numa_node >= 0 else (gpu_numa_node() if pin else -1)
        journal = None
        if config.l1_persist:  # locked before the arena file is touched: one server per file
            journal = L1Journal(config.l1_persist + ".journal", config.l1_size // config.slab_size * config.slab_size,
                                config.slab_size)
        try:
            self.arena = HostArena(config.l1_size, config.slab_size, pin, numa, config.l1_persist)
        except Exception:
            if journal is not None:
                journal.close()
            raise
        self.l1 = L1Store(self.arena, policy=config.eviction_policy)
        self.tenancy: Tenancy | None = None  # with --tenants: set by attach_tenancy before requests come
        if config.tenants:  # before the journal re-attaches chunks: each is counted to its tenant
            self.l1.quotas = L1Quotas()
        self.l1.on_commit = made_long_lived  # (a no-op unless this process is only a server)
        self.events = EventLog(config.kv_events)
        self.l1.events = self.events if config.kv_events else None
        if journal is not None:
            self._reattach(journal)
        self.l2 = self._open_l2(config)
        self._lock = threading.Lock()
        self._entries: dict[int, Entry] = {}
        self._clients: dict[bytes, float] = {}  # client id -> last time heard from
        self._pid_namespace = own_pid_namespace()
        self._processes = ProcessWatch(self._process_exited)  # clients whose process this server sees
        self._ipc = IpcMemoryCache() if self.device == "cuda" else None
        self._events = IpcEventCache() if self.device == "cuda" else None
        self._uuids: dict[bytes, int] = {}
        if self.device == "cuda":
            from lmcache_mp import _C

            self._uuids = {_C.cuda.device_uuid(i): i for i in range(_C.cuda.device_count())}
        self._bulk = SerialWorker("lmcache-housekeeping")
        self._init_engine_copies()
        self._pinned = False  # the arena's background pinning has finished
        self.lane = ""  # the transport's local-lane address, told to clients in HELLO
        self.url = ""  # the bound endpoint
        self.moved = {"store": 0, "retrieve": 0}  # bytes between KV caches and L1, by direction
        self._moved_lock = threading.Lock()
        self.http = ""  # the HTTP listener's address ("" when none)
        # Every registration's thread, until it ended: close() waits for them all, so that no
        # context is torn down (driver calls, without the GIL) while the interpreter shuts down.
        self._workers: set[SerialWorker] = set()
        self._close_hooks: list[Callable[[], None]] = []
        self._closed = False
        self.started = time.time()
        self.gc_pauses = GCPauses()
        cut = ""
        if config.slab_cut_from:  # (the default slab size is cut without a word of what was "set")
            cut = (f", not the {format_size(config.slab_cut_from)} set: a slab is at most L1/16"
                   if "slab_size" in config.given else ": at most L1/16")
        logger.info(
            "L1: %s of %s host memory (slabs of %s%s%s)",
            format_size(self.arena.capacity), "pinned" if pin else "shared", format_size(self.arena.slab_bytes),
            cut, f", NUMA node {numa}" if numa >= 0 else "",
        )

    def _open_l2(self, config: ServerConfig) -> L2Tiers | None:
        """The L2 tiers, nearest first: the local disk, then a shared Valkey/Redis server, then Mooncake."""
        tiers, writes = [], []
        if config.l2_disk:
            from lmcache_mp.storage.l2.disk import DiskTier

            try:
                tiers.append(DiskTier(config.l2_disk, config.l2_disk_size, config.l2_io_threads,
                                      config.eviction_policy))
                writes.append(config.l2_write_of("disk", DiskTier.default_write))
            except (OSError, RuntimeError, ValueError) as e:
                raise RuntimeError(f"cannot open the L2 disk {config.l2_disk}: {e}") from None
        if config.l2_redis:  # unreachable at start is fine: it is tried again later
            from lmcache_mp.storage.l2.valkey import ValkeyTier

            tiers.append(ValkeyTier(config.l2_redis, config.l2_redis_prefix, config.l2_redis_ttl,
                                    connections=config.l2_io_threads, cluster=config.l2_redis_cluster))
            writes.append(config.l2_write_of("redis", ValkeyTier.default_write))
        if config.l2_mooncake:
            from lmcache_mp.storage.l2.mooncake import MooncakeTier

            metadata = config.l2_mooncake_metadata or f"http://{config.l2_mooncake.rsplit(':', 1)[0]}:8080/metadata"
            tiers.append(MooncakeTier(config.l2_mooncake, metadata, self.arena, config.l2_mooncake_segment,
                                      prefix=config.l2_redis_prefix))
            writes.append(config.l2_write_of("mooncake", MooncakeTier.default_write))
        if not tiers:
            return None
        from lmcache_mp.storage.l2.codec import CodecTier

        if config.tenants:  # per-tenant caps on the shared tiers (the tenants file's l2_valkey_max, l2_mooncake_max)
            from lmcache_mp.storage.l2.tenant_caps import TenantCapped

            tiers = [t if getattr(t, "local", True) else TenantCapped(t) for t in tiers]
        codecs = {"disk": config.l2_disk_codec, "valkey": config.l2_redis_codec, "mooncake": config.l2_mooncake_codec}
        tiers = [CodecTier(t, codecs.get(t.name, "none")) for t in tiers]
        return L2Tiers(tiers, self.l1, writes=writes, admit=config.l2_admit,
                       queue_bytes=config.l2_queue_size, max_prefetches=config.max_prefetches,
                       prefetch_timeout=config.prefetch_timeout)

    # ---- dispatch ----------------------------------------------------------------------------

    def handle(self, msg: p._Msg, reply: Reply) -> None:
        """Answer one decoded request, now or later; exactly one reply either way."""
        try:
            if self._closed:
                raise RequestFailure(p.ErrorCode.SHUTTING_DOWN, "the server is shutting down")
            handler = self._handlers.get(type(msg))
            if handler is None:
                raise RequestFailure(p.ErrorCode.UNKNOWN_OP, f"unsupported request {type(msg).__name__}")
            if self.tenancy is not None:
                self._scope(msg, reply)
            elif SEP in getattr(msg, "model", "") or type(msg) is p.Events and any(SEP in m for m in msg.models):
                # (a tenant's namespace: a server without tenants that shares an L1 file or an L2
                # tier with one must not let its clients name it)
                raise RequestFailure(p.ErrorCode.INVALID_ARGUMENT, "model names must not contain \\x1f")
            handler(self, msg, reply)
        except RequestFailure as e:
            reply(p.Error(code=int(e.code), message=str(e)))
        except Exception as e:
            logger.exception("internal error handling %s", type(msg).__name__)
            reply(p.Error(code=int(p.ErrorCode.INTERNAL), message=f"internal error: {e}"))

    @staticmethod
    def _job(reply: Reply, fn: Callable[[], None]) -> Callable[[], None]:
        """fn for a worker thread: whatever it raises still becomes the request's one reply."""

        def run() -> None:
            try:
                fn()
            except RequestFailure as e:
                reply(p.Error(code=int(e.code), message=str(e)))
            except Exception as e:
                logger.exception("internal error in a queued request")
                reply(p.Error(code=int(p.ErrorCode.INTERNAL), message=f"internal error: {e}"))

        return run

    def _touch(self, client_id: bytes) -> None:
        if client_id:
            self._clients[client_id] = time.monotonic()

    def _hello(self, msg: p.Hello, reply: Reply) -> None:
        if msg.version != p.PROTOCOL_VERSION:
            raise RequestFailure(
                p.ErrorCode.PROTOCOL_MISMATCH,
                f"client speaks protocol {msg.version}, server {p.PROTOCOL_VERSION}: upgrade the older side",
            )
        self._touch(check.client_id(msg.client_id))
        watched = (msg.pid > 0 and msg.pid_namespace == self._pid_namespace != 0
                   and self._processes.watch(msg.client_id, msg.pid, msg.start_time or None))
        logger.debug("hello from %s (pid %d%s)", msg.client_name or msg.client_id.hex(), msg.pid,
                     ", watched" if watched else "")
        reply(p.HelloReply(protocol_version=p.PROTOCOL_VERSION, server_version=__version__,
                           session_id=self.session_id, chunk_size=self.config.chunk_size, device=self.device,
                           capabilities=["lookup_lock", "reply_on_submit", "named_leases", "deadlines",
                                         "engine_copy"],
                           lease_ttl=self.config.lease_ttl, lane=self.lane,
                           lane_ticket=self.tenancy.ticket(reply.credential, msg.client_id) if self.tenancy else b""))

    def _ping(self, msg: p.Ping, reply: Reply) -> None:
        client = check.client_id(msg.client_id, required=False)
        self._touch(client)
        conn = getattr(reply, "conn", None)  # on the local lane: the kernel says which process it is
        if client and conn is not None and not self._processes.watching(client):
            self._processes.watch(client, conn.peer[0])
        reply(p.PingReply(session_id=self.session_id))

    def _status(self, msg: p.Status, reply: Reply) -> None:
        tenant: TenantState | None = getattr(reply, "tenant", None)
        if tenant is not None and not tenant.tenant.admin:
            status = self._tenant_view(tenant)  # what other tenants hold is not this one's business
        else:
            status = self.status()
        if msg.client_id:
            with self._lock:
                status["mine"] = [kv for kv, e in self._entries.items() if e.ctx.reg.client_id == msg.client_id]
        reply(p.StatusReply(status=status))

    def _events_since(self, msg: p.Events, reply: Reply) -> None:
        self._touch(check.client_id(msg.client_id, required=False))
        tenant = getattr(reply, "tenant", None)
        if tenant is None:
            reply(event_feed.answer(self.events, self.session_id, msg))
        else:  # its own namespace's events, and the shared namespace's where it reads them
            reply(event_feed.answer(self.events, self.session_id, msg, tenant.prefix,
                                    SHARED + SEP if tenant.tenant.reads_shared else ""))

    def _clear(self, msg: p.Clear, reply: Reply) -> None:
        self._bulk.submit(self._job(reply, lambda: reply(p.ClearReply(removed=self.clear()))))

    # ---- housekeeping ------------------------------------------------------------------------

    def _forget_client(self, client: bytes) -> tuple[int, int]:
        """Drop a client's leases and registrations; returns how many of each."""
        self._processes.forget(client)
        if self.tenancy is not None:
            self.tenancy.forget(client)
        with self._lock:
            self._clients.pop(client, None)
            owned = [kv for kv, e in self._entries.items() if e.ctx.reg.client_id == client]
        dropped = self.l1.drop_owner(client)
        for kv_id in owned:
            self.unregister_kv_cache(p.UnregisterKVCache(kv_id=kv_id))
        self._client_gone(client)
        return dropped, len(owned)

    def _bye(self, msg: p.Bye, reply: Reply) -> None:
        client = check.client_id(msg.client_id)

        def run() -> None:
            leases, regs = self._forget_client(client)
            reply(p.ByeReply(leases=leases, registrations=regs))

        self._bulk.submit(self._job(reply, run))

    def _process_exited(self, clients: list[bytes], pid: int) -> None:
        """A watched process exited: forget its clients now, not after their heartbeat timeout
        (each registration closes after the copies it has queued)."""

        def run() -> None:
            dropped = owned = 0
            for client in clients:
                leases, regs = self._forget_client(client)
                dropped, owned = dropped + leases, owned + regs
            if dropped or owned:
                logger.info("the process %d of %d client(s) exited: dropped %d leases and %d registrations", pid,
                            len(clients), dropped, owned)

        self._bulk.submit(run)

    def tick(self, heard_until: float | None = None) -> None:
        """Expire leases; forget clients that stopped sending heartbeats, with their leases and
        registrations (called about twice a second by the transport; the work itself runs on
        the housekeeping thread). heard_until: the transport has handled every request that came
        before this time (after a stall of its own, requests wait in its socket: a client is
        silent only if the server could have heard it, not because the server was not listening)."""
        now = time.monotonic()
        deadline = (now if heard_until is None else min(now, heard_until)) - self.config.heartbeat_timeout
        silent = [c for c, seen in list(self._clients.items()) if seen < deadline]

        def run() -> None:
            self.l1.expire()
            self._reap_reservations()
            for client in silent:
                if self._clients.get(client, 0) >= deadline:
                    continue  # heard from again meanwhile
                dropped, owned = self._forget_client(client)
                if dropped or owned:
                    logger.info("client %s went silent: dropped %d leases and %d registrations",
                                client.hex()[:8], dropped, owned)

        self._bulk.submit(run)

    def status(self) -> dict:
        with self._lock:
            regs = [
                {"id": f"{kv & 0xFFFF:04x}",  # a tag (as in thread names): the kv_id is the client's secret
                 "model": shown(e.ctx.reg.model), "rank": e.ctx.reg.rank, "world_size": e.ctx.reg.world_size,
                 "layout": e.ctx.reg.spec.kind, "layers": e.ctx.reg.spec.model_layers,
                 "copy_bytes": e.ctx.reg.spec.segment_bytes, "device": e.ctx.device,
                 "transfer_mode": e.ctx.transfer_mode, "transfer_mode_reason": e.ctx.mode_reason,
                 "object_bytes": e.ctx.reg.object_bytes}
                for kv, e in self._entries.items()
            ]
        arena = dict(self.arena.stats())
        out = {
            "version": __version__,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started, 1),
            "url": self.url,
            "http": self.http,
            "bytes_moved": dict(self.moved),
            "device": self.device,
            "chunk_size": self.config.chunk_size,
            "clients": len(self._clients),
            "registrations": regs,
            "gc": self.gc_pauses.stats(),
            "l1": {**self.l1.stats(), "capacity": arena["capacity"],
                   "bytes_free": arena["free_slabs"] * arena["slab_bytes"],  # whole slabs, any size
                   "sizes": self.l1.size_stats(), "arena": arena, "pinning": dict(self.arena.pin_status())},
        }
        if self.l2 is not None:
            out["l2"] = self.l2.stats()
        out["engine_copies"] = self.engine_copies_status()
        if self.tenancy is not None:
            out["tenants"] = self.tenants_status()
        return out

    def _reattach(self, journal: L1Journal) -> None:
        """The chunks a previous server left in the arena file, at once (on the cuda device once
        L1 is page-locked: no copy may touch memory that is not)."""
        live = journal.read_live() if self.arena.reattached else {}
        if not self.arena.reattached and journal.bytes:
            logger.warning("L1 in %s: the arena file was not of %s (--l1-size or --slab-size changed, or the file "
                           "was damaged): L1 starts empty", self.config.l1_persist, format_size(self.arena.capacity))
        if live and self.device == "cuda":
            logger.info("L1: waiting for the arena to be page-locked before re-attaching %d chunks", len(live))
            self.arena.wait_pinned(3600.0)
        self.l1.attach_journal(journal)
        restored, dropped = self.l1.restore(live.values())
        what = f"re-attached {restored} chunks of the previous server" + (f", dropped {dropped}" if dropped else "")
        logger.info("L1 in %s: %s", self.config.l1_persist, what if self.arena.reattached else "a new arena file")

    @property
    def closing(self) -> bool:
        """close() has begun (the server drains, then stops)."""
        return self._closed

    def add_close_hook(self, fn: Callable[[], None]) -> None:
        self._close_hooks.append(fn)

    def close(self) -> None:
        """Stop taking requests, finish queued work, free every registration and the arena."""
        if self._closed:
            return
        self._closed = True
        if self.l2 is not None:  # its loads in flight still answer (through their registrations)
            self.l2.close()
        with self._lock:
            kv_ids = list(self._entries)
        for kv_id in kv_ids:
            self.unregister_kv_cache(p.UnregisterKVCache(kv_id=kv_id))
        with self._lock:
            workers = list(self._workers)
        deadline = time.monotonic() + self.config.drain_timeout
        for worker in workers:  # those unregistered before may still be closing their context
            worker.stop(timeout=max(0.0, deadline - time.monotonic()))
        self._processes.close()
        self._bulk.stop(timeout=max(0.0, deadline - time.monotonic()))
        late = sum(w.alive() for w in workers)
        if late:
            logger.warning("%d KV caches still had work after the drain timeout (%.0f s); stopping anyway", late,
                           self.config.drain_timeout)
        if self._events is not None:
            self._events.close()
        if self.l1.journal is not None:  # the chunks stay in the arena file for the next server
            self.l1.close_journal()
        else:
            self.l1.clear()
        self._windows.close()
        for hook in self._close_hooks:  # e.g. stop the transport once the last replies are out
            hook()
        self.gc_pauses.close()
        if not late:  # nothing copies any more: L1's memory goes back now, not during the process's exit
            t0 = time.monotonic()
            if self.arena.release_memory():
                logger.info("gave L1's %s back to the machine in %.1f s", format_size(self.arena.capacity),
                            time.monotonic() - t0)

    _handlers = {
        p.Hello: _hello,
        p.Ping: _ping,
        p.Status: _status,
        p.Clear: _clear,
        p.Events: _events_since,
        p.RegisterKVCache: RegistrationHandling.register_kv_cache,
        p.UnregisterKVCache: RegistrationHandling.unregister_kv_cache,
        p.Store: ServerCopies.store,
        p.Retrieve: ServerCopies.retrieve,
        p.Lookup: LookupHandling.lookup,
        p.Release: LookupHandling.release,
        p.Bye: _bye,
        p.MapArena: EngineCopies._map_arena,
        p.Reserve: EngineCopies._reserve,
        p.Commit: EngineCopies._commit,
        p.Read: EngineCopies._read,
        p.ReadDone: EngineCopies._read_done,
    }
