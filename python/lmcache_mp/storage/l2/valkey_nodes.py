"""How the Valkey/Redis tier reaches its servers: the URL (TLS included), the cluster's key slots,
and one server's pooled connections with their reconnect backoff (valkey.py is the tier itself)."""

from __future__ import annotations

import binascii
import queue
import ssl
import threading
import time
from urllib.parse import parse_qsl, unquote, urlparse

from lmcache_mp.storage.l2.resp import Connection, RespError

SLOTS = 16384
BACKOFF_S = (0.5, 10.0)  # first and longest wait before reconnecting to an unreachable server
TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")


def parse_url(url: str) -> dict:
    """redis[s]://[user:password@]host:port[,host:port...][/db][?option=value&...]: several
    addresses are seeds of a cluster. rediss:// is TLS, verified against the system's CAs or
    ssl_ca_certs; ssl_certfile/ssl_keyfile give a client certificate; ssl_cert_reqs=none skips
    the verification, ssl_check_hostname=false only the host name check (option names as redis-py's)."""
    u = urlparse(url)
    if u.scheme not in ("redis", "rediss"):
        raise ValueError(f"L2 redis URL must be redis[s]://[user:password@]host:port[,host:port...][/db], got {url!r}")
    options = dict(parse_qsl(u.query, keep_blank_values=True))
    unknown = set(options) - set(TLS_OPTIONS)
    if unknown or (options and u.scheme != "rediss"):
        raise ValueError(f"L2 redis URL {url!r}: options {sorted(options)} are not known"
                         f"{'' if unknown else ' without rediss://'} (known: {', '.join(TLS_OPTIONS)})")
    netloc = u.netloc.rsplit("@", 1)[-1]
    seeds = []
    for hp in netloc.split(","):
        host, _, port = hp.rpartition(":")
        if not host:
            host, port = hp, "6379"
        seeds.append((host.strip("[]") or "127.0.0.1", int(port)))
    return dict(seeds=seeds, username=unquote(u.username or ""), password=unquote(u.password or ""),
                db=int(u.path.lstrip("/") or 0), tls=_tls_context(options) if u.scheme == "rediss" else None)


def _tls_context(options: dict) -> ssl.SSLContext:
    try:
        ctx = ssl.create_default_context(cafile=options.get("ssl_ca_certs") or None)
        if options.get("ssl_certfile"):
            ctx.load_cert_chain(options["ssl_certfile"], options.get("ssl_keyfile") or None)
    except OSError as e:  # ssl.SSLError is one
        raise ValueError(f"L2 redis TLS files: {e}") from None
    reqs = options.get("ssl_cert_reqs", "required").lower()
    if reqs not in ("required", "none"):
        raise ValueError(f"ssl_cert_reqs must be required or none, got {reqs!r}")
    if reqs == "none" or options.get("ssl_check_hostname", "true").lower() in ("false", "0", "no"):
        ctx.check_hostname = False
    if reqs == "none":
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def key_slot(key: bytes) -> int:
    """The cluster's key-to-slot hash: CRC16-XMODEM (binascii's crc_hqx from 0, in C: a loop in
    Python took 57 us a key, 4 ms of a 64-chunk lookup) of the key's hash tag."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1:end]
    return binascii.crc_hqx(key, 0) % SLOTS


class Node:
    """Pooled connections to one server, with its own reconnect backoff."""

    def __init__(self, addr: tuple, auth: dict, timeout: float, connections: int):
        self.addr, self._auth, self._timeout = addr, auth, timeout
        self._pool: queue.LifoQueue = queue.LifoQueue()
        self._slots = threading.Semaphore(connections)
        self._lock = threading.Lock()
        self.down_until = 0.0
        self._backoff = BACKOFF_S[0]
        self.connects = 0

    def _connect(self) -> Connection:
        now = time.monotonic()
        if now < self.down_until:
            raise ConnectionError(f"{self.addr[0]}:{self.addr[1]} is down (next try in {self.down_until - now:.1f} s)")
        try:
            c = Connection(self.addr[0], self.addr[1], self._timeout, **self._auth)
        except (OSError, RespError) as e:
            with self._lock:
                self.down_until = time.monotonic() + self._backoff
                self._backoff = min(self._backoff * 2, BACKOFF_S[1])
            raise ConnectionError(f"{self.addr[0]}:{self.addr[1]}: {e}") from None
        with self._lock:
            self._backoff = BACKOFF_S[0]
            self.connects += 1
        return c

    def run(self, fn):
        """fn(connection) on a pooled connection; a broken one is closed, not returned."""
        self._slots.acquire()
        try:
            try:
                c = self._pool.get_nowait()
            except queue.Empty:
                c = self._connect()
            try:
                out = fn(c)
            except (OSError, ConnectionError) as e:  # a timeout too: later calls fail fast for a while
                c.close()
                with self._lock:
                    self.down_until = time.monotonic() + self._backoff
                    self._backoff = min(self._backoff * 2, BACKOFF_S[1])
                raise ConnectionError(f"{self.addr[0]}:{self.addr[1]}: {e}") from None
            self._pool.put(c)
            return out
        finally:
            self._slots.release()

    def close(self) -> None:
        while True:
            try:
                self._pool.get_nowait().close()
            except queue.Empty:
                return


def redacted(url: str) -> str:
    """The URL without its password (status and logs are not secret)."""
    u = urlparse(url)
    if u.password is None:
        return url
    return url.replace(f":{u.password}@", ":***@", 1)
