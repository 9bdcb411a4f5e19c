"""The Mooncake Store tier: the shared memory pool that vLLM, SGLang, LMCache and Dynamo use.

The L1 arena is registered with the store once, so `batch_put_from` and `batch_get_into` move
payloads straight between arena slots and the pool (TCP transport here; RDMA where the
machine has it). Mooncake keeps bytes, not our header, so every chunk has a second, small
object `<key>:m` with the same header as the Valkey tier (magic, key, format, length, XXH3-64):
a read fetches it first and checks format and length, then the payload, then the checksum.
The store's own errors (for example -704, the object was evicted) are misses.

Needs the optional `mooncake-transfer-engine-non-cuda` package (and the system's libibverbs
even for TCP) and a running `mooncake_master` with its metadata server.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import time
from urllib.parse import urlparse

from lmcache_mp.storage.l2 import (CORRUPT, FORMAT_MISMATCH, HEADER_BYTES, IO_ERROR, MISS, TOO_LARGE, L2Backend,
                                   checksum_async, memory_view, pack_header, unpack_header)

logger = logging.getLogger(__name__)

MAGIC = b"LMCMPM2\0"  # M1 summed with XXH64
RETRY_S = 5.0  # a store that failed to set up is tried again after this long


class MooncakeTier(L2Backend):
    name = "mooncake"
    local = False
    default_write = "all"  # shared by every node: written as soon as stored, so that the others find it

    def __init__(self, master: str, metadata: str, arena, segment_bytes: int, local_buffer_bytes: int = 64 << 20,
                 prefix: str = "lmcache", protocol: str = "tcp"):
        from lmcache_mp import native

        self._name_of = native.DiskStore.name_of
        self.master, self.metadata = master, metadata
        self._arena = arena
        self._segment, self._local_buffer = segment_bytes, local_buffer_bytes
        self._prefix, self._protocol = prefix, protocol
        self._lock = threading.Lock()
        self._store = None
        self._buffers: list[tuple[int, int]] = []  # memory besides the arena that moves (a codec's)
        self._setting_up = False
        self._retry_at = 0.0
        self._st = collections.Counter({k: 0 for k in (
            "reads", "read_bytes", "writes", "write_bytes", "errors", "corrupt", "misses")})
        self._seconds = {"read": 0.0, "write": 0.0}
        self.last_error = ""
        self._logged_down = False
        self._ensure()

    def _ensure(self):
        """The set-up store, or None while it is not (yet). Setting up talks to the master and
        may block for long when it is not there, so it runs on a thread of its own, again at
        most every RETRY_S; requests meanwhile are misses."""
        with self._lock:
            if self._store is not None or self._setting_up or time.monotonic() < self._retry_at:
                return self._store
            self._setting_up = True
            self._retry_at = time.monotonic() + RETRY_S
        threading.Thread(target=self._set_up, name="lmcache-mooncake-setup", daemon=True).start()
        return None

    def _reachable(self) -> None:
        """Both the master and the metadata server accept connections (raises OSError if not):
        Mooncake's set-up holds the GIL while it waits for them, which would stall the server."""
        meta = urlparse(self.metadata)
        for host, port in (self.master.rsplit(":", 1), (meta.hostname, meta.port or 80)):
            socket.create_connection((host, int(port)), timeout=1.0).close()

    def _set_up(self) -> None:
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        store = None
        try:
            self._reachable()
            from mooncake.store import MooncakeDistributedStore

            store = MooncakeDistributedStore()
            rc = store.setup("127.0.0.1" if self._protocol == "tcp" else os.uname().nodename, self.metadata,
                             self._segment, self._local_buffer, self._protocol, "", self.master)
            if rc != 0:
                raise RuntimeError(f"setup returned {rc}")
            for base, size in [(self._arena.base, self._arena.capacity), *self._buffers]:
                rc = store.register_buffer(base, size)
                if rc != 0:
                    raise RuntimeError(f"registering memory ({size} bytes at {base:#x}) returned {rc}")
        except Exception as e:  # ImportError, a master that is not there, ...
            self._error(f"{self.master}: {e}")
            with self._lock:
                self._setting_up = False
                logged, self._logged_down = self._logged_down, True
            if not logged:
                logger.warning("L2 mooncake %s: not reachable (%s); serving from the other tiers until it is",
                               self.master, e)
            return
        with self._lock:
            self._store, self._setting_up = store, False
        logger.info("L2 mooncake %s: connected, %d MiB contributed", self.master, self._segment >> 20)

    def register_memory(self, ptr: int, nbytes: int) -> None:
        """Memory besides L1's arena that puts and gets will name (the store moves only memory
        registered with it): now if the store is set up, else when it is."""
        with self._lock:
            self._buffers.append((ptr, nbytes))
            store = self._store
        if store is not None and store.register_buffer(ptr, nbytes) != 0:
            self._error(f"registering {nbytes} bytes of codec memory failed")

    def _error(self, msg: str) -> None:
        with self._lock:
            self._st["errors"] += 1
            self.last_error = msg

    def _key(self, key: bytes) -> str:
        return f"{self._prefix}:{self._name_of(key)}"

    def put(self, keys, formats, ptrs, sizes):
        store = self._ensure()
        if store is None:
            return [False] * len(keys)
        t0 = time.perf_counter()
        names = [self._key(k) for k in keys]
        sums = [checksum_async(memory_view(p, n)) for p, n in zip(ptrs, sizes)]
        try:
            ok = [r == 0 for r in store.batch_put_from(names, list(ptrs), list(sizes))]
            done = [j for j in range(len(keys)) if ok[j]]
            if done and store.put_batch([names[j] + ":m" for j in done], [
                    pack_header(MAGIC, keys[j], formats[j], sizes[j], sums[j].result()) for j in done]) != 0:
                for j in done:  # (all or none; another node may have written them first)
                    ok[j] = False
        except Exception as e:
            self._error(f"put: {e}")
            return [False] * len(keys)
        with self._lock:
            for n, good in zip(sizes, ok):
                if good:
                    self._st["writes"] += 1
                    self._st["write_bytes"] += n
            self._seconds["write"] += time.perf_counter() - t0
        return ok

    def _heads(self, store, names: list[str]) -> list:
        try:
            return store.get_batch([n + ":m" for n in names])
        except Exception as e:
            self._error(f"get: {e}")
            return [b""] * len(names)

    def get(self, keys, formats, ptrs, capacities):
        store = self._ensure()
        if store is None:
            return [IO_ERROR] * len(keys)
        t0 = time.perf_counter()
        names = [self._key(k) for k in keys]
        heads = self._heads(store, names)
        out = [MISS] * len(keys)
        want = []  # (index, payload length, checksum)
        for i, (key, fmt, raw, cap) in enumerate(zip(keys, formats, heads, capacities)):
            if not raw or len(raw) < HEADER_BYTES:
                continue
            h = unpack_header(MAGIC, raw)
            if h is None or h.key != key:
                out[i] = CORRUPT
            elif h.fmt != fmt:
                out[i] = FORMAT_MISMATCH
            elif h.payload_bytes > cap:
                out[i] = TOO_LARGE
            else:
                want.append((i, h.payload_bytes, h.checksum))
        if want:
            try:
                got = store.batch_get_into([names[i] for i, _, _ in want], [ptrs[i] for i, _, _ in want],
                                           [n for _, n, _ in want])
            except Exception as e:
                self._error(f"get: {e}")
                got = [IO_ERROR] * len(want)
            sums = [checksum_async(memory_view(ptrs[i], n)) if r == n else None
                    for (i, n, _), r in zip(want, got)]
            for (i, n, summed), r, mine in zip(want, got, sums):
                if r != n:
                    out[i] = MISS  # evicted meanwhile (-704) or another error: a miss either way
                else:
                    out[i] = n if mine.result() == summed else CORRUPT
        with self._lock:
            for r in out:
                if r >= 0:
                    self._st["reads"] += 1
                    self._st["read_bytes"] += r
                elif r == CORRUPT:
                    self._st["corrupt"] += 1
                else:
                    self._st["misses"] += 1
            self._seconds["read"] += time.perf_counter() - t0
        return out

    def lookup(self, keys):
        store = self._ensure()
        if store is None:
            return [None] * len(keys)
        out = []
        for key, raw in zip(keys, self._heads(store, [self._key(k) for k in keys])):
            h = unpack_header(MAGIC, raw) if raw else None
            out.append((h.payload_bytes, h.fmt) if h is not None and h.key == key else None)
        return out

    def remove(self, keys):
        store = self._ensure()
        if store is None:
            return 0
        removed = 0
        for name in (self._key(k) for k in keys):
            removed += store.remove(name) == 0
            store.remove(name + ":m")
        return removed

    def stats(self) -> dict:
        with self._lock:
            st = dict(self._st)
            up = self._store is not None
        return {"master": self.master, "connected": up, **st, "read_seconds": self._seconds["read"],
                "write_seconds": self._seconds["write"], "last_error": self.last_error}

    def close(self) -> None:
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            try:
                for base, _ in [(self._arena.base, 0), *self._buffers]:
                    store.unregister_buffer(base)
                store.close()
            except Exception as e:
                logger.debug("closing the mooncake store: %s", e)
