"""Refused clients: short names of their credentials, and WARNING lines that cannot flood the log."""

from __future__ import annotations

import hashlib
import logging
import threading
import time

from zmq.utils import z85

logger = logging.getLogger(__name__)

LOG_EVERY_S = 60.0  # refusals of one kind: a line at most this often


def fingerprint(z85_public_key: bytes | str) -> str:
    """A short name of a CURVE public key for logs (its SHA-256, 12 hex digits)."""
    key = z85_public_key.encode() if isinstance(z85_public_key, str) else z85_public_key
    return hashlib.sha256(z85.decode(key)).hexdigest()[:12]


class RefusalLog:
    """WARNING lines of refused clients, at most one a LOG_EVERY_S of each kind."""

    def __init__(self):
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}
        self.count = 0

    def refused(self, kind: str, message: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.count += 1
            if now - self._last.get(kind, -LOG_EVERY_S) < LOG_EVERY_S:
                self._quiet[kind] = self._quiet.get(kind, 0) + 1
                return
            self._last[kind] = now
            quiet = self._quiet.pop(kind, 0)
        logger.warning("refused a client: %s%s", message, f" ({quiet} more refused like it since the last line)"
                       if quiet else "")
