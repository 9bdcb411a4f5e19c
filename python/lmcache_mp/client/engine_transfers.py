"""Stores and retrieves of KV caches registered with transfer="engine": this process copies.

A store asks the server for slots (RESERVE, one round trip), copies the chunks not stored yet
into them (client/engine_copy.py: on the GPU after the work queued so far on the caller's
stream, on streams of low priority), and then commits them (COMMIT): they become visible to
lookups only then. A retrieve asks where the leading stored chunks are (READ, which pins them on
the server), copies them into the blocks and lets them go (READ_DONE).

Deadlines: a store's reservation is asked for until its deadline (its timeout from now) and the
server reserves nothing after it; a reservation that arrives later is given back unused. Once
reserved, the copy is this process's own: its future fails only after the copy has ended, so
the blocks may be reused whenever the future is done, whatever the server does. A retrieve with
a deadline gives up on the READ at it (a late READ is let go at once); no byte is copied after.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import numpy as np

from lmcache_mp import protocol as p
from lmcache_mp.client.engine_copy import EngineCopier, MappedArena
from lmcache_mp.client.results import RetrieveResult, StoreResult
from lmcache_mp.errors import RequestError, ServerUnavailable
from lmcache_mp.layout import describe_layers

logger = logging.getLogger(__name__)


class CopyFuture(Future):
    """The future of a request this process copies: result() and exception() without a timeout
    wait for the copy on the calling thread (no hand-off from the completion thread, as a reply
    future reads its reply itself)."""

    def __init__(self):
        super().__init__()
        self.wait_here: Callable[[], bool] | None = None

    def _settle_here(self, timeout: float | None) -> None:
        wait, self.wait_here = self.wait_here, None
        if timeout is None and wait is not None and not self.done():
            wait()

    def result(self, timeout: float | None = None) -> Any:
        self._settle_here(timeout)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._settle_here(timeout)
        return super().exception(timeout)


class ArenaUse:
    """Counts the copies into a mapped arena, so that it is unmapped only once none runs."""

    def __init__(self, arena: MappedArena):
        self.arena = arena
        self._cv = threading.Condition()
        self._users = 0

    def acquire(self) -> MappedArena:
        with self._cv:
            self._users += 1
        return self.arena

    def release(self) -> None:
        with self._cv:
            self._users -= 1
            self._cv.notify_all()

    def close(self, timeout: float) -> None:
        with self._cv:
            if not self._cv.wait_for(lambda: self._users == 0, timeout):
                logger.warning("copies into the server's old L1 mapping did not end; it stays mapped")
                return
        self.arena.close()


class EngineTransfers:
    """The engine-side copies of one Client: its mapping of the server's L1 and each handle's copier."""

    def __init__(self, client):
        self._client = client
        self._lock = threading.Lock()
        self._use: ArenaUse | None = None
        self._commits: set[Future] = set()  # sent, not answered yet

    # ---- the mapping -------------------------------------------------------------------------

    def arena(self) -> ArenaUse:
        """The current session's mapping of L1 (mapped on first use, and again after a restart)."""
        c = self._client
        with self._lock:
            use = self._use
            if use is not None and use.arena.session_id == c.session_id:
                return use
            lane = c.server_info.get("lane", "")
            if not lane or "engine_copy" not in c.server_info.get("capabilities", ()):
                raise RequestError(int(p.ErrorCode.UNSUPPORTED), "the server offers no engine-side copies here "
                                   "(no local lane reachable: another machine or network namespace, or CURVE "
                                   "without tenants)")
            self._use = ArenaUse(MappedArena(lane, c.client_id, c.timeout, c.server_info.get("lane_ticket", b"")))
        if use is not None:  # the old session's mapping, once its last copy ended
            threading.Thread(target=use.close, args=(60.0,), name="lmcache-client-unmap", daemon=True).start()
        return self._use

    def attach(self, handle) -> None:
        """Give a handle registered for engine-side copies its copier (after registering)."""
        c = self._client
        d = handle.described
        # The server derived its format from the same description: a packed cache here is one there
        spec = describe_layers(d.layers, handle.requested_layout, handle.requested_block_size or None)
        if spec.kind != handle.layout or spec.object_bytes(handle.chunk_size) != handle.object_bytes:
            raise RequestError(int(p.ErrorCode.INTERNAL), f"the server's chunk objects are {handle.layout}, "
                               f"{handle.object_bytes} bytes; this cache's {spec.kind}, "
                               f"{spec.object_bytes(handle.chunk_size)} bytes")
        use = self.arena()
        old = handle.copier
        handle.copier = EngineCopier(spec, handle.tensors, handle.chunk_size, d.device_index, handle.object_bytes,
                                     handle.staging_bytes, handle.pack_ctas)
        if old is not None:
            old.close()
        if d.device == "cuda":
            use.arena.use_device(d.device_index)

    def pin_all(self) -> None:
        with self._lock:
            use = self._use
        if use is not None:
            use.arena.pin_all()

    def close_copiers(self, handles, timeout: float = 10.0) -> None:
        """Wait for every copy of these handles and for the commits they sent, then free them."""
        for h in handles:
            if h.copier is not None:
                h.copier.close()
                h.copier = None
        with self._lock:
            commits = list(self._commits)
        cf.wait(commits, timeout)

    def unmap(self) -> None:
        with self._lock:
            use, self._use = self._use, None
        if use is not None:
            use.close(60.0)

    # ---- stores ------------------------------------------------------------------------------

    def store(self, handle, packed: bytes, ids: bytes, salt: bytes, stream_ptr: int, timeout: float,
              stamps: list | None, parent: bytes = b"", shared: bool = False) -> Future:
        c = self._client
        out = CopyFuture()
        out.trace = stamps  # the request's stages when traced (its RESERVE's), as other futures have
        deadline = time.monotonic() + timeout
        event = None
        if handle.events is not None:
            event, _ = handle.events.record(stream_ptr)
        msg = p.Reserve(kv_id=handle.kv_id, hashes=packed, client_id=c.client_id, salt=salt, deadline=deadline,
                        parent=parent, shared=shared)
        reserving = c._async(msg, timeout, lambda r: c._checked(r, p.ReserveReply), None, expires=False,
                             stamps=stamps)
        try:
            r = reserving.result(max(0.0, deadline - time.monotonic()))
        except cf.TimeoutError:
            reserving.add_done_callback(self._give_back)  # a reservation that comes later goes unused
            self._fail(out, handle, event, ServerUnavailable(f"no reservation for a store within {timeout:.3g} s"))
            return out
        except BaseException as e:  # noqa: BLE001 - the future carries it
            self._fail(out, handle, event, e)
            return out
        if not r.reservation:
            self._fail(out, handle, event, None, StoreResult(0, r.present, r.skipped))
            return out
        use = None
        try:
            if r.object_bytes != handle.object_bytes:
                raise RequestError(int(p.ErrorCode.INTERNAL), "the server's objects are of another size")
            chunks = p.unpack_block_ids(r.chunks)
            bpc = handle.chunk_size // handle.block_size
            block_ids = np.frombuffer(ids, dtype=p.BLOCK_ID_DTYPE).reshape(-1, bpc)[chunks].reshape(-1)
            use = self.arena()
            arena = use.acquire()
            offsets = p.unpack_offsets(r.offsets)
            arena.ensure_pinned(offsets)
            ptrs = arena.pointers(offsets, r.object_bytes)
        except BaseException as e:  # noqa: BLE001 - the slots go back, the future carries the error
            if use is not None:
                use.release()
            self._give_back(reserving)
            self._fail(out, handle, event, e)
            return out

        def landed(error: BaseException | None) -> None:
            use.release()
            if event is not None:
                handle.events.give_back(event)
            if error is not None:
                self._give_back(reserving)
                out.set_exception(RequestError(int(p.ErrorCode.DEVICE_ERROR), f"the store's copy failed: {error}"))
                return
            # Resolved once committed, so that any client's lookup sees the chunks then (on the
            # thread that waits for the copy: its result() or the completion thread).
            try:
                done = self._commit(r.reservation, True).result()
            except BaseException as e:  # noqa: BLE001 - the copy ended: the blocks are free either way
                out.set_exception(e)
                return
            out.set_result(StoreResult(done.stored, done.present, done.skipped))

        try:
            out.wait_here = handle.copier.copy("gather", block_ids, ptrs, landed,
                                               wait_event=event[0] if event else 0)
        except BaseException as e:  # noqa: BLE001 - refused before anything was queued
            landed(e)
        return out

    def _commit(self, reservation: int, ok: bool) -> Future:
        """Commit (or give back) a reservation; the future of its reply (a failure is logged)."""
        c = self._client

        def answered(fut: Future) -> None:
            with self._lock:
                self._commits.discard(fut)
            if fut.exception() is not None:
                logger.warning("lmcache-mp: a commit of an engine-side store failed (%s); its chunks are not on "
                               "the server", fut.exception())

        fut = c._async(p.Commit(client_id=c.client_id, reservation=reservation, ok=ok), c.timeout,
                       lambda r: c._checked(r, p.CommitReply), None)
        with self._lock:
            self._commits.add(fut)
        fut.add_done_callback(answered)
        return fut

    def _give_back(self, reserving: Future) -> None:
        if reserving.exception() is None and reserving.result().reservation:
            try:
                self._commit(reserving.result().reservation, False)
            except ServerUnavailable as e:  # closed meanwhile: the server gives it back once we are gone
                logger.debug("a reservation could not be given back: %s", e)

    @staticmethod
    def _fail(out: Future, handle, event, error: BaseException | None, result: Any = None) -> None:
        if event is not None:
            handle.events.give_back(event)
        if error is not None:
            out.set_exception(error)
        else:
            out.set_result(result)

    # ---- retrieves ---------------------------------------------------------------------------

    def retrieve(self, handle, packed: bytes, ids: bytes, salt: bytes, stream_ptr: int, wait: str, lease: int,
                 deadline: float | None, timeout: float, stamps: list | None) -> Future:
        c = self._client
        out = CopyFuture()
        out.trace = stamps  # (its READ's stages when traced)
        end = deadline if deadline else time.monotonic() + timeout
        msg = p.Read(kv_id=handle.kv_id, hashes=packed, client_id=c.client_id, salt=salt, lease=lease)
        reading = c._async(msg, timeout, lambda r: c._checked(r, p.ReadReply), None, expires=False, stamps=stamps)
        try:
            r = reading.result(max(0.0, end - time.monotonic()))
        except cf.TimeoutError:
            reading.add_done_callback(self._let_go)  # no byte is copied after the deadline
            if deadline:
                out.set_exception(RequestError(int(p.ErrorCode.DEADLINE_EXCEEDED), "the server did not say where "
                                               "the chunks are before the deadline; nothing was written"))
            else:
                out.set_exception(ServerUnavailable(f"no reply to Read within {timeout:.3g} s"))
            return out
        except BaseException as e:  # noqa: BLE001 - the future carries it
            out.set_exception(e)
            return out
        offsets = p.unpack_offsets(r.offsets)
        n = len(offsets)
        if not r.read:
            out.set_result(RetrieveResult(0))
            return out
        event, use = None, None
        try:
            if r.object_bytes != handle.object_bytes:
                raise RequestError(int(p.ErrorCode.INTERNAL), "the server's objects are of another size")
            bpc = handle.chunk_size // handle.block_size
            block_ids = np.frombuffer(ids, dtype=p.BLOCK_ID_DTYPE)[: n * bpc]
            use = self.arena()
            arena = use.acquire()
            arena.ensure_pinned(offsets)
            ptrs = arena.pointers(offsets, r.object_bytes)
            if handle.events is not None:
                event, _ = handle.events.record(stream_ptr)  # the blocks' earlier work comes first
        except BaseException as e:  # noqa: BLE001
            if use is not None:
                use.release()
            self._read_done(r.read)
            out.set_exception(e)
            return out
        early = wait == "stream" and handle.copier.cuda

        def copied(error: BaseException | None) -> None:
            use.release()
            if event is not None:
                handle.events.give_back(event)
            self._read_done(r.read)
            if error is not None:
                logger.error("a retrieve's copy failed: %s", error)
            if out.done():
                return
            if error is not None:
                out.set_exception(RequestError(int(p.ErrorCode.DEVICE_ERROR), f"the retrieve's copy failed: {error}"))
            else:
                out.set_result(RetrieveResult(n))

        try:
            wait_here = handle.copier.copy("scatter", block_ids, ptrs, copied, wait_event=event[0] if event else 0,
                                           then_stream=stream_ptr if early else 0)
        except BaseException as e:  # noqa: BLE001 - refused before anything was queued
            copied(e)
            return out
        if early and not out.done():
            out.set_result(RetrieveResult(n))  # the caller's stream waits for the copy
        else:
            out.wait_here = wait_here
        return out

    def _read_done(self, read: int) -> None:
        c = self._client

        def done(fut: Future) -> None:
            if fut.exception() is not None:
                logger.debug("finishing a read failed (%s): the server lets it go with this client",
                             fut.exception())

        c._async(p.ReadDone(client_id=c.client_id, read=read), c.timeout,
                 lambda r: c._checked(r, p.ReadDoneReply), None).add_done_callback(done)

    def _let_go(self, reading: Future) -> None:
        if reading.exception() is None and reading.result().read:
            self._read_done(reading.result().read)
