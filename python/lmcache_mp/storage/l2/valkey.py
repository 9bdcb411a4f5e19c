"""The Valkey/Redis tier (a server or a cluster): chunks shared by every node that reaches it.

Keys: `<prefix>:{<name>}:v`, where name is the 128-bit hash of the chunk's full key (model,
world size, rank, digest, salt) that the disk tier uses too, inside a hash tag so that any later
parts of one chunk land in the same cluster slot. A value is a header and the payload:

    magic "LMCMPV2\\0" | u32 key length | u32 format length | u64 payload length | u64 XXH3-64 of
    the payload | the chunk's key | its layout format | payload

A read checks the magic, that key and format are the ones asked for and the checksum, so a stale
or foreign value is a miss (counted), never garbage in GPU blocks. Values move with the zero-copy
RESP connection of resp.py (the measurements behind that choice are in its docstring). The
checksums run on two helper threads (they release the GIL), overlapped with the socket: a put
sends value i while value i+1 is summed, a get sums value i while reading value i+1.

Failures are misses: a server that cannot be reached is tried again only after a backoff, so a
lookup never waits on connects; keys just found missing are not asked for again for a second.
A cluster's slot map comes from CLUSTER SLOTS; commands are pipelined per node, MOVED reloads
the map, ASK is followed once, and a node that fails makes the map reload (a failover). How a
node is reached (the URL, TLS, a node's connections) is valkey_nodes.py's.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from typing import NamedTuple

from lmcache_mp.storage.l2 import (CORRUPT, FORMAT_MISMATCH, HEADER_BYTES, IO_ERROR, MISS, TOO_LARGE, L2Backend,
                                   checksum_async, memory_view, pack_header, unpack_header)
from lmcache_mp.storage.l2.resp import Connection, RespError
from lmcache_mp.storage.l2.valkey_nodes import SLOTS, Node, key_slot, parse_url, redacted

logger = logging.getLogger(__name__)

MAGIC = b"LMCMPV2\0"  # V1 summed with XXH64: its values are foreign now
MAX_FORMAT = 512  # bytes of a format a lookup reads with the header
SEND_BATCH = 1 << 20  # a pipeline's commands go out once this many bytes are framed
# GETs in flight on one connection. One: with two, the server copies the next value into an
# output buffer while the first is still being sent; measured on loopback, 32 MiB values, that
# took GET from 2.4 to 1.4 GB/s. A round trip per value costs about 1% at this size.
GET_WINDOW = 1
PUT_WINDOW = 4  # SETs in flight on one connection (their replies are small)
MISSING_TTL_S = 1.0
MISSING_MAX = 1 << 16


class _Redirect(NamedTuple):
    node: tuple
    ask: bool


class ValkeyTier(L2Backend):
    name = "valkey"
    local = False
    default_write = "all"  # shared by every node: written as soon as stored, so that the others find it

    def __init__(self, url: str, prefix: str = "lmcache", ttl: float = 0.0, connections: int = 4,
                 timeout: float = 5.0, cluster: bool = False):
        from lmcache_mp import native

        self._name_of = native.DiskStore.name_of
        self.url = url
        where = parse_url(url)
        self._seeds = where.pop("seeds")
        self._auth = where
        self.cluster = cluster or len(self._seeds) > 1
        self._prefix = prefix
        self._ttl_ms = int(ttl * 1000)
        self._timeout = timeout
        self._connections = connections
        # a batch's streams to every primary at once (threads are made as needed: up to 16 primaries)
        self._parallel = concurrent.futures.ThreadPoolExecutor(16 * connections, thread_name_prefix="lmcache-valkey")
        self._lock = threading.Lock()
        self._nodes: dict[tuple, Node] = {}
        self._slot_map: list | None = None  # cluster: slot -> primary's address
        self._missing: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._st = collections.Counter({k: 0 for k in (
            "reads", "read_bytes", "writes", "write_bytes", "errors", "corrupt", "foreign", "redirects",
            "slot_map_loads")})
        self._st_seconds = {"read": 0.0, "write": 0.0}
        self.last_error = ""
        try:
            if self.cluster:
                self._load_slots()
            else:
                self._node(self._seeds[0]).run(lambda c: c.call("PING"))
            logger.info("L2 valkey %s: connected%s", redacted(url),
                        f", a cluster of {len(set(self._slot_map))} primaries" if self.cluster else "")
        except (ConnectionError, RespError) as e:
            logger.warning("L2 valkey %s: not reachable (%s); serving from the other tiers until it is",
                           redacted(url), str(e))

    # ---- routing -----------------------------------------------------------------------------

    def _node(self, addr: tuple) -> Node:
        with self._lock:
            node = self._nodes.get(addr)
            if node is None:
                node = self._nodes[addr] = Node(addr, self._auth, self._timeout, self._connections)
            return node

    def _load_slots(self) -> None:
        """The cluster's slot map, from the first node that answers (known ones, then the seeds)."""
        errors = []
        with self._lock:
            known = list(self._nodes)
        for addr in dict.fromkeys(known + self._seeds):
            try:
                ranges = self._node(addr).run(lambda c: c.call("CLUSTER", "SLOTS"))
            except (ConnectionError, RespError) as e:
                errors.append(str(e))
                continue
            slots: list = [None] * SLOTS
            for r in ranges:
                primary = (r[2][0].decode() or addr[0], int(r[2][1]))
                for i in range(int(r[0]), int(r[1]) + 1):
                    slots[i] = primary
            with self._lock:
                self._slot_map = slots
                self._st["slot_map_loads"] += 1
            return
        raise ConnectionError("no cluster node answered: " + "; ".join(errors))

    def _addr_of(self, rkey: bytes) -> tuple:
        if not self.cluster:
            return self._seeds[0]
        if self._slot_map is None:
            self._load_slots()
        addr = self._slot_map[key_slot(rkey)]
        if addr is None:
            raise ConnectionError(f"slot {key_slot(rkey)} is not served by any node")
        return addr

    def _batch(self, rkeys: list[bytes], frame_of, read_of, failed, window: int = 0) -> list:
        """One command per key (frame_of(i) -> buffers), pipelined per node, each reply read by
        read_of(connection, i). Cluster redirects are followed (MOVED reloads the slot map, ASK
        goes to the named node once); a key whose node cannot be reached gets failed(i)."""
        out: list = [None] * len(rkeys)
        todo, asking = list(range(len(rkeys))), {}
        for _ in range(3):
            groups: dict[tuple, list[int]] = collections.defaultdict(list)
            reload = False
            for i in todo:
                try:
                    groups[asking.get(i) or self._addr_of(rkeys[i])].append(i)
                except ConnectionError as e:
                    self._error(str(e))
                    out[i] = failed(i)
            retry = []
            jobs = [(addr, part) for addr, idx in groups.items() for part in self._streams(idx, window)]

            def run(job):
                addr, idx = job
                try:
                    return idx, self._node(addr).run(lambda c: self._pipe(c, idx, frame_of, read_of, asking, window))
                except (ConnectionError, RespError) as e:
                    return idx, e

            for idx, got in (self._parallel.map(run, jobs) if len(jobs) > 1 else map(run, jobs)):
                if isinstance(got, Exception):
                    self._error(str(got))
                    reload = self.cluster  # a primary may have failed over
                    for i in idx:
                        out[i] = failed(i)
                    continue
                for i, r in zip(idx, got):
                    if isinstance(r, _Redirect):
                        retry.append(i)
                        with self._lock:
                            self._st["redirects"] += 1
                        if r.ask:
                            asking[i] = r.node
                        else:
                            asking.pop(i, None)
                            reload = True
                    else:
                        asking.pop(i, None)
                        out[i] = r
            if reload:
                try:
                    self._load_slots()
                except ConnectionError as e:
                    self._error(str(e))
            todo = retry
            if not todo:
                break
        for i in todo:
            out[i] = failed(i)
        return out

    def _streams(self, idx: list[int], window: int) -> list[list[int]]:
        """The batches of large values (gets and puts, which set a window) spread over the node's
        connections, so that several TCP streams move them at once; small commands stay on one."""
        k = min(self._connections, len(idx)) if window else 1
        return [idx[j::k] for j in range(k)]

    @staticmethod
    def _pipe(c: Connection, idx: list[int], frame_of, read_of, asking: dict, window: int = 0) -> list:
        """The commands of idx on one connection; with a window, at most that many are in flight
        (large replies: the server would copy every pipelined value into output buffers)."""

        def send(some: list[int]) -> None:
            parts, framed = [], 0
            for i in some:  # large values go out as they are framed (their checksums are ready one by one)
                if i in asking:
                    parts += Connection.frame("ASKING")
                more = _flatten(frame_of(i))
                parts += more
                framed += sum(memoryview(p).nbytes for p in more)
                if framed >= SEND_BATCH:
                    c.send(parts)
                    parts, framed = [], 0
            if parts:
                c.send(parts)

        ahead = window or len(idx)
        send(idx[:ahead])
        out = []
        for i in idx:
            if i in asking:
                c.read()
            try:
                out.append(read_of(c, i))
            except RespError as e:
                words = str(e).split()
                if words and words[0] in ("MOVED", "ASK") and len(words) == 3:
                    host, _, port = words[2].rpartition(":")
                    out.append(_Redirect((host or c.sock.getpeername()[0], int(port)), words[0] == "ASK"))
                else:
                    raise
            if ahead < len(idx):
                send(idx[ahead:ahead + 1])
                ahead += 1
        return out

    def _error(self, msg: str) -> None:
        with self._lock:
            self._st["errors"] += 1
            self.last_error = msg

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
        rkeys = [self._key(k) for k in keys]

        sums = [checksum_async(memory_view(p, n)) for p, n in zip(ptrs, sizes)]

        def frame_of(i: int) -> list:
            head = pack_header(MAGIC, keys[i], formats[i], sizes[i], sums[i].result())
            return Connection.frame("SET", rkeys[i], _Joined(head, memory_view(ptrs[i], sizes[i])), *px)

        ok = self._batch(rkeys, frame_of, lambda c, i: c.read() == "OK", lambda i: False, window=PUT_WINDOW)
        with self._lock:
            for rk, n, good in zip(rkeys, sizes, ok):
                if good:
                    self._st["writes"] += 1
                    self._st["write_bytes"] += n
                    self._missing.pop(rk, None)
            self._st_seconds["write"] += time.perf_counter() - t0
        return ok

    def get(self, keys, formats, ptrs, capacities):
        t0 = time.perf_counter()
        rkeys = [self._key(k) for k in keys]

        def read_of(c: Connection, i: int) -> int:
            head = bytearray(HEADER_BYTES + len(keys[i]) + len(formats[i]))
            n = c.read_value_into(memoryview(head), memory_view(ptrs[i], capacities[i]))
            return self._check(n, head, keys[i], formats[i], ptrs[i], capacities[i])

        results = self._batch(rkeys, lambda i: Connection.frame("GET", rkeys[i]), read_of, lambda i: IO_ERROR,
                              window=GET_WINDOW)
        results = [self._sum_checked(*r) if isinstance(r, tuple) else r for r in results]
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
        h = unpack_header(MAGIC, head)
        if h is None or n != h.size + h.payload_bytes:
            return self._bad("corrupt")
        if h.key != key:
            return self._bad("foreign")  # another key hashed to this name
        if h.fmt != fmt:
            return FORMAT_MISMATCH  # (its bytes landed in the slot, which stays unused)
        if h.payload_bytes > cap:
            return TOO_LARGE
        return checksum_async(memory_view(ptr, h.payload_bytes)), h.checksum, h.payload_bytes

    def _sum_checked(self, summed: concurrent.futures.Future, want: int, n: int) -> int:
        return n if summed.result() == want else self._bad("corrupt")

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
        sub = [rkeys[i] for i in ask]
        heads = self._batch(sub, lambda j: Connection.frame("GETRANGE", sub[j], 0,
                                                            HEADER_BYTES + len(keys[ask[j]]) + MAX_FORMAT - 1),
                            lambda c, j: c.read(), lambda j: None)
        missing = []
        for i, raw in zip(ask, heads):
            if not raw or len(raw) < HEADER_BYTES:
                if raw is not None:
                    missing.append(rkeys[i])
                continue
            h = unpack_header(MAGIC, raw)
            if h is not None and h.key == keys[i]:
                out[i] = (h.payload_bytes, h.fmt)
        self._note_missing(missing)
        return out

    def remove(self, keys):
        rkeys = [self._key(k) for k in keys]
        return sum(r or 0 for r in self._batch(rkeys, lambda i: Connection.frame("DEL", rkeys[i]),
                                               lambda c, i: c.read(), lambda i: 0))

    def stats(self) -> dict:
        with self._lock:
            st = dict(self._st)
            nodes = list(self._nodes.values())
        now = time.monotonic()
        return {"url": redacted(self.url), "cluster": self.cluster, "nodes": len(nodes),
                "connected": bool(nodes) and all(now >= n.down_until for n in nodes),
                "connects": sum(n.connects for n in nodes), **st, "read_seconds": self._st_seconds["read"],
                "write_seconds": self._st_seconds["write"], "last_error": self.last_error}

    def close(self) -> None:
        with self._lock:
            nodes = list(self._nodes.values())
        for n in nodes:
            n.close()
        self._parallel.shutdown(wait=True)


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
