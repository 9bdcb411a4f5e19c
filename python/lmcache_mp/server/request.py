"""How the engine answers a request: a `Reply` callable, sent exactly once, that may carry a
timing trace of the request's stages when its client asked for one."""

from __future__ import annotations

import time
from typing import Callable

from lmcache_mp import protocol as p

Reply = Callable[[p._Msg], None]


def mark(reply: Reply, stage: str, at_ns: int = 0) -> None:
    """Timestamp a stage of a traced request (now, or at_ns); nothing happens for untraced ones."""
    stamps = getattr(reply, "stamps", None)
    if stamps is not None:
        stamps.append((stage, at_ns or time.monotonic_ns()))


def mark_all(reply: Reply, stamps) -> None:
    for stage, at_ns in stamps:
        mark(reply, stage, at_ns)
