"""The client's I/O thread: owns the asynchronous DEALER socket, matches replies to futures,
enforces per-request timeouts, and sends heartbeats.

Other threads hand requests over through a deque and an eventfd that the thread polls together
with the socket: no sleeps, and a request leaves as soon as it is queued.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import os
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import zmq

from lmcache_mp import protocol as p
from lmcache_mp.errors import ServerUnavailable

logger = logging.getLogger(__name__)

# Called on the I/O thread with the decoded reply; returns the future's result or raises.
Converter = Callable[[Any], Any]


def add_trace(stamps: list, frames: list) -> None:
    """Append the server's stages of a traced reply, then its arrival here."""
    if len(frames) == 3:
        try:
            stamps.extend(p.decode_trace(frames[2]))
        except Exception:
            logger.debug("ignored a malformed trace frame")
    stamps.append(("client received", time.monotonic_ns()))


class _Pending:
    __slots__ = ("future", "convert", "deadline", "what", "on_settled", "expires", "stamps")

    def __init__(self, future: Future, convert: Converter, deadline: float, what: str, on_settled, expires: bool,
                 stamps: list | None = None):
        self.future = future
        self.stamps = stamps  # a traced request's timestamps (also future.trace)
        self.convert = convert
        self.deadline = deadline  # to be sent by then; once sent, answered by then if `expires`
        self.what = what
        self.on_settled = on_settled
        self.expires = expires


class IOThread:
    def __init__(self, ctx: zmq.Context, url: str, heartbeat: Callable[[], tuple[p._Msg, Converter]] | None,
                 heartbeat_interval: float):
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue requests for a server that is not there
        self._sock.connect(url)
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # Writes after the fd is closed would land in whatever reuses its number (e.g. a ZMQ
        # mailbox eventfd, which then aborts the process): close and write under one lock.
        self._wake_lock = threading.Lock()
        self._wake_open = True
        self._inbox: collections.deque = collections.deque()
        self._unsent: collections.deque = collections.deque()  # queued until the socket connects
        self._pending: dict[int, _Pending] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._ids = itertools.count(1 << 62)  # apart from the sync sockets' ids
        self._heartbeat = heartbeat
        self._interval = heartbeat_interval
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="lmcache-client-io", daemon=True)
        self._thread.start()

    def request(self, msg: p._Msg, timeout: float, convert: Converter,
                on_settled: Callable[[], None] | None = None, expires: bool = True,
                stamps: list | None = None) -> Future:
        """Queue msg; the future gets convert(reply), or an error. on_settled runs once the
        request is answered, failed or timed out (e.g. to return a pooled event). expires=False:
        once sent, the request waits for its reply however long it takes (it still fails when
        it cannot be sent within `timeout`, when the client closes, or on fail_all). stamps: a
        list to trace the request in (the server's stages included), also set as future.trace."""
        fut: Future = Future()
        fut.trace = stamps
        if self._stop:
            fut.set_exception(ServerUnavailable("the client is closed"))
            return fut
        body = p.encode(msg)
        if len(body) > p.MAX_MESSAGE_BYTES:
            fut.set_exception(p.too_large(msg, len(body)))
            return fut
        rid = next(self._ids)
        self._inbox.append((rid, body, _Pending(fut, convert, time.monotonic() + timeout, type(msg).__name__,
                                                on_settled, expires, stamps)))
        self._wakeup()
        return fut

    def fail_all(self, error: BaseException) -> None:
        """Fail every request in flight (e.g. the server restarted and will never answer)."""
        self._inbox.append((None, None, error))
        self._wakeup()

    def _wakeup(self) -> None:
        with self._wake_lock:
            if self._wake_open:
                os.eventfd_write(self._wake, 1)

    # ---- on the I/O thread --------------------------------------------------------------------

    def _settle(self, pend: _Pending, result: Any = None, error: BaseException | None = None) -> None:
        if pend.on_settled is not None:
            try:
                pend.on_settled()
            except Exception:
                logger.exception("error returning resources of a %s request", pend.what)
        if pend.future.done():
            return
        if pend.stamps is not None:
            pend.stamps.append(("client resolved", time.monotonic_ns()))
        if error is not None:
            pend.future.set_exception(error)
        else:
            pend.future.set_result(result)

    def _send_queued(self) -> None:
        while self._inbox:
            item = self._inbox.popleft()
            if item[0] is None:  # fail_all marker
                error = item[2]
                for r, pd in list(self._pending.items()):
                    del self._pending[r]
                    self._settle(pd, error=error)
                while self._unsent:
                    self._settle(self._unsent.popleft()[2], error=error)
                continue
            self._unsent.append(item)
        while self._unsent:
            rid, body, pend = self._unsent[0]
            frames = (p.pack_request_id(rid), body) if pend.stamps is None else (p.pack_request_id(rid), body,
                                                                                  p.TRACE_FRAME)
            try:
                self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return  # not connected (yet): wait for the socket to become writable, or the deadline
            except zmq.ZMQError as e:
                self._unsent.popleft()
                self._settle(pend, error=ServerUnavailable(f"cannot send {pend.what}: {e}"))
                continue
            self._unsent.popleft()
            self._pending[rid] = pend
            if pend.stamps is not None:
                pend.stamps.append(("client sent", time.monotonic_ns()))
            if pend.expires:
                heapq.heappush(self._deadlines, (pend.deadline, rid))

    def _receive(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) not in (2, 3) or len(frames[0]) != 8:
                logger.warning("ignored a malformed reply from the server")
                continue
            pend = self._pending.pop(p.unpack_request_id(frames[0]), None)
            if pend is None:
                continue  # answered after its timeout
            if pend.stamps is not None:
                add_trace(pend.stamps, frames)
            try:
                result = pend.convert(p.decode_reply(frames[1]))
            except BaseException as e:
                self._settle(pend, error=e)
            else:
                self._settle(pend, result=result)

    def _expire(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, rid = heapq.heappop(self._deadlines)
            pend = self._pending.pop(rid, None)
            if pend is not None:
                self._settle(pend, error=ServerUnavailable(f"no reply to {pend.what} within its timeout"))
        if self._unsent and any(item[2].deadline <= now for item in self._unsent):
            keep = collections.deque()
            for item in self._unsent:
                if item[2].deadline <= now:
                    self._settle(item[2], error=ServerUnavailable(f"no server reachable to send {item[2].what}"))
                else:
                    keep.append(item)
            self._unsent = keep

    def _next_deadline(self, default: float) -> float:
        t = min(default, self._deadlines[0][0]) if self._deadlines else default
        return min([t] + [item[2].deadline for item in self._unsent])

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        next_beat = time.monotonic() + self._interval
        writable_wanted = False
        while not self._stop:
            if bool(self._unsent) != writable_wanted:  # wait for a connection only while needed
                writable_wanted = bool(self._unsent)
                poller.modify(self._sock, zmq.POLLIN | (zmq.POLLOUT if writable_wanted else 0))
            now = time.monotonic()
            wake_at = self._next_deadline(next_beat)
            ready = dict(poller.poll(max(0.0, wake_at - now) * 1000))
            if self._wake in ready:
                try:
                    os.eventfd_read(self._wake)
                except BlockingIOError:
                    pass
            self._send_queued()
            if ready.get(self._sock, 0) & zmq.POLLIN:
                self._receive()
            now = time.monotonic()
            self._expire(now)
            if now >= next_beat and self._heartbeat is not None:
                next_beat = now + self._interval
                beat = self._heartbeat()
                if beat is not None:
                    self.request(beat[0], self._interval * 2, beat[1])
        err = ServerUnavailable("the client is closed")
        for pend in list(self._pending.values()):
            self._settle(pend, error=err)
        for _rid, _body, pend in list(self._unsent) + list(self._inbox):
            if isinstance(pend, _Pending):
                self._settle(pend, error=err)
        self._sock.close(linger=0)
        with self._wake_lock:
            self._wake_open = False
            os.close(self._wake)

    def stop(self) -> None:
        self._stop = True
        self._wakeup()
        if threading.current_thread() is not self._thread:
            self._thread.join(5)
