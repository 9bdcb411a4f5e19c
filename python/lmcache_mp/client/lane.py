"""The client's end of the server's local lane: a unix SOCK_SEQPACKET connection beside its
ZeroMQ socket, on which small requests go out as datagrams when this process can reach it.

`ClientLane` is a part of the I/O thread (io_thread.py), built from the I/O thread's lock and
table of pending requests: a request sent on the lane is pending there like one sent over
ZeroMQ, and its reply is read by
whoever reads replies (the waiting caller, or the I/O thread). When the lane breaks (the server
went away) what went out on it fails, and the client looks whether the server is still there.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
from concurrent.futures import Future
from typing import Any, Callable

from lmcache_mp import protocol as p
from lmcache_mp.client.futures import Pending
from lmcache_mp.errors import ServerUnavailable

logger = logging.getLogger(__name__)


def socket_address(address: str) -> str:
    """A lane address as the server gives it ("@name": Linux's abstract namespace)."""
    return "\0" + address[1:] if address.startswith("@") else address


def claim_lane(sock: socket.socket, ticket: bytes) -> None:
    """A server with tenants gave this client a lane ticket: a new lane connection claims the
    client's tenant with it first (the uid of this process may name no tenant, or another)."""
    if ticket:
        sock.send(p.pack_lane(0, p.encode(p.LaneClaim(ticket=ticket))))


def connect_lane(address: str, ticket: bytes) -> socket.socket:
    """A connected, claimed lane socket (OSError when this process cannot reach the lane)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.connect(socket_address(address))
        claim_lane(sock, ticket)
    except OSError:
        sock.close()
        raise
    return sock


class ClientLane:
    def __init__(self, lock: threading.Lock, pending: dict[int, Pending], sockets: select.epoll, *,
                 is_open: Callable[[], bool], track: Callable[[int, Pending], bool], wakeup: Callable[[], None],
                 settle: Callable[..., None], deliver: Callable[[Pending | None, bytes, Any], None],
                 lost: Callable[[], None]):
        """The I/O thread's: its lock, table of pending requests (by request id) and epoll set of
        sockets; is_open() (under the lock); track(rid, pend) after a send (under the lock: True
        when the I/O thread must wake up), wakeup(); settle(pend, error=) and deliver(pend, body,
        trace) outside the lock; lost() when the lane broke."""
        self._lock = lock
        self._pending = pending
        self._sockets = sockets
        self._is_open = is_open
        self._track = track
        self._wakeup = wakeup
        self._settle = settle
        self._deliver = deliver
        self._lost = lost
        self.sock: socket.socket | None = None  # the connected lane, when there is one

    def set(self, sock: socket.socket) -> None:
        """Send small requests on this connected lane socket from now on."""
        with self._lock:
            if not self._is_open():  # closed meanwhile (e.g. by a recovery that ended late)
                sock.close()
                return
            self._sockets.register(sock.fileno(), select.EPOLLIN)
            old, self.sock = self.sock, sock
        if old is not None:
            self.drop(old, "replaced")

    def send(self, rid: int, body: bytes, pend: Pending) -> bool:
        """Send a request on the lane; False when it cannot take it now (ZeroMQ then does)."""
        broken = None
        with self._lock:
            lane = self.sock
            if lane is None or not self._is_open():
                return False
            self._pending[rid] = pend  # before the send: the reply may come at once
            try:
                lane.send(p.pack_lane(rid, body, traced=pend.stamps is not None), socket.MSG_DONTWAIT)
            except BlockingIOError:  # the server is not reading: ZeroMQ queues it instead
                del self._pending[rid]
                return False
            except OSError as e:
                del self._pending[rid]
                broken = e
            else:
                pend.lane = lane
                wake = self._track(rid, pend)
        if broken is not None:
            self.drop(lane, str(broken))
            return False
        if wake:
            self._wakeup()
        return True

    def drop(self, lane: socket.socket, why: str) -> None:
        """The lane broke (the server went away) or was replaced: fail what went out on it."""
        with self._lock:
            if self.sock is lane:
                self.sock = None
            if self._is_open() and lane.fileno() >= 0:  # not closed yet (by another thread that saw it break)
                self._sockets.unregister(lane.fileno())
            lost = [rid for rid, pd in self._pending.items() if pd.lane is lane]
            pends = [self._pending.pop(rid) for rid in lost]
            lane.close()
        logger.debug("local lane closed (%s): %d requests in flight failed", why, len(pends))
        for pend in pends:
            self._settle(pend, error=ServerUnavailable(f"the server's local lane closed ({why}); "
                                                       f"the {pend.what} was lost"))
        if why != "replaced":
            self._lost()

    def receive(self, until: Future | None) -> bool:
        """Read the lane's replies there are and settle their futures; True once `until` is settled."""
        while self.sock is not None:
            with self._lock:
                lane = self.sock
                if lane is None or not self._is_open():
                    return False
                try:
                    data = lane.recv(p.LANE_MAX_BYTES, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    return False
                except OSError:
                    data = b""
                pend = None
                if data:
                    try:
                        rid, body, trace = p.unpack_lane_reply(data)
                    except ValueError:
                        logger.warning("ignored a malformed lane reply from the server")
                        continue
                    pend = self._pending.pop(rid, None)
            if not data:
                self.drop(lane, "the server closed it")
                return False
            self._deliver(pend, body, trace)
            if until is not None and until.done():
                return True
        return False

    def close(self) -> None:
        """(under the I/O thread's lock, as it ends)"""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
