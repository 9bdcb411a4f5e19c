"""The Valkey/Redis tier (standalone server): chunks shared by every node that reaches it.

Keys: `<prefix>:{<name>}:v`, where name is the 128-bit hash of the chunk's full key (model,
world size, rank, digest, salt) that the disk tier uses too, inside a hash tag so that any later
parts of one chunk land in the same cluster slot. A value is a header and the payload:

    magic "LMCMPV1\\0" | u32 key length | u32 format length | u64 payload length | u64 XXH64 of the
    payload | the chunk's key | its layout format | payload

A read checks the magic, that key and format are the ones asked for and the checksum, so a stale
or foreign value is a miss (counted), never garbage in GPU blocks. Values move with the zero-copy
RESP connection of resp.py (the measurements behind that choice are in its docstring).

Failures are misses: a server that cannot be reached is tried again only after a backoff, so a
lookup never waits on connects; keys just found missing are not asked for again for a second.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import queue
import struct
import threading
import time
from urllib.parse import unquote, urlparse

from lmcache_mp.storage.l2 import CORRUPT, FORMAT_MISMATCH, IO_ERROR, MISS, TOO_LARGE, L2Backend
from lmcache_mp.storage.l2.resp import Connection, RespError

logger = logging.getLogger(__name__)

MAGIC = b"LMCMPV1\0"
HEAD = struct.Struct("<8sIIQQ")
MAX_FORMAT = 512  # bytes of a format a lookup reads with the header
BACKOFF_S = (0.5, 10.0)  # first and longest wait before reconnecting to an unreachable server
MISSING_TTL_S = 1.0
MISSING_MAX = 1 << 16


def parse_url(url: str) -> dict:
    u = urlparse(url)
    if u.scheme != "redis":
        raise ValueError(f"L2 redis URL must be redis://[user:password@]host:port[/db], got {url!r} "
                         "(rediss:// and cluster mode are not supported yet)")
    db = int(u.path.lstrip("/") or 0)
    return dict(host=u.hostname or "127.0.0.1", port=u.port or 6379, username=unquote(u.username or ""),
                password=unquote(u.password or ""), db=db)


def _view(ptr: int, n: int) -> memoryview:
    return memoryview((ctypes.c_char * n).from_address(ptr)).cast("B")


class ValkeyTier(L2Backend):
    name = "valkey"
    local = False

    def __init__(self, url: str, prefix: str = "lmcache", ttl: float = 0.0, connections: int = 4,
                 timeout: float = 5.0):
        from lmcache_mp import _C

        self._name_of = _C.DiskStore.name_of
        self._xxh64 = _C.xxh64
        self.url = url
        self._where = parse_url(url)
        self._prefix = prefix
        self._ttl_ms = int(ttl * 1000)
        self._timeout = timeout
        self._pool: queue.LifoQueue = queue.LifoQueue()
        self._slots = threading.Semaphore(connections)
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._backoff = BACKOFF_S[0]
        self._missing: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._st = collections.Counter({k: 0 for k in (
            "reads", "read_bytes", "writes", "write_bytes", "errors", "corrupt", "foreign", "connects")})
        self._st_seconds = {"read": 0.0, "write": 0.0}
        self.last_error = ""
        try:
            self._release(self._connect())
            logger.info("L2 valkey %s:%d: connected", self._where["host"], self._where["port"])
        except OSError as e:
            logger.warning("L2 valkey %s: not reachable (%s); serving from the other tiers until it is", url, str(e))

    # ---- connections -------------------------------------------------------------------------

    def _connect(self) -> Connection:
        now = time.monotonic()
        if now < self._down_until:
            raise ConnectionError(f"{self.url} is down (next try in {self._down_until - now:.1f} s)")
        try:
            c = Connection(self._where["host"], self._where["port"], self._timeout, self._where["username"],
                           self._where["password"], self._where["db"])
        except (OSError, RespError) as e:
            with self._lock:
                self._down_until = time.monotonic() + self._backoff
                self._backoff = min(self._backoff * 2, BACKOFF_S[1])
            raise ConnectionError(str(e)) from None
        with self._lock:
            self._backoff = BACKOFF_S[0]
            self._st["connects"] += 1
        return c

    def _acquire(self) -> Connection:
        self._slots.acquire()
        try:
            return self._pool.get_nowait()
        except queue.Empty:
            try:
                return self._connect()
            except BaseException:
                self._slots.release()
                raise

    def _release(self, c: Connection | None) -> None:
        if c is not None:
            self._pool.put(c)
        self._slots.release()

    def _run(self, fn):
        """fn(connection) with a pooled connection; a broken one is closed, not returned."""
        c = self._acquire()
        try:
            out = fn(c)
        except (OSError, ConnectionError) as e:
            c.close()
            self._release(None)
            with self._lock:
                self._st["errors"] += 1
                self.last_error = f"{self.url}: {e}"
            raise ConnectionError(str(e)) from None
        self._release(c)
        return out

    # ---- keys and values ---------------------------------------------------------------------

    def _key(self, key: bytes) -> bytes:
        return f"{self._prefix}:{{{self._name_of(key)}}}:v".encode()

    def _recently_missing(self, rkey: bytes) -> bool:
        with self._lock:
            t = self._missing.get(rkey)
            if t is None:
                return False
            if t < time.monotonic():
                del self._missing[rkey]
                return False
            return True

    def _note_missing(self, rkeys) -> None:
        with self._lock:
            until = time.monotonic() + MISSING_TTL_S
            for k in rkeys:
                self._missing[k] = until
                self._missing.move_to_end(k)
            while len(self._missing) > MISSING_MAX:
                self._missing.popitem(last=False)

    def put(self, keys, formats, ptrs, sizes):
        t0 = time.perf_counter()
        px = ("PX", self._ttl_ms) if self._ttl_ms else ()
        frames = []
        for key, fmt, ptr, n in zip(keys, formats, ptrs, sizes):
            payload = _view(ptr, n)
            head = HEAD.pack(MAGIC, len(key), len(fmt), n, self._xxh64(payload)) + key + fmt
            frames.append(Connection.frame("SET", self._key(key), _Joined(head, payload), *px))

        def send(c: Connection):
            for f in frames:
                c.send(_flatten(f))
            return [c.read() == "OK" for _ in frames]

        try:
            ok = self._run(send)
        except (ConnectionError, RespError) as e:
            self.last_error = str(e)
            return [False] * len(keys)
        with self._lock:
            for key, n, good in zip(keys, sizes, ok):
                if good:
                    self._st["writes"] += 1
                    self._st["write_bytes"] += n
                    self._missing.pop(self._key(key), None)
            self._st_seconds["write"] += time.perf_counter() - t0
        return ok

    def get(self, keys, formats, ptrs, capacities):
        t0 = time.perf_counter()
        rkeys = [self._key(k) for k in keys]

        def fetch(c: Connection):
            c.send([part for rk in rkeys for part in Connection.frame("GET", rk)])
            out = []
            for key, fmt, ptr, cap in zip(keys, formats, ptrs, capacities):
                head = bytearray(HEAD.size + len(key) + len(fmt))
                n = c.read_value_into(memoryview(head), _view(ptr, cap))
                out.append(self._check(n, head, key, fmt, ptr, cap))
            return out

        try:
            results = self._run(fetch)
        except (ConnectionError, RespError) as e:
            self.last_error = str(e)
            return [IO_ERROR] * len(keys)
        self._note_missing([rk for rk, r in zip(rkeys, results) if r == MISS])
        with self._lock:
            for r in results:
                if r >= 0:
                    self._st["reads"] += 1
                    self._st["read_bytes"] += r
            self._st_seconds["read"] += time.perf_counter() - t0
        return results

    def _check(self, n: int, head: bytearray, key: bytes, fmt: bytes, ptr: int, cap: int) -> int:
        if n < 0:
            return MISS
        if n < len(head) or n - len(head) > cap:
            return TOO_LARGE  # not the size asked for: drained unread (a lookup tells the size)
        magic, klen, flen, plen, checksum = HEAD.unpack_from(head)
        if magic != MAGIC or n != HEAD.size + klen + flen + plen:
            return self._bad("corrupt")
        if klen != len(key) or head[HEAD.size:HEAD.size + klen] != key:
            return self._bad("foreign")  # another key hashed to this name
        if flen != len(fmt) or head[HEAD.size + klen:] != fmt:
            return FORMAT_MISMATCH  # (its bytes landed in the slot, which stays unused)
        if plen > cap:
            return TOO_LARGE
        if self._xxh64(_view(ptr, plen)) != checksum:
            return self._bad("corrupt")
        return plen

    def _bad(self, what: str) -> int:
        with self._lock:
            self._st[what] += 1
        return CORRUPT

    def lookup(self, keys):
        rkeys = [self._key(k) for k in keys]
        ask = [i for i, rk in enumerate(rkeys) if not self._recently_missing(rk)]
        out: list = [None] * len(keys)
        if not ask:
            return out

        def heads(c: Connection):
            parts = []
            for i in ask:
                parts += Connection.frame("GETRANGE", rkeys[i], 0, HEAD.size + len(keys[i]) + MAX_FORMAT - 1)
            c.send(parts)
            return [c.read() for _ in ask]

        try:
            got = self._run(heads)
        except (ConnectionError, RespError) as e:
            self.last_error = str(e)
            return out
        missing = []
        for i, h in zip(ask, got):
            if not h or len(h) < HEAD.size:
                missing.append(rkeys[i])
                continue
            magic, klen, flen, plen, _ = HEAD.unpack_from(h)
            if magic == MAGIC and h[HEAD.size:HEAD.size + klen] == keys[i]:
                out[i] = (plen, bytes(h[HEAD.size + klen:HEAD.size + klen + flen]))
        self._note_missing(missing)
        return out

    def remove(self, keys):
        try:
            return self._run(lambda c: c.call("DEL", *[self._key(k) for k in keys]))
        except (ConnectionError, RespError):
            return 0

    def stats(self) -> dict:
        with self._lock:
            st = dict(self._st)
            down = max(0.0, self._down_until - time.monotonic())
        return {"url": self.url, **st, "read_seconds": self._st_seconds["read"],
                "write_seconds": self._st_seconds["write"], "down_for_s": round(down, 2),
                "last_error": self.last_error}

    def close(self) -> None:
        while True:
            try:
                self._pool.get_nowait().close()
            except queue.Empty:
                return


class _Joined:
    """Header and payload sent as one RESP value without joining them in memory."""

    def __init__(self, head: bytes, payload: memoryview):
        self.parts = (head, payload)
        self.nbytes = len(head) + payload.nbytes


def _flatten(frame: list) -> list:
    out = []
    for part in frame:
        if isinstance(part, _Joined):
            out += part.parts
        else:
            out.append(part)
    return out
