"""Threads that run a registration's requests in order (GPU completions: lmcache_mp/completions.py)."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

logger = logging.getLogger(__name__)


class SerialWorker:
    """Runs submitted callables one after another on its own thread (one per registration, so
    tensor-parallel ranks proceed in parallel while one client's requests keep their order)."""

    def __init__(self, name: str):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
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
