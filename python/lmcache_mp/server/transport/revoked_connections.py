"""Closing the ZeroMQ connections of a credential a reload removed from the tenants file.

ZeroMQ gives a ROUTER no call to drop one peer: `disconnect` and `unbind` act on endpoints, and
unbinding drops every client; ROUTER_HANDOVER lets a new connection take over a routing id, but
a peer may not choose the ids ZeroMQ generates (they begin with a zero byte); the ZAP handler is
asked only at the handshake, and the socket monitor only reports. What a message does carry is
the descriptor of the connection it came in on (ZMQ_SRCFD). A request of a revoked credential is
answered "credential revoked"; a moment later this module shuts that descriptor down
(shutdown(2), never close: the descriptor stays ZeroMQ's, which then sees the peer gone and tears
the connection down itself). The client's ZeroMQ reconnects, its handshake is refused by ZAP,
and libzmq does not reconnect after a refused handshake: the connection is gone for good.

A connection is closed at its first request after the reload (clients send a heartbeat every
second); one that sends nothing stays open, and can do nothing. The descriptor is checked to be
the same socket (inode) when the close comes: a number closed meanwhile and reused by another
connection is left alone.
"""

from __future__ import annotations

import logging
import os
import socket
import time

logger = logging.getLogger(__name__)

# Between the refusal and the close: the refusal is written by ZeroMQ's I/O thread (microseconds
# on an idle machine); a close before it would cost the client the reply that says why.
CLOSE_AFTER_S = 0.5


def _inode(fd: int) -> tuple[int, int] | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class RevokedConnections:
    """Used by the socket thread only."""

    def __init__(self) -> None:
        self._due: dict[int, tuple[tuple[int, int], float]] = {}  # fd -> (its socket's inode, when to close)
        self.closed = 0

    def refused(self, fd: int) -> None:
        """A request of a revoked credential came in on fd and is being refused."""
        if fd < 0 or fd in self._due:
            return
        inode = _inode(fd)
        if inode is not None:
            self._due[fd] = (inode, time.monotonic() + CLOSE_AFTER_S)

    def close_due(self) -> None:
        now, closed = time.monotonic(), 0
        for fd, (inode, due) in list(self._due.items()):
            if due > now:
                continue
            del self._due[fd]
            try:
                dup = os.dup(fd)  # (the check and the shutdown on one socket, whatever happens to fd meanwhile)
            except OSError:
                continue  # ZeroMQ closed it already (the client went away)
            sock = None
            try:
                if _inode(dup) == inode:
                    sock = socket.socket(fileno=dup)  # (owns dup from here)
                    sock.shutdown(socket.SHUT_RDWR)
                    closed += 1
            except OSError as e:
                logger.debug("could not close a revoked connection (fd %d): %s", fd, e)
            finally:
                if sock is not None:
                    sock.close()
                else:
                    os.close(dup)
        if closed:
            self.closed += closed
            logger.info("closed %d ZeroMQ connection%s of revoked credentials", closed, "s" if closed > 1 else "")
