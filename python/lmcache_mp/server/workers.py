"""Threads that run a registration's requests in order, and that wait for GPU completions."""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
from typing import Callable

from lmcache_mp.native import spin_poll

logger = logging.getLogger(__name__)


class SpinQueue:
    """A queue whose consumer polls for a while before it sleeps (see native.spin_poll): a job
    that arrives soon after the last one finds the thread awake."""

    def __init__(self, spin_us: int):
        self._items: collections.deque = collections.deque()
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._fds = [self._fd]
        self._spin = spin_us

    def put(self, item) -> None:
        self._items.append(item)
        os.eventfd_write(self._fd, 1)

    def get(self):
        while True:
            try:
                return self._items.popleft()
            except IndexError:
                pass
            if spin_poll(self._fds, self._spin, -1):
                os.eventfd_read(self._fd)

    def __del__(self):
        os.close(self._fd)


class SerialWorker:
    """Runs submitted callables one after another on its own thread (one per registration, so
    tensor-parallel ranks proceed in parallel while one client's requests keep their order)."""

    def __init__(self, name: str, spin_us: int = 0):
        self._q = SpinQueue(spin_us) if spin_us else queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None]) -> None:
        self._q.put(fn)

    def _run(self) -> None:
        while True:
            fn = self._q.get()
            if fn is None:
                return
            try:
                fn()
            except Exception:  # a job answers its own errors; this is a last resort
                logger.exception("unhandled error in %s", self._thread.name)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float | None = None) -> None:
        """Finish the queued work, then end the thread."""
        self._q.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)


class CompletionWaiter:
    """Waits for GPU tickets in submission order (they complete in order on one direction's
    stream) with the GIL released inside `wait`, then runs each ticket's callback. With spin_us
    it polls for the next ticket that long before it sleeps: a short copy would otherwise be
    done before the thread woke up to wait for it."""

    def __init__(self, name: str, wait: Callable[[int], None], spin_us: int = 0):
        self._wait = wait
        self._worker = SerialWorker(name, spin_us)

    def add(self, ticket: int, done: Callable[[BaseException | None], None]) -> None:
        def job() -> None:
            try:
                self._wait(ticket)
            except Exception as e:  # a CUDA error surfaced at completion
                done(e)
                return
            done(None)

        self._worker.submit(job)

    def stop(self, timeout: float | None = None) -> None:
        self._worker.stop(timeout)
