"""Server: the engine plus its socket thread, in this process (tests, embedding, the CLI)."""

from __future__ import annotations

import logging
import signal
import threading

import zmq

from lmcache_mp.config import ServerConfig, format_size
from lmcache_mp.server.engine import MPCacheEngine
from lmcache_mp.server.ops.gc_pauses import settle
from lmcache_mp.server.ops.resources import check_start, memory_note
from lmcache_mp.server.tenancy.audit import open_audit_log
from lmcache_mp.server.tenancy.tenancy import NoTenancy, Tenancy
from lmcache_mp.server.tenancy.gate import TenantGate
from lmcache_mp.server.transport.router import Transport

logger = logging.getLogger(__name__)


def run_cache_server(config: ServerConfig, return_engine: bool = False) -> MPCacheEngine | None:
    """Start a cache server for `config`.

    return_engine=True: start it in background threads and return the engine (its `url` is the
    bound endpoint; `close()` stops the whole server). Otherwise serve until SIGINT or SIGTERM,
    then drain and stop.
    """
    # embedded (Server, return_engine) a setting is ServerConfig's field; from the CLI, its flag
    setting = (lambda name: name) if return_engine else (lambda name: "--" + name.replace("_", "-"))
    check_start(config, setting)
    try:
        engine = MPCacheEngine(config)
    except RuntimeError as e:
        if "arena" in str(e):  # e.g. mmap: Cannot allocate memory (where overcommit is off)
            raise RuntimeError(f"{e} (L1 of {format_size(config.l1_size)}; {memory_note()})") from None
        raise
    curve = gate = None
    tenancy: Tenancy | NoTenancy = NoTenancy()
    stops: list = []  # what was started, to stop if a later part fails
    try:
        audit = open_audit_log(config.audit_log)
        stops.append(audit.close)
        if config.tenants:
            tenancy = Tenancy(config.tenants, audit, l1_bytes=config.l1_size)
        if config.curve_secret_key:
            from lmcache_mp.server.transport.curve import CurveServer

            curve = CurveServer(config.curve_secret_key, config.curve_clients, tenancy, audit)
            stops.append(curve.stop)
            context = curve.context
        elif tenancy.enabled:  # ipc:// peers by uid/gid: the ZAP handler on a context of its own
            context = zmq.Context()
            gate = TenantGate(context, tenancy)
            stops += [lambda: threading.Thread(target=context.term, daemon=True).start(), gate.stop]
        else:
            context = None
        transport = Transport(config.url, engine, context=context, spin_us=config.spin_us,
                              lane=config.local_lane, ipc_group=config.ipc_group, curve=curve, tenancy=tenancy)
    except Exception:
        for stop in reversed(stops):
            stop()
        engine.close()
        raise
    if tenancy.enabled:
        engine.attach_tenancy(tenancy, transport.revoke)
        audit.write("server_start", tenants_file=config.tenants, tenants=len(tenancy.table), url=transport.url)
    engine.url = transport.url
    engine.lane = transport.lane.address if transport.lane is not None else ""
    engine.add_close_hook(transport.stop)
    for stop in reversed(stops):  # after the socket closes: no handshake goes unchecked meanwhile
        engine.add_close_hook(stop)
    http = None
    try:
        http = _http_endpoint(config, engine, transport, setting("http_addr"))
    except Exception:
        engine.close()
        raise
    settle()  # what start-up made lives as long as the server
    transport.start()
    if http is not None:
        http.ready = True
    if return_engine:
        return engine
    stop = threading.Event()

    def on_signal(signum, frame):
        logger.info("received %s: shutting down", signal.Signals(signum).name)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    if tenancy.enabled:  # the reload runs on a thread of its own, not in the signal handler
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, lambda signum, frame: threading.Thread(
            target=tenancy.reload, name="lmcache-tenants-reload", daemon=True).start())
    else:  # (SIGHUP's default action ends the process, silently: an operator's reload must not)
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, lambda signum, frame: logger.info(
            "received SIGHUP: nothing to reload (no --tenants file; every other setting needs a restart)"))
    logger.info("ready: serving on %s", transport.url)
    try:
        # A signal to the process may land on any of its threads; Python runs the handler on this
        # one only when it next runs: it wakes every second for that (an hour's wait kept a SIGTERM
        # that another thread took unanswered for that hour).
        while not stop.wait(1.0):
            pass
    finally:
        engine.close()
        for s, h in previous.items():
            signal.signal(s, h)
        logger.info("stopped")
    return None


def _http_endpoint(config: ServerConfig, engine: MPCacheEngine, transport: Transport, setting: str):
    """The HTTP listener (stopped last, so that /health says "draining" while the server drains).
    The default address taken (another server on this machine) leaves it to that server: this one
    listens on a free port of the same host and says at WARNING which server answers on the
    default address and where its own /health is; an address a setting named is an error when
    taken (probes would reach the other server). Both name `setting`, where the address came from."""
    if config.http_addr == "off":
        return None
    from lmcache_mp.config import DEFAULT_HTTP_ADDR, parse_addr
    from lmcache_mp.server.ops.http import HttpEndpoint
    from lmcache_mp.server.ops.resources import http_answerer

    try:
        http = HttpEndpoint(config.http_addr, engine, transport)
    except OSError as e:
        if config.http_addr != DEFAULT_HTTP_ADDR or "http_addr" in config.given:
            raise OSError(f"cannot serve HTTP on {config.http_addr} ({setting}): {e}") from None
        host, _ = parse_addr(config.http_addr)
        http = HttpEndpoint(f"{host}:0", engine, transport)
        logger.warning("HTTP: %s is taken (%s answers there), so this server's /metrics, /health and /status are on "
                       "%s; set %s to pin an address of its own", config.http_addr, http_answerer(config.http_addr),
                       http.address, setting)
    engine.http, engine.http_endpoint = http.address, http
    engine.add_close_hook(http.stop)
    return http.start()


class Server:
    """A cache server running in background threads of this process.

    >>> server = Server(ServerConfig(url="tcp://127.0.0.1:0", l1_size="2GiB", device="cpu")).start()
    >>> server.url            # the bound endpoint
    >>> server.stop()
    """

    def __init__(self, config: ServerConfig | None = None, **overrides):
        if config is None:
            config = ServerConfig(**overrides)
        elif overrides:
            raise TypeError("pass either a ServerConfig or keyword settings, not both")
        self.config = config
        self.engine: MPCacheEngine | None = None

    def start(self) -> "Server":
        if self.engine is None:
            self.engine = run_cache_server(self.config, return_engine=True)
        return self

    @property
    def url(self) -> str:
        if self.engine is None:
            raise RuntimeError("the server is not started")
        return self.engine.url

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
