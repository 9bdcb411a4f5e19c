"""The socket thread: owns the ZMQ ROUTER, decodes requests, sends every reply.

Replies produced on other threads (registration workers, GPU completion threads) are handed over
through a queue and an eventfd the socket thread polls with the socket, so nothing sleeps and a
reply leaves as soon as it exists. Malformed input of any kind is answered with an error and the
loop goes on.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time

import zmq

from lmcache_mp import protocol as p

logger = logging.getLogger(__name__)

TICK_SECONDS = 0.5
_ZERO_ID = p.pack_request_id(0)


class Transport:
    def __init__(self, url: str, engine, context: zmq.Context | None = None):
        self.engine = engine
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.bind(url)
        self.url = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._ipc_path = self.url[len("ipc://"):] if self.url.startswith("ipc://") else None
        self._outbox: collections.deque = collections.deque()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # Writes after the fd is closed would land in whatever reuses its number (e.g. a ZMQ
        # mailbox eventfd, which then aborts the process): close and write under one lock.
        self._wake_lock = threading.Lock()
        self._wake_open = True
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="lmcache-socket", daemon=True)
        self._ident: int | None = None

    def start(self) -> None:
        self._thread.start()

    # ---- replies -----------------------------------------------------------------------------

    def _responder(self, identity: bytes, req_id: bytes):
        def reply(msg: p._Msg) -> None:
            body = p.encode(msg)
            if threading.get_ident() == self._ident:
                self._send(identity, req_id, body)
            else:
                self._outbox.append((identity, req_id, body))
                self._wakeup()  # after stop the reply has nowhere to go

        return reply

    def _send(self, identity: bytes, req_id: bytes, body: bytes) -> None:
        try:
            self._sock.send_multipart((identity, req_id, body), flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:  # the client is gone (EHOSTUNREACH) or not reading (EAGAIN)
            logger.debug("dropped a reply to %s: %s", identity.hex()[:8], e)

    # ---- the loop ----------------------------------------------------------------------------

    def _handle(self, frames: list[bytes]) -> None:
        identity = frames[0]
        if len(frames) != 3 or len(frames[1]) != 8:
            req_id = frames[1] if len(frames) >= 2 and len(frames[1]) == 8 else _ZERO_ID
            msg = "a request is two frames: an 8-byte request id and a body"
            self._send(identity, req_id, p.encode(p.Error(code=int(p.ErrorCode.BAD_REQUEST), message=msg)))
            return
        reply = self._responder(identity, frames[1])
        try:
            msg = p.decode_request(frames[2])
        except p.FrameError as e:
            reply(p.Error(code=int(e.code), message=str(e)))
            return
        self.engine.handle(msg, reply)

    def _run(self) -> None:
        self._ident = threading.get_ident()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake, zmq.POLLIN)
        next_tick = time.monotonic() + TICK_SECONDS
        while not self._stop:
            timeout_ms = max(0.0, next_tick - time.monotonic()) * 1000
            ready = dict(poller.poll(timeout_ms))
            if self._sock in ready:
                for _ in range(256):  # take a batch, then give the outbox its turn
                    try:
                        self._handle(self._sock.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    except Exception:
                        logger.exception("error handling a request")
                    if not self._sock.get(zmq.EVENTS) & zmq.POLLIN:
                        break  # cheaper than the exception of another non-blocking recv
            if self._wake in ready:
                try:
                    os.eventfd_read(self._wake)
                except BlockingIOError:
                    pass
            while self._outbox:
                self._send(*self._outbox.popleft())
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + TICK_SECONDS
                try:
                    self.engine.tick()
                except Exception:
                    logger.exception("error in periodic housekeeping")
        while self._outbox:  # last replies of the drain
            self._send(*self._outbox.popleft())
        self._sock.close(linger=0)
        with self._wake_lock:
            self._wake_open = False
            os.close(self._wake)
        if self._ipc_path:
            try:
                os.unlink(self._ipc_path)
            except OSError:
                pass

    def stop(self, drain: float = 5.0) -> None:
        """Stop reading requests; replies queued within `drain` seconds still go out."""
        if not self._thread.is_alive():
            return
        self._stop = True
        self._wakeup()
        self._thread.join(drain)

    def _wakeup(self) -> None:
        with self._wake_lock:
            if self._wake_open:
                os.eventfd_write(self._wake, 1)
