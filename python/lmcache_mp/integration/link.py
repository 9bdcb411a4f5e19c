"""A connection to the lmcache-mp server that an engine can use without ever waiting on it.

The engine's scheduler must not stall because the cache server is slow, absent or restarting:
a missing server only means "no cache hits". `ClientLink` owns at most one `Client`, made by a
thread of its own that tries every `retry_interval` seconds until a server answers (the worker
registers its KV cache there, so a server that comes up later is used as soon as it answers, not
at the next request). Once made, the client watches the server itself (its heartbeat): while
the server is away `get()` hands out no client, and when it is back (restarted or not) the
client registers the KV caches again before it serves. Requests therefore never wait for a
reconnection. A server that answers heartbeats but lets a request time out is slow: the client
is not handed out for `retry_interval` seconds, so such a server costs one timeout per interval,
not one per request.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from typing import Any, Callable

from lmcache_mp.client.endpoint import nothing_listens
from lmcache_mp.errors import ServerUnavailable

logger = logging.getLogger(__name__)

_live_links: "weakref.WeakSet[ClientLink]" = weakref.WeakSet()


@atexit.register
def _close_live_links() -> None:
    # Engines do not always call shutdown() before the interpreter exits; closing the clients
    # here, while the interpreter is still whole, says goodbye to the server (dropping leases)
    # and stops the client's threads before their sockets are torn down at random.
    for link in list(_live_links):
        link.close()


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
        curve_server_key: str = "",
        curve_client_key: str = "",
        client_factory: Callable[[str, float, float], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.url = url
        self.name = name
        self.request_timeout = float(request_timeout)
        self.connect_timeout = float(connect_timeout)
        self.retry_interval = float(retry_interval)
        # CURVE key files for the client (empty: the client's LMCACHE_MP_CURVE_* environment variables)
        self.curve_server_key = curve_server_key
        self.curve_client_key = curve_client_key
        self._on_connect = on_connect
        self._factory = client_factory or self._make_client
        self._probe = client_factory is None  # (a test's factory may need no server)
        self._clock = clock
        self._lock = threading.Lock()
        self._client = None
        self._connecting: threading.Thread | None = None
        self._settled = threading.Event()  # set when the first attempt ended, either way
        self._stop = threading.Event()
        self._paused_until = 0.0
        self._slow_logged = False  # a slow server has been logged and has not answered since
        self._away_logged = False  # an outage has been logged and not yet its end
        self._closed = False
        _live_links.add(self)

    def _make_client(self, url: str, timeout: float, connect_timeout: float):
        from lmcache_mp import Client

        return Client(url, timeout=timeout, connect_timeout=connect_timeout, name=self.name.removeprefix("lmcache-mp "),
                      curve_server_key=self.curve_server_key or None, curve_client_key=self.curve_client_key or None)

    # ---- state -------------------------------------------------------------------------------

    @property
    def client(self):
        """The client if one was ever made (even while its server is away), else None."""
        return self._client

    def connect(self, wait: float = 0.0):
        """Start connecting if needed, and wait up to `wait` seconds for the first attempt to
        end (at once when nobody listens at the URL); returns `get()`."""
        self._start()
        if wait > 0:
            self._settled.wait(wait)
        return self.get()

    def get(self):
        """The client, or None while none is made, its server is away, or it is paused after a
        slow request."""
        client = self._client
        if client is None:
            if self._connecting is None:
                self._start()
            return None
        if self._closed:
            return None
        away = getattr(client, "server_away", "")
        if away:
            # The heartbeat says when it is back; a pause for a request that failed as it left
            # would only hold the client back longer.
            self._paused_until = 0.0
            self._log_outage(away)
            return None
        if self._away_logged:
            self._log_outage("")
        if self._clock() < self._paused_until:
            return None
        return client

    def _log_outage(self, away: str) -> None:
        """Once when the engine first meets an outage, once when it first finds it over."""
        with self._lock:
            changed = self._away_logged != bool(away)
            self._away_logged = bool(away)
        if changed and away:
            logger.warning("%s: server %s is away (%s); treating it as a cache miss until it is back", self.name,
                           self.url, away)
        elif changed:
            logger.info("%s: server %s is back", self.name, self.url)

    def report_failure(self, exc: BaseException) -> None:
        """A request failed (timed out, or found no server): unless the client already knows its
        server is away, the server is slow; stop using the client for retry_interval seconds."""
        client = self._client
        if client is not None and getattr(client, "server_away", ""):
            return  # the client logged the outage, and hands out nothing until it is over
        with self._lock:
            self._paused_until = self._clock() + self.retry_interval
            first = not self._slow_logged
            self._slow_logged = True
        if first:
            logger.warning(
                "%s: a request to %s failed (%s); treating the server as a cache miss for %.1f s at a time while "
                "requests fail",
                self.name,
                self.url,
                exc,
                self.retry_interval,
            )

    def report_success(self) -> None:
        if self._slow_logged:
            with self._lock:
                was, self._slow_logged = self._slow_logged, False
            if was:
                logger.info("%s: server %s answers in time again", self.name, self.url)

    # ---- connecting --------------------------------------------------------------------------

    def _start(self) -> None:
        with self._lock:
            if self._closed or self._connecting is not None:
                return
            self._connecting = threading.Thread(target=self._run, name=f"{self.name}-connect", daemon=True)
        self._connecting.start()

    def _run(self) -> None:
        """Until a client is made: an attempt, then retry_interval seconds of rest."""
        failed_before = False
        while not self._stop.is_set():
            client = self._attempt(failed_before)
            self._settled.set()
            if client is not None:
                return
            failed_before = True
            self._stop.wait(self.retry_interval)

    def _attempt(self, failed_before: bool):
        client = None
        try:
            if self._probe and nothing_listens(self.url, timeout=min(self.connect_timeout, 0.5)):
                # a handshake that cannot come: do not wait connect_timeout for it
                raise ServerUnavailable(f"nothing listens at {self.url}")
            client = self._factory(self.url, self.request_timeout, self.connect_timeout)
            if self._on_connect is not None:
                self._on_connect(client)
        except Exception as exc:  # noqa: BLE001 - any failure means "try again later"
            if client is not None:
                try:
                    client.close()
                except Exception:  # noqa: BLE001
                    pass
            log = logger.debug if failed_before else logger.warning
            log("%s: cannot connect to %s (%s); running without the cache, retrying every %.1f s",
                self.name, self.url, exc, self.retry_interval)
            return None
        with self._lock:
            closed = self._closed
            if not closed:
                self._client = client
        if closed:
            client.close()
            return None
        logger.info("%s: connected to %s", self.name, self.url)
        return client

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001
                logger.debug("%s: error closing client", self.name, exc_info=True)
