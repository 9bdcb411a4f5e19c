"""The operator's HTTP listener: /metrics (Prometheus), /live, /health and /status (JSON).

  /live    200 while the socket thread goes round its loop (it wakes at least twice a second);
           503 when it has not for LIVE_STALL_S, or has stopped: restart the process.
  /health  200 when the server takes requests: socket bound, arena allocated, not draining;
           503 while starting or draining. The body says why, and how each L2 tier is doing
           (an L2 tier that is down never makes the server unhealthy: L2 is lossy).
  /status  the engine's status, as `lmcache-mp-server`'s clients get it from `Client.status()`.

Every answer is computed when asked for; nothing here runs on the request path.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from lmcache_mp.config import parse_addr

logger = logging.getLogger(__name__)

LIVE_STALL_S = 10.0


class HttpEndpoint:
    def __init__(self, addr: str, engine, transport):
        from prometheus_client import CollectorRegistry

        from lmcache_mp.server.ops.metrics import StatusCollector

        self.engine, self.transport = engine, transport
        self.ready = False
        registry = CollectorRegistry(auto_describe=False)
        registry.register(StatusCollector(engine, transport.stats))
        self._registry = registry
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the http.server name
                path = self.path.split("?", 1)[0]
                try:
                    code, kind, body = endpoint.answer(path)
                except Exception as e:  # an answer that failed is a 500, never a dead listener
                    logger.exception("HTTP %s failed", path)
                    code, kind, body = 500, "text/plain", f"{type(e).__name__}: {e}\n".encode()
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt, *args):
                logger.debug("HTTP %s " + fmt, self.client_address[0], *args)

        self._http = ThreadingHTTPServer(parse_addr(addr), Handler)
        self._http.daemon_threads = True
        self.address = "%s:%d" % self._http.server_address[:2]
        self._thread = threading.Thread(target=self._http.serve_forever, name="lmcache-http", daemon=True)

    def start(self) -> "HttpEndpoint":
        self._thread.start()
        logger.info("HTTP on %s: /metrics /live /health /status", self.address)
        return self

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()

    # ---- answers -----------------------------------------------------------------------------

    def answer(self, path: str) -> tuple[int, str, bytes]:
        if path == "/metrics":
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            return 200, CONTENT_TYPE_LATEST, generate_latest(self._registry)
        if path == "/live":
            ok, why = self.live()
            return (200 if ok else 503), "text/plain", (why + "\n").encode()
        if path == "/health":
            body = self.health()
            return (200 if body["ready"] else 503), "application/json", _json(body)
        if path == "/status":
            return 200, "application/json", _json(self.engine.status())
        return 404, "text/plain", b"not found: /metrics /live /health /status\n"

    def live(self) -> tuple[bool, str]:
        beat = getattr(self.transport, "beat", None)
        if not self.transport.alive():
            return False, "the socket thread has stopped"
        if beat is not None and time.monotonic() - beat > LIVE_STALL_S:
            return False, f"the socket thread has not gone round its loop for {time.monotonic() - beat:.0f} s"
        return True, "live"

    def health(self) -> dict:
        if self.engine.closing:
            state = "draining"
        elif not self.ready:
            state = "starting"
        elif not self.transport.alive():
            state = "socket closed"
        else:
            state = "ready"
        # url and pid: which server answers here (another on this machine may have been meant)
        out = {"ready": state == "ready", "state": state, "url": self.engine.url, "pid": os.getpid()}
        if self.engine.l2 is not None:
            out["l2"] = [{"name": t.get("name"), "up": t.get("connected", True) and not t.get("down", False),
                          "last_error": t.get("last_error", "")} for t in self.engine.l2.stats()["tiers"]]
        return out


def _json(obj) -> bytes:
    return (json.dumps(obj, default=str, indent=1) + "\n").encode()
