"""MPCacheEngine: registrations, store, retrieve, lookup and leases over the L1 host arena.

Requests arrive from the transport as `Request` values (request.py). The socket thread only does what is
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

The walk of a request, from the socket to storage: the transport (transport/router.py) makes one
`Request` (request.py: message, tenant, credential, lane connection, route back) and calls
`handle`; the tenancy admits it (tenancy/tenancy.py; `NoTenancy` without a tenants file); the
dispatch table names the part that answers, each an object built here from the collaborators it
names: `registrations` (registry/registrations.py: REGISTER, UNREGISTER), `server_copies`
(copies/server_copies.py: STORE, RETRIEVE), `engine_copies` (copies/engine_copies.py: MAP_ARENA,
RESERVE, COMMIT, READ, READ_DONE), `lookups` (registry/lookups.py: LOOKUP, RELEASE), `hints`
(hints.py: HINT), or the engine itself (HELLO, PING, STATUS, EVENTS, CLEAR, BYE). The parts hold `l1` (storage/l1.py, an
`L1Store`) and, with a tier below, `l2` (storage/l2/tiers.py, `L2Tiers`), both opened by
storage_setup.py. `clients` (registry/clients.py) knows who was heard from and when; `shares`
(tenancy/shares.py) keeps the tenants' quotas.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from typing import Callable


from lmcache_mp import native, protocol as p
from lmcache_mp._version import __version__
from lmcache_mp.config import ServerConfig, format_size
from lmcache_mp.native import set_cpu_threads
from lmcache_mp.server import validation as check
from lmcache_mp.server.copies.contexts import IpcEventCache, IpcMemoryCache
from lmcache_mp.server.copies.devices import gpu_numa_node, resolve_device
from lmcache_mp.server.copies.engine_copies import EngineCopies
from lmcache_mp.server.copies.server_copies import BytesMoved, ServerCopies
from lmcache_mp.server.copies.workers import SerialWorker
from lmcache_mp.server.ops.gc_pauses import GCPauses
from lmcache_mp.server.hints import Hints
from lmcache_mp.server.registry import event_feed
from lmcache_mp.server.registry.clients import Clients
from lmcache_mp.server.registry.lookups import Lookups
from lmcache_mp.server.registry.registrations import Registrations
from lmcache_mp.server.request import Reply, Request
from lmcache_mp.server.tenancy.shares import TenantShares
from lmcache_mp.server.tenancy.tenancy import NoTenancy, Tenancy
from lmcache_mp.server.tenancy.tenants_file import SHARED
from lmcache_mp.server.validation import RequestFailure
from lmcache_mp.server.storage_setup import open_l1, open_l2
from lmcache_mp.storage.eviction.quotas import SEP

logger = logging.getLogger(__name__)


class MPCacheEngine:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.session_id = secrets.token_bytes(16)
        if config.cpu_threads:
            set_cpu_threads(config.cpu_threads)
        cuda = pin = self.device == "cuda"
        numa = config.numa_node if config.numa_node >= 0 else (gpu_numa_node() if pin else -1)
        self.arena, self.l1, self.events = open_l1(config, self.device, numa)
        self.l2 = open_l2(config, self.arena, self.l1)
        # with --tenants: the Tenancy, set by attach_tenancy before requests come
        self.tenancy: Tenancy | NoTenancy = NoTenancy()
        self._housekeeping = SerialWorker("lmcache-housekeeping")
        self.clients = Clients(self._process_exited)
        # this server's GPUs by uuid (a registration names the GPU its cache is on)
        uuids = {native.cuda.device_uuid(i): i for i in range(native.cuda.device_count())} if cuda else {}
        self.registrations = Registrations(config, self.device, self.arena, self.clients,
                                           IpcMemoryCache() if cuda else None, IpcEventCache() if cuda else None, uuids)
        self.moved = BytesMoved()  # between KV caches and L1, by direction
        self.server_copies = ServerCopies(config, self.device, self.arena, self.l1, self.l2, self.registrations,
                                          self.clients, self.moved)
        self.engine_copies = EngineCopies(config, self.arena, self.l1, self.session_id, self.registrations,
                                          self.clients, self.server_copies, self.moved)
        self.lookups = Lookups(config, self.l1, self.l2, self.clients, self._housekeeping)
        self.hints = Hints(config, self.l1, self.l2, self.clients, self._housekeeping)
        self.shares = TenantShares(self.l1, self.l2, self.registrations, self.engine_copies.windows,
                                   self._housekeeping, self._forget_client)
        self._handlers: dict[type, Callable[[Request], None]] = {
            p.Hello: self._hello,
            p.Ping: self._ping,
            p.Status: self._status,
            p.Clear: self._clear,
            p.Events: self._events_since,
            p.RegisterKVCache: self.registrations.register_kv_cache,
            p.UnregisterKVCache: self.registrations.unregister_kv_cache,
            p.Store: self.server_copies.store,
            p.Retrieve: self.server_copies.retrieve,
            p.Lookup: self.lookups.lookup,
            p.Release: self.lookups.release,
            p.Bye: self._bye,
            p.MapArena: self.engine_copies.map_arena,
            p.Reserve: self.engine_copies.reserve,
            p.Commit: self.engine_copies.commit,
            p.Read: self.engine_copies.read,
            p.ReadDone: self.engine_copies.read_done,
            p.Hint: self.hints.hint,
        }
        self.lane = ""  # the transport's local-lane address, told to clients in HELLO
        self.url = ""  # the bound endpoint
        self.http = ""  # the HTTP listener's address ("" when none)
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

    # ---- dispatch ----------------------------------------------------------------------------

    def handle(self, request: Request) -> None:
        """Answer one decoded request, now or later; exactly one reply either way."""
        msg = request.msg
        try:
            if self._closed:
                raise RequestFailure(p.ErrorCode.SHUTTING_DOWN, "the server is shutting down")
            handler = self._handlers.get(type(msg))
            if handler is None:
                raise RequestFailure(p.ErrorCode.UNKNOWN_OP, f"unsupported request {type(msg).__name__}")
            self.tenancy.admit(msg, request.tenant, request.credential)
            handler(request)
        except RequestFailure as e:
            request.fail(e.code, str(e))
        except Exception as e:
            logger.exception("internal error handling %s", type(msg).__name__)
            request.fail(p.ErrorCode.INTERNAL, f"internal error: {e}")

    def attach_tenancy(self, tenancy: Tenancy, revoke_lane: Callable[[str], None]) -> None:
        """Tenants (tenancy/tenancy.py), for every part that asks; their shares (tenancy/shares.py)."""
        self.tenancy = tenancy
        for part in (self.registrations, self.server_copies, self.engine_copies, self.lookups, self.hints):
            part.tenancy = tenancy
        self.shares.attach(tenancy, revoke_lane)

    def tenants_status(self) -> dict[str, dict]:
        return self.shares.status()

    def _hello(self, request: Request) -> None:
        msg: p.Hello = request.msg
        if msg.version != p.PROTOCOL_VERSION:
            raise RequestFailure(
                p.ErrorCode.PROTOCOL_MISMATCH,
                f"client speaks protocol {msg.version}, server {p.PROTOCOL_VERSION}: upgrade the older side",
            )
        self.clients.touch(check.client_id(msg.client_id))
        watched = self.clients.watch_hello(msg)
        logger.debug("hello from %s (pid %d%s)", msg.client_name or msg.client_id.hex(), msg.pid,
                     ", watched" if watched else "")
        request.reply(p.HelloReply(protocol_version=p.PROTOCOL_VERSION, server_version=__version__,
                                   session_id=self.session_id, chunk_size=self.config.chunk_size, device=self.device,
                                   capabilities=["lookup_lock", "reply_on_submit", "named_leases", "deadlines",
                                                 "engine_copy", "hints"],
                                   lease_ttl=self.config.lease_ttl, lane=self.lane,
                                   lane_ticket=self.tenancy.ticket(request.credential, msg.client_id)))

    def _ping(self, request: Request) -> None:
        client = check.client_id(request.msg.client_id, required=False)
        self.clients.touch(client)
        if request.lane is not None:  # on the local lane: the kernel says which process it is
            self.clients.watch_lane_peer(client, request.lane)
        request.reply(p.PingReply(session_id=self.session_id))

    def _status(self, request: Request) -> None:
        msg: p.Status = request.msg
        tenant = request.tenant
        if tenant is not None and not tenant.tenant.admin:  # what other tenants hold is not this one's business
            status = self.shares.tenant_view(self.status(), tenant)
        else:
            status = self.status()
        if msg.client_id:
            status["mine"] = self.registrations.of_client(msg.client_id)
        request.reply(p.StatusReply(status=status))

    def _events_since(self, request: Request) -> None:
        msg: p.Events = request.msg
        self.clients.touch(check.client_id(msg.client_id, required=False))
        tenant = request.tenant
        if tenant is None:
            request.reply(event_feed.answer(self.events, self.session_id, msg))
        else:  # its own namespace's events, and the shared namespace's where it reads them
            request.reply(event_feed.answer(self.events, self.session_id, msg, tenant.prefix,
                                            SHARED + SEP if tenant.tenant.reads_shared else ""))

    def _clear(self, request: Request) -> None:
        self._housekeeping.submit(request.job(lambda: request.reply(p.ClearReply(removed=self.clear()))))

    # ---- housekeeping ------------------------------------------------------------------------

    def _forget_client(self, client: bytes) -> tuple[int, int]:
        """Drop a client's leases and registrations; returns how many of each."""
        self.clients.unwatch(client)
        self.tenancy.forget(client)
        owned = self.registrations.forget_client(client)
        dropped = self.l1.drop_owner(client)
        for kv_id in owned:
            self.registrations.unregister(kv_id)
        self.engine_copies.client_gone(client)
        return dropped, len(owned)

    def _bye(self, request: Request) -> None:
        client = check.client_id(request.msg.client_id)

        def run() -> None:
            leases, regs = self._forget_client(client)
            request.reply(p.ByeReply(leases=leases, registrations=regs))

        self._housekeeping.submit(request.job(run))

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

        self._housekeeping.submit(run)

    def tick(self, heard_until: float | None = None) -> None:
        """Expire leases; forget clients that stopped sending heartbeats, with their leases and
        registrations (called about twice a second by the transport; the work itself runs on
        the housekeeping thread). heard_until: the transport has handled every request that came
        before this time (after a stall of its own, requests wait in its socket: a client is
        silent only if the server could have heard it, not because the server was not listening)."""
        now = time.monotonic()
        deadline = (now if heard_until is None else min(now, heard_until)) - self.config.heartbeat_timeout
        silent = self.clients.silent_since(deadline)

        def run() -> None:
            self.l1.expire()
            self.l1.slices.drop()
            self.engine_copies.reap_reservations()
            for client in silent:
                if self.clients.heard(client) >= deadline:
                    continue  # heard from again meanwhile
                dropped, owned = self._forget_client(client)
                if dropped or owned:
                    logger.info("client %s went silent: dropped %d leases and %d registrations",
                                client.hex()[:8], dropped, owned)

        self._housekeeping.submit(run)

    def status(self) -> dict:
        regs = self.registrations.status()
        arena = dict(self.arena.stats())
        out = {
            "version": __version__,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started, 1),
            "url": self.url,
            "http": self.http,
            "bytes_moved": self.moved.snapshot(),
            "device": self.device,
            "chunk_size": self.config.chunk_size,
            "clients": len(self.clients),
            "registrations": regs,
            "gc": self.gc_pauses.stats(),
            "l1": {**self.l1.stats(), "capacity": arena["capacity"],
                   "bytes_free": arena["free_slabs"] * arena["slab_bytes"],  # whole slabs, any size
                   "sizes": self.l1.size_stats(), "arena": arena, "pinning": dict(self.arena.pin_status())},
        }
        if self.l2 is not None:
            out["l2"] = self.l2.stats()
        out["engine_copies"] = self.engine_copies.status()
        out["hints"] = self.hints.stats()
        if self.tenancy.enabled:
            out["tenants"] = self.shares.status()
            for name, t in out["tenants"].items():
                t["pinned_bytes"] = out["hints"]["tenants"].get(name, {}).get("pinned_bytes", 0)
        return out

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
        self._closed = self.registrations.closing = True
        if self.l2 is not None:  # its loads in flight still answer (through their registrations)
            self.l2.close()
        for kv_id in self.registrations.kv_ids():
            self.registrations.unregister(kv_id)
        workers = self.registrations.workers()
        deadline = time.monotonic() + self.config.drain_timeout
        for worker in workers:  # those unregistered before may still be closing their context
            worker.stop(timeout=max(0.0, deadline - time.monotonic()))
        self.clients.close()
        self._housekeeping.stop(timeout=max(0.0, deadline - time.monotonic()))
        late = sum(w.alive() for w in workers)
        if late:
            logger.warning("%d KV caches still had work after the drain timeout (%.0f s); stopping anyway", late,
                           self.config.drain_timeout)
        self.registrations.close_event_cache()
        if self.l1.journal is not None:  # the chunks stay in the arena file for the next server
            self.l1.close_journal()
        else:
            self.l1.clear()
        self.engine_copies.close()
        for hook in self._close_hooks:  # e.g. stop the transport once the last replies are out
            hook()
        self.gc_pauses.close()
        if not late:  # nothing copies any more: L1's memory goes back now, not during the process's exit
            t0 = time.monotonic()
            if self.arena.release_memory():
                logger.info("gave L1's %s back to the machine in %.1f s", format_size(self.arena.capacity),
                            time.monotonic() - t0)

    # ---- the names of the engine this re-implements (DESIGN.md): each a request of its part ----

    def register_kv_cache(self, msg: p.RegisterKVCache, reply: Reply) -> None:
        self.handle(Request(msg, reply))

    def unregister_kv_cache(self, msg: p.UnregisterKVCache, reply: Reply | None = None) -> None:
        """From a client (reply given): only its own registration. Internal (no reply): any."""
        if reply is None:
            self.registrations.unregister(msg.kv_id)
        else:
            self.handle(Request(msg, reply))

    def store(self, msg: p.Store, reply: Reply) -> None:
        self.handle(Request(msg, reply))

    def retrieve(self, msg: p.Retrieve, reply: Reply) -> None:
        self.handle(Request(msg, reply))

    def lookup(self, msg: p.Lookup, reply: Reply) -> None:
        self.handle(Request(msg, reply))

    def clear(self) -> int:
        removed = self.l1.clear()
        logger.info("cleared %d objects", removed)
        return removed

    def get_chunk_size(self) -> int:
        return self.config.chunk_size
