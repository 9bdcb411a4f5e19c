"""Client: the library engine workers use to talk to an lmcache-mp server.

Thread-safe. Store and retrieve return futures (client/io_thread.py): a request leaves from the
calling thread, and a caller that waits on its future reads the reply itself. Small requests take
the server's local lane when this process can reach it (a unix datagram socket, no ZeroMQ I/O
threads on the way); synchronous calls without it go out on a ZeroMQ socket of the calling thread.
Either way a request costs one round trip and no thread hand-offs. A heartbeat notices a server
that went away (requests then fail at once until it is back) or restarted: the client then fails
what was in flight and registers its KV caches again (client/recovery.py). KV caches registered
with transfer="engine" are copied by this process (client/engine_transfers.py).

One module over 450 lines: it is the public `Client` of DESIGN.md, a method for each request, and
what is not a request already lives apart in client/.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any, Iterable, Sequence

import zmq

from lmcache_mp import protocol as p
from lmcache_mp import shm
from lmcache_mp.client.cuda_events import EventPool, OpenedEvents, current_stream
from lmcache_mp.client.curve import apply_curve
from lmcache_mp.client.endpoint import HandshakeWatch, check_url, unreachable_hint
from lmcache_mp.client.engine_transfers import EngineTransfers
from lmcache_mp.client.handles import KVCacheHandle
from lmcache_mp.client.hints import HintResult, hint_message, hint_result
from lmcache_mp.client.futures import add_trace
from lmcache_mp.client.io_thread import ZMQ_EVENTS, ZMQ_POLLIN, IOThread
from lmcache_mp.client.lane import connect_lane
from lmcache_mp.client.leases import HeldLeases, LookupResult
from lmcache_mp.client.recovery import RECOVERY_STOP_S, RestartRecovery
from lmcache_mp.client.results import RetrieveResult, StoreResult, check_reply as _check
from lmcache_mp.client.tensors import describe_kv_caches
from lmcache_mp.errors import RequestError, ServerUnavailable
from lmcache_mp.keys import DIGEST_BYTES, pack_hashes, unpack_hashes
from lmcache_mp.native import default_spin_us, request_block_ids, spin_poll
from lmcache_mp.processes import own_pid_namespace, process_start

logger = logging.getLogger(__name__)



# A synchronous call waiting for a connection or a reply looks this often whether the client has
# found the server away (unsent requests fail then) or gone (then waiting for a reply ends too).
AWAY_CHECK_S = 0.05
# Synchronous calls that take the local lane when there is one (small replies, quick on the server).
_LANE_CALLS = (p.Lookup, p.Release, p.Ping, p.UnregisterKVCache, p.Clear)


class Client(RestartRecovery):
    """Connects to a server (handshake first: raises ServerUnavailable if none answers within
    connect_timeout, at once when nothing listens at the URL or the server refused this client's
    credential; ProtocolMismatch on a version mismatch). spin_us: how long a thread waiting
    on a store or retrieve polls for its reply before it sleeps (a sleeping thread wakes tens of
    microseconds late; 0: sleep at once; default: 5000 on machines of at least 8 cores, else 0).
    local_lane: send small requests on the server's local lane when it offers one and this
    process can reach it (a unix datagram socket: no ZeroMQ I/O threads on the way).
    A heartbeat every heartbeat_interval seconds watches the server: while it finds the server
    away, requests fail at once with ServerUnavailable (`server_away` says why), and once it is
    back the client registers again what a restarted server lost, then serves.
    curve_server_key, curve_client_key: key files for a server with CURVE authentication
    (default: LMCACHE_MP_CURVE_SERVER_KEY and LMCACHE_MP_CURVE_CLIENT_KEY; see client/curve.py)."""

    def __init__(self, url: str, *, timeout: float = 10.0, connect_timeout: float = 5.0,
                 heartbeat_interval: float = 1.0, name: str = "", trace: bool = False, spin_us: int | None = None,
                 local_lane: bool = True, curve_server_key: str | None = None,
                 curve_client_key: str | None = None):
        self.url = check_url(url)
        # Timing traces (lmcache-mp-bench --trace): the futures of store/retrieve get .trace, and
        # last_trace() gives the calling thread's last synchronous call: [(stage, monotonic ns)].
        self.trace = trace
        spin_us = default_spin_us() if spin_us is None else spin_us
        self._spin = spin_us / 1e6
        self.timeout = timeout
        self.name = name or f"pid{os.getpid()}"
        self.client_id = secrets.token_bytes(16)
        self._ctx = zmq.Context()
        if url.startswith("tcp://["):  # an IPv6 address: ZeroMQ's sockets take one only with this option
            self._ctx.setsockopt(zmq.IPV6, 1)
        self.curve = apply_curve(self._ctx, curve_server_key, curve_client_key)  # (also from the environment)
        self._local = threading.local()
        self._sync_sockets: dict[zmq.Socket, threading.Thread] = {}  # each caller thread's, and that thread
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._handles: list[KVCacheHandle] = []
        self._opened = OpenedEvents()
        self._closed = False
        self._away = ""  # why the server is taken to be away (recovery.py)
        self._revoked = ""  # why the server refuses this client's credential, for good (recovery.py)
        self._gone = False  # and nothing listens at its address: no request it took will be answered
        self._restarting = threading.Lock()
        self._connect_watch: HandshakeWatch | None = None  # while the first handshake is pending
        self._io: IOThread | None = None
        self._engine = EngineTransfers(self)
        try:
            hello = self._hello(connect_timeout)
        except BaseException:
            self._close_sockets()
            raise
        self.server_info = {f: getattr(hello, f) for f in hello.__struct_fields__}
        self.chunk_size: int = hello.chunk_size
        self.session_id: bytes = hello.session_id
        self._leases = HeldLeases(hello.lease_ttl)
        ref = weakref.ref(self)  # the I/O thread must not keep a dropped client alive

        def heartbeat():
            client = ref()
            return client._heartbeat_msg() if client is not None else None

        self._io = IOThread(self._ctx, url, heartbeat, heartbeat_interval, spin_us)
        self._finalizer = weakref.finalize(self, Client._finalize, ref, self._io, self._ctx, self._sync_sockets,
                                           self._restarting)
        self._use_lane = local_lane

        def connection_lost() -> None:  # the lane's, or ZeroMQ's: has the server gone or restarted?
            client = ref()
            if client is not None:
                client._suspect_restart(dropped=True)

        def refused(status: int) -> None:  # a reconnection's handshake: its credential revoked?
            client = ref()
            if client is not None:
                client._refused_handshake(status)

        self._io.on_lane_lost = self._io.on_disconnected = connection_lost
        self._io.on_refused = refused
        self._connect_lane(hello.lane)

    # ---- synchronous calls on the caller's socket ----------------------------------------------

    def _socket(self) -> zmq.Socket:
        if self._closed:  # before the cached socket: close() has closed it
            raise ServerUnavailable("the client is closed")
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.connect(self.url)
            self._local.sock = sock
            self._local.fds = [sock.get(zmq.FD)]
            with self._lock:
                self._sync_sockets[sock] = threading.current_thread()
        return sock

    def _connect_lane(self, address: str) -> None:
        if not (address and self._use_lane and self._io is not None):
            return
        try:
            sock = connect_lane(address, self.server_info.get("lane_ticket", b""))
        except OSError as e:  # e.g. another network namespace: ZeroMQ only
            logger.debug("the server's local lane %s is out of reach (%s): using ZeroMQ only", address, e)
            return
        self._io.set_lane(sock)

    def _call(self, msg: p._Msg, expected: type, timeout: float | None = None) -> Any:
        self._check_reachable()
        timeout = self.timeout if timeout is None else timeout
        if self._io is not None and self._io.has_lane and isinstance(msg, _LANE_CALLS):
            stamps = [("call", time.monotonic_ns())] if self.trace else None
            try:
                return self._io.call(msg, timeout, lambda r: _check(r, expected), stamps)
            finally:
                if stamps is not None:
                    self._local.trace = stamps
        sock = self._socket()
        rid = next(self._ids)
        deadline = time.monotonic() + timeout
        stamps = [("call", time.monotonic_ns())] if self.trace else None
        body = p.encode(msg)
        if len(body) > p.MAX_MESSAGE_BYTES:
            raise p.too_large(msg, len(body))
        frames = (p.pack_request_id(rid), body) if stamps is None else (p.pack_request_id(rid), body, p.TRACE_FRAME)
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:  # no connection (yet)
            self._send_once_connected(sock, frames, deadline, timeout)
        if stamps is not None:
            stamps.append(("client sent", time.monotonic_ns()))
        spin_until = time.monotonic() + self._spin
        while True:
            now = time.monotonic()
            if now > deadline:
                raise ServerUnavailable(f"no reply to {type(msg).__name__} from {self.url} within {timeout:.3g} s")
            if self._gone:  # its process is gone: no reply will come
                raise self._away_error(self._away)
            if not sock.get(ZMQ_EVENTS) & ZMQ_POLLIN:  # poll for the reply a while before sleeping
                spin_poll(self._local.fds, int(max(0.0, spin_until - now) * 1e6),
                          int(min(deadline - now, AWAY_CHECK_S) * 1000) + 1)
                continue
            frames = sock.recv_multipart(zmq.NOBLOCK)
            if self._io is not None:
                self._io.last_heard = time.monotonic()
            if len(frames) in (2, 3) and len(frames[0]) == 8 and p.unpack_request_id(frames[0]) == rid:
                if stamps is not None:
                    add_trace(stamps, frames[2] if len(frames) == 3 else None)
                    self._local.trace = stamps
                return _check(p.decode_reply(frames[1]), expected)
            # a late reply to a request that timed out earlier: skip it

    def _send_once_connected(self, sock: zmq.Socket, frames: tuple, deadline: float, timeout: float) -> None:
        """A synchronous request ZeroMQ could not send at once (no connection): sent once it
        can be, unless the deadline passes or the client finds the server away meanwhile."""
        while True:
            if self._away:
                raise self._away_error(self._away)
            if self._connect_watch is not None and (why := self._connect_watch.known()):
                raise ServerUnavailable(f"no server at {self.url}: {why}")
            left = deadline - time.monotonic()
            if left <= 0:
                hint = " (with CURVE: are the server key and this client's key the right ones?)" if self.curve else ""
                raise ServerUnavailable(f"no server reachable at {self.url} within {timeout:.3g} s{hint}")
            if sock.poll(int(min(left, AWAY_CHECK_S) * 1000) + 1, zmq.POLLOUT):
                try:
                    sock.send_multipart(frames, flags=zmq.NOBLOCK)
                    return
                except zmq.Again:
                    pass

    def last_trace(self) -> list[tuple[str, int]] | None:
        """The stages of this thread's last synchronous call (lookup, ...) when tracing."""
        return getattr(self._local, "trace", None)

    def _hello_msg(self) -> p.Hello:
        return p.Hello(version=p.PROTOCOL_VERSION, client_id=self.client_id, client_name=self.name, pid=os.getpid(),
                       capabilities=["reply_on_submit"], pid_namespace=own_pid_namespace(),
                       start_time=process_start(os.getpid()) or 0)

    def _hello(self, timeout: float) -> p.HelloReply:
        # what makes the wait pointless (a refused credential, nothing listening) ends it at once
        self._connect_watch = HandshakeWatch(self._socket(), self.url, self.curve)
        try:
            return self._call(self._hello_msg(), p.HelloReply, timeout)
        except ServerUnavailable as e:
            if str(e).startswith(f"no server at {self.url}: "):  # (the watch's: known already)
                raise
            hint = unreachable_hint(self._ctx, self.url, self.curve)  # what is there: nothing, or a CURVE server?
            if not hint:
                raise
            raise ServerUnavailable(f"no server reachable at {self.url} within {timeout:.3g} s: {hint}") from None
        finally:
            watch, self._connect_watch = self._connect_watch, None
            watch.close()

    def lookup(self, hashes: bytes | Iterable[bytes], *, model: str, world_size: int = 1, lock: bool = False,
               salt: bytes = b"", timeout: float | None = None, tp_shared: bool = False) -> LookupResult:
        """Leading chunks present for every rank of (model, world_size), as an int. lock=True
        leases them: pass `result.lease` to the retrieves that read them (each read consumes
        the lease's use of what it reads) and to release(); it also ends at the server's TTL or
        when this client closes. tp_shared: of tp-shared chunks (register_kv_cache), which one
        object holds for every rank of any TP size."""
        packed = pack_hashes(hashes)
        msg = p.Lookup(client_id=self.client_id, model=model, world_size=world_size, hashes=packed, lock=lock,
                       salt=salt, tp_shared=tp_shared)
        r = self._call(msg, p.LookupReply, timeout)
        if r.lease:
            self._leases.add(r.lease, model, world_size, salt, unpack_hashes(packed[: r.hits * DIGEST_BYTES]))
        return LookupResult(r.hits, r.lease, r.from_l2)

    def lookup_async(self, hashes: bytes | Iterable[bytes], *, model: str, world_size: int = 1, lock: bool = False,
                     salt: bytes = b"", timeout: float | None = None,
                     tp_shared: bool = False) -> "Future[LookupResult]":
        """lookup() without waiting: a lookup with lock may wait on the server while chunks found
        in L2 are brought into L1 (up to its prefetch timeout)."""
        self._check_reachable()
        stamps = [("call", time.monotonic_ns())] if self.trace else None
        packed = pack_hashes(hashes)
        msg = p.Lookup(client_id=self.client_id, model=model, world_size=world_size, hashes=packed, lock=lock,
                       salt=salt, tp_shared=tp_shared)

        def convert(reply: Any) -> LookupResult:
            r = _check(reply, p.LookupReply)
            if r.lease:
                self._leases.add(r.lease, model, world_size, salt, unpack_hashes(packed[: r.hits * DIGEST_BYTES]))
            return LookupResult(r.hits, r.lease, r.from_l2)

        return self._async(msg, timeout, convert, None, stamps=stamps)

    def release(self, hashes: bytes | Iterable[bytes] | None = None, *, lease: int | None = None,
                model: str | None = None, world_size: int = 1, salt: bytes = b"",
                timeout: float | None = None) -> int:
        """Drop lookup leases not consumed by retrieves; returns the objects let go.

        With `lease` (an id, or the LookupResult): that lease, on `hashes` only if given. Without:
        this client's own leases on `hashes` of (model, world_size, salt)."""
        packed = pack_hashes(hashes) if hashes is not None else b""
        if lease is not None:
            lease = int(getattr(lease, "lease", lease))
            if not packed:
                self._leases.forget(lease)
            return self._release_one(lease, packed, timeout)
        if model is None:
            raise ValueError("release() needs a lease, or the model (and hashes) of this client's leases")
        return sum(self._release_one(held, b"".join(mine), timeout)
                   for held, mine in self._leases.matching(model, world_size, salt, unpack_hashes(packed)))

    def _release_one(self, lease: int, packed: bytes, timeout: float | None) -> int:
        if not lease:
            return 0
        return self._call(p.Release(client_id=self.client_id, lease=lease, hashes=packed), p.ReleaseReply,
                          timeout).released

    def hint(self, action: str, hashes: bytes | Iterable[bytes], *, model: str, world_size: int = 1,
             salt: bytes = b"", ttl: float = 0.0, priority: int = 0, tp_shared: bool = False,
             timeout: float | None = None) -> HintResult:
        """A hint about the leading chunks of `hashes` the server holds, in this client's tenant
        (docs/hints.md): "pin" keeps them in L1 for `ttl` seconds within the tenant's hint budget
        (over it: RequestError LIMIT_EXCEEDED, nothing pinned), "unpin" ends the tenant's pins on
        them, "retain" counts them `priority` (1-16) more uses, "prefetch" loads them from L2 into
        L1, "demote" writes them to L2 and drops them from L1, "drop" frees them from L1. An action
        the server does not know is ignored (`result.ignored`). Hints never change what a lookup
        or retrieve finds. tp_shared: of tp-shared chunks (as lookup's)."""
        msg = hint_message(self.client_id, action, hashes, model, world_size, salt, ttl, priority, tp_shared)
        return hint_result(self._call(msg, p.HintReply, timeout))

    def hint_async(self, action: str, hashes: bytes | Iterable[bytes], *, model: str, world_size: int = 1,
                   salt: bytes = b"", ttl: float = 0.0, priority: int = 0, tp_shared: bool = False,
                   timeout: float | None = None) -> "Future[HintResult]":
        """hint() without waiting."""
        self._check_reachable()
        msg = hint_message(self.client_id, action, hashes, model, world_size, salt, ttl, priority, tp_shared)
        return self._async(msg, timeout, lambda reply: hint_result(_check(reply, p.HintReply)), None)

    def ping(self, timeout: float | None = None) -> float:
        """Round-trip seconds."""
        t0 = time.perf_counter()
        self._call(p.Ping(client_id=self.client_id), p.PingReply, timeout)
        return time.perf_counter() - t0

    def status(self, timeout: float | None = None) -> dict:
        """The server's status; "mine" lists the kv_ids of this client's registrations."""
        return self._call(p.Status(client_id=self.client_id), p.StatusReply, timeout).status

    def events(self, since: int = 0, models: Sequence[str] = (), max_events: int = 1024,
               timeout: float | None = None) -> p.EventsReply:
        """The server's chunk events (committed, removed) from sequence number `since` on, of
        these models (namespaces) only, or of all: `.events`, `.next` (where to continue),
        `.first` (events before it were lost), `.session_id` (a new one: the server restarted)."""
        return self._call(p.Events(client_id=self.client_id, since=since, models=list(models),
                                   max_events=max_events), p.EventsReply, timeout)

    def events_async(self, since: int = 0, models: Sequence[str] = (), max_events: int = 1024,
                     timeout: float | None = None) -> "Future[p.EventsReply]":
        self._check_reachable()
        msg = p.Events(client_id=self.client_id, since=since, models=list(models), max_events=max_events)
        return self._async(msg, timeout, lambda reply: self._checked(reply, p.EventsReply), None)

    def clear(self, timeout: float | None = None) -> int:
        """Remove every object not in use on the server; returns how many."""
        return self._call(p.Clear(), p.ClearReply, timeout).removed

    # ---- registration ------------------------------------------------------------------------

    def register_kv_cache(self, kv_caches: Sequence[Any] | dict, *, model: str, world_size: int = 1, rank: int = 0,
                          layout: str = "auto", block_size: int | None = None, transfer: str = "auto",
                          staging_bytes: int | None = None, pack_ctas: int = 0,
                          chunk_size: int = 0, tp_shared: bool = False, num_kv_heads: int = 0,
                          pipeline_size: int = 1) -> KVCacheHandle:
        """Register one tensor per layer (CPU tensors in shared memory, or CUDA tensors; with
        transfer="engine", CPU tensors anywhere in this process's memory).

        transfer: who moves the bytes. "server" (and "auto", for now): the server, with its
        kernels and copy engines (the only way from another machine or network namespace);
        "engine": this process, in its own CUDA context (it maps the server's L1;
        client/engine_copy.py), so that the transfers of a busy engine share its GPU as its own
        work does: a busy engine keeps 0.96-0.97x of its GEMM rate instead of 0.83-0.85x. Its
        cost: this process page-locks each slab of L1 the first time it needs it, and every
        other CUDA call of the process waits meanwhile (about 0.17 s per 256 MiB slab; pin_l1()
        does them all at once). handle.transfer_mode says which was taken. staging_bytes,
        pack_ctas: the engine-side copier's GPU ring and its packing kernels' CTAs (0: one per
        SM). chunk_size: tokens per chunk of this cache's requests (0: the server's, `self.chunk_size`),
        a multiple of its block size; `handle.chunk_size` says what it is.

        tp_shared: store and read tensor-parallel-shared chunks, one object with every KV head
        that engines of any TP size share (docs/tensor-parallel.md); num_kv_heads: the model's KV
        heads (not this rank's), pipeline_size: the pipeline stages world_size counts. The server
        refuses a cache whose head split it cannot prove. Lookups of these chunks pass tp_shared=True
        (`handle.tp_shared` says whether the server took them, also when it opts every cache in)."""
        if transfer not in ("auto", "server", "engine"):
            raise ValueError(f"transfer must be 'auto', 'server' or 'engine', got {transfer!r}")
        tensors = list(kv_caches.values()) if isinstance(kv_caches, dict) else list(kv_caches)
        described = describe_kv_caches(tensors, private_cpu=transfer == "engine")
        handle = KVCacheHandle(tensors, model, world_size, rank, layout, block_size, described,
                               transfer, staging_bytes, pack_ctas, chunk_size)
        handle.requested_tp = (tp_shared, num_kv_heads, pipeline_size)
        handle.chunk_size = chunk_size or self.chunk_size
        if handle.device == "cuda":
            handle.events = EventPool(handle.described.device_index)
        self._register(handle)
        with self._lock:
            self._handles.append(handle)
        return handle

    def pin_l1(self) -> None:
        """Page-lock all of the server's L1 in this process now, for its own copies (otherwise a
        slab is locked the first time a request needs it; either way every other CUDA call of
        the process waits meanwhile: about 0.17 s per 256 MiB on an H200 host). Nothing to do
        unless a KV cache was registered with transfer="engine"."""
        self._engine.pin_all()

    def _engine_copies(self, handle: KVCacheHandle) -> bool:
        """Whether this process copies the handle's chunks itself (mapping L1 first if so)."""
        want = handle.requested_transfer
        if want != "engine":  # "auto" takes the server's copies until L1 can be shared without page-locking it here
            return False
        try:
            self._engine.arena()
            return True
        except (RequestError, ServerUnavailable) as e:
            if want == "engine":
                raise
            logger.info("lmcache-mp: the server copies this KV cache's chunks (%s)", e)
            return False

    def _register(self, handle: KVCacheHandle, call=None) -> None:
        """call: _call, or the recovery's (_recovery_call)."""
        d = handle.described
        engine = self._engine_copies(handle)
        msg = p.RegisterKVCache(client_id=self.client_id, model=handle.model, world_size=handle.world_size,
                                rank=handle.rank, device=d.device, device_uuid=d.device_uuid,
                                layout=handle.requested_layout, layers=d.layers,
                                block_size=handle.requested_block_size or 0, transfer="engine" if engine else "",
                                chunk_size=handle.requested_chunk_size, tp_shared=handle.requested_tp[0],
                                num_kv_heads=handle.requested_tp[1], pipeline_size=handle.requested_tp[2])
        # A worker's CPU cache may live in an unnamed file: the server opens it by name, so it
        # has one until the server answered (it has mapped the file then).
        files = {layer.memory.name for layer in d.layers if layer.memory.kind == "shm"}
        try:
            with shm.published(files):
                reply = (call or self._call)(msg, p.RegisterReply, max(self.timeout, 30.0))
        except RequestError as e:
            unnamed = [name for name in files if shm.is_unnamed(name) and name in e.message]
            if not unnamed:
                raise
            logger.warning("lmcache-mp: the server cannot open this process's shared memory through /proc (%s): "
                           "it gets a name in %s for good, which a killed process leaves behind (run the server "
                           "as the same user, in the same pid namespace)", e, shm.SHM_DIR)
            for name in unnamed:
                shm.keep_name(name)
            reply = (call or self._call)(msg, p.RegisterReply, max(self.timeout, 30.0))
        handle._apply(reply)
        if engine:
            self._engine.attach(handle)

    def unregister_kv_cache(self, handle: KVCacheHandle, timeout: float | None = None) -> None:
        with self._lock:
            if handle in self._handles:
                self._handles.remove(handle)
        if handle.closed:
            return
        self._engine.close_copiers([handle])  # its copies end (and commit) first
        handle.closed = True
        try:
            self._call(p.UnregisterKVCache(kv_id=handle.kv_id, client_id=self.client_id), p.UnregisterReply, timeout)
        except RequestError as e:
            if e.code != p.ErrorCode.UNKNOWN_REGISTRATION:
                raise

    # ---- store / retrieve --------------------------------------------------------------------

    def _request_args(self, handle: KVCacheHandle, hashes, block_ids, distinct: bool = False) -> tuple[bytes, bytes]:
        """Packed hashes and block ids. The engine-side path checks the ids here, before any slot
        is reserved (the server checks them for its own copies)."""
        if handle.closed:
            raise ValueError("this KV cache was unregistered")
        packed = pack_hashes(hashes)
        ids = p.pack_block_ids(block_ids)
        n = len(packed) // DIGEST_BYTES
        per_chunk = handle.chunk_size // handle.block_size
        if len(ids) // 4 != n * per_chunk:
            raise ValueError(f"{n} chunks of {handle.chunk_size} tokens need {n * per_chunk} block ids "
                             f"(blocks of {handle.block_size} tokens), got {len(ids) // 4}")
        if handle.copier is not None:
            request_block_ids(ids, n, per_chunk, handle.num_blocks, distinct)
        return packed, ids

    def store(self, handle: KVCacheHandle, hashes: bytes | Iterable[bytes], block_ids, *, salt: bytes = b"",
              stream: Any = None, timeout: float | None = None, parent: bytes = b"",
              shared: bool = False) -> "Future[StoreResult]":
        """Copy these chunks' blocks into the server. The future resolves once the bytes are in
        host memory (the blocks may then be reused). On CUDA the server first waits for the work
        queued so far on `stream` (default: the current stream), so the KV may still be in flight.

        `parent`: the hash of the prompt's chunk before the first one here, when the store names
        only a prompt's new chunks (an engine storing as the prompt grows). The server then writes
        them to L2 after it and only if it got there: an L2 lookup stops at the first miss, so a
        chunk whose prefix L2 lacks would be a fragment nobody can hit.

        The store's deadline is `timeout` seconds from now (default: the client's timeout): the
        server starts no copy after it and keeps none that ended after it (DEADLINE_EXCEEDED). So
        once the future has failed for its timeout, the blocks may be reused whatever the server
        does later: a stalled server that resumes never saves bytes the engine wrote since.

        `shared`: into the shared namespace every tenant that reads it finds (a server with
        tenants, whose tenants file lets this client's tenant write it; docs/tenants.md)."""
        self._check_reachable()
        stamps = [("call", time.monotonic_ns())] if self.trace else None
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout  # before the future's own expiry, which is armed later
        packed, ids = self._request_args(handle, hashes, block_ids)
        if parent and len(parent) != DIGEST_BYTES:
            raise ValueError(f"parent must be one {DIGEST_BYTES}-byte chunk hash, got {len(parent)} bytes")
        if handle.copier is not None:
            stream_ptr = self._stream_ptr(handle, stream) if handle.events is not None else 0
            return self._engine.store(handle, packed, ids, salt, stream_ptr, timeout, stamps, parent, shared)
        event, ev_handle, settled = None, b"", None
        if handle.events is not None:
            event, ev_handle = handle.events.record(self._stream_ptr(handle, stream))
            if event is not None:
                settled = lambda: handle.events.give_back(event)  # noqa: E731
        msg = p.Store(kv_id=handle.kv_id, hashes=packed, block_ids=ids, salt=salt, event=ev_handle,
                      client_id=self.client_id, deadline=deadline, parent=parent, shared=shared)

        def convert(reply: Any) -> StoreResult:
            r = self._checked(reply, p.StoreReply)
            return StoreResult(r.stored, r.present, r.skipped)

        return self._async(msg, timeout, convert, settled, stamps=stamps)

    def retrieve(self, handle: KVCacheHandle, hashes: bytes | Iterable[bytes], block_ids, *, salt: bytes = b"",
                 stream: Any = None, wait: str = "host", lease: int = 0, deadline: float | None = None,
                 scratch_blocks=None, timeout: float | None = None) -> "Future[RetrieveResult]":
        """Load the leading stored chunks into these blocks; result.loaded says how many.

        `lease`: the LookupResult (or its lease id) of the lookup that found them; this read
        consumes that lease's use of what it reads. `scratch_blocks`: block ids that may appear
        more than once in `block_ids`, where bytes go that nobody reads. `deadline` (a
        time.monotonic() value): no copy starts after it (DEADLINE_EXCEEDED instead). The future of a
        retrieve with a deadline does not time out here: it resolves once the server answered
        (or this client closed, or the server restarted), so a caller that gives up at the
        deadline can tell when the blocks are surely no longer written.
        CUDA: the server waits for the work queued so far on `stream` before writing. wait="host"
        resolves the future when the bytes are in the blocks; wait="stream" resolves it as soon as
        `stream` has been made to wait for the copy (the host never blocks on the copy)."""
        self._check_reachable()
        stamps = [("call", time.monotonic_ns())] if self.trace else None
        if wait not in ("host", "stream"):
            raise ValueError("wait must be 'host' or 'stream'")
        # (scratch blocks repeat: the engine-side check leaves distinctness to the server's own)
        packed, ids = self._request_args(handle, hashes, block_ids, distinct=scratch_blocks is None)
        if handle.copier is not None:
            stream_ptr = self._stream_ptr(handle, stream) if handle.events is not None else 0
            return self._engine.retrieve(handle, packed, ids, salt, stream_ptr, wait,
                                         int(getattr(lease, "lease", lease) or 0), deadline,
                                         self.timeout if timeout is None else timeout, stamps)
        event, ev_handle, settled, stream_ptr = None, b"", None, 0
        if handle.events is not None:
            stream_ptr = self._stream_ptr(handle, stream)
            event, ev_handle = handle.events.record(stream_ptr)
            if event is not None:
                settled = lambda: handle.events.give_back(event)  # noqa: E731
        early = wait == "stream" and handle.device == "cuda"
        msg = p.Retrieve(kv_id=handle.kv_id, hashes=packed, block_ids=ids, salt=salt, event=ev_handle,
                         reply_on_submit=early, lease=int(getattr(lease, "lease", lease) or 0),
                         deadline=float(deadline or 0.0), client_id=self.client_id,
                         scratch_blocks=p.pack_block_ids(scratch_blocks) if scratch_blocks is not None else b"")

        def convert(reply: Any) -> RetrieveResult:
            r = self._checked(reply, p.RetrieveReply)
            if early and r.event:
                from lmcache_mp import native

                dev = handle.described.device_index
                native.cuda.stream_wait_event(stream_ptr, self._opened.get(dev, r.event))
            return RetrieveResult(r.loaded)

        return self._async(msg, timeout, convert, settled, expires=deadline is None, stamps=stamps)

    @staticmethod
    def _stream_ptr(handle: KVCacheHandle, stream: Any) -> int:
        if stream is None:
            return current_stream(handle.described.device_index)
        return int(getattr(stream, "cuda_stream", stream))

    def _async(self, msg: p._Msg, timeout: float | None, convert, settled, expires: bool = True,
               stamps: list | None = None) -> Future:
        """stamps: the trace of a traced call, begun when it was called."""
        if self._closed or self._io is None:
            raise ServerUnavailable("the client is closed")
        return self._io.request(msg, self.timeout if timeout is None else timeout, convert, settled, expires, stamps)

    def _checked(self, reply: Any, expected: type) -> Any:
        if isinstance(reply, p.Error) and reply.code == p.ErrorCode.UNKNOWN_REGISTRATION:
            self._suspect_restart()
        return _check(reply, expected)

    # ---- closing -----------------------------------------------------------------------------

    def close(self) -> None:
        """Unregister every KV cache, drop this client's leases on the server, stop threads."""
        if self._closed:
            return
        with self._lock:
            handles = list(self._handles)
        self._engine.close_copiers(handles)  # this process's copies end (and commit) before the goodbye
        try:
            self._call(p.Bye(client_id=self.client_id), p.ByeReply, min(self.timeout, 0.5))
        except Exception as e:  # the server may be gone; its heartbeat timeout cleans up
            logger.debug("goodbye to %s failed: %s", self.url, e)
        with self._lock:
            for h in self._handles:
                h.closed = True
            self._handles.clear()
        self._closed = True
        self._finalizer.detach()
        stopped = self._io.stop() if self._io is not None else True  # a recovery's call in flight fails
        if not self._restarting.acquire(timeout=RECOVERY_STOP_S):
            logger.warning("a recovery of the connection to %s did not end; closing anyway", self.url)
        if stopped:
            self._close_sockets()
        self._engine.unmap()

    def _close_sockets(self) -> None:
        with self._lock:
            socks = list(self._sync_sockets)
            self._sync_sockets.clear()
        for s in socks:
            s.close(linger=0)
        self._ctx.destroy(linger=0)

    @staticmethod
    def _finalize(ref: weakref.ref, io: IOThread, ctx: zmq.Context, sockets: dict,
                  restarting: threading.Lock) -> None:
        """A client dropped without close(), or still open at exit. Its I/O thread stops first,
        which ends a recovery (whose calls it carries), then the sockets close, then the context;
        but never a socket another thread may be using (closing it aborts libzmq): at exit the
        client is alive, and a daemon thread may be inside a call on its socket. Those, and the
        context, are left to the end of the process."""
        client = ref()
        if client is not None:
            client._closed = True  # no new recovery or call starts
        stopped = io.stop()
        restarting.acquire(timeout=RECOVERY_STOP_S)
        me = threading.current_thread()
        idle = [s for s, t in list(sockets.items()) if client is None or t is me or not t.is_alive()]
        for s in idle:
            s.close(linger=0)
        if stopped and len(idle) == len(sockets):
            ctx.destroy(linger=0)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
