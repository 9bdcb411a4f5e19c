"""A connection to the lmcache-mp server that an engine can use without ever waiting on it.

The engine's scheduler must not stall because the cache server is slow, absent or restarting:
a missing server only means "no cache hits". `ClientLink` owns at most one `Client`, makes it
in a background thread (at most once every `retry_interval` seconds), and after a call fails
with `ServerUnavailable` hands out no client until `retry_interval` has passed, so each outage
costs one timeout, not one per request. Outages are logged once when they start and once when
they end. Once made, the client reconnects and re-registers by itself after a server restart.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from typing import Any, Callable

logger = logging.getLogger(__name__)

_live_links: "weakref.WeakSet[ClientLink]" = weakref.WeakSet()


@atexit.register
def _close_live_links() -> None:
    # Engines do not always call shutdown() before the interpreter exits; closing the clients
    # here, while the interpreter is still whole, says goodbye to the server (dropping leases)
    # and stops the client's threads before their sockets are torn down at random.
    for link in list(_live_links):
        link.close()


def _default_factory(url: str, timeout: float, connect_timeout: float):
    from lmcache_mp import Client

    return Client(url, timeout=timeout, connect_timeout=connect_timeout)


class ClientLink:
    """Lazily connected client: `get()` never blocks; it returns None while the server is away.

    `on_connect(client)` runs in the connecting thread before the client is handed out (the
    worker registers its KV cache there); if it raises, the client is closed and the attempt
    counts as failed.
    """

    def __init__(
        self,
        url: str,
        *,
        name: str = "lmcache-mp",
        request_timeout: float = 10.0,
        connect_timeout: float = 5.0,
        retry_interval: float = 5.0,
        on_connect: Callable[[Any], None] | None = None,
        client_factory: Callable[[str, float, float], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.url = url
        self.name = name
        self.request_timeout = float(request_timeout)
        self.connect_timeout = float(connect_timeout)
        self.retry_interval = float(retry_interval)
        self._on_connect = on_connect
        self._factory = client_factory or _default_factory
        self._clock = clock
        self._lock = threading.Lock()
        self._client = None
        self._connecting: threading.Thread | None = None
        self._settled = threading.Event()  # set when the latest attempt ended, either way
        self._next_attempt = 0.0
        self._paused_until = 0.0
        self._down = False  # an outage has been logged and not yet its end
        self._closed = False
        _live_links.add(self)

    # ---- state -------------------------------------------------------------------------------

    @property
    def client(self):
        """The client if one was ever made (even while paused), else None."""
        return self._client

    def connect(self, wait: float = 0.0):
        """Start connecting if needed and wait up to `wait` seconds for the attempt to end;
        returns `get()`."""
        self._maybe_start_attempt(force=True)
        if wait > 0:
            self._settled.wait(wait)
        return self.get()

    def get(self):
        """The client, or None while it is not connected or paused after a failure."""
        if self._closed:
            return None
        client = self._client
        if client is None:
            self._maybe_start_attempt()
            return None
        if self._clock() < self._paused_until:
            return None
        return client

    def report_failure(self, exc: BaseException) -> None:
        """A call timed out or found no server: stop using the client for a while."""
        with self._lock:
            self._paused_until = self._clock() + self.retry_interval
            first = not self._down
            self._down = True
        if first:
            logger.warning(
                "%s: server %s unavailable (%s); treating it as a cache miss, retrying every %.1f s",
                self.name,
                self.url,
                exc,
                self.retry_interval,
            )

    def report_success(self) -> None:
        if self._down:
            with self._lock:
                was_down, self._down = self._down, False
            if was_down:
                logger.info("%s: server %s reachable again", self.name, self.url)

    # ---- connecting --------------------------------------------------------------------------

    def _maybe_start_attempt(self, force: bool = False) -> None:
        with self._lock:
            if self._closed or self._client is not None or self._connecting is not None:
                return
            if not force and self._clock() < self._next_attempt:
                return
            self._next_attempt = self._clock() + self.retry_interval
            t = threading.Thread(target=self._attempt, name=f"{self.name}-connect", daemon=True)
            self._connecting = t
            self._settled.clear()
        t.start()

    def _attempt(self) -> None:
        client = None
        try:
            client = self._factory(self.url, self.request_timeout, self.connect_timeout)
            if self._on_connect is not None:
                self._on_connect(client)
        except Exception as exc:  # noqa: BLE001 - any failure means "try again later"
            if client is not None:
                try:
                    client.close()
                except Exception:  # noqa: BLE001
                    pass
            with self._lock:
                self._connecting = None
                first = not self._down
                self._down = True
            if first:
                logger.warning(
                    "%s: cannot connect to %s (%s); running without the cache, retrying every %.1f s",
                    self.name,
                    self.url,
                    exc,
                    self.retry_interval,
                )
            self._settled.set()
            return
        with self._lock:
            self._connecting = None
            if self._closed:
                closed = True
            else:
                closed = False
                self._client = client
                self._paused_until = 0.0
        self._settled.set()
        if closed:
            client.close()
            return
        if self._down:
            self.report_success()
        else:
            logger.info("%s: connected to %s", self.name, self.url)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001
                logger.debug("%s: error closing client", self.name, exc_info=True)
