"""The socket thread: owns the ZMQ ROUTER and the local lane (lane.py), decodes requests, makes
each one request value (server/request.py: message, tenant, credential, route back) and hands it
to the engine.

Replies leave from whichever thread produces them (the socket thread, a registration's worker, a
GPU completion thread): the socket is used under a lock, and the loop polls only its fd, so a
reply costs no hand-off to another thread. Malformed input of any kind is answered with an error
and the loop goes on.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import zmq

from lmcache_mp import protocol as p
from lmcache_mp.config import is_ipv6_url
from lmcache_mp.errors import CREDENTIAL_REVOKED
from lmcache_mp.native import spin_poll
from lmcache_mp.server.request import Request, Route
from lmcache_mp.server.tenancy.tenancy import NoTenancy, Tenancy, TenantState
from lmcache_mp.server.transport.lane import Lane, LaneConn, lane_path
from lmcache_mp.server.transport.routes import LaneResponder, Responder
from lmcache_mp.server.transport.request_stats import RequestStats
from lmcache_mp.server.transport.revoked_connections import RevokedConnections
from lmcache_mp.server.transport.socket_files import claim_socket_file, share_with_group, socket_files_private

logger = logging.getLogger(__name__)

TICK_SECONDS = 0.5
_ZERO_ID = p.pack_request_id(0)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: pyzmq's enum flags cost a microsecond a test


class Transport:
    def __init__(self, url: str, engine, context: zmq.Context | None = None, spin_us: int = 0,
                 lane: bool = True, ipc_group: str = "", curve=None,
                 tenancy: Tenancy | NoTenancy = NoTenancy()):
        self.engine = engine
        self.tenancy = tenancy  # with tenants: every request's tenant comes from its connection's credential
        self._revoked: list[str] = []  # credentials whose lane connections the loop closes
        self.revoked_connections = RevokedConnections()  # ZeroMQ connections of revoked credentials, to close
        self.stats = RequestStats()
        self._spin = spin_us / 1e6
        # The lane has no authentication of its own: with CURVE it is there only for tenants, whose
        # lane connections claim the tenant their client's CURVE handshake proved (LaneClaim).
        lane = lane and (curve is None or tenancy.enabled)
        if url.startswith("ipc://"):  # both files before anything is made: a refusal leaves nothing to undo
            claim_socket_file(url[len("ipc://"):], socket.SOCK_STREAM, "the endpoint")
            if lane:
                claim_socket_file(lane_path(url), socket.SOCK_SEQPACKET, "the local lane")
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        if is_ipv6_url(url):
            self._sock.setsockopt(zmq.IPV6, 1)
        if curve is not None:
            curve.apply(self._sock)
        if tenancy.enabled:
            from lmcache_mp.server.tenancy.gate import TenantGate

            TenantGate.apply(self._sock)
        with socket_files_private():
            self._sock.bind(url)
        self.url = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._ipc_path = self.url[len("ipc://"):] if self.url.startswith("ipc://") else None
        if self._ipc_path:
            share_with_group(self._ipc_path, ipc_group)
        self._sock_lock = threading.Lock()  # every use of the socket, from any thread
        self._open = True
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # Writes after the fd is closed would land in whatever reuses its number (e.g. a ZMQ
        # mailbox eventfd, which then aborts the process): close and write under one lock.
        self._wake_lock = threading.Lock()
        self._wake_open = True
        self.lane = Lane(self.url, ipc_group, tenancy) if lane else None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="lmcache-socket", daemon=True)
        self._ident: int | None = None
        self.beat = time.monotonic()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    # ---- replies -----------------------------------------------------------------------------

    def _responded(self, identity: bytes, req_id: bytes, body: bytes, stamps: list | None) -> None:
        """A reply, sent at once from whichever thread has it (after stop it has nowhere to go)."""
        self._send(identity, req_id, body, stamps)
        if threading.get_ident() != self._ident and self._readable():
            self._wakeup()  # our send took the socket's signal of a request the loop must read

    def _send(self, identity: bytes, req_id: bytes, body: bytes, stamps: list | None = None) -> None:
        frames = (identity, req_id, body)
        if stamps is not None:
            stamps.append(("sent", time.monotonic_ns()))
            frames += (p.encode_trace(stamps),)
        with self._sock_lock:
            if not self._open:
                return
            try:
                self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.ZMQError as e:  # the client is gone (EHOSTUNREACH) or not reading (EAGAIN)
                logger.debug("dropped a reply to %s: %s", identity.hex()[:8], e)

    def _readable(self) -> bool:
        with self._sock_lock:
            return self._open and bool(self._sock.get(_EVENTS) & _POLLIN)

    def _recv(self) -> list | None:
        """The next request, or None when there is none (then the fd will signal the next one).
        With tenants, its last item is (the credential its connection's handshake proved, and
        where that credential was revoked since, the connection's fd; else -1)."""
        with self._sock_lock:
            if not self._sock.get(_EVENTS) & _POLLIN:
                return None
            if not self.tenancy.enabled:
                return self._sock.recv_multipart(zmq.NOBLOCK)
            frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
        credential = frames[-1].get("User-Id")
        fd = frames[-1].get(zmq.SRCFD) if self.tenancy.state_of(credential) is None else -1
        return [f.bytes for f in frames] + [(credential, fd)]

    # ---- the loop ----------------------------------------------------------------------------

    def _handle(self, frames: list[bytes]) -> None:
        credential, fd = frames.pop() if self.tenancy.enabled else (None, -1)
        identity = frames[0]
        traced = len(frames) == 4 and frames[3] == p.TRACE_FRAME
        if not (len(frames) == 3 or traced) or len(frames[1]) != 8:
            req_id = frames[1] if len(frames) >= 2 and len(frames[1]) == 8 else _ZERO_ID
            msg = "a request is two frames: an 8-byte request id and a body (and optionally a trace frame)"
            err = p.Error(code=int(p.ErrorCode.BAD_REQUEST), message=msg)
            self.stats.done("invalid", time.monotonic(), err)
            self._send(identity, req_id, p.encode(err))
            return
        route = Responder(self._responded, self.stats, identity, frames[1],
                          [("received", time.monotonic_ns())] if traced else None)
        tenant = None
        if credential is not None:
            tenant = self._admit(route, credential)
            if tenant is None:
                self.revoked_connections.refused(fd)  # (closed once the refusal is out)
                return
        self._dispatch(frames[2], route, tenant, credential)

    def _admit(self, route: Route, credential: str) -> TenantState | None:
        """The request's tenant, from its connection's credential (None, refused: revoked since the
        handshake); the request is in flight for its tenant until its reply."""
        state = self.tenancy.state_of(credential)
        if state is None:
            route(p.Error(code=int(p.ErrorCode.PERMISSION_DENIED), message=f"{CREDENTIAL_REVOKED}: this "
                          "connection's credential is no longer in the tenants file"))
            return None
        state.begin()
        return state

    def _handle_lane(self, conn: LaneConn, datagram: bytes) -> None:
        first, conn.claimable = conn.claimable, False  # (any datagram, a malformed one too)
        try:
            req_id, traced, body = p.unpack_lane(datagram)
        except ValueError:
            logger.debug("ignored a malformed lane datagram")
            return
        route = LaneResponder(conn, req_id, [("received", time.monotonic_ns())] if traced else None, self.stats)
        if not self.tenancy.enabled:
            self._dispatch(body, route, lane=conn)
            return
        try:
            msg = p.decode_request(body)
        except p.FrameError:
            msg = None
        if type(msg) is p.LaneClaim:  # (no reply: a claim that fails closes the connection)
            claimed = (self.lane.claim(conn, self.tenancy.ticket_credential(msg.ticket)) if first
                       else self.lane.refuse_late_claim(conn))
            if not claimed:
                self.lane.drop(conn)
            return
        tenant = self._admit(route, conn.credential) if conn.credential is not None else None
        if tenant is None:
            self.lane.drop(conn)  # its peer is in no tenant and claimed none, or its credential was revoked
            return
        self._dispatch(body, route, tenant, conn.credential, conn, msg)

    def revoke(self, credential: str) -> None:
        """Close the local-lane connections of a credential removed from the tenants file (from
        any thread: the loop closes them, as it owns the lane)."""
        with self._wake_lock:
            self._revoked.append(credential)
        self._wakeup()

    def _dispatch(self, body: bytes, route: Responder | LaneResponder, tenant: TenantState | None = None,
                  credential: str | None = None, lane: LaneConn | None = None, msg: p._Msg | None = None) -> None:
        """The request value, made once and handed to the engine."""
        try:
            msg = msg or p.decode_request(body)
        except p.FrameError as e:
            Request(None, route, tenant, credential, lane).fail(e.code, str(e))
            return
        route.op = type(msg).__name__
        if route.stamps is not None:
            route.stamps.append(("decoded", time.monotonic_ns()))
        self.engine.handle(Request(msg, route, tenant, credential, lane, route.stamps))

    def _run(self) -> None:
        self._ident = threading.get_ident()
        # The socket's own fd, not the socket: a ZMQ socket is used by one thread at a time (under
        # _sock_lock), and only its fd may be polled meanwhile. It signals edges: whoever touched
        # the socket last may have taken the signal, so the loop asks the socket before it sleeps.
        # After a request it polls without sleeping for a while: the next request of a busy client
        # then finds it awake (waking a sleeping thread costs tens of microseconds).
        base = [self._sock.get(zmq.FD), self._wake]
        fds, fds_version = base, -1
        next_tick = time.monotonic() + TICK_SECONDS
        spin_until = 0.0
        # Every request that came before this time has been handled: the ZeroMQ socket was found
        # empty then (lane connections are read every round). After a stall of this loop (the
        # process descheduled, a long collection) it stays behind until the requests that waited
        # meanwhile, heartbeats among them, are handled: the housekeeping tick takes nobody to be
        # silent for the time the server was not listening.
        heard = time.monotonic()
        while not self._stop:
            self.beat = time.monotonic()  # /live: the loop goes round (at least every TICK_SECONDS)
            if self.lane is not None and fds_version != self.lane.version:
                fds, fds_version = base + self.lane.fds(), self.lane.version
            frames = self._recv()
            if frames is None:
                heard = self.beat
            if frames is not None:
                self._guarded(self._handle, frames)
                spin_until = time.monotonic() + self._spin
                ready = spin_poll(fds, 0, 0) if self.lane is not None else ()  # the lane gets its turn
            else:
                now = time.monotonic()
                spin_us = int(max(0.0, spin_until - now) * 1e6)
                ready = spin_poll(fds, spin_us, int(max(0.0, next_tick - now) * 1000) + 1)
            if ready:
                self._serve_ready(ready)
                if any(i > 2 for i in ready):
                    spin_until = time.monotonic() + self._spin
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + TICK_SECONDS
                try:
                    self.engine.tick(heard)
                    with self._sock_lock:  # (closed only while ZeroMQ's socket is open: its fds are live)
                        if self._open:
                            self.revoked_connections.close_due()
                except Exception:
                    logger.exception("error in periodic housekeeping")
        with self._sock_lock:
            self._open = False
            self._sock.close(linger=0)
        if self.lane is not None:
            self.lane.close()
        with self._wake_lock:
            self._wake_open = False
            os.close(self._wake)
        if self._ipc_path:
            try:
                os.unlink(self._ipc_path)
            except OSError:
                pass

    def _serve_ready(self, ready: list[int]) -> None:
        """The wake eventfd (1), the lane's listener (2) and lane connections (3...) that are ready."""
        if 1 in ready:
            os.eventfd_read(self._wake)
            if self._revoked and self.lane is not None:
                with self._wake_lock:
                    revoked, self._revoked = set(self._revoked), []
                for conn in [c for c in self.lane.conns if c.credential in revoked]:
                    self.lane.drop(conn)
                return  # (the fds changed: the loop polls again)
        conns = [self.lane.conns[i - 3] for i in ready if i > 2]  # before reads drop closed ones
        if 2 in ready:
            self.lane.accept()
        for conn in conns:
            try:
                for datagram in self.lane.read(conn):
                    self._guarded(self._handle_lane, conn, datagram)
            except Exception:  # the loop must go on whatever one connection does
                logger.exception("error reading a local-lane connection")
                self.lane.drop(conn)

    @staticmethod
    def _guarded(handle, *args) -> None:
        try:
            handle(*args)
        except Exception:
            logger.exception("error handling a request")

    def stop(self, drain: float = 5.0) -> None:
        """Stop reading requests and close the socket (waiting up to `drain` seconds for the
        request being handled); later replies are dropped."""
        if not self._thread.is_alive():
            return
        self._stop = True
        self._wakeup()
        self._thread.join(drain)

    def _wakeup(self) -> None:
        with self._wake_lock:
            if self._wake_open:
                os.eventfd_write(self._wake, 1)
