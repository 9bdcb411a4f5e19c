"""How L1 keeps its journal (--l1-persist; the file format is in storage/l1_journal.py): a part
L1Store owns once it is given a journal, built from the journal and L1's arena, lock and index.

A commit record carries the checksum of the chunk's bytes, so that a restarted server can tell a
chunk's own bytes from whatever a lost or damaged record let it believe. Summing is mostly not on
the store path: committed objects are queued, and a thread sums them (a few at once, on threads
that let go of the GIL) without the lock, then writes their records with it. An object freed or
moved while it was summed is not recorded from that sum (a moved one is queued again at its new
slot), so a sum never describes bytes that were not the chunk's.

The queue is bounded: the objects of at most MAX_LAG_STORES stores, of at most MAX_LAG_BYTES,
wait for their records (a store that finds none waiting is queued whole, however large). A store
whose objects do not fit sums them itself before it is answered (the first ones of the request,
its prefix: the rest is worth nothing without them), so a crash loses the chunks of at most
MAX_LAG_STORES answered stores, however busy the host. Unbounded, the queue fell seconds
behind on a busy host: the stores (copies at normal priority, on every core) outran the summing
thread (low priority, fewer cores), and nothing made them wait. The bound makes the stores wait
instead, by what summing their own bytes costs (measured in docs/OPERATIONS.md). A clean stop
writes every record first (close_journal).

At start-up `restore` claims the slots the journal names and sums them all (on every core, before
any request), keeping only the chunks whose bytes match.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable

from lmcache_mp.storage.l1_index import L1Index
from lmcache_mp.storage.l1_journal import Entry, L1Journal, chunk_sum, commit_record, free_record
from lmcache_mp.storage.index import SHARDS
from lmcache_mp.storage.objects import L1Object

if TYPE_CHECKING:
    from lmcache_mp.native import HostArena

logger = logging.getLogger(__name__)

SUM_BATCH_BYTES = 256 << 20  # bytes summed between two takes of the lock
SUM_INLINE_BYTES = 8 << 20  # a batch this small is summed on the summing thread alone
SUM_THREADS = max(1, min(4, (os.cpu_count() or 1) // 4))  # while serving: a few cores at most
SUM_STORE_THREADS = max(1, min(8, (os.cpu_count() or 1) // 2))  # for a store that sums its own chunks
# Answered stores whose records may wait for the summing thread, and their bytes (what a crash can
# lose at most; a store that finds none waiting is queued whole, however large)
MAX_LAG_STORES = 32
MAX_LAG_BYTES = 4 << 30
JOURNAL_RECORD_ESTIMATE = 170  # bytes of one chunk's journal record (a rewrite compares with this)


def _background() -> None:
    """This thread yields the cores to the copies and the socket thread when they want them."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except OSError:  # not allowed here: the thread runs at the process's priority
        pass


class _Waiting:
    """The objects of one store that wait for their records."""

    __slots__ = ("left",)

    def __init__(self, left: int):
        self.left = left


class L1Persistence:
    """The journal's side of L1Store. class_bytes: L1's object bytes per size class; counters:
    L1's, where summing is counted; committed(): how many objects L1 holds committed (what a
    rewrite would write)."""

    def __init__(self, journal: L1Journal, arena: HostArena, lock: threading.Lock, index: L1Index,
                 class_bytes: dict[int, int], counters: dict, committed: Callable[[], int]):
        self.journal = journal
        self.arena = arena
        self._lock = lock
        self._index = index
        self._class_bytes = class_bytes
        self.counters = counters
        self._committed = committed
        self._unsummed: collections.deque = collections.deque()
        self._sums_wanted = threading.Condition(lock)  # the summing thread waits for work
        self._sums_done = threading.Condition(lock)  # flush waits for records
        self._summing = 0  # objects taken by the summing thread and not yet recorded
        self._reserved = 0  # room in the queue taken by stores about to commit (sum_ahead)
        self._lag_stores = 0  # stores with objects queued, taken or reserved
        self._lag_bytes = 0  # the bytes of those objects
        self._sums_stop = False
        # summed_by_stores: objects a store summed itself (the queue was full); journal_backlog_max:
        # the most committed objects that waited for their records at once
        for name in ("summed_bytes", "summed_by_stores", "journal_backlog_max"):
            counters.setdefault(name, 0)
        counters.setdefault("sum_seconds", 0.0)
        self._sum_pool = ThreadPoolExecutor(SUM_THREADS, thread_name_prefix="lmcache-l1-sum", initializer=_background)
        # a store waiting for its own sums must not wait behind low-priority threads
        self._store_pool = ThreadPoolExecutor(SUM_STORE_THREADS, thread_name_prefix="lmcache-l1-store-sum")
        self._sum_thread = threading.Thread(target=self._sum_loop, name="lmcache-l1-journal-sums", daemon=True)
        self._sum_thread.start()

    def _object_sum(self, obj) -> int:
        return chunk_sum(self.arena.view(obj.offset, self._class_bytes[obj.size_class]))

    def sum_ahead(self, objs) -> None:
        """(before objs are committed: nothing moves or frees them meanwhile) Reserve room in the
        queue for the last ones of this request, and sum the others here, without the lock, so
        that the store is answered only once their records are written. The room: none while
        MAX_LAG_STORES stores wait; else up to MAX_LAG_BYTES waiting in all; when none waits, the
        whole request (one large request is not summed on the store path while the summing
        thread keeps up)."""
        if not objs:
            return
        nbytes = self._class_bytes[objs[0].size_class]  # (one object size per store)
        with self._lock:
            if self._lag_stores == 0 or self._sums_stop:  # (once the journal closed nothing is recorded)
                room = len(objs)
            elif self._lag_stores >= MAX_LAG_STORES:
                room = 0
            else:
                room = min(len(objs), max(0, MAX_LAG_BYTES - self._lag_bytes) // nbytes)
            if room:
                self._reserved += room
                self._lag_stores += 1
                self._lag_bytes += room * nbytes
        mine = objs[:len(objs) - room]
        try:
            if len(mine) > 1 and len(mine) * nbytes > SUM_INLINE_BYTES:
                sums = list(self._store_pool.map(self._object_sum, mine))  # a large request: on several cores
            else:
                sums = [self._object_sum(obj) for obj in mine]
            for obj, value in zip(mine, sums):
                obj.checksum = value
        except BaseException:
            with self._lock:
                if room:
                    self._reserved -= room
                    self._settled(_Waiting(1), room * nbytes)
            raise

    def record_commits(self, objs) -> None:
        """Committed objects (lock held; sum_ahead saw them first): records now for those it
        summed, the queue for those it reserved room for."""
        records = [obj for obj in objs if obj.checksum is not None]
        queued = [obj for obj in objs if obj.checksum is None]
        self.counters["summed_by_stores"] += len(records)
        self.journal.write([self.commit_record(obj) for obj in records])
        if queued:
            self._reserved -= len(queued)
            waiting = _Waiting(len(queued))
            self._unsummed.extend((obj, waiting) for obj in queued)
            self.counters["journal_backlog_max"] = max(self.counters["journal_backlog_max"], self.backlog())
            self._sums_wanted.notify()

    def _settled(self, waiting: _Waiting, nbytes: int) -> None:
        """(lock held) An object of this store waits no more: recorded, or gone."""
        self._lag_bytes -= nbytes
        waiting.left -= 1
        if waiting.left == 0:
            self._lag_stores -= 1

    def freed(self, obj: L1Object) -> None:
        """(lock held) A committed object is freed: recorded before its slot can go to anyone else."""
        self.journal.write([free_record(obj.offset)])

    def moved(self, obj: L1Object, old: int) -> None:
        """(lock held) A committed object's bytes were copied from old to obj.offset: one write
        (one not summed yet is summed at its new slot, and recorded then)."""
        self.journal.write([free_record(old)] + ([self.commit_record(obj)] if obj.checksum is not None else []))

    def commit_record(self, obj) -> bytes:
        return commit_record(obj.offset, self._class_bytes[obj.size_class], obj.key, obj.format_key, obj.checksum)

    def _sum_loop(self) -> None:
        _background()
        while True:
            with self._lock:
                while not self._unsummed and not self._sums_stop:
                    self._sums_wanted.wait()
                if not self._unsummed:
                    return
                todo, size = [], 0
                while self._unsummed and size < SUM_BATCH_BYTES:
                    obj, waiting = self._unsummed.popleft()
                    nbytes = self._class_bytes[obj.size_class]
                    if obj.committed and self._index.at.get(obj.offset) is obj and obj.checksum is None:
                        todo.append((obj, obj.offset, nbytes, waiting))
                        size += nbytes
                    else:
                        self._settled(waiting, nbytes)  # freed meanwhile: nothing to record
                self._summing = len(todo)
            t0 = time.perf_counter()
            try:
                one = lambda t: chunk_sum(self.arena.view(t[1], t[2]))  # noqa: E731
                sums = list(map(one, todo) if size <= SUM_INLINE_BYTES else self._sum_pool.map(one, todo))
            except Exception:
                logger.exception("summing L1 chunks for the journal failed; they are not recorded")
                sums = [None] * len(todo)
            took = time.perf_counter() - t0
            with self._lock:
                self.counters["summed_bytes"] += size
                self.counters["sum_seconds"] += took
                records = []
                for (obj, offset, nbytes, waiting), value in zip(todo, sums):
                    if obj.offset != offset and value is not None and self._index.at.get(obj.offset) is obj:
                        self._unsummed.append((obj, waiting))  # moved meanwhile: sum its new slot
                        continue
                    self._settled(waiting, nbytes)
                    if value is None or self._index.at.get(obj.offset) is not obj:
                        continue  # freed meanwhile: nothing to record
                    obj.checksum = value
                    records.append(self.commit_record(obj))
                self.journal.write(records)
                self._summing = 0
                self._sums_done.notify_all()
                self._maybe_compact()

    def backlog(self) -> int:
        """Committed objects whose records are not written yet, and those of stores about to be
        committed that will wait for theirs (lock held or not: a glance)."""
        return len(self._unsummed) + self._summing + self._reserved

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every object committed so far is recorded; False after timeout."""
        end = time.monotonic() + timeout
        with self._lock:
            while self._unsummed or self._summing:
                left = end - time.monotonic()
                if left <= 0 or not self._sum_thread.is_alive():
                    return False
                self._sums_done.wait(min(left, 1.0))
        return True

    def close(self, timeout: float = 60.0) -> None:
        """Record what was committed (a clean stop loses nothing), then close the journal."""
        if not self.flush(timeout):
            logger.warning("L1 journal: %d chunks were not recorded before the stop", self.backlog())
        with self._lock:
            self._sums_stop = True
            self._sums_wanted.notify_all()
        self._sum_thread.join(timeout)
        self._sum_pool.shutdown(wait=False)
        self._store_pool.shutdown(wait=False)
        self.journal.close()

    # ---- rewrites -----------------------------------------------------------------------------

    def _maybe_compact(self) -> None:
        """(lock held) Start a rewrite when the journal has grown to several times its content."""
        journal = self.journal
        if not journal.rewriting and journal.wants_rewrite(self._committed() * JOURNAL_RECORD_ESTIMATE):
            journal.start_rewrite()
            threading.Thread(target=self._compact_journal, args=(journal,), name="lmcache-l1-journal",
                             daemon=True).start()

    def _compact_journal(self, journal) -> None:
        """Rewrite the journal from the recorded chunks (its start_rewrite was called, lock held):
        the offset index a part at a time under the lock, the records made and written without it
        (l1_journal.py says why what changes meanwhile is not lost). A million chunks' records
        built and written under the lock had held every request for seconds."""
        old = -1
        try:
            n = journal.write_rewrite(self._journal_parts())
            with self._lock:
                before = journal.bytes
                old = journal.finish_rewrite()
            if old >= 0:
                logger.info("L1 journal rewritten: %d chunks, %.1f -> %.1f MiB", n, before / 2**20,
                            journal.bytes / 2**20)
        except Exception:
            logger.exception("rewriting the L1 journal failed; it goes on growing until the next attempt")
        finally:
            journal.close_old(old)
            if journal.rewriting:  # it failed before finishing
                with self._lock:
                    journal.abandon_rewrite()

    def _journal_parts(self):
        """The commit records of the recorded chunks, one part of the offset index at a time
        (those still waiting for their sum are written once summed, after the rewrite began)."""
        for part in range(SHARDS):
            with self._lock:
                live = [(o.offset, o.size_class, o.key, o.format_key, o.checksum)
                        for o in self._index.at.parts[part].values() if o.committed and o.checksum is not None]
            yield [commit_record(off, self._class_bytes[cls], key, fmt, value) for off, cls, key, fmt, value in live]

    # ---- start-up -----------------------------------------------------------------------------

    def restore(self, entries, size_class: Callable[[int], int],
                adopt: Callable[[Entry, int], L1Object | None]) -> tuple[int, int]:
        """Re-attach a previous server's chunks (l1_journal.Entry, oldest first) at their slots,
        before any request: a chunk comes back only if its slot still holds bytes of its
        checksum. size_class(object bytes): L1's class of that size; adopt(entry, class): L1
        takes the chunk in (lock held), or None when it holds that key already. The journal is
        then rewritten to what was restored. Returns (restored, dropped): dropped are slots
        that cannot be claimed, keys met twice and bytes that changed."""
        t0 = time.monotonic()
        claimed, dropped = [], 0
        with self._lock:
            for e in entries:
                try:
                    cls = size_class(e.object_bytes)
                    ok = e.object_bytes > 0 and self.arena.claim(e.offset, cls)
                except (ValueError, RuntimeError):
                    ok = False
                if ok:
                    claimed.append((e, cls))
                else:
                    dropped += 1
        with ThreadPoolExecutor(max(1, min(16, os.cpu_count() or 1)), thread_name_prefix="lmcache-l1-check") as pool:
            same = list(pool.map(lambda c: chunk_sum(self.arena.view(c[0].offset, c[0].object_bytes)) == c[0].checksum,
                                 claimed))
        changed = same.count(False)
        checked = sum(e.object_bytes for e, _ in claimed)
        kept = []
        with self._lock:
            for (e, cls), ok in zip(claimed, same):
                obj = adopt(e, cls) if ok else None
                if obj is None:
                    self.arena.free(e.offset)
                    continue
                kept.append(obj)
            # in the order they came back: the order of use
            self.journal.rewrite([self.commit_record(o) for o in kept])
        dropped += len(claimed) - len(kept)
        if entries:
            logger.info("L1 journal: %d chunks described, %.2f GiB of them checked in %.2f s: %d re-attached, %d "
                        "dropped (%d whose bytes changed)", len(entries), checked / 2**30, time.monotonic() - t0,
                        len(kept), dropped, changed)
        return len(kept), dropped
