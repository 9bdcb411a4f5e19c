"""Answers with a deadline: a thread that runs callbacks at their time, and the guard that lets
only the first of two events (done, deadline) answer."""

from __future__ import annotations

import heapq
import logging
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)


def first_of_two() -> Callable[[], bool]:
    """True for the first call only, from any thread: of two events (done, deadline), the
    first one answers."""
    once = iter((True,))
    return lambda: next(once, False)


class Deadlines:
    """One thread that runs callbacks at their time."""

    def __init__(self):
        self._heap: list = []
        self._seq = 0
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="lmcache-l2-deadlines", daemon=True)
        self._thread.start()

    def at(self, when: float, fn: Callable[[], None]) -> None:
        with self._cv:
            self._seq += 1
            heapq.heappush(self._heap, (when, self._seq, fn))
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cv.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                if self._stop:
                    return
                _, _, fn = heapq.heappop(self._heap)
            try:
                fn()
            except Exception:
                logger.exception("L2 deadline callback failed")

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join()
