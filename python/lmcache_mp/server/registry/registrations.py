"""Registering and unregistering KV caches: the engine's `Registrations` part.

A registration is checked on the socket thread (scalar fields only) and opened on a thread of
its own (layouts, shared memory or CUDA IPC, the transfer engine), which then runs that cache's
requests in order. It belongs to the client that made it: when the client goes away, so does the
registration, its mappings and its thread.
"""

from __future__ import annotations

import logging
import secrets
import threading
from typing import Callable

from lmcache_mp import protocol as p
from lmcache_mp.completions import CompletionWaiter
from lmcache_mp.config import ServerConfig, format_size
from lmcache_mp.head_slices import head_slice
from lmcache_mp.layout import LayoutError, describe_kind
from lmcache_mp.native import HostArena, pinning_paused
from lmcache_mp.server import validation as check
from lmcache_mp.server.copies.contexts import (
    CPUCacheContext,
    EngineCopyContext,
    GPUCacheContext,
    IpcEventCache,
    IpcMemoryCache,
    Registration,
    RegistrationError,
    describe_layers,
)
from lmcache_mp.server.copies.transfer_mode import choose_transfer_mode
from lmcache_mp.server.copies.workers import SerialWorker
from lmcache_mp.server.ops.gc_pauses import settle
from lmcache_mp.server.registry.clients import Clients
from lmcache_mp.server.request import Request
from lmcache_mp.server.tenancy.tenancy import NoTenancy, Tenancy, shown, strip
from lmcache_mp.server.validation import RequestFailure, invalid, over_limit
from lmcache_mp.storage.eviction.quotas import SEP

logger = logging.getLogger(__name__)

# A registration's completion threads poll this long for the next ticket before they sleep: back
# to back requests keep them awake, an idle registration costs nothing after a millisecond.
COMPLETION_SPIN_US = 1000


class Entry:
    """A live registration: its context, its worker and, on the GPU, its completion threads.

    Its jobs run one at a time, in the order they were given. A cheap job given while nothing of
    the registration is queued or running runs at once on the caller's thread (the socket
    thread: no hand-off); any other job waits its turn on the worker."""

    def __init__(self, ctx, worker: SerialWorker):
        self.ctx = ctx
        self.worker = worker
        self.store_done: CompletionWaiter | None = None
        self.retrieve_done: CompletionWaiter | None = None
        self.closed = False  # set by the job that closes it; later jobs fail
        self._count_lock = threading.Lock()
        self._jobs = 0  # given and not finished
        self._running = threading.Lock()  # held by the job that runs

    def run(self, job: Callable[[], None], inline: bool = False, limit: int = 0) -> None:
        """limit: refuse the job (LIMIT_EXCEEDED) when that many are queued or running already."""
        with self._count_lock:
            if limit and self._jobs >= limit:
                raise RequestFailure(p.ErrorCode.LIMIT_EXCEEDED,
                                     f"{self._jobs} requests of this KV cache are queued or running, the most "
                                     "allowed (max_queued_requests); try again when some have finished")
            inline = inline and self._jobs == 0
            self._jobs += 1
        if inline:
            self._execute(job)
        else:
            self.worker.submit(lambda: self._execute(job))

    def _execute(self, job: Callable[[], None]) -> None:
        try:
            with self._running:
                job()
        finally:
            with self._count_lock:
                self._jobs -= 1


class Registrations:
    """The live registrations (kv_id -> Entry) and the threads of those that ended until they did."""

    def __init__(self, config: ServerConfig, device: str, arena: HostArena, clients: Clients,
                 ipc: IpcMemoryCache | None, events: IpcEventCache | None, uuids: dict[bytes, int]):
        """ipc, events: the CUDA IPC caches (None on the cpu device); uuids: this server's GPUs by uuid."""
        self.config = config
        self.device = device
        self.arena = arena
        self.clients = clients
        self.tenancy: Tenancy | NoTenancy = NoTenancy()  # (MPCacheEngine.attach_tenancy)
        self._ipc = ipc
        self._events = events
        self._uuids = uuids
        self.lock = threading.Lock()  # the entries and the clients they belong to, together
        self._entries: dict[int, Entry] = {}
        # Every registration's thread, until it ended: close() waits for them all, so that no
        # context is torn down (driver calls, without the GIL) while the interpreter shuts down.
        self._workers: set[SerialWorker] = set()
        self.closing = False  # set by the engine's close: a registration opened after it is abandoned

    def register_kv_cache(self, request: Request) -> None:
        msg: p.RegisterKVCache = request.msg
        cid = check.client_id(msg.client_id)
        check.world_size(msg.world_size)
        if not 0 <= msg.rank < msg.world_size:
            raise invalid(f"rank {msg.rank} / world_size {msg.world_size} is not a valid pair")
        check.names(msg.model)
        if len(msg.layers) > p.MAX_LAYERS:
            raise over_limit(f"{len(msg.layers)} layers, over the limit of {p.MAX_LAYERS}")
        if msg.device not in ("cpu", "cuda"):
            raise invalid(f"device must be 'cpu' or 'cuda', got {msg.device!r}")
        if msg.transfer not in ("", "server", "engine"):
            raise invalid(f"transfer must be 'server' or 'engine', got {msg.transfer!r}")
        engine_copies = msg.transfer == "engine"  # the engine moves the bytes: any device will do
        if msg.device != self.device and not engine_copies:
            raise RequestFailure(
                p.ErrorCode.UNSUPPORTED,
                f"this server runs on the {self.device} device; it cannot take a {msg.device} KV cache",
            )
        self.clients.touch(cid)
        tenant = request.tenant
        with self.lock:
            mine = sum(e.ctx.reg.client_id == cid for e in self._entries.values())
            tenants = 0 if tenant is None else sum(e.ctx.reg.model.startswith(tenant.prefix)
                                                   for e in self._entries.values())
        if tenant is not None and tenants >= tenant.tenant.max_registrations:
            self.tenancy.audit.denied(tenant.name, "register", "max_registrations")
            raise over_limit(f"tenant {tenant.name} has {tenants} KV caches registered, the most its tenants file "
                             "entry allows (max_registrations)")
        if mine >= self.config.max_registrations_per_client:
            raise over_limit(f"this client has {mine} KV caches registered, the most allowed "
                             "(max_registrations_per_client); unregister one first")
        kv_id = secrets.randbits(63)  # unguessable, never reused: a stale id cannot hit another cache
        worker = SerialWorker(f"lmcache-kv-{kv_id & 0xFFFF:04x}")
        with self.lock:
            self._workers = {w for w in self._workers if w.alive()}
            self._workers.add(worker)

        def open_context() -> None:  # on the registration's own thread: the socket thread goes on
            ctx = None
            try:
                reg = self._registration(kv_id, msg)
                if engine_copies:
                    ctx = EngineCopyContext(reg, msg)
                elif self.device == "cpu":
                    ctx = CPUCacheContext(reg, msg)
                else:
                    dev = self._uuids.get(msg.device_uuid)
                    if dev is None:
                        raise RegistrationError("the KV cache is on a GPU this server cannot see "
                                                f"(uuid {msg.device_uuid.hex()}); check CUDA_VISIBLE_DEVICES")
                    with pinning_paused(self.arena):  # pinning holds the driver; registering needs it
                        ctx = GPUCacheContext(reg, msg, dev, self._ipc, self._events, self.config.transfer_mode,
                                              choose_transfer_mode, self.config.staging_size, self.config.direct_ctas)
                entry = Entry(ctx, worker)
                if isinstance(ctx, GPUCacheContext):
                    # Through ctx, not a bound method: the mover must go when the context closes.
                    mover_of = lambda ctx=ctx: ctx.mover  # noqa: E731
                    spin = min(self.config.spin_us, COMPLETION_SPIN_US)
                    entry.store_done = CompletionWaiter(f"lmcache-store-{kv_id & 0xFFFF:04x}", mover_of,
                                                        "gather", spin)
                    entry.retrieve_done = CompletionWaiter(f"lmcache-load-{kv_id & 0xFFFF:04x}", mover_of,
                                                           "scatter", spin)
                with self.lock:  # a client forgotten meanwhile must not leave a registration behind
                    alive = self.clients.known(cid) and not self.closing
                    if alive:
                        self._entries[kv_id] = entry
                if not alive:
                    for waiter in (entry.store_done, entry.retrieve_done):
                        if waiter is not None:
                            waiter.stop()
                    raise RegistrationError("the client went away while its KV cache was being registered")
            except (RegistrationError, RequestFailure) as e:
                self._abandon(ctx, worker)
                code = e.code if isinstance(e, RequestFailure) else p.ErrorCode.INVALID_ARGUMENT
                request.fail(code, str(e))
                return
            except Exception as e:  # every request gets a reply, even on a bug here
                self._abandon(ctx, worker)
                logger.exception("internal error registering a KV cache")
                request.fail(p.ErrorCode.INTERNAL, f"internal error: {e}")
                return
            settle()  # the registration's objects live until it ends
            spec = reg.spec
            if tenant is not None:
                self.tenancy.audit.write("registration", tenant=tenant.name, model=strip(reg.model),
                                         kv=f"{kv_id & 0xFFFF:04x}", world_size=reg.world_size, rank=reg.rank)
            logger.info("registered %s KV cache: model %s rank %d/%d, %d layers x %d blocks of %d tokens, "
                        "%s, %s per chunk%s, transfer mode %s (%s)", describe_kind(spec), shown(reg.model), reg.rank,
                        reg.world_size, spec.model_layers, spec.num_blocks, spec.block_size, spec.dtype,
                        format_size(reg.object_bytes),
                        "" if reg.slice is None else
                        f" (tp-shared: heads {reg.slice.first}-{reg.slice.first + reg.slice.count - 1} "
                        f"of {reg.slice.heads})",
                        ctx.transfer_mode, ctx.mode_reason)
            request.reply(p.RegisterReply(kv_id=kv_id, layout=spec.kind, object_bytes=reg.object_bytes,
                                          transfer_mode=ctx.transfer_mode, shared=reg.shared,
                                          block_size=spec.block_size, num_blocks=spec.num_blocks,
                                          chunk_size=reg.chunk_size, tp_shared=reg.slice is not None))

        worker.submit(open_context)

    def _registration(self, kv_id: int, msg: p.RegisterKVCache) -> Registration:
        spec = describe_layers(msg)
        if not 0 <= msg.chunk_size <= p.MAX_CHUNK_TOKENS:
            raise RegistrationError(f"chunk_size must be in [0, {p.MAX_CHUNK_TOKENS}] (0: the server's), "
                                    f"got {msg.chunk_size}")
        chunk_size = msg.chunk_size or self.config.chunk_size
        if chunk_size % spec.block_size:
            where = "the registration's" if msg.chunk_size else "the server's (--chunk-size)"
            raise RegistrationError(f"block size {spec.block_size} does not divide {where} chunk size {chunk_size}")
        tp_slice = None
        if msg.tp_shared or self.config.tp_shared:
            if msg.transfer == "engine":
                raise RegistrationError("tp-shared chunks are copied by the server: register with transfer='server'")
            if spec.kind == "packed":  # the object is per layer and token: the layers' own views, one by one
                spec = spec.layer
            try:
                layer = msg.layers[0]
                spec, tp_slice = head_slice(spec, layer.shape, layer.strides, msg.world_size, msg.rank,
                                            msg.num_kv_heads, msg.pipeline_size)
            except LayoutError as e:
                raise RegistrationError(str(e)) from None
        reg = Registration(kv_id=kv_id, client_id=msg.client_id, model=msg.model, world_size=msg.world_size,
                           rank=msg.rank, spec=spec, chunk_size=chunk_size, slice=tp_slice)
        if reg.object_bytes > self.arena.slab_bytes:
            raise RegistrationError(f"one chunk of this cache is {format_size(reg.object_bytes)}, more than a slab "
                                    f"({format_size(self.arena.slab_bytes)}): raise --slab-size or lower "
                                    "--chunk-size")
        return reg

    @staticmethod
    def _abandon(ctx, worker: SerialWorker) -> None:
        if ctx is not None:
            ctx.close()
        worker.stop()

    def entry(self, kv_id: int, client_id: bytes) -> Entry:
        """The registration kv_id, for the client that made it: another client's request is told
        it does not exist (a kv_id is unguessable; this also stops one that leaked)."""
        with self.lock:
            entry = self._entries.get(kv_id)
        if entry is None or entry.ctx.reg.client_id != client_id:
            raise RequestFailure(p.ErrorCode.UNKNOWN_REGISTRATION,
                                 f"no KV cache of this client is registered as {kv_id} (was the server restarted?)")
        return entry

    def unregister_kv_cache(self, request: Request) -> None:
        """UNREGISTER from a client: only its own registration."""
        msg: p.UnregisterKVCache = request.msg
        if not self._unregister(msg.kv_id, msg.client_id, request):
            raise RequestFailure(p.ErrorCode.UNKNOWN_REGISTRATION,
                                 f"no KV cache of this client is registered as {msg.kv_id}")

    def unregister(self, kv_id: int) -> None:
        """Internal (the client went away, the server closes): any registration, no reply."""
        self._unregister(kv_id, None, None)

    def _unregister(self, kv_id: int, client_id: bytes | None, request: Request | None) -> bool:
        with self.lock:
            entry = self._entries.get(kv_id)
            if entry is not None and (client_id is None or entry.ctx.reg.client_id == client_id):
                del self._entries[kv_id]
            else:
                entry = None
        if entry is None:
            return False

        def close() -> None:  # runs after the registration's queued work
            entry.closed = True
            for waiter in (entry.store_done, entry.retrieve_done):
                if waiter is not None:
                    waiter.stop()
            entry.ctx.close()
            entry.worker.stop()
            reg = entry.ctx.reg
            logger.info("unregistered KV cache of model %s rank %d", shown(reg.model), reg.rank)
            self.tenancy.audit.write("unregistration", tenant=reg.model.split(SEP, 1)[0], model=strip(reg.model),
                                     kv=f"{kv_id & 0xFFFF:04x}", rank=reg.rank)
            if request is not None:
                request.reply(p.UnregisterReply(kv_id=kv_id))

        entry.run(close)
        return True

    def forget_client(self, client: bytes) -> list[int]:
        """The client is forgotten (it was heard from no more): the kv_ids of its registrations."""
        with self.lock:
            self.clients.drop(client)
            return [kv for kv, e in self._entries.items() if e.ctx.reg.client_id == client]

    def of_client(self, client: bytes) -> list[int]:
        with self.lock:
            return [kv for kv, e in self._entries.items() if e.ctx.reg.client_id == client]

    def models(self) -> list[str]:
        with self.lock:
            return [e.ctx.reg.model for e in self._entries.values()]

    def kv_ids(self) -> list[int]:
        with self.lock:
            return list(self._entries)

    def workers(self) -> list[SerialWorker]:
        with self.lock:
            return list(self._workers)

    def status(self) -> list[dict]:
        with self.lock:
            return [
                {"id": f"{kv & 0xFFFF:04x}",  # a tag (as in thread names): the kv_id is the client's secret
                 "model": shown(e.ctx.reg.model), "rank": e.ctx.reg.rank, "world_size": e.ctx.reg.world_size,
                 "layout": e.ctx.reg.spec.kind, "layers": e.ctx.reg.spec.model_layers,
                 "copy_bytes": e.ctx.reg.spec.segment_bytes, "device": e.ctx.device,
                 "transfer_mode": e.ctx.transfer_mode, "transfer_mode_reason": e.ctx.mode_reason,
                 "object_bytes": e.ctx.reg.object_bytes, "tp_shared": e.ctx.reg.slice is not None}
                for kv, e in self._entries.items()
            ]

    def close_event_cache(self) -> None:
        """The CUDA IPC events opened for registrations (once they are all closed)."""
        if self._events is not None:
            self._events.close()
