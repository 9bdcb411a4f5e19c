"""A trace replayed on a policy's own code, without a server: for sweeps over cache sizes in
seconds (bench/bench_trace.py), and Belady's offline optimum beside it.

A trace is a list of requests, each the ids of its blocks in prefix order (a request shares ids
with another exactly as far as their prompts share a prefix). A request's hits are its leading
blocks present before it touches anything. The policy then sees what a server's L1 makes of an
engine's lookup with lock, retrieve of the hits and store of the rest (bench_trace's server mode,
storage/l1.py), in that order: the hits leased and read (unparked, used), then parked again
deepest first; the store's blocks already held used and held; room made for its new blocks one
at a time (a block that finds none ends the store: a request larger than the cache keeps only
what fits); the held ones parked again; the new ones admitted in parts of SLICE.
"""

from __future__ import annotations

import bisect
import heapq
from typing import Sequence

import xxhash

from lmcache_mp.storage.eviction import make_policy
from lmcache_mp.storage.l1_index import SLICE
from lmcache_mp.storage.objects import ObjectKey


class SimObject:
    """What a policy sees of a stored object (and the block id it stands for)."""

    __slots__ = ("key", "block", "older", "newer", "queue", "freq", "stamp", "since", "prev")

    def __init__(self, key: ObjectKey, block: int, prev: SimObject | None):
        self.key, self.block, self.prev = key, block, prev
        self.older = self.newer = None
        self.queue = self.freq = self.stamp = self.since = 0


def block_key(block_id: int, model: str = "trace") -> ObjectKey:
    """The chunk key a trace's block id stands for (a 16-byte digest, as a client's hashes are)."""
    return ObjectKey(model, 1, 0, xxhash.xxh3_128_digest(block_id.to_bytes(8, "little")), b"")


def _leading(blocks: Sequence[int], held) -> int:
    """A request's hits: its leading blocks present."""
    n = 0
    for b in blocks:
        if b not in held:
            break
        n += 1
    return n


def replay(requests: Sequence[Sequence[int]], policy: str, capacity: int) -> dict:
    """Blocks requested and served from the cache, replaying on the named policy."""
    pol = make_policy(policy)
    held: dict[int, SimObject] = {}
    keys: dict[int, ObjectKey] = {}
    hits = total = 0
    for blocks in requests:
        n = _leading(blocks, held)
        hits += n
        total += len(blocks)
        reads = [held[b] for b in blocks[:n]]
        for obj in reads:  # leased by the lookup
            pol.unpark(obj)
        for obj in reads:  # read
            pol.use(obj)
        for obj in reversed(reads):  # the read ends
            pol.park(obj)
        used: list[SimObject] = []
        new: list[SimObject] = []
        before = reads[-1] if reads else None  # the object of the block before (a store names it)
        for b in blocks[n:]:  # the store, in prefix order
            obj = held.get(b)
            if obj is not None:  # a store of a block held: a use
                pol.use(obj)
                pol.unpark(obj)
                used.append(obj)
            else:  # a slot, evicting when none is free; none to evict: the store ends here
                if pol.resident + len(new) >= capacity:
                    victim = next(pol.candidates(), None)
                    if victim is None:
                        break
                    pol.evicted(victim)
                    pol.remove(victim)
                    del held[victim.block]
                key = keys.get(b)
                if key is None:
                    key = keys[b] = block_key(b)
                obj = SimObject(key, b, before)
                new.append(obj)
            before = obj
        for obj in reversed(used):
            pol.park(obj)
        for obj in new:
            held[obj.block] = obj
        for start in range(0, len(new), SLICE):
            pol.admit(new[start:start + SLICE], new[0], start + SLICE >= len(new))
    return {"hits": hits, "blocks": total, "ratio": hits / total if total else 0.0}


def belady(requests: Sequence[Sequence[int]], capacity: int) -> dict:
    """Belady's MIN, offline: over capacity, the block whose next use is farthest goes (a request's
    blocks are touched the last first)."""
    never = len(requests)
    next_use: list[list[int]] = [[] for _ in requests]
    last: dict[int, int] = {}
    for i in range(len(requests) - 1, -1, -1):
        next_use[i] = [last.get(b, never) for b in requests[i]]
        for b in requests[i]:
            last[b] = i
    held: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, block); stale entries skipped
    hits = total = 0
    for i, blocks in enumerate(requests):
        hits += _leading(blocks, held)
        total += len(blocks)
        for j in range(len(blocks) - 1, -1, -1):
            b, nu = blocks[j], next_use[i][j]
            held[b] = nu
            heapq.heappush(heap, (-nu, b))
            while len(held) > capacity:
                far, v = heapq.heappop(heap)
                if held.get(v) == -far:
                    del held[v]
    return {"hits": hits, "blocks": total, "ratio": hits / total if total else 0.0}


def next_turn(requests: Sequence[Sequence[int]], capacity: int, overdue: float = 3.0) -> dict:
    """An offline model of valuing sessions by when their next turn comes (not a policy: it scans
    every session at each eviction). A request's session is its first block (a session's turns
    re-send its context); its next turn is predicted at its last turn plus a running mean of its
    gaps between turns, in requests (a session of one turn: the median gap so far). Over
    capacity, the deepest held block of the session predicted farthest goes; a session more than
    `overdue` gaps past its prediction has ended, and goes first."""
    held: dict[int, int] = {}  # block -> the session that stored it
    chains: dict[int, list[int]] = {}  # session -> its held blocks, in the order stored
    last: dict[int, int] = {}
    gap: dict[int, float] = {}
    gaps: list[int] = []
    hits = total = 0
    for i, blocks in enumerate(requests):
        if not blocks:
            continue
        hits += _leading(blocks, held)
        total += len(blocks)
        s = blocks[0]
        if s in last:
            g = i - last[s]
            bisect.insort(gaps, g)
            gap[s] = g if s not in gap else 0.5 * (g + gap[s])
        last[s] = i
        new = [b for b in blocks if b not in held]
        need = len(held) + len(new) - capacity
        typical = gaps[len(gaps) // 2] if gaps else 1

        def farthest(x: int) -> float:
            g = gap.get(x, typical)
            late = i - last[x]
            return 1e18 + late if late > overdue * g else last[x] + g

        while need > 0:
            others = [x for x, c in chains.items() if c and x != s]
            if not others:
                break
            chain = chains[max(others, key=farthest)]
            while need > 0 and chain:
                del held[chain.pop()]
                need -= 1
        mine = chains.setdefault(s, [])
        for b in new:
            held[b] = s
            mine.append(b)
        while len(held) > capacity and mine:  # (a session larger than the cache)
            del held[mine.pop()]
        for x in [x for x, c in chains.items() if not c and x != s]:
            del chains[x]
    return {"hits": hits, "blocks": total, "ratio": hits / total if total else 0.0}
