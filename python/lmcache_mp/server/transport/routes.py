"""The routes back: how one request's reply leaves, over ZeroMQ or on the local lane.

Replies leave from whichever thread produces them (the socket thread, a registration's worker, a
GPU completion thread); each is counted in the request statistics before the client can have it.
"""

from __future__ import annotations

import time
from typing import Callable

from lmcache_mp import protocol as p
from lmcache_mp.server.transport.lane import LaneConn
from lmcache_mp.server.transport.request_stats import RequestStats


class Responder:
    """The route back of one request that came over ZeroMQ (see server/request.py)."""

    __slots__ = ("_send", "_stats", "_identity", "_req_id", "stamps", "op", "t0")

    def __init__(self, send: Callable[[bytes, bytes, bytes, list | None], None], stats: RequestStats,
                 identity: bytes, req_id: bytes, stamps: list | None):
        """send(identity, request id, body, stamps): the transport's, from whichever thread replies."""
        self._send, self._stats = send, stats
        self._identity = identity
        self._req_id = req_id
        self.stamps = stamps
        self.op, self.t0 = "invalid", time.monotonic()  # the op once decoded

    def __call__(self, msg: p._Msg, fds: tuple[int, ...] = ()) -> None:  # (no descriptor crosses ZeroMQ)
        if self.stamps is not None:
            self.stamps.append(("replied", time.monotonic_ns()))
        body = p.encode(msg)
        # Counted before the client can have the reply (as the tenant's request is no longer in
        # flight by then: Request.reply): a client that holds it finds it in /metrics and status,
        # and its next request is not refused for this one still being in flight.
        self._stats.done(self.op, self.t0, msg)
        self._send(self._identity, self._req_id, body, self.stamps)


class LaneResponder:
    """The route back of one request that came on the local lane, over its connection `conn`;
    a reply may pass file descriptors with it."""

    __slots__ = ("conn", "_req_id", "stamps", "op", "t0", "_stats")

    def __init__(self, conn: LaneConn, req_id: int, stamps: list | None, stats: RequestStats):
        self.conn = conn
        self._req_id = req_id
        self.stamps = stamps
        self.op, self.t0, self._stats = "invalid", time.monotonic(), stats

    def __call__(self, msg: p._Msg, fds: tuple[int, ...] = ()) -> None:
        body = p.encode(msg)
        trace = None
        if self.stamps is not None:
            now = time.monotonic_ns()
            self.stamps += [("replied", now), ("sent", now)]
            trace = p.encode_trace(self.stamps)
        datagram = p.pack_lane(self._req_id, body, trace=trace)
        if len(datagram) > p.LANE_MAX_BYTES:  # only a reply the client should not have asked here for
            err = p.Error(code=int(p.ErrorCode.LIMIT_EXCEEDED),
                          message=f"a {type(msg).__name__} reply is too large for the local lane: use ZeroMQ")
            datagram = p.pack_lane(self._req_id, p.encode(err))
        self._stats.done(self.op, self.t0, msg)  # before the client can have it (see Responder)
        self.conn.send(datagram, fds)
