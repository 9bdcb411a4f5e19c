"""The client's asynchronous requests: one DEALER socket, replies matched to futures, per-request
timeouts, heartbeats.

A request leaves from the calling thread. Its reply is read by whoever gets to it first: the
thread that waits on the future (`result()` reads the socket itself, so a request that is waited
for costs no hand-off between threads) or the I/O thread, which serves futures nobody waits on
(callbacks, `concurrent.futures.wait`, polling), timeouts and heartbeats. The socket is used under
a lock; threads sleep on its fd (never on the socket), which signals edges, so each asks the
socket before it sleeps.

The I/O thread sleeps in an epoll set, and watches the sockets only while no other thread reads
them: a thread that reads for its own reply takes them out of the set (the I/O thread would only
wake up to hand the reply over, and take the GIL from the reader), and the last one to leave puts
them back if requests are in flight. A request sent while nobody reads puts them in: a caller
that waits with result() takes them out again within microseconds of its send, before any reply
can come (tens of microseconds at the earliest), so a future nobody reads for resolves when its
reply comes, and one that is waited for wakes the I/O thread for nothing. Synchronous calls, which
read from before their send (call()), touch neither. epoll applies these changes to the thread
sleeping on it: none costs a wake-up.

One module over 450 lines: the sends, the reads of a waiting thread and the I/O thread's loop share
one socket, one lock and one table of pending requests, in the order reasoned about above (the
local lane is client/lane.py, the futures client/futures.py).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import math
import os
import select
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from lmcache_mp import protocol as p
from lmcache_mp.client.futures import Converter, Heartbeat, Pending, ReplyFuture, Waker, add_trace
from lmcache_mp.client.lane import ClientLane
from lmcache_mp.errors import ServerUnavailable
from lmcache_mp.native import spin_poll

logger = logging.getLogger(__name__)

WAITER_BACKOFF = 0.001  # while a caller reads the socket, queued requests are retried this often
# plain ints: pyzmq's enum flags cost a microsecond a test
ZMQ_EVENTS, ZMQ_POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


class IOThread:
    def __init__(self, ctx: zmq.Context, url: str, heartbeat: Callable[[], "Heartbeat | None"] | None,
                 heartbeat_interval: float, spin_us: int = 0):
        """heartbeat: called every heartbeat_interval; the request it gives is sent with a
        timeout of two intervals (its convert gets the reply, its failed the error)."""
        self._spin = spin_us / 1e6  # a caller waiting on a reply polls without sleeping this long
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue requests for a server that is not there
        self._sock.connect(url)
        self._fd = self._sock.get(zmq.FD)
        # The socket, _pending, _deadlines, _waiters, _watching and _wake_at: under
        # _lock, from any thread.
        self._lock = threading.Lock()
        self._open = True
        self._pending: dict[int, Pending] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._waiters = 0  # threads reading the socket for a future of theirs
        self.on_lane_lost: Callable[[], None] | None = None
        self._wake_at = 0.0  # when the I/O thread looks at deadlines next
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._sockets = select.epoll()  # the ZeroMQ socket's fd and the lane's
        self._sockets.register(self._fd, select.EPOLLIN)
        # the server's local lane, when connected (lane.py)
        self.lane = ClientLane(self._lock, self._pending, self._sockets, is_open=lambda: self._open,
                               track=self._track, wakeup=self._wakeup, settle=self._settle, deliver=self._deliver,
                               lost=lambda: self.on_lane_lost is not None and self.on_lane_lost())
        self._poller = select.epoll()  # what the I/O thread sleeps on: _wake, and _sockets while watched
        self._poller.register(self._wake, select.EPOLLIN)
        # ZeroMQ says when the connection to the server drops (its process died, or it stopped):
        # the client then looks at once instead of at its next heartbeat. Read by the I/O thread only.
        # A reconnection whose handshake the server refuses (its credential revoked) is not
        # retried by libzmq: on_refused(ZAP status) says so.
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        self._poller.register(self._monitor.get(zmq.FD), select.EPOLLIN)
        self.on_disconnected: Callable[[], None] | None = None
        self.on_refused: Callable[[int], None] | None = None
        self._watching = False  # _sockets is in _poller (never while a thread reads)
        # Writes after the fd is closed would land in whatever reuses its number (e.g. a ZMQ
        # mailbox eventfd, which then aborts the process): close and write under one lock.
        self._wake_lock = threading.Lock()
        self._wake_open = True
        self._inbox: collections.deque = collections.deque()  # for the I/O thread: unsent requests, failures
        # While set (the server is away, and why), requests that could not be sent at once fail
        # instead of waiting to be sent (see set_away).
        self._away = ""
        self._away_error: Callable[[str], Exception] = ServerUnavailable  # what they fail with
        self._unsent: collections.deque = collections.deque()  # I/O thread: queued until the socket connects
        self._local = threading.local()
        self._ids = itertools.count(1 << 62)  # apart from the sync sockets' ids
        self._heartbeat = heartbeat
        self._interval = heartbeat_interval
        self.last_heard = 0.0  # time.monotonic() of the latest reply from the server (any request)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="lmcache-client-io", daemon=True)
        self._thread.start()

    def request(self, msg: p._Msg, timeout: float, convert: Converter,
                on_settled: Callable[[], None] | None = None, expires: bool = True,
                stamps: list | None = None, while_away: bool = False) -> Future:
        """Send msg; the future gets convert(reply), or an error. on_settled runs once the
        request is answered, failed or timed out (e.g. to return a pooled event). expires=False:
        once sent, the request waits for its reply however long it takes (it still fails when
        it cannot be sent within `timeout`, when the client closes, or on fail_all). stamps: a
        list to trace the request in (the server's stages included), also set as future.trace.
        while_away: it may wait to be sent while the server is away (set_away), as the requests
        that find out whether it is back do."""
        fut = ReplyFuture(self)
        fut.trace = stamps
        if self._stop:
            fut.set_exception(ServerUnavailable("the client is closed"))
            return fut
        body = p.encode(msg)
        if len(body) > p.MAX_MESSAGE_BYTES:
            fut.set_exception(p.too_large(msg, len(body)))
            return fut
        rid = next(self._ids)
        pend = Pending(fut, convert, time.monotonic() + timeout, type(msg).__name__, on_settled, expires, stamps,
                        while_away)
        if (self.lane.sock is not None and len(body) <= p.LANE_MAX_BYTES - 64 and not isinstance(msg, p.Status)
                and self.lane.send(rid, body, pend)):
            return fut
        if not self._send_zmq(rid, body, pend):
            self._inbox.append((rid, body, pend))  # not connected yet: the I/O thread sends it once it can
            self._wakeup()
            if self._stop:  # the I/O thread may have ended before it saw the request
                self._settle(pend, error=ServerUnavailable("the client is closed"))
        return fut

    def _frames(self, rid: int, body: bytes, pend: Pending) -> tuple:
        if pend.stamps is None:
            return (p.pack_request_id(rid), body)
        return (p.pack_request_id(rid), body, p.TRACE_FRAME)

    def _send_zmq(self, rid: int, body: bytes, pend: Pending, queued: bool = False) -> bool:
        """Send on the ZeroMQ socket; False when not connected (yet). queued: the head of _unsent,
        sent by the I/O thread; else a caller's request, which waits behind queued ones to keep
        their order."""
        error = None
        with self._lock:
            if not queued and (self._unsent or self._inbox or not self._open):
                return False
            self._pending[rid] = pend  # before the send: the reply may come at once
            try:
                self._sock.send_multipart(self._frames(rid, body, pend), flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                del self._pending[rid]
                return False
            except zmq.ZMQError as e:
                del self._pending[rid]
                error = e
            else:
                # The send may have taken the fd's signal of a reply someone should read.
                wake = self._track(rid, pend) or bool(self._sock.get(ZMQ_EVENTS) & ZMQ_POLLIN)
            if queued:
                self._unsent.popleft()
        if error is not None:
            self._settle(pend, error=ServerUnavailable(f"cannot send {pend.what}: {error}"))
        elif wake and not queued:
            self._wakeup()
        return True

    def _track(self, rid: int, pend: Pending) -> bool:
        """After a send, under the lock: stamp it, see that its reply will be read (by the I/O
        thread while nobody reads), and arm its deadline; True when the I/O thread must wake up
        earlier than it planned to expire it."""
        if not self._waiters:
            self._watch(True)
        if pend.stamps is not None:
            pend.stamps.append(("client sent", time.monotonic_ns()))
        if not pend.expires:
            return False
        heapq.heappush(self._deadlines, (pend.deadline, rid))
        return pend.deadline < self._wake_at

    # ---- the local lane (lane.py) --------------------------------------------------------------

    @property
    def has_lane(self) -> bool:
        return self.lane.sock is not None

    def set_lane(self, sock) -> None:
        """Send small requests on this connected local-lane socket from now on."""
        self.lane.set(sock)

    def fail_all(self, why: str) -> None:
        """Fail every request in flight with ServerUnavailable(why) (e.g. the server restarted
        and will never answer)."""
        self._inbox.append((None, None, why))
        self._wakeup()

    def set_away(self, why: str, in_flight: bool = False,
                 error: Callable[[str], Exception] = ServerUnavailable) -> None:
        """The server is away (why it is said to be) or back (""). While it is away, requests
        waiting to be sent fail with error(why) at once, as do those that cannot be
        sent later (but for while_away ones); in_flight: the server's process is gone, so those
        sent to it fail too (no reply will ever come)."""
        self._away, self._away_error = why, error
        if why:
            self._inbox.append((None, in_flight, why))
            self._wakeup()

    def _wakeup(self) -> None:
        with self._wake_lock:
            if self._wake_open:
                os.eventfd_write(self._wake, 1)

    def _watch(self, on: bool) -> None:
        """Under the lock: put the sockets into the I/O thread's poller, or take them out (one
        syscall, no wake-up: epoll applies it to the thread sleeping in it)."""
        if on == self._watching or not self._open:
            return
        if on:
            self._poller.register(self._sockets.fileno(), select.EPOLLIN)
        else:
            self._poller.unregister(self._sockets.fileno())
        self._watching = on

    # ---- any thread ---------------------------------------------------------------------------

    def on_io_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def wait(self, fut: ReplyFuture, timeout: float | None) -> bool:
        """Read replies on this thread until fut is settled or `timeout` passes; True if settled.
        The I/O thread keeps away from the socket meanwhile (it would only hand the reply over)."""
        if fut.done():
            return True
        if threading.current_thread() is self._thread:
            return False  # a callback on the I/O thread: the plain future wait applies
        waker = getattr(self._local, "waker", None)
        if waker is None:
            waker = self._local.waker = Waker()
        lane, fds = None, [self._fd, waker.fd]
        start = time.monotonic()
        end = math.inf if timeout is None else start + timeout
        spin_until = start + self._spin
        fut.wakers.append(waker)
        self._reading(1)
        try:
            while True:
                self._receive(fut)
                if fut.done():
                    return True
                now = time.monotonic()
                if now >= end or self._stop:
                    return fut.done()
                if self.lane.sock is not lane:  # (dis)connected meanwhile
                    lane = self.lane.sock
                    fd = lane.fileno() if lane is not None else -1
                    fds = [self._fd, waker.fd] + ([fd] if fd >= 0 else [])
                # Poll without sleeping while the reply may come soon: a sleeping thread wakes late.
                spin_us = int(max(0.0, min(spin_until, end) - now) * 1e6)
                if 1 in spin_poll(fds, spin_us, int(min(end - now, 1.0) * 1000) + 1):
                    os.eventfd_read(waker.fd)
        finally:
            fut.wakers.remove(waker)
            self._reading(-1)

    def call(self, msg: p._Msg, timeout: float, convert: Converter, stamps: list | None = None) -> Any:
        """request(...).result(), read on this thread, which counts as reading from before the
        send: a quick reply cannot wake the I/O thread."""
        self._reading(1)
        try:
            return self.request(msg, timeout, convert, stamps=stamps).result()
        finally:
            self._reading(-1)

    def _reading(self, n: int) -> None:
        """A thread starts (1) or stops (-1) reading the socket for a future of its own. While one
        does, the sockets' fds are out of the I/O thread's poller: it would only wake up to hand
        the reply over, and take the GIL from the reader (on a VM, a thread that waits for the
        GIL may sleep for 100s of us)."""
        with self._lock:
            self._waiters += n
            orphans = not self._waiters and bool(self._pending)
            self._watch(orphans)
        if orphans and n < 0:  # replies that came meanwhile may have taken the ZeroMQ fd's signal
            self._wakeup()

    def _receive(self, until: Future | None = None) -> None:
        """Read every reply there is and settle its future (outside the lock: callbacks run);
        stop early once `until` is settled (its caller returns at once: the rest can wait)."""
        if self.lane.receive(until):
            return
        while True:
            with self._lock:
                if not self._open or not self._sock.get(ZMQ_EVENTS) & ZMQ_POLLIN:
                    break
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
                if len(frames) not in (2, 3) or len(frames[0]) != 8:
                    logger.warning("ignored a malformed reply from the server")
                    continue
                pend = self._pending.pop(p.unpack_request_id(frames[0]), None)
            self._deliver(pend, frames[1], frames[2] if len(frames) == 3 else None)

    def _deliver(self, pend: Pending | None, body: bytes, trace: bytes | None) -> None:
        self.last_heard = time.monotonic()
        if pend is None:
            return  # answered after its timeout
        if pend.stamps is not None:
            add_trace(pend.stamps, trace)
        try:
            result = pend.convert(p.decode_reply(body))
        except BaseException as e:
            self._settle(pend, error=e)
        else:
            self._settle(pend, result=result)

    def _settle(self, pend: Pending, result: Any = None, error: BaseException | None = None) -> None:
        if pend.settled:  # e.g. failed by close() and by the sender at once
            return
        pend.settled = True
        if pend.on_settled is not None:
            try:
                pend.on_settled()
            except Exception:
                logger.exception("error returning resources of a %s request", pend.what)
        fut = pend.future
        if fut.done():
            return
        if pend.stamps is not None:
            pend.stamps.append(("client resolved", time.monotonic_ns()))
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
        mine = getattr(self._local, "waker", None)  # this thread is awake: no need to wake it
        for waker in list(getattr(fut, "wakers", ())):  # threads reading the socket for it may sleep
            if waker is not mine:
                os.eventfd_write(waker.fd, 1)

    # ---- on the I/O thread --------------------------------------------------------------------

    def _send_queued(self) -> None:
        while self._inbox:
            item = self._inbox.popleft()
            if item[0] is None:  # a failure: (None, None, why) of fail_all, (None, in_flight, why) of set_away
                _, in_flight, why = item
                everything = in_flight is None
                with self._lock:
                    gone = [rid for rid, pd in self._pending.items()
                            if everything or (in_flight and not pd.while_away)]
                    failed = [self._pending.pop(rid) for rid in gone]
                unsent, self._unsent = self._unsent, collections.deque()
                for it in unsent:
                    if everything or not it[2].while_away:
                        failed.append(it[2])
                    else:
                        self._unsent.append(it)
                for pd in failed:  # (an exception each: a raised one keeps its traceback's frames)
                    self._settle(pd, error=ServerUnavailable(why) if everything else self._away_error(why))
                continue
            away = self._away
            if away and not item[2].while_away:  # it could not be sent at once: it never will
                self._settle(item[2], error=self._away_error(away))
                continue
            self._unsent.append(item)
        while self._unsent:
            rid, body, pend = self._unsent[0]
            if not self._send_zmq(rid, body, pend, queued=True):
                return  # not connected (yet): wait for the socket to become writable, or the deadline

    def _read_monitor(self) -> None:
        """Read the socket's events (its fd signals edges: every wake-up reads until none is left)."""
        dropped, refused = False, 0
        while self._monitor.get(ZMQ_EVENTS) & ZMQ_POLLIN:
            event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                refused = event["value"]  # the ZAP status: 400, the credential is refused
            else:
                dropped = True
        if dropped and self.on_disconnected is not None:
            logger.debug("the connection to the server dropped")
            self.on_disconnected()
        if refused and self.on_refused is not None:
            logger.debug("the server refused a reconnection's handshake (status %d)", refused)
            self.on_refused(refused)

    def _expire(self, now: float) -> None:
        expired = []
        with self._lock:
            while self._deadlines and self._deadlines[0][0] <= now:
                _, rid = heapq.heappop(self._deadlines)
                pend = self._pending.pop(rid, None)
                if pend is not None:
                    expired.append(pend)
        for pend in expired:
            self._settle(pend, error=ServerUnavailable(f"no reply to {pend.what} within its timeout"))
        if self._unsent and any(item[2].deadline <= now for item in self._unsent):
            keep = collections.deque()
            for item in self._unsent:
                if item[2].deadline <= now:
                    self._settle(item[2], error=ServerUnavailable(f"no server reachable to send {item[2].what}"))
                else:
                    keep.append(item)
            self._unsent = keep

    def _run(self) -> None:
        next_beat = time.monotonic() + self._interval
        self._read_monitor()  # until it is read once, its fd signals nothing new
        while not self._stop:
            try:
                next_beat = self._turn(next_beat)
            except Exception:  # (a callback's, say): the thread must go on, or no future it serves settles
                logger.exception("error in the client's I/O thread")
                time.sleep(0.01)
        self._finish()

    def _turn(self, next_beat: float) -> float:
        """One turn of the I/O thread: sleep until something is due, then do it. Returns when the
        next heartbeat is due."""
        now = time.monotonic()
        with self._lock:
            wake_at = min(next_beat, self._deadlines[0][0]) if self._deadlines else next_beat
            if self._unsent:
                wake_at = min([wake_at] + [item[2].deadline for item in self._unsent])
            self._wake_at = wake_at
            # While a caller reads the socket, keep away from it (see _reading). Else watch it
            # for the requests in flight and those to send, unless it has news.
            if not self._waiters and (self._pending or self._unsent):
                self._watch(True)
            watch = self._watching
            events = self._sock.get(ZMQ_EVENTS) if watch else 0
        if not watch and self._unsent:
            wake_at = min(wake_at, now + WAITER_BACKOFF)
        elif events & zmq.POLLIN or (self._unsent and events & zmq.POLLOUT):
            wake_at = now
        if wake_at > now:
            self._poller.poll(wake_at - now)
        try:
            os.eventfd_read(self._wake)
        except BlockingIOError:
            pass
        self._send_queued()
        if self._waiters == 0:
            self._receive()
        self._read_monitor()
        now = time.monotonic()
        self._expire(now)
        if now >= next_beat and self._heartbeat is not None:
            next_beat = now + self._interval
            beat = self._heartbeat()
            if beat is not None:
                self.request(beat.msg, self._interval * 2, beat.convert,
                             while_away=True).add_done_callback(beat.settled)
        return next_beat

    def _finish(self) -> None:
        """The thread ends: fail what is left, close the sockets."""
        err = ServerUnavailable("the client is closed")
        with self._lock:
            self._open = False
            left = list(self._pending.values())
            self._pending.clear()
            self._poller.close()
            self._sockets.close()
            self._monitor.close(linger=0)
            self._sock.close(linger=0)
            self.lane.close()
        for pend in left:
            self._settle(pend, error=err)
        for _rid, _body, pend in list(self._unsent) + list(self._inbox):
            if isinstance(pend, Pending):
                self._settle(pend, error=err)
        with self._wake_lock:
            self._wake_open = False
            os.close(self._wake)

    def stop(self) -> bool:
        """Stop the thread (requests in flight fail); False if it is still running after 5 s (on
        the I/O thread itself, a callback's: True, the thread ends once the callback returns)."""
        self._stop = True
        self._wakeup()
        if threading.current_thread() is self._thread:
            return True
        self._thread.join(5)
        return not self._thread.is_alive()
