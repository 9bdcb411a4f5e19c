"""A request of the client while it is in flight: its future (which reads its reply on the
waiting thread: io_thread.py), what is pending for it, the heartbeat request, trace stamps."""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future
from typing import Any, Callable, NamedTuple, Protocol

from lmcache_mp import protocol as p

logger = logging.getLogger(__name__)

# Called with the decoded reply; returns the future's result or raises.
Converter = Callable[[Any], Any]


def add_trace(stamps: list, trace: bytes | None) -> None:
    """Append the server's stages of a traced reply, then its arrival here."""
    if trace:
        try:
            stamps.extend(p.decode_trace(trace))
        except Exception:
            logger.debug("ignored a malformed trace frame")
    stamps.append(("client received", time.monotonic_ns()))


class Heartbeat(NamedTuple):
    msg: p._Msg
    convert: Converter  # called with the reply
    failed: Callable[[BaseException], None]  # called when it got none

    def settled(self, fut: Future) -> None:
        error = fut.exception()
        if error is not None:
            self.failed(error)


class Pending:
    __slots__ = ("future", "convert", "deadline", "what", "on_settled", "expires", "stamps", "lane", "settled",
                 "while_away")

    def __init__(self, future: Future, convert: Converter, deadline: float, what: str, on_settled, expires: bool,
                 stamps: list | None = None, while_away: bool = False):
        self.future = future
        self.convert = convert
        self.deadline = deadline  # to be sent by then; once sent, answered by then if `expires`
        self.what = what
        self.on_settled = on_settled
        self.expires = expires
        self.stamps = stamps  # a traced request's timestamps (also future.trace)
        self.lane = None  # the local-lane socket it went out on, if it did
        self.settled = False
        self.while_away = while_away  # may wait to be sent while the server is away (heartbeats, recovery)


class Waker:
    """A thread's eventfd, written when another thread settles a future it waits on."""

    def __init__(self):
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def __del__(self):
        os.close(self.fd)


class ReplyReader(Protocol):
    """Who reads replies for a waiting thread (the I/O thread, io_thread.py)."""

    def wait(self, fut: ReplyFuture, timeout: float | None) -> bool: ...

    def on_io_thread(self) -> bool: ...


class ReplyFuture(Future):
    """A request's future; result() and exception() read the reply on the calling thread."""

    def __init__(self, io: ReplyReader):
        super().__init__()
        self._io = io
        self.wakers: list[Waker] = []  # of the threads waiting on it, reading the socket
        self.trace: list | None = None

    def _left(self, timeout: float | None) -> float | None:
        """How long the plain future wait may still take once this thread read for `timeout`."""
        if self._io.wait(self, timeout):
            return 0
        return timeout if timeout is None or self._io.on_io_thread() else 0

    def result(self, timeout: float | None = None) -> Any:
        return super().result(self._left(timeout))

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return super().exception(self._left(timeout))
