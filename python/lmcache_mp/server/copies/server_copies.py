"""Stores and retrieves the server copies itself (its CPU copy threads, or its GPU transfer
engine): the engine's `ServerCopies` part. A store's copy ends in host memory before its chunks are
committed; a retrieve's chunks are pinned for reading until the copy into the blocks ended.
Deadlines: no copy starts after a request's deadline, and a store whose copy ended after it
keeps nothing (the engine may have reused the blocks by then)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import numpy as np

from lmcache_mp import protocol as p
from lmcache_mp.config import ServerConfig
from lmcache_mp.keys import DIGEST_BYTES
from lmcache_mp.native import HostArena
from lmcache_mp.server import validation as check
from lmcache_mp.server.registry.clients import Clients
from lmcache_mp.server.registry.registrations import Entry, Registrations
from lmcache_mp.server.request import Request
from lmcache_mp.server.tenancy.tenancy import NoTenancy, Tenancy
from lmcache_mp.server.validation import RequestFailure, chunk_request, parent_key
from lmcache_mp.storage.l1 import L1Store
from lmcache_mp.storage.l2.tiers import L2Tiers

logger = logging.getLogger(__name__)

INLINE_CHUNKS = 64  # stores and retrieves of at most this many chunks may run on the socket thread
INLINE_CPU_BYTES = 256 << 10  # ... and on the CPU device, of at most this many bytes


class BytesMoved:
    """Bytes copied between KV caches and L1, by direction ("store", "retrieve")."""

    def __init__(self):
        self._lock = threading.Lock()
        self._moved = {"store": 0, "retrieve": 0}

    def count(self, direction: str, nbytes: int) -> None:
        with self._lock:
            self._moved[direction] += nbytes

    def snapshot(self) -> dict[str, int]:
        return dict(self._moved)


def check_deadline(msg: p.Retrieve | p.Store | p.Reserve | p.Read) -> None:
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


def check_open(entry: Entry) -> None:
    if entry.closed:
        raise RequestFailure(p.ErrorCode.UNKNOWN_REGISTRATION, "the KV cache was unregistered")


class ServerCopies:
    def __init__(self, config: ServerConfig, device: str, arena: HostArena, l1: L1Store, l2: L2Tiers | None,
                 registrations: Registrations, clients: Clients, moved: BytesMoved):
        self.config = config
        self.device = device
        self.arena = arena
        self.l1 = l1
        self.l2 = l2
        self.registrations = registrations
        self.clients = clients
        self.moved = moved
        self.tenancy: Tenancy | NoTenancy = NoTenancy()  # (MPCacheEngine.attach_tenancy)
        self._pinned = False  # the arena's background pinning has finished

    def _object_ptrs(self, objs) -> np.ndarray:
        base = self.arena.base
        return np.array([base + o.offset for o in objs], dtype=np.uint64)

    def store(self, request: Request) -> None:
        msg: p.Store = request.msg
        entry = self._server_entry(msg.kv_id, msg.client_id)
        entry.run(request.job(lambda: self._run_store(entry, msg, request)), self._cheap(entry, msg.hashes),
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

    def _server_entry(self, kv_id: int, client_id: bytes) -> Entry:
        entry = self.registrations.entry(kv_id, client_id)
        if entry.ctx.transfer_mode == "engine":
            raise RequestFailure(p.ErrorCode.INVALID_ARGUMENT, "this KV cache was registered for the engine's own "
                                 "copies: use RESERVE/COMMIT and READ/READ_DONE")
        return entry

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

    def _run_store(self, entry: Entry, msg: p.Store, request: Request) -> None:
        reply = request.reply
        request.mark("started")
        check_open(entry)
        reg = entry.ctx.reg
        keys, ids = chunk_request(reg, msg.hashes, msg.block_ids, msg.salt)
        parent = parent_key(reg, msg.parent, msg.salt)
        if msg.shared:
            shared = self.tenancy.shared_of(reg.model)
            keys, parent = check.shared_keys(shared, keys), parent and check.shared_keys(shared, [parent])[0]
        request.mark("checked")
        self.clients.touch(reg.client_id)
        check_deadline(msg)
        tp = reg.slice
        plan = self.l1.begin_store(keys, reg.object_bytes, reg.format_key, parent,
                                   *((tp.cover, tp.full) if tp is not None else ()))
        request.mark("in L1")
        if plan.skipped:
            logger.debug("store skipped %d chunks: no evictable memory", plan.skipped)

        def answer() -> None:  # once our bytes and those of the chunks others were writing landed
            def send(failed: int) -> None:
                self.moved.count("store", len(plan.objects) * reg.object_bytes)
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
        request.mark("planned")
        try:
            check_deadline(msg)  # the last moment before a byte may move
            if entry.store_done is None:
                entry.ctx.copy("gather", block_ids, ptrs, capacity)
                request.mark("copied")
            else:
                ticket = entry.ctx.submit("gather", block_ids, ptrs, capacity, msg.event)
                request.mark("submitted")

                def done(err: BaseException | None, stamps: tuple) -> None:
                    request.mark_all(stamps)
                    request.mark("copied")
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

    def retrieve(self, request: Request) -> None:
        msg: p.Retrieve = request.msg
        entry = self._server_entry(msg.kv_id, msg.client_id)
        entry.run(request.job(lambda: self._run_retrieve(entry, msg, request)), self._cheap(entry, msg.hashes),
                  limit=self.config.max_queued_requests)

    def read_objects(self, entry: Entry, msg: p.Retrieve | p.Read, request: Request, held: list | None,
                     again: Callable[[list], None], ids: list | None = None) -> list | None:
        """The leading stored objects of a retrieve or read, pinned for reading; None when what
        only L2 holds is being loaded first: `again(objs)` then runs the request once more (the
        chunks found in L1 and those loaded stay pinned meanwhile, and are the `held` of that
        run). ids: a list that receives the request's checked block ids (retrieves)."""
        request.mark("started")
        try:
            check_open(entry)
            reg = entry.ctx.reg
            if ids is None:
                keys = check.chunk_keys(reg, msg.hashes, msg.salt)
            else:
                keys, checked = chunk_request(reg, msg.hashes, msg.block_ids, msg.salt, distinct=True,
                                              scratch=msg.scratch_blocks)
                ids.append(checked)
            request.mark("checked")
            self.clients.touch(reg.client_id)
            check_deadline(msg)
            shared_model = self.tenancy.shared_of(reg.model)
            shared = check.shared_keys(shared_model, keys) if shared_model else None
            objs = self.l1.begin_read(keys, reg.format_key, msg.lease, shared)
            request.mark("in L1")
        finally:
            if held:
                self.l1.end_read(held)
        if held is None and self.l2 is not None and len(objs) < len(keys):
            # Load what L2 has, then run again (the chunks found in L1 and those loaded stay
            # pinned meanwhile); a remote tier is asked from the L2 reader thread, not from here.
            spare = shared[len(objs):] if shared else None
            if self.l2.remote:
                self.l2.load_keys(keys[len(objs):], lambda loaded: again(objs + loaded), spare)
                return None
            found = self.l2.find_keys(keys[len(objs):], spare)
            if found:
                self.l2.load(found, lambda loaded: again(objs + loaded))
                return None
        return objs

    def _run_retrieve(self, entry: Entry, msg: p.Retrieve, request: Request, held: list | None = None) -> None:
        """held: the objects an earlier run of this retrieve kept while L2 chunks were loaded."""
        def again(objs: list) -> None:
            entry.run(request.job(lambda: self._run_retrieve(entry, msg, request, held=objs)))

        reply = request.reply
        checked: list = []
        objs = self.read_objects(entry, msg, request, held, again, ids=checked)
        if objs is None:
            return
        reg = entry.ctx.reg
        if not objs:
            reply(p.RetrieveReply(loaded=0))
            return
        ids = checked[0]
        block_ids = ids[: len(objs)].reshape(-1)
        ptrs = self._object_ptrs(objs)
        request.mark("planned")
        try:
            check_deadline(msg)  # the last moment before a byte may move
            if entry.retrieve_done is None:
                entry.ctx.copy("scatter", block_ids, ptrs, objs[0].nbytes)
                request.mark("copied")
            else:
                early = msg.reply_on_submit
                ticket, handle = entry.ctx.submit("scatter", block_ids, ptrs, objs[0].nbytes, msg.event,
                                                  with_handle=True)
                request.mark("submitted")
                if early:
                    self.moved.count("retrieve", len(objs) * reg.object_bytes)
                    reply(p.RetrieveReply(loaded=len(objs), event=handle))

                def done(err: BaseException | None, stamps: tuple) -> None:
                    request.mark_all(stamps)
                    request.mark("copied")
                    self.l1.end_read(objs)
                    if err is not None:
                        logger.error("retrieve on model %s rank %d failed: %s", reg.model, reg.rank, err)
                    if early:
                        return
                    if err is None:
                        self.moved.count("retrieve", len(objs) * reg.object_bytes)
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
        self.moved.count("retrieve", len(objs) * reg.object_bytes)
        reply(p.RetrieveReply(loaded=len(objs)))
