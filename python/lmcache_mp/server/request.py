"""The request value: what the transport hands the engine for each request it decoded.

A request carries its message, the tenant its connection's credential names (None on a server
without tenants), that credential, the local-lane connection it came on (None over ZeroMQ: on
the lane the kernel says which process the peer is) and its route back: the callable that sends
the one reply (transport/routes.py), which may carry a timing trace of the request's stages when
its client asked for one. The engine's parts answer through `reply`, exactly once, from whichever
thread has the answer.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

from lmcache_mp import protocol as p
from lmcache_mp.server.validation import RequestFailure

if TYPE_CHECKING:
    from lmcache_mp.server.tenancy.tenancy import TenantState
    from lmcache_mp.server.transport.lane import LaneConn

logger = logging.getLogger(__name__)

Reply = Callable[[p._Msg], None]
# route(answer) sends a reply; on the local lane route(answer, fds) also passes file descriptors
Route = Callable[..., None]


class Request:
    __slots__ = ("msg", "route", "tenant", "credential", "lane", "stamps")

    def __init__(self, msg: p._Msg, route: Route, tenant: TenantState | None = None, credential: str | None = None,
                 lane: LaneConn | None = None, stamps: list | None = None):
        self.msg = msg
        self.route = route
        self.tenant = tenant  # with tenants: the request's TenantState (tenancy/tenancy.py), counted in flight
        self.credential = credential
        self.lane = lane
        self.stamps = stamps  # a traced request's (stage, monotonic ns) list; None for untraced ones

    def reply(self, answer: p._Msg, fds: tuple[int, ...] = ()) -> None:
        """The request's one reply (fds: file descriptors to pass with it, on the local lane)."""
        if self.tenant is not None:  # no longer in flight before the client can have the reply
            self.tenant.done(answer)
        if fds:
            self.route(answer, fds)
        else:
            self.route(answer)

    def fail(self, code: p.ErrorCode, message: str) -> None:
        self.reply(p.Error(code=int(code), message=message))

    def job(self, fn: Callable[[], None]) -> Callable[[], None]:
        """fn for a worker thread: whatever it raises still becomes the request's one reply."""
        def run() -> None:
            try:
                fn()
            except RequestFailure as e:
                self.fail(e.code, str(e))
            except Exception as e:
                logger.exception("internal error in a queued request")
                self.fail(p.ErrorCode.INTERNAL, f"internal error: {e}")

        return run

    def mark(self, stage: str, at_ns: int = 0) -> None:
        """Timestamp a stage of a traced request (now, or at_ns); nothing happens for untraced ones."""
        if self.stamps is not None:
            self.stamps.append((stage, at_ns or time.monotonic_ns()))

    def mark_all(self, stamps) -> None:
        for stage, at_ns in stamps:
            self.mark(stage, at_ns)
