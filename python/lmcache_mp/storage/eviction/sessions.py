"""The sessions policy (`--eviction-policy sessions`): the session whose next turn is farthest goes first.

Agentic and chat traffic comes in sessions: each turn re-sends the session's context and adds to
it, after the think or tool time of the turn before. Where the live sessions' contexts are larger
than the cache, what a cache can do is hold whole sessions, the ones coming back soonest, and let
the others go. This policy does that with what a store tells it:

- **A session is a chain of stores.** A store whose parent chunk (the chunk before its first new
  one) is at the session's deepest point, or within BRANCH_SLACK chunks of it, continues that
  session (the next turn re-sends the context, whose last, partial chunk changed); a store that
  branches off higher up, or names no parent, starts a session keyed by its first new chunk (a
  conversation below a shared system prompt is a session of its own; it starts with the pace of
  the session it branched from: a sub-agent's, a rewritten context's). What is known of a
  session keyed so (its gap) is remembered after its chunks are gone (GHOSTS_PER_OBJECT per object
  held).
- **Its turns and their gap.** The clock counts reads and stores of chunks. An access to a
  session quiet for longer than a sixteenth of the objects held starts a turn of it; its gap is
  the running mean of the time from turn to turn (a session of one turn: the median of the latest
  GAP_WINDOW gaps of every session).
- **The victim**: first the deepest parked chunk of a session that has ended (more than OVERDUE
  gaps since it was last read or stored), the one that ended first; else a chunk its session's
  latest turn did not touch (the previous turn's last chunk, whose tokens changed; an abandoned
  branch); else the deepest chunk of the session whose next turn (its last turn plus its gap) is
  farthest. A session accessed within the latest ACCESSING reads and stores, and the quiet time
  of a turn (its request's store is making room), goes last. Within a session the chunks its
  latest turn did not touch go first, then the deepest, so what stays of it is a prefix.

Sessions of more than one turn sit in two heaps (by when they end, by their next turn), updated once
per turn; an entry found at the top is skipped if stale, and moved if its session was accessed
since (it ends later). Sessions of one turn share the typical gap, so they are kept in the order
they began. A chunk's call is O(1), a turn's O(log sessions). A walk past the first session (a
chooser passing over busy chunks) sorts the sessions with parked chunks.
"""

from __future__ import annotations

import bisect
import collections
import heapq
import itertools
from typing import Iterator, Sequence

from lmcache_mp.storage.eviction.base import GHOST_BYTES, EvictionPolicy, ghost_limit
from lmcache_mp.storage.index import Lru

BRANCH_SLACK = 2  # a store whose parent is this close to its session's deepest chunk continues it
OVERDUE = 3.0  # a session this many gaps past its last access has ended
GAP_WINDOW = 255  # latest gaps between turns, for the typical gap
QUIET = 16  # a session quiet for 1 / QUIET of the objects held (at least MIN_QUIET) starts a turn
MIN_QUIET = 8
ACCESSING = 64  # a session accessed within this many reads and stores is being accessed: it goes last
STASH = 4  # sessions being accessed passed over at the top of the heap before the sessions are sorted


class Session:
    __slots__ = ("chunks", "old", "start", "last", "gap", "turns", "tip", "resident", "version")

    def __init__(self):
        self.chunks = Lru()  # parked chunks read or stored in its latest turn, the deepest first
        self.old = Lru()  # parked chunks not touched since its latest turn began
        self.start = self.last = 0  # clock at its latest turn's start, at its latest access
        self.gap = 0.0  # mean clock from turn to turn (0: one turn so far)
        self.turns = 0
        self.tip = -1  # depth of its deepest chunk stored
        self.resident = 0
        self.version = 0  # of its heap entries


class SessionsPolicy(EvictionPolicy):
    name = "sessions"

    def __init__(self):
        super().__init__()
        self.clock = 0
        self._parked = 0
        self._known: collections.OrderedDict = collections.OrderedDict()  # first key -> session
        self._live: dict = {}  # sessions with parked chunks (dicts: a reproducible order)
        self._stale: dict = {}  # sessions with parked chunks untouched in their latest turn
        self._fresh: dict = {}  # sessions of one turn (their gap: the typical one), the oldest first
        self._ends: list = []  # (end of its next turn's window, seq, version, session)
        self._nexts: list = []  # (-its next turn, seq, version, session)
        self._seq = itertools.count()
        self._recent: collections.deque = collections.deque()
        self._sorted: list = []  # the same gaps, sorted

    # ---- sessions ------------------------------------------------------------------------------

    def _session_of(self, first, parent) -> tuple[Session, int]:
        if parent is not None and isinstance(parent.queue, Session):
            s = parent.queue
            if parent.since >= s.tip - BRANCH_SLACK:
                return s, parent.since + 1
            depth, was = parent.since + 1, s
        else:
            depth, was = 0, None
        known = self._known
        s = known.pop(first.key, None)
        if s is None:
            s = Session()
            if was is not None:  # a branch: its parent session's pace
                s.gap = was.gap
        known[first.key] = s
        while len(known) > ghost_limit(self.resident):
            known.popitem(last=False)
        return s, depth

    def _typical(self) -> float:
        ranked = self._sorted
        return ranked[len(ranked) // 2] if ranked else float(max(self.resident, 1))

    def _quiet(self) -> int:
        return max(MIN_QUIET, self.resident // QUIET)

    def _touch(self, s: Session) -> None:
        now = self.clock
        if not s.turns or now - s.last > self._quiet():
            if s.turns:
                g = now - s.start
                s.gap = g if not s.gap else 0.5 * (g + s.gap)
                bisect.insort(self._sorted, g)
                self._recent.append(g)
                if len(self._recent) > GAP_WINDOW:
                    del self._sorted[bisect.bisect_left(self._sorted, self._recent.popleft())]
            s.start = now
            s.turns += 1
            if s.gap:
                self._fresh.pop(s, None)
            else:  # its first turn: ordered by when it began
                self._fresh[s] = None
            if s.chunks:
                s.old.take_all(s.chunks)
            if s.old:
                self._stale[s] = None
                self._schedule(s)
        s.last = now

    def _schedule(self, s: Session) -> None:
        """Into the heaps, as of its latest turn (a session of one turn is in _fresh)."""
        s.version += 1
        gap = s.gap
        if not gap:
            return
        seq = next(self._seq)
        heapq.heappush(self._ends, (s.last + OVERDUE * gap, seq, s.version, s))
        heapq.heappush(self._nexts, (-(s.start + gap), seq, s.version, s))
        if len(self._ends) > 4 * len(self._live) + 64:  # stale entries: rebuild
            self._ends = [e for e in self._ends if e[2] == e[3].version and e[3] in self._live]
            self._nexts = [e for e in self._nexts if e[2] == e[3].version and e[3] in self._live]
            heapq.heapify(self._ends)
            heapq.heapify(self._nexts)

    # ---- the policy's calls --------------------------------------------------------------------

    def admit(self, objs: Sequence, lead=None, last: bool = True) -> None:
        if not objs:
            return
        s, depth = self._session_of(objs[0], objs[0].prev)
        self._touch(s)
        self.clock += len(objs)
        self.resident += len(objs)
        s.resident += len(objs)
        s.tip = max(s.tip, depth + len(objs) - 1)
        was = len(s.chunks) + len(s.old)
        chunks, turn = s.chunks, s.turns
        for obj in objs:  # each deeper than the one before: nearer eviction
            obj.queue, obj.since, obj.stamp = s, depth, turn
            depth += 1
            chunks.to_oldest(obj)
        self._parked += len(objs)
        if not was:
            self._live[s] = None
            self._schedule(s)

    def use(self, obj) -> None:
        s = obj.queue
        self._touch(s)
        self.clock += 1
        if obj.stamp != s.turns:
            if obj.newer is not None:
                s.old.remove(obj)
                s.chunks.to_newest(obj)
                if not s.old:
                    self._stale.pop(s, None)
            obj.stamp = s.turns

    def _list(self, obj) -> Lru:
        s = obj.queue
        return s.chunks if obj.stamp == s.turns else s.old

    def park(self, obj) -> None:
        if obj.newer is not None:
            return
        s = obj.queue
        chunks = self._list(obj)
        chunks.to_newest(obj)
        self._parked += 1
        if chunks is s.old:
            self._stale[s] = None
        if len(s.chunks) + len(s.old) == 1:
            self._live[s] = None
            self._schedule(s)

    def unpark(self, obj) -> None:
        if obj.newer is None:
            return
        s = obj.queue
        self._list(obj).remove(obj)
        self._parked -= 1
        if not s.old:
            self._stale.pop(s, None)
            if not s.chunks:
                self._live.pop(s, None)

    def remove(self, obj) -> None:
        self.unpark(obj)
        s = obj.queue
        s.resident -= 1
        self.resident -= 1
        if not s.resident:
            self._fresh.pop(s, None)

    # ---- the victims ---------------------------------------------------------------------------

    def _top(self, heap: list):
        while heap:
            when, seq, version, s = heap[0]
            if version == s.version and (s.chunks or s.old):
                if heap is self._ends and when < s.last + OVERDUE * s.gap:  # accessed since: later
                    heapq.heapreplace(heap, (s.last + OVERDUE * s.gap, seq, version, s))
                    continue
                return s
            heapq.heappop(heap)
        return None

    def _rank(self, s: Session):
        now = self.clock
        gap = s.gap or self._typical()
        if now - s.last <= min(ACCESSING, self._quiet()):
            return (2, 0.0)  # being accessed: last
        if now > s.last + OVERDUE * gap:
            return (0, s.last + OVERDUE * gap)
        return (1, -(s.start + gap))

    def _fresh_end(self, newest: bool):
        """The session of one turn, parked chunks and not being accessed, nearest that end of _fresh."""
        ends = reversed(self._fresh) if newest else iter(self._fresh)
        for s in itertools.islice(ends, STASH + 1):
            if s in self._live and self._rank(s)[0] < 2:
                return s
        return None

    def _first(self):
        """The first session to lose a chunk, from the heaps' tops and _fresh's ends (None: sort
        them all)."""
        now, typical = self.clock, self._typical()
        ended = self._top(self._ends)
        if ended is not None and self._rank(ended)[0] != 0:
            ended = None
        old = self._fresh_end(newest=False)
        if old is not None and now > old.last + OVERDUE * typical:
            if ended is None or old.last + OVERDUE * typical < ended.last + OVERDUE * ended.gap:
                ended = old
        if ended is not None:
            return ended
        stash, far = [], None
        while len(stash) <= STASH:
            s = self._top(self._nexts)
            if s is None:
                break
            if self._rank(s)[0] < 2:
                far = s
                break
            stash.append(heapq.heappop(self._nexts))  # being accessed: the next one
        for entry in stash:
            heapq.heappush(self._nexts, entry)
        new = self._fresh_end(newest=True)
        if new is not None and (far is None or new.start + typical > far.start + far.gap):
            far = new
        return far

    def _stale_session(self):
        """A session with chunks untouched in its latest turn (not the one being accessed)."""
        accessing = min(ACCESSING, self._quiet())
        for s in self._stale:
            if self.clock - s.last > accessing:
                return s
        return None

    def candidates(self) -> Iterator:
        """Each parked chunk once: an ended session's, else one session's chunks left behind,
        then the first session's, then every session's in rank order."""
        first = self._first()
        stale = None
        if first is None or self._rank(first)[0] != 0:
            stale = self._stale_session()
            if stale is not None:
                yield from stale.old.oldest()
        if first is not None:
            yield from first.chunks.oldest() if first is stale else _chunks(first)
        for s in sorted(self._live, key=self._rank):
            if s is not first:
                yield from s.chunks.oldest() if s is stale else _chunks(s)

    def order(self) -> Iterator:
        for s in sorted(self._live, key=self._rank):
            yield from _chunks(s)

    def __len__(self) -> int:
        return self._parked

    def stats(self) -> dict:
        keys = len(self._known) + len(self._recent)
        return {"policy": self.name, "history_keys": keys, "history_bytes": keys * GHOST_BYTES,
                "sessions": len(self._live)}


def _chunks(s: Session) -> Iterator:
    yield from s.old.oldest()
    yield from s.chunks.oldest()

