"""Tenants' shares of a store (L1, the disk tier): the bytes each owner holds and its limits; the
victim chooser (chooser.py) enforces them. The server's tenants file sets them
(server/tenancy/tenancy.py).

A tenant's objects live under models named `TENANT<SEP>model` (the server chose the prefix, the
client cannot), so the owner of an object is read from its key. Per owner: the bytes it holds, a
floor (L1's `l1_min`: bytes no other owner's store may evict) and a cap (`l1_max`, `l2_disk_max`:
beyond it, its stores evict its own objects first). Without a tenants file L1 has no quotas and
none of this runs; the disk tier counts its files' owners always (its files outlive the server).
"""

from __future__ import annotations

from typing import Callable

SEP = "\x1f"  # between a tenant's name and the client's model name (not in any tenant name)
PRESSURE = "pressure"  # why an object was evicted: another store needed room (else its owner's cap, by name)
CAUSES = (PRESSURE, "l1_max")  # L1's


def tenant_of(model: str) -> str:
    """The tenant whose namespace a model name is in ("" for a name of a server without tenants)."""
    cut = model.find(SEP)
    return model[:cut] if cut >= 0 else ""


class Quotas:
    """Owners by index (stable for the process: objects keep theirs across reloads of limits).
    cap: the name of the store's cap (what an eviction for it is counted as)."""

    def __init__(self, cap: str = "l1_max"):
        self.cap = cap
        self._index: dict[str, int] = {}
        self.names: list[str] = []
        self.limits: list[tuple[int, int]] = []  # (floor, cap), 0: none
        self.bytes: list[int] = []
        self.objects: list[int] = []
        self.evicted: list[dict[str, int]] = []
        self.skipped: list[int] = []  # chunks a store of this owner could not place (its cap, or no room)
        self.on_breach: Callable[[str, str, int, int], None] | None = None  # (owner, quota, bytes, limit)

    def owner_of(self, model: str) -> int:
        name = tenant_of(model)
        i = self._index.get(name)
        if i is None:
            i = self._index[name] = len(self.names)
            self.names.append(name)
            self.limits.append((0, 0))
            self.bytes.append(0)
            self.objects.append(0)
            self.evicted.append(dict.fromkeys((PRESSURE, self.cap), 0))
            self.skipped.append(0)
        return i

    def set_limits(self, name: str, floor: int, cap: int) -> None:
        self.limits[self.owner_of(name + SEP)] = (floor, cap)

    def added(self, owner: int, nbytes: int) -> None:
        self.bytes[owner] += nbytes
        self.objects[owner] += 1

    def removed(self, owner: int, nbytes: int) -> None:
        self.bytes[owner] -= nbytes
        self.objects[owner] -= 1

    def cap_of(self, owner: int) -> int:
        return self.limits[owner][1]

    def over_max(self, owner: int, nbytes: int) -> bool:
        """Would `nbytes` more take the owner past its cap?"""
        cap = self.limits[owner][1]
        if cap and self.bytes[owner] + nbytes > cap:
            if self.on_breach is not None:
                self.on_breach(self.names[owner], self.cap, self.bytes[owner], cap)
            return True
        return False

    def protected(self, victim_owner: int, nbytes: int, for_owner: int) -> bool:
        """May a store of `for_owner` not evict this object (its owner would fall below its floor)?"""
        if victim_owner == for_owner:
            return False
        floor = self.limits[victim_owner][0]
        return bool(floor) and self.bytes[victim_owner] - nbytes < floor

    def stats(self) -> dict[str, dict]:
        """Per owner, as L1's status shows it (its floor and cap named l1_min and l1_max)."""
        return {name or "(none)": {"bytes": self.bytes[i], "objects": self.objects[i], "l1_min": self.limits[i][0],
                                   "l1_max": self.limits[i][1], "evicted": dict(self.evicted[i]),
                                   "skipped": self.skipped[i]}
                for i, name in enumerate(self.names)}
