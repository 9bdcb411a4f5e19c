"""Tenants' caps on a tier that several nodes share (Valkey/Redis, Mooncake): a per-node write budget.

Such a tier evicts by its own rule (Valkey's maxmemory-policy, Mooncake's), which knows nothing of
tenants: without a cap one tenant's stores push every other tenant's chunks out. With a cap (the
tenants file's `l2_valkey_max`, `l2_mooncake_max`, also in `[shared]`), this node keeps, per capped
tenant, the objects it wrote to the tier with their bytes as stored (header and payload), least
recently used first (a read of this node is a use). A write that would take the tenant past its cap
first deletes that tenant's own least recently used objects from the tier; the chunks of a batch
beyond the cap by themselves are not written. Other tenants' objects are never deleted for it.

A node knows only what it wrote, deleted and found gone itself: objects of other nodes count to
no node's budget, so across N nodes a tenant may hold up to N times its cap (size the tier for
nodes x caps, and its own eviction never has to run), and an object the tier dropped on its own
(its eviction, a TTL) counts until one of this node's reads misses it (the budget errs small).
Caps apply from when they are set: objects written before are not counted. Tenants without a cap
are not tracked at all, so a server whose tenants have none keeps nothing here.
"""

from __future__ import annotations

import collections
import logging
import threading

import msgspec

from lmcache_mp.storage.l2 import CORRUPT, HEADER_BYTES, MISS, L2Backend
from lmcache_mp.storage.eviction.quotas import tenant_of

logger = logging.getLogger(__name__)


def owner_of(blob: bytes) -> str:
    """The tenant of a tier key (the writers encode (model, world size, rank, digest, salt));
    "" for any other key."""
    try:
        model = msgspec.msgpack.decode(blob)[0]
    except (msgspec.DecodeError, TypeError, IndexError, KeyError):
        return ""
    return tenant_of(model) if isinstance(model, str) else ""


class TenantCapped(L2Backend):
    """A shared tier with this node's per-tenant caps in front of it (see the module's docstring)."""

    def __init__(self, inner: L2Backend):
        self.inner = inner
        self.name, self.default_write = inner.name, inner.default_write
        self.local = getattr(inner, "local", True)
        self._lock = threading.Lock()  # puts (the tier's writer), gets (the reader), removes
        self._caps: dict[str, int] = {}
        self._held: dict[str, collections.OrderedDict[bytes, int]] = {}  # tenant -> key -> bytes, LRU first
        self._bytes: dict[str, int] = {}
        self._counts = {"over_tenant_cap": 0, "tenant_cap_deletes": 0}

    def __getattr__(self, name: str):
        # what only the tier itself offers (Mooncake's register_memory for codec memory)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def set_quota(self, tenant: str, nbytes: int) -> None:
        """A tenant's cap on this tier from this node (0: none, and its objects are forgotten)."""
        with self._lock:
            if nbytes:
                self._caps[tenant] = nbytes
                self._held.setdefault(tenant, collections.OrderedDict())
                self._bytes.setdefault(tenant, 0)
            else:
                self._caps.pop(tenant, None)
                self._held.pop(tenant, None)
                self._bytes.pop(tenant, None)

    def tenant_bytes(self) -> dict[str, int]:
        """Bytes of the capped tenants' objects this node wrote and believes still there."""
        with self._lock:
            return {t: n for t, n in self._bytes.items() if t}

    def _forget(self, owner: str, blob: bytes) -> None:
        n = self._held[owner].pop(blob, None)
        if n is not None:
            self._bytes[owner] -= n

    def put(self, keys, formats, ptrs, sizes):
        if not self._caps:
            return self.inner.put(keys, formats, ptrs, sizes)
        keep: list[int] = []
        victims: list[bytes] = []
        owners = [owner_of(k) for k in keys]
        stored = [HEADER_BYTES + len(k) + len(f) + n for k, f, n in zip(keys, formats, sizes)]
        with self._lock:
            taken: dict[str, int] = {}
            full: set[str] = set()
            for i, owner in enumerate(owners):
                cap = self._caps.get(owner, 0)
                if cap:
                    # prefix order: once a chunk does not fit, the tenant's later ones are of no use
                    if owner in full or taken.get(owner, 0) + stored[i] > cap:
                        full.add(owner)
                        self._counts["over_tenant_cap"] += 1
                        continue
                    taken[owner] = taken.get(owner, 0) + stored[i]
                    self._forget(owner, keys[i])  # written again: the new value replaces it
                keep.append(i)
            for owner, need in taken.items():  # room within the cap: the tenant's own oldest go
                held, cap = self._held[owner], self._caps[owner]
                while held and self._bytes[owner] + need > cap:
                    blob, n = held.popitem(last=False)
                    self._bytes[owner] -= n
                    victims.append(blob)
            for i in keep:  # counted while written, so that a concurrent put sees them
                if owners[i] in taken:
                    self._held[owners[i]][keys[i]] = stored[i]
                    self._bytes[owners[i]] += stored[i]
            self._counts["tenant_cap_deletes"] += len(victims)
        if victims:
            try:
                self.inner.remove(victims)
            except Exception as e:  # the tier's eviction takes them later; the budget holds meanwhile
                logger.warning("L2 %s: deleting %d objects of capped tenants failed: %s", self.name, len(victims), e)
        ok = [False] * len(keys)
        if keep:
            pick = lambda xs: [xs[i] for i in keep]  # noqa: E731
            for i, good in zip(keep, self.inner.put(pick(keys), pick(formats), pick(ptrs), pick(sizes))):
                ok[i] = good
        with self._lock:
            for i in keep:
                held = self._held.get(owners[i])
                if held is None:
                    continue  # (its cap went meanwhile)
                if ok[i] and keys[i] not in held:  # (a read missed it while it was being written)
                    held[keys[i]] = stored[i]
                    self._bytes[owners[i]] += stored[i]
                elif not ok[i]:
                    self._forget(owners[i], keys[i])
        return ok

    def get(self, keys, formats, ptrs, capacities):
        got = self.inner.get(keys, formats, ptrs, capacities)
        if self._caps:
            with self._lock:
                for blob, r in zip(keys, got):
                    held = self._held.get(owner_of(blob))
                    if held is None or blob not in held:
                        continue
                    if r >= 0:
                        held.move_to_end(blob)
                    elif r in (MISS, CORRUPT):  # the tier dropped it (its eviction, a TTL, another value)
                        self._forget(owner_of(blob), blob)
        return got

    def lookup(self, keys):
        return self.inner.lookup(keys)

    def remove(self, keys):
        if self._caps:
            with self._lock:
                for blob in keys:
                    if (owner := owner_of(blob)) in self._held:
                        self._forget(owner, blob)
        return self.inner.remove(keys)

    def stats(self) -> dict:
        with self._lock:
            counts = dict(self._counts)
        return {**self.inner.stats(), **counts}

    def close(self) -> None:
        self.inner.close()
