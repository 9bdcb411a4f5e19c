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
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from typing import Callable

import numpy as np

from lmcache_mp import protocol as p
from lmcache_mp._version import __version__
from lmcache_mp.keys import DIGEST_BYTES
from lmcache_mp.config import ServerConfig, format_size
from lmcache_mp.native import HostArena, set_cpu_threads
from lmcache_mp.server.contexts import IpcEventCache, IpcMemoryCache
from lmcache_mp.server.devices import gpu_numa_node, resolve_device
from lmcache_mp.server.gc_pauses import GCPauses, made_long_lived
from lmcache_mp.server import event_feed
from lmcache_mp.server import validation as check
from lmcache_mp.server.validation import RequestFailure, chunk_request, over_limit
from lmcache_mp.server.engine_copies import EngineCopies
from lmcache_mp.server.registrations import Entry, RegistrationHandling
from lmcache_mp.server.replies import Reply, mark, mark_all
from lmcache_mp.server.workers import SerialWorker
from lmcache_mp.storage.events import EventLog
from lmcache_mp.storage.l1 import L1Store
from lmcache_mp.storage.l1_journal import L1Journal
from lmcache_mp.storage.l2.tiers import L2Tiers
from lmcache_mp.storage.leases import TooManyLeases

logger = logging.getLogger(__name__)

INLINE_LOOKUP_KEYS = 2048  # lookups of at most this many keys (hashes x ranks) run on the socket thread
INLINE_CHUNKS = 64  # stores and retrieves of at most this many chunks may run on the socket thread
INLINE_CPU_BYTES = 256 << 10  # ... and on the CPU device, of at most this many bytes


class MPCacheEngine(RegistrationHandling, EngineCopies):
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
        self.l1 = L1Store(self.arena)
        self.l1.on_commit = made_long_lived  # (a no-op unless this process is only a server)
        self.events = EventLog(config.kv_events)
        self.l1.events = self.events if config.kv_events else None
        if journal is not None:
            self._reattach(journal)
        self.l2 = self._open_l2(config)
        self._lock = threading.Lock()
        self._entries: dict[int, Entry] = {}
        self._clients: dict[bytes, float] = {}  # client id -> last time heard from
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
        logger.info(
            "L1: %s of %s host memory (slabs of %s%s)",
            format_size(self.arena.capacity), "pinned" if pin else "shared",
            format_size(self.arena.slab_bytes), f", NUMA node {numa}" if numa >= 0 else "",
        )

    def _open_l2(self, config: ServerConfig) -> L2Tiers | None:
        """The L2 tiers, nearest first: the local disk, then a shared Valkey/Redis server, then Mooncake."""
        tiers, writes = [], []
        if config.l2_disk:
            from lmcache_mp.storage.l2.disk import DiskTier

            try:
                tiers.append(DiskTier(config.l2_disk, config.l2_disk_size, config.l2_io_threads))
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
        logger.debug("hello from %s (pid %d)", msg.client_name or msg.client_id.hex(), msg.pid)
        reply(p.HelloReply(protocol_version=p.PROTOCOL_VERSION, server_version=__version__,
                           session_id=self.session_id, chunk_size=self.config.chunk_size, device=self.device,
                           capabilities=["lookup_lock", "reply_on_submit", "named_leases", "deadlines",
                                         "engine_copy"],
                           lease_ttl=self.config.lease_ttl, lane=self.lane))

    def _ping(self, msg: p.Ping, reply: Reply) -> None:
        self._touch(check.client_id(msg.client_id, required=False))
        reply(p.PingReply(session_id=self.session_id))

    def _status(self, msg: p.Status, reply: Reply) -> None:
        status = self.status()
        if msg.client_id:
            with self._lock:
                status["mine"] = [kv for kv, e in self._entries.items() if e.ctx.reg.client_id == msg.client_id]
        reply(p.StatusReply(status=status))

    def _events_since(self, msg: p.Events, reply: Reply) -> None:
        self._touch(check.client_id(msg.client_id, required=False))
        reply(event_feed.answer(self.events, self.session_id, msg))

    def _clear(self, msg: p.Clear, reply: Reply) -> None:
        self._bulk.submit(self._job(reply, lambda: reply(p.ClearReply(removed=self.clear()))))

    # ---- store / retrieve --------------------------------------------------------------------

    def _object_ptrs(self, objs) -> np.ndarray:
        base = self.arena.base
        return np.array([base + o.offset for o in objs], dtype=np.uint64)

    def store(self, msg: p.Store, reply: Reply) -> None:
        entry = self._server_entry(msg.kv_id, msg.client_id)
        entry.run(self._job(reply, lambda: self._run_store(entry, msg, reply)), self._cheap(entry, msg.hashes),
                  limit=self.config.max_queued_requests)

    def _cheap(self, entry: Entry, hashes: bytes) -> bool:
        """Whether a store or retrieve may run on the socket thread (when its registration is idle):
        on the GPU it only enqueues the copy; on the CPU device it copies, so only small ones."""
        chunks = len(hashes) // DIGEST_BYTES
        if chunks > INLINE_CHUNKS:
            return False
        if self.device == "cpu":
            return chunks * entry.ctx.reg.object_bytes <= INLINE_CPU_BYTES
        if not self._pinned:  # pinning holds the driver for a slab at a time: not on the socket thread
            self._pinned = bool(self.arena.pin_status()["done"])
        return self._pinned

    @staticmethod
    def _check_open(entry: Entry) -> None:
        if entry.closed:
            raise RequestFailure(p.ErrorCode.UNKNOWN_REGISTRATION, "the KV cache was unregistered")

    def _server_entry(self, kv_id: int, client_id: bytes) -> Entry:
        entry = self._entry(kv_id, client_id)
        if entry.ctx.transfer_mode == "engine":
            raise RequestFailure(p.ErrorCode.INVALID_ARGUMENT, "this KV cache was registered for the engine's own "
                                 "copies: use RESERVE/COMMIT and READ/READ_DONE")
        return entry

    @staticmethod
    def _check_deadline(msg: p.Retrieve | p.Store | p.Reserve | p.Read) -> None:
        """A worker gives up on a request at its deadline and the engine may reuse the blocks: no
        copy may start after it."""
        deadline = getattr(msg, "deadline", 0.0)
        if deadline and time.monotonic() > deadline:
            late = time.monotonic() - deadline
            if isinstance(msg, (p.Store, p.Reserve)):
                raise RequestFailure(p.ErrorCode.DEADLINE_EXCEEDED,
                                     f"the store's deadline passed {late:.3f} s ago; nothing was stored")
            raise RequestFailure(p.ErrorCode.DEADLINE_EXCEEDED,
                                 f"the retrieve's deadline passed {late:.3f} s ago; nothing was written")

    @staticmethod
    def _ended_late(msg: p.Store) -> RequestFailure | None:
        """A store's copy that ended after its deadline may have read blocks the engine had reused
        by then (the server stalled mid-copy): its bytes are not kept. The check comes after the
        copy is known to have ended, on the clock the client's deadline is on."""
        if msg.deadline and time.monotonic() > msg.deadline:
            return RequestFailure(p.ErrorCode.DEADLINE_EXCEEDED,
                                  f"the store's copy ended {time.monotonic() - msg.deadline:.3f} s after its "
                                  "deadline; nothing was kept")
        return None

    def _run_store(self, entry: Entry, msg: p.Store, reply: Reply) -> None:
        mark(reply, "started")
        self._check_open(entry)
        reg = entry.ctx.reg
        keys, ids = chunk_request(reg, msg.hashes, msg.block_ids, msg.salt)
        mark(reply, "checked")
        self._touch(reg.client_id)
        self._check_deadline(msg)
        plan = self.l1.begin_store(keys, reg.object_bytes, reg.format_key)
        mark(reply, "in L1")
        if plan.skipped:
            logger.debug("store skipped %d chunks: no evictable memory", plan.skipped)

        def answer() -> None:  # once our bytes and those of the chunks others were writing landed
            def send(failed: int) -> None:
                self._count_moved("store", len(plan.objects) * reg.object_bytes)
                reply(p.StoreReply(stored=len(plan.objects), present=plan.present + len(plan.pending) - failed,
                                   skipped=plan.skipped + failed))

            self.l1.when_written(plan.pending, send)

        def fail(err: BaseException, code: p.ErrorCode) -> None:
            self.l1.abort(plan)
            if code == p.ErrorCode.DEVICE_ERROR:
                logger.error("store on model %s rank %d failed: %s", reg.model, reg.rank, err)
            elif code == p.ErrorCode.DEADLINE_EXCEEDED:  # the server was stalled: its log says more
                logger.debug("store on model %s rank %d: %s", reg.model, reg.rank, err)
            reply(p.Error(code=int(code), message=str(err)))

        def landed() -> None:
            late = self._ended_late(msg)
            if late is not None:
                fail(late, late.code)
                return
            self.l1.commit(plan)
            answer()

        if not plan.objects:
            answer()
            return
        block_ids = (ids if len(plan.indices) == len(ids) else ids[plan.indices]).reshape(-1)
        ptrs = self._object_ptrs(plan.objects)
        capacity = plan.objects[0].nbytes
        mark(reply, "planned")
        try:
            self._check_deadline(msg)  # the last moment before a byte may move
            if entry.store_done is None:
                entry.ctx.copy("gather", block_ids, ptrs, capacity)
                mark(reply, "copied")
            else:
                ticket = entry.ctx.submit("gather", block_ids, ptrs, capacity, msg.event)
                mark(reply, "submitted")

                def done(err: BaseException | None, stamps: tuple) -> None:
                    mark_all(reply, stamps)
                    mark(reply, "copied")
                    if err is not None:
                        fail(err, p.ErrorCode.DEVICE_ERROR)
                        return
                    landed()

                entry.store_done.add(ticket, done)
                return
        except RequestFailure as e:
            fail(e, e.code)
            return
        except ValueError as e:
            fail(e, p.ErrorCode.INVALID_ARGUMENT)
            return
        except Exception as e:
            fail(e, p.ErrorCode.DEVICE_ERROR)
            return
        landed()

    def retrieve(self, msg: p.Retrieve, reply: Reply) -> None:
        entry = self._server_entry(msg.kv_id, msg.client_id)
        entry.run(self._job(reply, lambda: self._run_retrieve(entry, msg, reply)), self._cheap(entry, msg.hashes),
                  limit=self.config.max_queued_requests)


    def _read_objects(self, entry: Entry, msg: p.Retrieve | p.Read, reply: Reply, held: list | None,
                      again: Callable[[list], None], ids: list | None = None) -> list | None:
        """The leading stored objects of a retrieve or read, pinned for reading; None when what
        only L2 holds is being loaded first: `again(objs)` then runs the request once more (the
        chunks found in L1 and those loaded stay pinned meanwhile, and are the `held` of that
        run). ids: a list that receives the request's checked block ids (retrieves)."""
        mark(reply, "started")
        try:
            self._check_open(entry)
            reg = entry.ctx.reg
            if ids is None:
                keys = check.chunk_keys(reg, msg.hashes, msg.salt)
            else:
                keys, checked = chunk_request(reg, msg.hashes, msg.block_ids, msg.salt, distinct=True,
                                              scratch=msg.scratch_blocks)
                ids.append(checked)
            mark(reply, "checked")
            self._touch(reg.client_id)
            self._check_deadline(msg)
            objs = self.l1.begin_read(keys, reg.format_key, msg.lease)
            mark(reply, "in L1")
        finally:
            if held:
                self.l1.end_read(held)
        if held is None and self.l2 is not None and len(objs) < len(keys):
            # Load what L2 has, then run again (the chunks found in L1 and those loaded stay
            # pinned meanwhile); a remote tier is asked from the L2 reader thread, not from here.
            if self.l2.remote:
                self.l2.load_keys(keys[len(objs):], lambda loaded: again(objs + loaded))
                return None
            found = self.l2.find_keys(keys[len(objs):])
            if found:
                self.l2.load(found, lambda loaded: again(objs + loaded))
                return None
        return objs

    def _run_retrieve(self, entry: Entry, msg: p.Retrieve, reply: Reply, held: list | None = None) -> None:
        """held: the objects an earlier run of this retrieve kept while L2 chunks were loaded."""
        def again(objs: list) -> None:
            entry.run(self._job(reply, lambda: self._run_retrieve(entry, msg, reply, held=objs)))

        checked: list = []
        objs = self._read_objects(entry, msg, reply, held, again, ids=checked)
        if objs is None:
            return
        reg = entry.ctx.reg
        if not objs:
            reply(p.RetrieveReply(loaded=0))
            return
        ids = checked[0]
        block_ids = ids[: len(objs)].reshape(-1)
        ptrs = self._object_ptrs(objs)
        mark(reply, "planned")
        try:
            self._check_deadline(msg)  # the last moment before a byte may move
            if entry.retrieve_done is None:
                entry.ctx.copy("scatter", block_ids, ptrs, objs[0].nbytes)
                mark(reply, "copied")
            else:
                early = msg.reply_on_submit
                ticket, handle = entry.ctx.submit("scatter", block_ids, ptrs, objs[0].nbytes, msg.event,
                                                  with_handle=True)
                mark(reply, "submitted")
                if early:
                    self._count_moved("retrieve", len(objs) * reg.object_bytes)
                    reply(p.RetrieveReply(loaded=len(objs), event=handle))

                def done(err: BaseException | None, stamps: tuple) -> None:
                    mark_all(reply, stamps)
                    mark(reply, "copied")
                    self.l1.end_read(objs)
                    if err is not None:
                        logger.error("retrieve on model %s rank %d failed: %s", reg.model, reg.rank, err)
                    if early:
                        return
                    if err is None:
                        self._count_moved("retrieve", len(objs) * reg.object_bytes)
                        reply(p.RetrieveReply(loaded=len(objs)))
                    else:
                        reply(p.Error(code=int(p.ErrorCode.DEVICE_ERROR), message=str(err)))

                entry.retrieve_done.add(ticket, done)
                return
        except RequestFailure:
            self.l1.end_read(objs)
            raise
        except Exception as e:
            self.l1.end_read(objs)
            code = p.ErrorCode.INVALID_ARGUMENT if isinstance(e, ValueError) else p.ErrorCode.DEVICE_ERROR
            logger.error("retrieve on model %s rank %d failed: %s", reg.model, reg.rank, e)
            reply(p.Error(code=int(code), message=str(e)))
            return
        self.l1.end_read(objs)
        self._count_moved("retrieve", len(objs) * reg.object_bytes)
        reply(p.RetrieveReply(loaded=len(objs)))

    def _count_moved(self, direction: str, nbytes: int) -> None:
        with self._moved_lock:
            self.moved[direction] += nbytes

    # ---- lookup and leases -------------------------------------------------------------------

    def lookup(self, msg: p.Lookup, reply: Reply) -> None:
        cost = check.lookup_cost(msg)
        self._touch(msg.client_id)

        def run() -> None:
            digests = check.digests(msg.hashes)
            try:
                hits, lease = self.l1.lookup(msg.model, msg.world_size, digests, msg.salt,
                                             lock=msg.lock, owner=msg.client_id, ttl=self.config.lease_ttl)
            except TooManyLeases as e:
                raise over_limit(str(e)) from None
            if self.l2 is not None and hits < len(digests):
                if self.l2.remote:  # network round trips: off the socket thread, within the deadline
                    self._lookup_remote(msg, digests, hits, lease, reply)
                else:
                    self._lookup_l2(msg, digests, hits, lease, reply)
            else:
                reply(p.LookupReply(hits=hits, lease=lease))

        if cost <= INLINE_LOOKUP_KEYS:
            run()
        else:
            self._bulk.submit(self._job(reply, run))

    def _lookup_remote(self, msg: p.Lookup, digests: list[bytes], hits: int, lease: int, reply: Reply) -> None:
        def found_in_l2(n: int | None) -> None:  # None: not known by the deadline
            if msg.lock:
                self._answer_leased(msg, digests, hits, lease, reply)
            else:
                reply(p.LookupReply(hits=hits + (n or 0), lease=0))

        self.l2.lookup_remote(lambda: self.l2.find(msg.model, msg.world_size, digests[hits:], msg.salt), msg.lock,
                              found_in_l2)

    def _answer_leased(self, msg: p.Lookup, digests: list[bytes], hits: int, lease: int, reply: Reply) -> None:
        """The reply of a lookup with lock once its L2 chunks were brought in (or its deadline
        passed): the leading chunks in L1 now, leased."""
        try:
            if lease:
                more, still = self.l1.lookup(msg.model, msg.world_size, digests[hits:], msg.salt, extend=lease)
                reply(p.LookupReply(hits=hits + more if still else 0, lease=still))
            else:
                got, new = self.l1.lookup(msg.model, msg.world_size, digests, msg.salt, lock=True,
                                          owner=msg.client_id, ttl=self.config.lease_ttl)
                reply(p.LookupReply(hits=got, lease=new))
        except TooManyLeases as e:
            reply(p.Error(code=int(p.ErrorCode.LIMIT_EXCEEDED), message=str(e)))
        except Exception as e:
            logger.exception("internal error answering a lookup after its prefetch")
            reply(p.Error(code=int(p.ErrorCode.INTERNAL), message=f"internal error: {e}"))

    def _lookup_l2(self, msg: p.Lookup, digests: list[bytes], hits: int, lease: int, reply: Reply) -> None:
        """The lookup goes on into L2 after the L1 prefix. Without lock it counts what L2 holds
        (a retrieve loads it); with lock the L2 chunks are loaded into L1 and the reply, which
        leases what is resident, waits until they are in or the prefetch deadline passed."""
        found = self.l2.find(msg.model, msg.world_size, digests[hits:], msg.salt)
        if not found:
            reply(p.LookupReply(hits=hits, lease=lease))
            return
        if not msg.lock:
            reply(p.LookupReply(hits=hits + len(found), lease=0))
            return

        def answer() -> None:
            self._answer_leased(msg, digests, hits, lease, reply)

        if not self.l2.prefetch(found, answer):
            reply(p.LookupReply(hits=hits, lease=lease))

    def release(self, msg: p.Release, reply: Reply) -> None:
        self._touch(check.client_id(msg.client_id))
        check.count_digests(msg.hashes)

        def run() -> None:
            digests = check.digests(msg.hashes) if msg.hashes else None
            reply(p.ReleaseReply(released=self.l1.release(msg.lease, digests)))

        self._bulk.submit(self._job(reply, run))

    def clear(self) -> int:
        removed = self.l1.clear()
        logger.info("cleared %d objects", removed)
        return removed

    def get_chunk_size(self) -> int:
        return self.config.chunk_size

    # ---- housekeeping ------------------------------------------------------------------------

    def _forget_client(self, client: bytes) -> tuple[int, int]:
        """Drop a client's leases and registrations; returns how many of each."""
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

    def tick(self) -> None:
        """Expire leases; forget clients that stopped sending heartbeats, with their leases and
        registrations (called about twice a second by the transport; the work itself runs on
        the housekeeping thread)."""
        deadline = time.monotonic() - self.config.heartbeat_timeout
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
                 "model": e.ctx.reg.model, "rank": e.ctx.reg.rank, "world_size": e.ctx.reg.world_size,
                 "layout": e.ctx.reg.spec.kind, "device": e.ctx.device, "transfer_mode": e.ctx.transfer_mode,
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
        for hook in self._close_hooks:  # e.g. stop the transport once the last replies are out
            hook()
        self.gc_pauses.close()

    _handlers = {
        p.Hello: _hello,
        p.Ping: _ping,
        p.Status: _status,
        p.Clear: _clear,
        p.Events: _events_since,
        p.RegisterKVCache: RegistrationHandling.register_kv_cache,
        p.UnregisterKVCache: RegistrationHandling.unregister_kv_cache,
        p.Store: store,
        p.Retrieve: retrieve,
        p.Lookup: lookup,
        p.Release: release,
        p.Bye: _bye,
        p.MapArena: EngineCopies._map_arena,
        p.Reserve: EngineCopies._reserve,
        p.Commit: EngineCopies._commit,
        p.Read: EngineCopies._read,
        p.ReadDone: EngineCopies._read_done,
    }
