"""What L1 indexes: the key of a chunk object and the object itself (its slot, its state)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

SHARED_RANK = -1  # rank of objects shared by every rank (MLA, tp-shared objects)
TP_SHARED_WORLD = 0  # world size of tp-shared objects (head_slices.py; protocol.TP_SHARED_WORLD)


class ObjectKey(NamedTuple):
    model: str
    world_size: int
    rank: int  # SHARED_RANK for objects every rank reads
    digest: bytes
    salt: bytes


@dataclass(eq=False, slots=True)  # slots: one object for the garbage collector to walk, not two
class L1Object:
    key: ObjectKey
    offset: int
    size_class: int
    nbytes: int  # slot bytes taken from the arena
    format_key: tuple
    committed: bool = False
    aborted: bool = False
    moving: bool = False  # being copied to another slot (its slab is changing size)
    readers: int = 0  # reads in progress
    leases: int = 0  # leases holding it
    waiters: list | None = None  # called with True/False once written/abandoned
    uses: int = 0  # stores and lookup hits: what L2 admission counts
    prev: L1Object | None = field(default=None, repr=False)  # the chunk before it in its store (l1_writeback.py)
    l2_copies: int = 0  # bits of the L2 tiers that hold a copy (written there or loaded from there)
    l2_writing: int = 0  # bits of the L2 tiers writing it now: not freed or moved until they have read it
    l2_lost: int = 0  # bits of the L2 tiers it never reaches (left L1 unwritten, or a write failed)
    owner: int = -1  # its tenant's index in L1's Quotas (-1: L1 has no quotas)
    checksum: int | None = None  # of its bytes, once summed for the journal (storage/l1_persist.py)
    # A tp-shared object (head_slices.py) is written by several stores, one slice of heads each,
    # as bits: it is committed once heads_landed is heads_full (0: one store writes it all).
    heads_full: int = 0
    heads_landed: int = 0
    heads_writing: int = 0
    touched: float = 0.0  # when a slice of it was last claimed or landed (partial ones expire)
    # The eviction policy's (storage/eviction/base.py): neighbours in the list it is parked in
    # (index.Lru; newer is None while it is not parked), and its own marks.
    older: L1Object | None = field(default=None, repr=False)
    newer: L1Object | None = field(default=None, repr=False)
    queue: int = field(default=0, repr=False)
    freq: int = field(default=0, repr=False)
    stamp: int = field(default=0, repr=False)
    since: int = field(default=0, repr=False)
