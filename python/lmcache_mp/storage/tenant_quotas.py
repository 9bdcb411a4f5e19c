"""Tenants' shares of L1 (a part of L1Store; the server's tenants file sets them, server/tenancy/tenancy.py).

A tenant's objects live under models named `TENANT<SEP>model` (the server chose the prefix, the
client cannot), so the owner of an object is read from its key. Per owner: the bytes it holds,
`l1_min` (bytes no other owner's store may evict) and `l1_max` (beyond it, its stores evict its own
objects first, and take no free memory). Without a tenants file L1 has no quotas and none of this
runs.
"""

from __future__ import annotations

from typing import Callable

SEP = "\x1f"  # between a tenant's name and the client's model name (not in any tenant name)
CAUSES = ("pressure", "l1_max")  # why an object was evicted: another store needed room, its owner's cap


def tenant_of(model: str) -> str:
    """The tenant whose namespace a model name is in ("" for a name of a server without tenants)."""
    cut = model.find(SEP)
    return model[:cut] if cut >= 0 else ""


class L1Quotas:
    """Owners by index (stable for the process: objects keep theirs across reloads of limits)."""

    def __init__(self):
        self._index: dict[str, int] = {}
        self.names: list[str] = []
        self.limits: list[tuple[int, int]] = []  # (l1_min, l1_max), 0: none
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
            self.evicted.append(dict.fromkeys(CAUSES, 0))
            self.skipped.append(0)
        return i

    def set_limits(self, name: str, l1_min: int, l1_max: int) -> None:
        self.limits[self.owner_of(name + SEP)] = (l1_min, l1_max)

    def added(self, owner: int, nbytes: int) -> None:
        self.bytes[owner] += nbytes
        self.objects[owner] += 1

    def removed(self, owner: int, nbytes: int) -> None:
        self.bytes[owner] -= nbytes
        self.objects[owner] -= 1

    def over_max(self, owner: int, nbytes: int) -> bool:
        """Would `nbytes` more take the owner past its l1_max?"""
        cap = self.limits[owner][1]
        if cap and self.bytes[owner] + nbytes > cap:
            if self.on_breach is not None:
                self.on_breach(self.names[owner], "l1_max", self.bytes[owner], cap)
            return True
        return False

    def protected(self, victim_owner: int, nbytes: int, for_owner: int) -> bool:
        """May a store of `for_owner` not evict this object (its owner would fall below l1_min)?"""
        if victim_owner == for_owner:
            return False
        floor = self.limits[victim_owner][0]
        return bool(floor) and self.bytes[victim_owner] - nbytes < floor

    def stats(self) -> dict[str, dict]:
        return {name or "(none)": {"bytes": self.bytes[i], "objects": self.objects[i], "l1_min": self.limits[i][0],
                                   "l1_max": self.limits[i][1], "evicted": dict(self.evicted[i]),
                                   "skipped": self.skipped[i]}
                for i, name in enumerate(self.names)}
