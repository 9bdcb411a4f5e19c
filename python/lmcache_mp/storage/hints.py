"""Pins: an application keeps a prefix in L1 for a while (server/hints.py), in a byte budget per tenant.

A pin is an L1 lease (leases.py) on the leading chunks present when it comes, owned by its tenant,
not by the client that sent it: it outlives that client's connection, and ends at its TTL, at an
unpin of its chunks, or when L1 is cleared. While it lasts its objects are neither evicted nor
moved, as any leased object. A pin never changes what a lookup or a retrieve finds: it only keeps.

Budget. A tenant's pinned bytes count each object once, however many of its pins hold it. A pin
is refused (OverBudget, nothing held) when it would take its tenant past its hint budget, or the
tenants' reservations together past L1: each tenant reserves the larger of its `l1_min` and its
pinned bytes, so that pins never take the memory another tenant's `l1_min` promises it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from lmcache_mp.sizes import format_size
from lmcache_mp.storage.l1 import L1Object, L1Store

MAX_PIN_TTL = 3600.0  # seconds: a pin is a hint for a pause in a session, not storage


class OverBudget(Exception):
    """A pin that would take its tenant past its hint budget, or the tenants' reservations past L1."""


def pin_owner(tenant: str) -> bytes:
    """The owner of a tenant's pin leases (no client id is 5 bytes + a name: clients' are 16)."""
    return b"pin\x1f\x00" + tenant.encode()


@dataclass(eq=False)
class _Pin:
    lease: int
    tenant: str
    space: tuple  # (model, world_size, salt, tp_shared)
    expires: float
    objs: list = field(default_factory=list)


class PinTable:
    def __init__(self, l1: L1Store, capacity: int, budget_of: Callable[[str], int],
                 floors: Callable[[], dict[str, int]], clock: Callable[[], float] = time.monotonic):
        """budget_of(tenant): its hint budget in bytes; floors(): every tenant's l1_min ("": none)."""
        self.l1 = l1
        self.capacity = capacity
        self.budget_of = budget_of
        self.floors = floors
        self._clock = clock
        self._lock = threading.Lock()
        self._pins: dict[int, _Pin] = {}  # lease id -> pin
        self._held: dict[str, dict[L1Object, int]] = {}  # tenant -> object -> its pins that hold it
        self._bytes: dict[str, int] = {}  # tenant -> pinned bytes
        self.counters = {"pins": 0, "refused": 0, "ended": 0}

    # ---- accounting (lock held) --------------------------------------------------------------

    def _hold(self, tenant: str, objs: Sequence[L1Object]) -> None:
        mine = self._held.setdefault(tenant, {})
        for obj in objs:
            n = mine.get(obj, 0)
            mine[obj] = n + 1
            if not n:
                self._bytes[tenant] = self._bytes.get(tenant, 0) + obj.nbytes

    def _let_go(self, tenant: str, objs: Sequence[L1Object]) -> None:
        mine = self._held.get(tenant, {})
        for obj in objs:
            n = mine.get(obj, 0)
            if n > 1:
                mine[obj] = n - 1
            elif n == 1:
                del mine[obj]
                self._bytes[tenant] -= obj.nbytes
        if not mine:
            self._held.pop(tenant, None)
            self._bytes.pop(tenant, None)

    def _sweep(self) -> None:
        """Forget the pins that ended: past their TTL (L1 expires their leases too), or whose lease
        L1 ended (cleared)."""
        now = self._clock()
        for lease, pin in list(self._pins.items()):
            if pin.expires <= now or self.l1.lease(lease) is None:
                del self._pins[lease]
                self._let_go(pin.tenant, pin.objs)
                self.counters["ended"] += 1

    def _refusal(self, tenant: str, adding: int) -> str:
        """Why a pin adding these bytes is refused ("" if it is not)."""
        have = self._bytes.get(tenant, 0)
        budget = self.budget_of(tenant)
        who = f"tenant {tenant}" if tenant else "the server's clients"
        if have + adding > budget:
            return (f"pinning {format_size(adding)} more would take {who} to {format_size(have + adding)} pinned, over "
                    f"its hint budget of {format_size(budget)} (--hint-budget, or hint_budget in the tenants file): "
                    "unpin something, or pin for less time")
        floors = self.floors()
        reserved = sum(max(floors.get(t, 0), self._bytes.get(t, 0)) for t in floors.keys() | self._bytes.keys()
                       if t != tenant) + max(floors.get(tenant, 0), have + adding)
        if reserved > self.capacity:
            return (f"pinning {format_size(adding)} more for {who} would leave less than the other tenants' l1_min "
                    f"in L1 ({format_size(reserved)} reserved by l1_min and pins together, of {format_size(self.capacity)})")
        return ""

    # ---- hints -------------------------------------------------------------------------------

    def pin(self, tenant: str, model: str, world_size: int, digests: Sequence[bytes], salt: bytes,
            ttl: float, tp_shared: bool = False) -> tuple[int, int]:
        """Hold the leading chunks present for ttl seconds: (chunks held, bytes added to the
        tenant's pinned bytes). Raises OverBudget (nothing held), or TooManyLeases. (Not a lookup
        in L1's counters, nor a use of the chunks: only reads and stores count.)"""
        with self._lock:
            self._sweep()
            hits, lease = self.l1.lookup(model, world_size, digests, salt, lock=True, owner=pin_owner(tenant), ttl=ttl,
                                         tp_shared=tp_shared, counted=False)
            held = self.l1.lease(lease)
            if held is None:
                return 0, 0
            objs = list(held.uses)
            mine = self._held.get(tenant, {})
            adding = sum(o.nbytes for o in objs if o not in mine)
            why = self._refusal(tenant, adding)
            if why:
                self.l1.release(lease)
                self.counters["refused"] += 1
                raise OverBudget(why)
            self._pins[lease] = _Pin(lease, tenant, (model, world_size, salt, tp_shared), self._clock() + ttl, objs)
            self._hold(tenant, objs)
            self.counters["pins"] += 1
            return hits, adding

    def unpin(self, tenant: str, model: str, world_size: int, digests: Sequence[bytes], salt: bytes,
              tp_shared: bool = False) -> int:
        """End this tenant's pins on these chunks (of this namespace); returns the objects let go."""
        released = 0
        with self._lock:
            self._sweep()
            for lease, pin in list(self._pins.items()):
                if pin.tenant != tenant or pin.space != (model, world_size, salt, tp_shared):
                    continue
                released += self.l1.release(lease, digests)
                held = self.l1.lease(lease)
                left = set(held.uses) if held is not None else set()
                self._let_go(tenant, [o for o in pin.objs if o not in left])
                pin.objs = [o for o in pin.objs if o in left]
                if not left:
                    del self._pins[lease]
                    self.counters["ended"] += 1
        return released

    def pinned_bytes(self, tenant: str) -> int:
        with self._lock:
            self._sweep()
            return self._bytes.get(tenant, 0)

    def stats(self) -> dict[str, dict]:
        """Per tenant with pins: its pinned bytes, objects and pins."""
        with self._lock:
            self._sweep()
            pins: dict[str, int] = {}
            for pin in self._pins.values():
                pins[pin.tenant] = pins.get(pin.tenant, 0) + 1
            return {t: {"pinned_bytes": self._bytes.get(t, 0), "pinned_objects": len(self._held.get(t, ())),
                        "pins": n, "hint_budget": self.budget_of(t)} for t, n in pins.items()}
