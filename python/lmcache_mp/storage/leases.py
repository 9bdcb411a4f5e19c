"""Lookup leases: named protections of a found prefix, consumed only by the reads they were taken for.

A lookup with lock=True opens one lease on the objects of the prefix it found, with one *use*
per rank that will read an object (a shared MLA object gets world_size uses). A retrieve that
names the lease consumes one use of each object it reads; when an object's uses are gone the
lease no longer holds it, and a lease with nothing left ends. A release drops what is left (on
some chunks, or all); a lease also ends at its TTL or when its owner goes away. Another
client's lease on the same chunks is never touched: several engines sharing a prefix each keep
their own protection.

The table is not thread-safe on its own: the L1 store calls it with its lock held. Objects count
the leases holding them (`obj.leases`). Calls that may end many holds at once (release, expire,
drop_owner, clear) return the objects let go instead of letting them go: the caller does that
(`unhold`) a slice at a time, so that no call holds the lock for long.
"""

from __future__ import annotations

import heapq
import secrets
from typing import Callable, Collection, Iterable

MAX_LEASES_PER_CLIENT = 4096
MAX_LEASED_PER_CLIENT = 1 << 20  # objects held by one client's leases together


class TooManyLeases(Exception):
    pass


def _each(entry) -> tuple:
    """The objects of one by_digest entry."""
    return entry if isinstance(entry, tuple) else (entry,)


class Lease:
    __slots__ = ("lease_id", "owner", "expires", "uses", "by_digest")

    def __init__(self, lease_id: int, owner: bytes, expires: float):
        self.lease_id = lease_id
        self.owner = owner
        self.expires = expires
        self.uses: dict = {}  # object -> reads left
        # chunk digest -> its object (shared, or world size 1), or a tuple of them (one per rank):
        # no container per chunk in the common case, so a large lease ends in a fraction of the time
        self.by_digest: dict[bytes, object] = {}


class LeaseTable:
    def __init__(self, on_unheld: Callable[[object], None]):
        self._on_unheld = on_unheld
        self._leases: dict[int, Lease] = {}
        self._by_owner: dict[bytes, dict[int, None]] = {}  # owner -> its lease ids, oldest first
        self._held_by_owner: dict[bytes, int] = {}
        self._expiry: list[tuple[float, int]] = []
        self.leased_objects = 0  # objects held by at least one lease
        self.expired = 0

    def __len__(self) -> int:
        return len(self._leases)

    def open(self, owner: bytes, expires: float) -> Lease:
        mine = self._by_owner.setdefault(owner, {})
        if len(mine) >= MAX_LEASES_PER_CLIENT or self._held_by_owner.get(owner, 0) >= MAX_LEASED_PER_CLIENT:
            if not mine:
                del self._by_owner[owner]
            raise TooManyLeases(f"this client holds {len(mine)} leases on {self._held_by_owner.get(owner, 0)} "
                                f"objects, the most allowed: retrieve or release some first")
        lease_id = secrets.randbits(63) or 1
        while lease_id in self._leases:
            lease_id = secrets.randbits(63) or 1
        lease = self._leases[lease_id] = Lease(lease_id, owner, expires)
        mine[lease_id] = None
        if len(self._expiry) > 2 * len(self._leases) + 1024:  # most entries are of leases long gone
            self._expiry = [(ls.expires, i) for i, ls in self._leases.items()]
            heapq.heapify(self._expiry)
        else:
            heapq.heappush(self._expiry, (expires, lease_id))
        return lease

    def add(self, lease: Lease, digest: bytes, found: Iterable[tuple[object, int]]) -> None:
        """Hold these objects of one chunk, each for `uses` reads."""
        new = []
        for obj, uses in found:
            if obj in lease.uses:
                lease.uses[obj] += uses
                continue
            lease.uses[obj] = uses
            new.append(obj)
            self._held_by_owner[lease.owner] = self._held_by_owner.get(lease.owner, 0) + 1
            obj.leases += 1
            if obj.leases == 1:
                self.leased_objects += 1
        if new:
            had = lease.by_digest.get(digest)
            lease.by_digest[digest] = new[0] if had is None and len(new) == 1 else (*_each(had or ()), *new)

    def get(self, lease_id: int) -> Lease | None:
        return self._leases.get(lease_id) if lease_id else None

    def unhold(self, obj) -> None:
        """One lease no longer holds obj (for objects returned by the calls below)."""
        obj.leases -= 1
        if obj.leases == 0:
            self.leased_objects -= 1
            self._on_unheld(obj)

    def _drop(self, lease: Lease, objs: list | None = None) -> Collection:
        """Stop holding objs (all the lease holds if None); a lease left holding nothing ends.
        Returns the objects let go, for the caller to unhold: for a whole lease, its detached
        table of uses (O(1) here, whatever its size; the caller walks it a slice at a time)."""
        if objs is None:
            objs, lease.uses = lease.uses, {}
        elif len(objs) == len(lease.uses):
            lease.uses = {}
        else:
            for obj in objs:
                del lease.uses[obj]
        left = self._held_by_owner.get(lease.owner, 0) - len(objs)
        if left > 0:
            self._held_by_owner[lease.owner] = left
        else:
            self._held_by_owner.pop(lease.owner, None)
        if not lease.uses and self._leases.pop(lease.lease_id, None) is not None:
            mine = self._by_owner.get(lease.owner)
            if mine is not None:
                mine.pop(lease.lease_id, None)
                if not mine:
                    del self._by_owner[lease.owner]
        return objs

    def consume(self, lease: Lease, obj) -> None:
        """One read of obj under this lease."""
        left = lease.uses.get(obj)
        if left is None:
            return
        if left > 1:
            lease.uses[obj] = left - 1
            return
        self._drop(lease, [obj])
        self.unhold(obj)

    def release(self, lease: Lease, digests: Iterable[bytes] | None = None) -> Collection:
        """Stop holding these chunks (all of them if None); returns the objects to unhold."""
        if digests is None:
            return self._drop(lease)
        return self._drop(lease, [o for d in dict.fromkeys(digests) for o in _each(lease.by_digest.get(d, ()))
                                  if o in lease.uses])

    def close(self, lease: Lease) -> None:
        """Forget a lease that ended up holding nothing (a lookup without hits)."""
        if not lease.uses:
            self._drop(lease, [])

    def expire(self, now: float) -> list[Collection]:
        """End the leases past their TTL; returns the objects to unhold, one collection per lease."""
        parts = []
        while self._expiry and self._expiry[0][0] <= now:
            _, lease_id = heapq.heappop(self._expiry)
            lease = self._leases.get(lease_id)
            if lease is not None:
                self.expired += 1
                parts.append(self._drop(lease))
        return parts

    def drop_owner(self, owner: bytes) -> tuple[int, list[Collection]]:
        """(leases ended, objects to unhold per lease) for a client that went away; its leases
        end oldest first, so the objects they held go back to the LRU list in a set order."""
        ids = list(self._by_owner.get(owner, ()))
        return len(ids), [self._drop(self._leases[lease_id]) for lease_id in ids]

    def clear(self) -> list[Collection]:
        parts = [self._drop(lease) for lease in list(self._leases.values())]
        self._expiry.clear()
        return parts
