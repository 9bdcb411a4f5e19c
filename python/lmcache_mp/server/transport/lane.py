"""The local lane: small requests of clients on this machine as datagrams on a unix SOCK_SEQPACKET
socket, read by the socket thread and answered from whichever thread has the reply.

ZeroMQ moves every message through an I/O thread in each process; a sleeping thread takes tens of
microseconds to wake, so a small request paid that four times. On the lane the client's thread
writes the datagram and the server's socket thread (polling, see transport.py) reads it. Same
bodies and replies as on the ZeroMQ socket (protocol.pack_lane); a client that cannot connect
(another network namespace) keeps using ZeroMQ.

Address: next to an ipc:// endpoint (PATH.lane, same directory and mode), else an abstract
socket (reachable from this network namespace, like a loopback TCP port).
"""

from __future__ import annotations

import array
import logging
import os
import secrets
import socket
import struct
import threading
from typing import Iterator

from lmcache_mp import protocol as p
from lmcache_mp.server.tenancy.tenancy import NoTenancy, Tenancy
from lmcache_mp.server.transport.socket_files import share_with_group, socket_files_private

logger = logging.getLogger(__name__)

READ_BATCH = 64  # datagrams read from one connection before the others get their turn
MAX_CONNECTIONS = 4096  # beyond this, new connections are closed at once (those clients use ZeroMQ)


class LaneConn:
    """One client's connection. Sends come from any thread; the lock keeps a send off a closed fd."""

    __slots__ = ("sock", "fd", "_lock", "_open", "_peer", "credential", "claimable")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.fd = sock.fileno()
        self._lock = threading.Lock()
        self._open = True
        self._peer = None
        self.credential: str | None = None  # with tenants: the peer's (uid:N or gid:N), read at accept
        # A ticket may be claimed only by the connection's first datagram: once a connection has
        # spoken as one tenant it never speaks as another (Transport._handle_lane).
        self.claimable = True

    @property
    def peer(self) -> tuple[int, int, int]:
        """(pid, uid, gid) of the process that connected, as the kernel saw it (pid 0: the
        process is in a pid namespace this server cannot see)."""
        if self._peer is None:
            creds = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            self._peer = struct.unpack("3i", creds)
        return self._peer

    def send(self, datagram: bytes, fds: tuple[int, ...] = ()) -> None:
        with self._lock:
            if not self._open:
                return
            try:
                if fds:
                    self.sock.sendmsg([datagram], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))],
                                      socket.MSG_DONTWAIT)
                else:
                    self.sock.send(datagram, socket.MSG_DONTWAIT)
            except OSError as e:  # gone, or not reading (a full buffer): like a dropped ZeroMQ reply
                logger.debug("dropped a lane reply: %s", e)

    @property
    def open(self) -> bool:
        return self._open

    def close(self) -> None:
        with self._lock:
            if self._open:
                self._open = False
                self.sock.close()


def lane_path(zmq_url: str) -> str | None:
    """The lane's socket file: beside an ipc:// endpoint's (None: an abstract address)."""
    return zmq_url[len("ipc://"):] + ".lane" if zmq_url.startswith("ipc://") else None


class Lane:
    def __init__(self, zmq_url: str, ipc_group: str = "", tenancy: Tenancy | NoTenancy = NoTenancy()):
        from lmcache_mp.server.transport.refusals import RefusalLog

        self._tenancy = tenancy
        self._refusals = RefusalLog()
        self._path = lane_path(zmq_url)
        if self._path:  # (claimed with the endpoint's before either is bound: Transport)
            bind_to = self._path
            self.address = self._path
        else:
            name = f"lmcache-mp-lane-{os.getpid()}-{secrets.token_hex(8)}"
            bind_to = "\0" + name
            self.address = "@" + name
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK
                                       | socket.SOCK_CLOEXEC)
        with socket_files_private():
            self._listener.bind(bind_to)
        if self._path:
            share_with_group(self._path, ipc_group)
        self._listener.listen(256)
        self.conns: list[LaneConn] = []
        self._full_logged = False
        self.version = 0  # changes whenever the set of fds does

    def fds(self) -> list[int]:
        return [self._listener.fileno()] + [c.fd for c in self.conns]

    def accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as e:  # e.g. out of fds: the client keeps ZeroMQ
                logger.warning("could not accept a local-lane connection: %s", e)
                return
            if len(self.conns) >= MAX_CONNECTIONS:
                sock.close()
                if not self._full_logged:
                    logger.warning("local lane: %d connections, refusing more (those clients use ZeroMQ)",
                                   MAX_CONNECTIONS)
                    self._full_logged = True
                continue
            sock.setblocking(False)
            conn = LaneConn(sock)
            if self._tenancy.enabled:
                self._admit(conn)
            self.conns.append(conn)
            self.version += 1

    def _admit(self, conn: LaneConn) -> None:
        """With tenants: a peer whose uid (else gid) is a tenant's credential is that tenant's
        at once; any other may still claim its client's credential (claim) before its first request."""
        cred = self._tenancy.peer_credential(*conn.peer[1:])
        if self._tenancy.state_of(cred) is not None:
            self.claim(conn, cred, "peer credentials")

    def claim(self, conn: LaneConn, cred: str | None, how: str = "the ticket of its client's HELLO") -> bool:
        """Bind a connection to a credential's tenant (False, and audited: a ticket that names none)."""
        from lmcache_mp.server.tenancy.tenants_file import credential_fingerprint

        pid, uid, gid = conn.peer
        peer = f"pid {pid} uid {uid} gid {gid}"
        state = self._tenancy.state_of(cred) if cred else None
        if state is None:
            self._refusals.refused("lane", f"a local-lane connection of {peer}: in no tenant of {self._tenancy.path}, "
                                   "and no valid ticket")
            fp = credential_fingerprint(self._tenancy.peer_credential(uid, gid))
            self._tenancy.audit.refused(fp, transport="lane", peer=peer, fingerprint=fp,
                                        reason="credential in no tenant, no valid lane ticket")
            return False
        conn.credential = cred
        self._tenancy.audit.write("connection_accepted", tenant=state.name, transport="lane", peer=peer,
                                  fingerprint=credential_fingerprint(cred), by=how)
        return True

    def refuse_late_claim(self, conn: LaneConn) -> bool:
        """A claim after the connection's first datagram: refused and audited (False; the caller
        closes the connection, as for a bad ticket)."""
        from lmcache_mp.server.tenancy.tenants_file import credential_fingerprint

        pid, uid, gid = conn.peer
        peer = f"pid {pid} uid {uid} gid {gid}"
        state = self._tenancy.state_of(conn.credential) if conn.credential else None
        self._refusals.refused("late claim", f"a local-lane connection of {peer} claimed a ticket after its first "
                               "datagram (a claim must come first); closed it")
        fp = credential_fingerprint(conn.credential or self._tenancy.peer_credential(uid, gid))
        self._tenancy.audit.refused(fp, transport="lane", peer=peer, fingerprint=fp,
                                    tenant=state.name if state is not None else "",
                                    reason="lane claim after the connection's first datagram")
        return False

    def drop(self, conn: LaneConn) -> None:
        if conn in self.conns:
            self.conns.remove(conn)
            self.version += 1
        conn.close()

    def read(self, conn: LaneConn) -> Iterator[bytes]:
        """The datagrams waiting on conn (a batch), each as soon as it is read: the first request
        is handled before the read that finds nothing more; a closed connection is dropped."""
        for _ in range(READ_BATCH):
            if not conn.open:  # dropped while its last datagram was handled (a refused claim, a revocation)
                return
            try:
                data = conn.sock.recv(p.LANE_MAX_BYTES)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # the client went away
                self.drop(conn)
                return
            yield data

    def close(self) -> None:
        for c in self.conns:
            c.close()
        self.conns.clear()
        self._listener.close()
        if self._path:
            try:
                os.unlink(self._path)
            except OSError:
                pass
