"""What an eviction policy is to the store that uses it (L1, the disk tier, the trace simulator).

The store owns the objects and decides when room is needed; the policy keeps the order in which
they go. An object the policy knows is either *parked* (a candidate for eviction) or held (read,
leased, being written: the store unparks it and parks it again once nothing holds it). Policies
keep their state in the object's own slots (`older`/`newer` for the list it is in, `queue`,
`freq`, `stamp`, `since`), so that no call allocates, and every call is O(1) amortised.

Calls, all with the store's lock held:

- `admit(objs, lead, last)`: newly stored objects of one request, in prefix order (each the chunk
  after the one before; `obj.prev` is the one before the first, when known); they are parked. A
  long request comes in parts: `lead` is its first object, `last` says whether this part ends it.
  A policy puts a request's deeper chunks nearer eviction than its shallower ones: a chunk is
  worth nothing once the chunk before it is gone.
- `use(obj)`: a counted use: a read, or a store of a chunk already held (the engine recomputed
  it). Lookups are not counted: a client that repeats lookups gains nothing.
- `park(obj)` / `unpark(obj)`: a candidate again, or held. Parking an object that is parked
  changes nothing for frequency policies; LRU counts it as recent (a lookup hit parks).
- `evicted(obj)`: the store evicts obj for room (then removes it): it may be remembered (ghosts).
- `dropped(obj)`: the same, but the victim was another policy's choice (follow.py): remembered as
  evicted, without the policy reading it as its own choice.
- `remove(obj)`: obj left the store (evicted, replaced, cleared).
- `candidates()`: parked objects, the next victim first (may reorder the policy's queues as it
  goes, as S3-FIFO's eviction does); `order()`: the same order without changing anything, for
  scans that only look (the L2 writers' write-ahead).
"""

from __future__ import annotations

import collections
from typing import Iterator, Sequence

GHOSTS_PER_OBJECT = 4  # keys of evicted objects remembered, per object held (at least MIN_GHOSTS)
MIN_GHOSTS = 4096
GHOST_BYTES = 120  # about what a remembered key costs (its dict entry and the key object)


class EvictionPolicy:
    name = ""

    def __init__(self):
        self.resident = 0  # objects admitted and not removed (parked or held)

    def admit(self, objs: Sequence, lead=None, last: bool = True) -> None:
        raise NotImplementedError

    def use(self, obj) -> None:
        pass

    def park(self, obj) -> None:
        raise NotImplementedError

    def unpark(self, obj) -> None:
        raise NotImplementedError

    def evicted(self, obj) -> None:
        pass

    def dropped(self, obj) -> None:
        self.evicted(obj)

    def remove(self, obj) -> None:
        self.unpark(obj)
        self.resident -= 1

    def candidates(self) -> Iterator:
        return self.order()

    def order(self) -> Iterator:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def stats(self) -> dict:
        """The policy and the memory its history of evicted keys takes (bounded)."""
        return {"policy": self.name, "history_keys": 0, "history_bytes": 0}


class Ghosts:
    """Keys of evicted objects with a small value each, the oldest forgotten first; at most
    GHOSTS_PER_OBJECT per object held (`limit`), MIN_GHOSTS at least."""

    __slots__ = ("_keys",)

    def __init__(self):
        self._keys: collections.OrderedDict = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key) -> bool:
        return key in self._keys

    def add(self, key, value, limit: int) -> None:
        keys = self._keys
        keys[key] = value
        keys.move_to_end(key)
        while len(keys) > limit:
            keys.popitem(last=False)

    def pop(self, key, default=None):
        return self._keys.pop(key, default)

    def pop_oldest(self) -> None:
        self._keys.popitem(last=False)


def ghost_limit(resident: int) -> int:
    return max(MIN_GHOSTS, GHOSTS_PER_OBJECT * resident)
