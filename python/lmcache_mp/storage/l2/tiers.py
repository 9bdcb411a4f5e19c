"""L2Tiers: what goes from L1 to the L2 tiers and back.

Writes. Each tier that takes writes has a writer of its own (writers.py), with its own policy:
the local disk writes what L1 is about to evict (`evicted`, ahead of the eviction), the shared
tiers every chunk soon after it is stored (`all`), so that other nodes find it. A chunk is
admitted once it was stored or looked up `admit` times, so one-off chunks do not churn the tiers.
Writes keep prefixes whole (storage/l1_writeback.py). `queue_bytes` (0: a quarter of L1, at most
half of it): write-back writes ahead of eviction while less than that is free, and one write holds
at most that much of L1.

Reads. `find` continues a lookup into the tiers after the L1 prefix (from their in-memory
indexes). `prefetch` loads found chunks into L1 on the reader thread and calls back once they
are resident or the prefetch deadline passed, whichever comes first, so that a lookup with lock
can lease them; the chunks it loads stay pinned until then, so a prefix longer than L1 has room
for loads as much of it as fits and leases that. At most `max_prefetches` run at once (beyond
that a lookup is answered from L1 alone). `load` does the same for a retrieve that names chunks
only L2 has.

Keys and formats are stored as msgpack of the L1 key and of the layout's format key.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Callable, NamedTuple, Sequence

import msgspec

from lmcache_mp.sizes import format_size
from lmcache_mp.storage.l1 import SHARED_RANK, TP_SHARED_WORLD, L1Object, L1Store, ObjectKey, StorePlan
from lmcache_mp.storage.l1_journal import format_key_from
from lmcache_mp.storage.l2 import CORRUPT, FORMAT_MISMATCH, IO_ERROR, MISS, L2Backend
from lmcache_mp.storage.l2.deadlines import Deadlines, first_of_two
from lmcache_mp.storage.l2.writers import POLICIES, Incident, TierWriter, key_bytes

logger = logging.getLogger(__name__)

LOAD_BATCH_CHUNKS = 16  # chunks per get() call: a deadline can answer with the chunks loaded so far
DRAIN_SECONDS = 30.0  # on close, the writes listed for write-through get this long to finish
# On close, a write-back tier (the disk's default) gets this long to take what L1 holds that it
# lacks, most valuable first; so that a restarted server finds them there. (Within systemd's stop
# timeout, deploy/lmcache-mp.service, beside the drain of requests.)
FLUSH_SECONDS = 10.0

_decode = msgspec.msgpack.decode


class Found(NamedTuple):
    """An object one of the tiers holds."""

    key: ObjectKey
    tier: int
    nbytes: int
    fmt: bytes


class L2Tiers:
    def __init__(self, tiers: Sequence[L2Backend], l1: L1Store, writes: Sequence[str] | None = None, admit: int = 1,
                 queue_bytes: int = 0, max_prefetches: int = 64, prefetch_timeout: float = 0.5):
        """writes: each tier's policy (evicted, all or none; default: the tier's own)."""
        if not tiers:
            raise ValueError("L2Tiers needs at least one tier")
        self.tiers = list(tiers)
        writes = list(writes) if writes is not None else [t.default_write for t in self.tiers]
        if len(writes) != len(self.tiers) or any(w not in POLICIES for w in writes):
            raise ValueError(f"one write policy of {POLICIES} per tier, got {writes}")
        self.l1 = l1
        self.writes = writes
        self.admit = admit
        half = l1.arena.capacity // 2
        self.queue_limit = min(queue_bytes or half // 2, half)
        if queue_bytes > half:
            logger.info("L2: --l2-queue-size %s is more than half of L1: %s is used", format_size(queue_bytes),
                        format_size(half))
        self.max_prefetches = max_prefetches
        self.prefetch_timeout = prefetch_timeout
        self.counters = collections.Counter({k: 0 for k in (
            "lookup_hits", "loaded", "prefetches", "prefetch_timeouts", "prefetches_refused")})
        self._tier_counts = [collections.Counter() for _ in self.tiers]
        self._cv = threading.Condition()
        self._closing = False
        self._prefetching = 0
        self._read_incident = Incident("reads")
        self._deadlines = Deadlines()
        self._reads: queue.SimpleQueue = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read_loop, name="lmcache-l2-reader", daemon=True)
        self._reader.start()
        self.writers = [TierWriter(l1, tier, i, w, self.queue_limit)
                        for i, (tier, w) in enumerate(zip(self.tiers, writes)) if w != "none"]
        if self.writers:
            through = [w for w in self.writers if w.policy == "all"]
            l1.attach_l2(sum(w.bit for w in self.writers), admit, self._dirty if through else None, self._dropped,
                         self._evicted)
            logger.info("L2 writes: %s; written ahead of eviction while less than %s of L1 is free",
                        ", ".join(f"{t.name} {w}" for t, w in zip(self.tiers, writes)), format_size(self.queue_limit))
        for tier, w in zip(self.tiers, writes):
            logger.info("L2 %s: codec %s, writes %s%s", tier.name, getattr(tier, "codec", "none"), w,
                        f" (a clean stop writes what L1 holds that it lacks, for at most {FLUSH_SECONDS:.0f} s)"
                        if w == "evicted" else "")

    # ---- writes (writers.py), called by L1 with its lock held ----------------------------------

    def _dirty(self, obj: L1Object) -> None:
        for w in self.writers:
            w.dirty(obj)

    def _dropped(self, dropped: int, lost: int, n: int) -> None:
        for w in self.writers:
            if (dropped | lost) & w.bit:
                w.dropped(n if dropped & w.bit else 0, n if lost & w.bit else 0)

    def _evicted(self) -> None:
        for w in self.writers:
            w.wake()

    @property
    def remote(self) -> bool:
        """Some tier answers lookups over the network: lookups then run off the socket thread."""
        return any(not getattr(t, "local", True) for t in self.tiers)

    def run_read(self, fn: Callable[[], None]) -> None:
        """fn on the reader thread (e.g. a lookup that asks a remote tier)."""
        self._reads.put(fn)

    # ---- reads -------------------------------------------------------------------------------

    def _locate(self, keys: Sequence[ObjectKey]) -> list[Found | None]:
        """Where each object is: the first tier that has it (from the tiers' indexes)."""
        out: list[Found | None] = [None] * len(keys)
        blobs = [key_bytes(k) for k in keys]
        for t, tier in enumerate(self.tiers):
            todo = [i for i, f in enumerate(out) if f is None]
            if not todo:
                break
            for i, got in zip(todo, tier.lookup([blobs[i] for i in todo])):
                if got is not None:
                    out[i] = Found(keys[i], t, got[0], got[1])
        return out

    def find(self, model: str, world_size: int, digests: Sequence[bytes], salt: bytes = b"",
             fallback_model: str = "", tp_shared: bool = False) -> list[list[Found]]:
        """The objects of the leading chunks the tiers hold for every rank (or as one shared
        object), chunk by chunk; a chunk not held under model is looked for under fallback_model
        (a tenant's reads of the shared namespace). tp_shared: as tp-shared objects only."""
        models = [m for m in (model, fallback_model) if m]
        space = TP_SHARED_WORLD if tp_shared else world_size
        shared = [self._locate([ObjectKey(m, space, SHARED_RANK, d, salt) for d in digests]) for m in models]
        chunks: list[list[Found]] = []
        for i, d in enumerate(digests):
            for m, held in zip(models, shared):
                if held[i] is not None:
                    chunks.append([held[i]])
                    break
                if tp_shared:
                    continue
                ranks = self._locate([ObjectKey(m, world_size, r, d, salt) for r in range(world_size)])
                if all(f is not None for f in ranks):
                    chunks.append(ranks)  # type: ignore[arg-type]
                    break
            else:
                break
        self.counters["lookup_hits"] += len(chunks)
        return chunks

    def find_keys(self, keys: Sequence[ObjectKey], fallback: Sequence[ObjectKey] | None = None) -> list[Found]:
        """The leading objects of these keys the tiers hold (fallback[i]: looked for when
        keys[i] is not held, as L1Store.begin_read)."""
        out = []
        spare = self._locate(fallback) if fallback is not None else [None] * len(keys)
        for f, g in zip(self._locate(keys), spare):
            if f is None and g is None:
                break
            out.append(f or g)
        return out

    def prefetch(self, chunks: list[list[Found]], answer: Callable[[], None]) -> bool:
        """Load these chunks into L1, then call answer() once: when they are in (or as many of
        them as fit), or at the prefetch deadline. The chunks loaded stay pinned until answer()
        returned, so that it can lease them. False (and nothing done) when too many prefetches
        run already."""
        with self._cv:
            if self._prefetching >= self.max_prefetches or self._closing:
                self.counters["prefetches_refused"] += 1
                return False
            self._prefetching += 1
        self.counters["prefetches"] += 1
        first = first_of_two()

        def at_deadline() -> None:
            if first():
                self.counters["prefetch_timeouts"] += 1
                answer()

        def run() -> None:
            held: list[L1Object] = []
            try:
                self._load([f for chunk in chunks for f in chunk], held)
            finally:
                with self._cv:
                    self._prefetching -= 1
                try:
                    if first():
                        answer()
                finally:
                    self.l1.end_read(held)

        self._deadlines.at(time.monotonic() + self.prefetch_timeout, at_deadline)
        self._reads.put(run)
        return True

    def lookup_remote(self, find: Callable[[], list[list[Found]]], lock: bool,
                      answer: Callable[[int | None], None]) -> None:
        """For tiers behind a network, the whole L2 part of a lookup runs on the reader thread:
        find(), and with lock the load of what it found (pinned until answered, as prefetch).
        answer(chunks found) is called once, when done, or answer(None) at the prefetch deadline,
        whichever comes first: a slow or hung server delays no lookup beyond it."""
        first = first_of_two()

        def at_deadline() -> None:
            if first():
                self.counters["prefetch_timeouts"] += 1
                answer(None)

        def run() -> None:
            n = 0
            held: list[L1Object] = []
            try:
                found = find()
                n = len(found)
                if lock and found:
                    self.counters["prefetches"] += 1
                    with self._cv:
                        self._prefetching += 1
                    try:
                        self._load([f for chunk in found for f in chunk], held)
                    finally:
                        with self._cv:
                            self._prefetching -= 1
            finally:
                try:
                    if first():
                        answer(n)
                finally:
                    self.l1.end_read(held)

        self._deadlines.at(time.monotonic() + self.prefetch_timeout, at_deadline)
        self._reads.put(run)

    def load(self, found: list[Found], then: Callable[[list[L1Object]], None]) -> None:
        """Load these objects into L1 on the reader thread, then call then(pinned) there: the
        objects loaded, pinned (read) until the caller's end_read."""

        def run() -> None:
            held: list[L1Object] = []
            try:
                self._load(found, held)
            finally:
                then(held)

        self._reads.put(run)

    def load_keys(self, keys: Sequence[ObjectKey], then: Callable[[list[L1Object]], None],
                  fallback: Sequence[ObjectKey] | None = None) -> None:
        """find_keys and load on the reader thread, then then(pinned) there (as load)."""

        def run() -> None:
            held: list[L1Object] = []
            try:
                found = self.find_keys(keys, fallback)
                if found:
                    self._load(found, held)
            finally:
                then(held)

        self._reads.put(run)

    def _read_loop(self) -> None:
        while True:
            job = self._reads.get()
            if job is None:
                return
            try:
                job()
            except Exception:
                logger.exception("L2 read failed")

    def _load(self, found: list[Found], held: list[L1Object]) -> None:
        """Read objects into new L1 objects, in order, a batch at a time, each batch pinned (added
        to held) so that the next cannot evict it; stops at the first one that cannot be placed
        (L1 has no room left for more of this prefix) or read."""
        start = 0
        while start < len(found):
            batch = found[start:start + LOAD_BATCH_CHUNKS]
            first = batch[0]
            batch = batch[: next((i for i, f in enumerate(batch) if (f.nbytes, f.fmt) != (first.nbytes, first.fmt)),
                                 len(batch))]
            n = self._load_batch(batch, held, found[start - 1].key if start else None)
            if n < len(batch):
                break
            start += len(batch)

    def _load_batch(self, batch: list[Found], held: list[L1Object], parent: ObjectKey | None) -> int:
        fmt = format_key_from(_decode(batch[0].fmt))
        plan = self.l1.begin_store([f.key for f in batch], batch[0].nbytes, fmt, parent)
        results: list[int] = []
        if plan.objects:
            base = self.l1.arena.base
            by_tier: dict[int, list[int]] = collections.defaultdict(list)
            for j, i in enumerate(plan.indices):
                by_tier[batch[i].tier].append(j)
            results = [IO_ERROR] * len(plan.objects)
            for t, js in by_tier.items():
                try:
                    got = self.tiers[t].get([key_bytes(plan.objects[j].key) for j in js], [batch[0].fmt] * len(js),
                                            [base + plan.objects[j].offset for j in js], [batch[0].nbytes] * len(js))
                except Exception as e:
                    logger.exception("L2 read failed: %s", e)
                    got = [IO_ERROR] * len(js)
                for j, r in zip(js, got):
                    results[j] = r
                    if r == batch[0].nbytes:
                        plan.objects[j].l2_copies = 1 << t  # (not committed yet: nobody else looks at it)
                    c = self._tier_counts[t]
                    c["hits" if r >= 0 else "misses" if r in (MISS, FORMAT_MISMATCH) else
                      "corrupt" if r == CORRUPT else "errors"] += 1
            ok = [o for o, r in zip(plan.objects, results) if r == batch[0].nbytes]
            bad = [o for o, r in zip(plan.objects, results) if r != batch[0].nbytes]
            if ok:
                self.l1.commit(StorePlan([], ok, 0, 0), from_l2=True)
            if bad:
                self.l1.abort(StorePlan([], bad, 0, 0))
            self.counters["loaded"] += len(ok)
            errors = sum(r not in (MISS, FORMAT_MISMATCH) and r < 0 for r in results)
            self._read_incident.update(errors, len(results), lambda: "; ".join(
                str(t.stats().get("last_error", "")) for t in self.tiers))
        # the leading objects now in L1: present before, written by this batch, or by another store
        good = {id(o) for o, r in zip(plan.objects, results) if r == batch[0].nbytes}
        placed = {i: o for i, o in zip(plan.indices, plan.objects)}
        n = 0
        for i in range(len(batch) - plan.skipped):
            o = placed.get(i)
            if o is not None and id(o) not in good:
                break
            n += 1
        pinned = self.l1.begin_read([f.key for f in batch[:n]], fmt) if n else []
        held += pinned
        return len(pinned)

    # ---- status ------------------------------------------------------------------------------

    def _disk(self):
        """The disk tier (under its codec), or None."""
        return next((getattr(t, "inner", t) for t in self.tiers if t.name == "disk"), None)

    def set_disk_quota(self, tenant: str, nbytes: int) -> None:
        """A tenant's l2_disk_max on the disk tier (0: none)."""
        if (disk := self._disk()) is not None:
            disk.set_quota(tenant, nbytes)

    def on_disk_over_cap(self, callback) -> None:
        """callback(tenant, chunks, bytes, limit): a disk-tier write of a tenant's chunks refused by
        its l2_disk_max (bytes: the tenant's files then). Called on the writer's thread."""
        if (disk := self._disk()) is not None:
            disk.on_over_cap = callback

    def disk_tenant_bytes(self) -> dict[str, int]:
        return disk.tenant_bytes() if (disk := self._disk()) is not None else {}

    def _capped(self, name: str):
        """The shared tier of this name with tenants' caps (storage/l2/tenant_caps.py), or None."""
        from lmcache_mp.storage.l2.tenant_caps import TenantCapped

        inner = (getattr(t, "inner", t) for t in self.tiers if t.name == name)
        return next((t for t in inner if isinstance(t, TenantCapped)), None)

    def set_tier_quota(self, tier: str, tenant: str, nbytes: int) -> None:
        """A tenant's cap on a shared tier ("valkey", "mooncake"; 0: none), as this node counts it."""
        if (capped := self._capped(tier)) is not None:
            capped.set_quota(tenant, nbytes)

    def tier_tenant_bytes(self, tier: str) -> dict[str, int] | None:
        """Bytes of the capped tenants' objects this node wrote to a shared tier (None: no such tier)."""
        return capped.tenant_bytes() if (capped := self._capped(tier)) is not None else None

    def stats(self) -> dict:
        with self._cv:
            prefetching = self._prefetching
        writers = {w.bit: w.stats() for w in self.writers}
        tiers = []
        for i, (tier, counts) in enumerate(zip(self.tiers, self._tier_counts)):
            st = dict(tier.stats())
            st.update(name=tier.name, hits=counts["hits"], misses=counts["misses"], read_corrupt=counts["corrupt"],
                      read_errors=counts["errors"])
            st.update(writers.get(1 << i, {"write": "none"}))
            for op in ("read", "write"):
                secs = st.get(f"{op}_seconds", 0)
                st[f"{op}_GBps"] = round(st.get(f"{op}_bytes", 0) / secs / 1e9, 3) if secs else 0.0
            tiers.append(st)
        w = list(writers.values())
        return {"write": {t.name: p for t, p in zip(self.tiers, self.writes)}, "admit": self.admit,
                "queue_objects": sum(x["listed"] + x["writing"] for x in w),
                "queue_bytes": sum(x["writing_bytes"] for x in w), "writing": sum(x["writing"] for x in w),
                "idle": all(x.idle() for x in self.writers), "queue_limit": self.queue_limit,
                "written": sum(x["written"] for x in w), "write_errors": sum(x["write_errors"] for x in w),
                "dropped_writes": sum(x["dropped_writes"] for x in w), "prefetching": prefetching,
                **dict(self.counters), "tiers": tiers}

    def close(self) -> None:
        """Finish the writes listed for write-through (for a while), stop the threads, close the tiers."""
        now = time.monotonic()
        with self._cv:
            self._closing = True
        flush = self.l1.l2_flush_order() if any(w.policy == "evicted" for w in self.writers) else None
        for w in self.writers:  # (all at once: one deadline each, not one after the other)
            w.begin_close(now + (FLUSH_SECONDS if w.policy == "evicted" else DRAIN_SECONDS), flush)
        for w in self.writers:
            w.close(now + (FLUSH_SECONDS if w.policy == "evicted" else DRAIN_SECONDS))
        self.l1.attach_l2(0, 1, None, None, None)
        self._reads.put(None)
        self._reader.join()
        self._deadlines.stop()
        for tier in self.tiers:
            tier.close()
