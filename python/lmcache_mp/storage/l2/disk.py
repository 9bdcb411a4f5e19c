"""The local-disk tier: one file per object under a directory, kept across restarts.

The I/O runs in the C++ core (`_C.DiskStore`) on its own threads without the GIL: `O_DIRECT`
between the file and arena memory when the slot is page-aligned, buffered otherwise. A file is
a 4 KiB header (key, format, length, checksums) and the payload; it is written under a temporary
name and renamed, so a crash mid-write leaves a temporary file that the next start removes. At
start the directory is scanned (headers only) and the index rebuilt; the payload checksum is
checked on every read, and a file that fails it is deleted and counted.

Which files stay within the size limit is the eviction policy's choice (storage/eviction/, the
same as L1's), and the victim chooser L1 uses picks them (storage/eviction/chooser.py), tenants'
caps (`l2_disk_max`) included: this tier keeps the policy's view of every file and makes room before
each write, so the store's own LRU (by bytes, the last resort) never has to. A read is a use; a
write batch is admitted as one request's chunks, in the order the writers give them (prefix order):
of a capped tenant's chunks in a batch larger than its cap, the leading ones that fit are written.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from typing import Callable

import msgspec
import xxhash

from lmcache_mp.sizes import format_size
from lmcache_mp.storage.eviction import DEFAULT_POLICY, make_policy
from lmcache_mp.storage.eviction.chooser import VictimChooser
from lmcache_mp.storage.eviction.quotas import PRESSURE, Quotas
from lmcache_mp.storage.l2 import CORRUPT, MISS, L2Backend
from lmcache_mp.storage.objects import ObjectKey

logger = logging.getLogger(__name__)

FREE_SPACE_SHARE = 0.9  # of the filesystem's free space, when no size is given
HEADER_BYTES = 4096  # of every file, besides its payload


def _bytes_in(path: str) -> int:
    total = 0
    for sub in os.scandir(path):
        if sub.is_dir(follow_symlinks=False):
            total += sum(e.stat(follow_symlinks=False).st_size for e in os.scandir(sub.path)
                         if e.is_file(follow_symlinks=False))
    return total


def policy_key(blob: bytes) -> ObjectKey:
    """The chunk key a file's key stands for (the writers encode ObjectKeys); any other key gets
    a digest of its own."""
    try:
        return ObjectKey(*msgspec.msgpack.decode(blob))
    except (msgspec.DecodeError, TypeError, ValueError):
        return ObjectKey("", 0, 0, xxhash.xxh3_128_digest(blob), b"")


class _File:
    """What the policy sees of a file (storage/eviction/base.py)."""

    __slots__ = ("key", "blob", "nbytes", "older", "newer", "queue", "freq", "stamp", "since", "prev", "owner")

    def __init__(self, blob: bytes, nbytes: int, owners: Quotas, prev: "_File | None" = None):
        self.key, self.blob, self.nbytes, self.prev = policy_key(blob), blob, nbytes, prev
        self.owner = owners.owner_of(self.key.model)
        self.older = self.newer = None
        self.queue = self.freq = self.stamp = self.since = 0


class DiskTier(L2Backend):
    name = "disk"

    def __init__(self, path: str, size: int = 0, io_threads: int = 4, policy: str = DEFAULT_POLICY):
        from lmcache_mp import native

        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"L2 disk path {path} exists and is not a directory")
        os.makedirs(path, exist_ok=True)
        if size <= 0:  # what is there already, and most of what is free
            size = int(_bytes_in(path) + FREE_SPACE_SHARE * shutil.disk_usage(path).free)
        self.path = path
        self.capacity = size
        self._store = native.DiskStore(path, size, io_threads)
        self._lock = threading.Lock()  # the policy and the byte counts (puts and gets come from other threads)
        self._policy = make_policy(policy)
        self._quotas = Quotas(cap="l2_disk_max")  # the files' owners: their bytes and caps (a server with tenants)
        self._chooser = VictimChooser(self._policy, self._quotas)
        self._files: dict[bytes, _File] = {}
        self._used = self._reserved = self._evicted = 0
        self._refused = 0  # chunks not written: their tenant's cap, and none of its own files to evict
        # (tenant, chunks not written, its files' bytes, its cap): for the audit log, called outside the lock
        self.on_over_cap: Callable[[str, int, int, int], None] | None = None
        for blob, payload in self._store.entries():  # least recently used first
            self._add([_File(blob, HEADER_BYTES + payload, self._quotas)])
        st = self._store.stats()
        logger.info("L2 disk %s: %s, %d objects (%s) found in %.2f s%s", path, format_size(size), st["objects"],
                    format_size(st["bytes_used"]), st["scan_seconds"],
                    f", {st['dropped_at_scan']} damaged or unfinished files removed" if st["dropped_at_scan"] else "")

    # ---- the policy's view (lock held) ------------------------------------------------------------

    def _add(self, files: list[_File]) -> None:
        for f in files:
            self._drop(self._files.get(f.blob))
            self._files[f.blob] = f
            self._used += f.nbytes
            self._quotas.added(f.owner, f.nbytes)
        self._policy.admit(files)

    def _drop(self, f: _File | None) -> None:
        if f is not None and self._files.get(f.blob) is f:
            del self._files[f.blob]
            self._used -= f.nbytes
            self._quotas.removed(f.owner, f.nbytes)
            self._policy.remove(f)

    def _evict(self, f: _File, cause: str, victims: list[bytes]) -> None:
        self._chooser.evicted(f, cause)
        self._drop(f)
        victims.append(f.blob)
        self._evicted += 1

    def _make_room(self, need: int) -> list[bytes]:
        """Evict (from the view) until `need` more bytes fit; the keys whose files must go."""
        victims: list[bytes] = []
        while self._files and self._used + self._reserved + need > self.capacity:
            f = self._chooser.victim()
            if f is None:
                break
            self._evict(f, PRESSURE, victims)
        return victims

    def _within_caps(self, keys, sizes) -> tuple[list[int], list[bytes], list[tuple[str, int, int, int]]]:
        """The writes that fit their tenants' l2_disk_max once those tenants' own files make
        room (their indices), the keys of the files that go for it, and the refusals (see on_over_cap).
        Of a tenant's writes in one batch the leading ones within its cap are admitted (prefix
        order: once one does not fit, the later ones are of no use), so what a tenant gets on disk
        does not depend on how many of its chunks the writer happened to batch together."""
        quotas = self._quotas
        if not any(cap for _, cap in quotas.limits):
            return list(range(len(keys))), [], []
        keep, victims, want, over = [], [], {}, []
        for i, blob in enumerate(keys):
            want.setdefault(quotas.owner_of(policy_key(blob).model), []).append(i)
        evict = lambda f, cause: self._evict(f, cause, victims)  # noqa: E731
        for owner, idx in want.items():
            cap = quotas.cap_of(owner)
            fit, need = len(idx), sum(HEADER_BYTES + sizes[i] for i in idx)
            if cap and need > cap:
                fit = need = 0
                while fit < len(idx) and need + HEADER_BYTES + sizes[idx[fit]] <= cap:
                    need += HEADER_BYTES + sizes[idx[fit]]
                    fit += 1
            if cap and fit and not self._chooser.fit_cap(owner, need, evict):
                fit = 0
            if fit < len(idx):
                self._refused += len(idx) - fit
                over.append((quotas.names[owner], len(idx) - fit, quotas.bytes[owner], cap))
            keep += idx[:fit]
        return sorted(keep), victims, over

    def set_quota(self, tenant: str, l2_disk_max: int) -> None:
        """A tenant's cap on this tier (0: none): beyond it, its writes evict its own files first."""
        with self._lock:
            self._quotas.set_limits(tenant, 0, l2_disk_max)

    def tenant_bytes(self) -> dict[str, int]:
        with self._lock:
            return {name: n for name, n in zip(self._quotas.names, self._quotas.bytes) if name}

    # ---- L2Backend ---------------------------------------------------------------------------------

    def put(self, keys, formats, ptrs, sizes):
        with self._lock:
            for blob in keys:  # a file written again replaces the old one
                self._drop(self._files.get(blob))
            keep, victims, over = self._within_caps(keys, sizes)
            need = sum(HEADER_BYTES + sizes[i] for i in keep)
            victims += self._make_room(need)
            self._reserved += need
        if over and self.on_over_cap is not None:
            for owner, chunks, owned, cap in over:
                self.on_over_cap(owner, chunks, owned, cap)
        if len(keep) < len(keys):
            pick = lambda xs: [xs[i] for i in keep]  # noqa: E731
            ok = dict(zip(keep, self._put(pick(keys), pick(formats), pick(ptrs), pick(sizes), victims, need)))
            return [ok.get(i, False) for i in range(len(keys))]
        return self._put(keys, formats, ptrs, sizes, victims, need)

    def _put(self, keys, formats, ptrs, sizes, victims, need):
        try:
            if victims:
                self._store.remove(victims)
            ok = self._store.put(keys, formats, ptrs, sizes) if keys else []
        finally:
            with self._lock:
                self._reserved -= need
        with self._lock:
            files: list[_File] = []
            for blob, size, stored in zip(keys, sizes, ok):
                if stored:
                    files.append(_File(blob, HEADER_BYTES + size, self._quotas, files[-1] if files else None))
            self._add(files)
        return ok

    def get(self, keys, formats, ptrs, capacities):
        got = self._store.get(keys, formats, ptrs, capacities)
        with self._lock:
            for blob, n in zip(keys, got):
                f = self._files.get(blob)
                if f is None:
                    continue
                if n >= 0:
                    self._policy.use(f)
                    self._policy.park(f)  # (recent, for LRU)
                elif n in (MISS, CORRUPT):  # the store has no such file (any more)
                    self._drop(f)
        return got

    def lookup(self, keys):
        return self._store.lookup(keys)

    def remove(self, keys):
        with self._lock:
            for blob in keys:
                self._drop(self._files.get(blob))
        return self._store.remove(keys)

    def stats(self) -> dict:
        with self._lock:
            policy = self._policy.stats()
            evicted = self._evicted
        st = dict(self._store.stats())
        st["evictions"] += evicted
        return {"path": self.path, **st, "eviction": policy, "over_tenant_cap": self._refused}

    def close(self) -> None:
        self._store = None
