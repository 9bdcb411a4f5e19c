"""Prometheus metrics, read from the engine's status on each scrape (nothing on the hot path)."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class StatusCollector:
    def __init__(self, engine, requests=None):
        self.engine = engine
        self.requests = requests  # the transport's RequestStats

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st = self.engine.status()
        if self.requests is not None:
            yield from _request_metrics(self.requests.snapshot())
        moved = CounterMetricFamily("lmcache_mp_bytes_moved", "bytes copied between KV caches and L1",
                                    labels=["direction", "device"])
        for direction, n in st["bytes_moved"].items():
            moved.add_metric([direction, st["device"]], n)
        yield moved
        l1 = st["l1"]
        yield GaugeMetricFamily("lmcache_mp_l1_capacity_bytes", "L1 host memory", value=l1["capacity"])
        yield GaugeMetricFamily("lmcache_mp_l1_used_bytes", "L1 bytes held by objects", value=l1["bytes_used"])
        yield GaugeMetricFamily("lmcache_mp_l1_free_bytes", "L1 bytes in free slabs (any object size)",
                                value=l1["bytes_free"])
        per_size = (("used_bytes", "bytes_used", "payload bytes of objects of this size"),
                    ("free_bytes", "bytes_free", "free slots held by this size (usable by it only)"),
                    ("fragmented_bytes", "bytes_fragmented", "slot rounding and slab tails of this size"),
                    ("objects", "objects", "objects of this size"),
                    ("slabs", "slabs", "slabs held by this size"))
        for suffix, field, help_ in per_size:
            g = GaugeMetricFamily(f"lmcache_mp_l1_size_{suffix}", f"L1, per object size: {help_}",
                                  labels=["object_bytes"])
            for size in l1["sizes"]:
                g.add_metric([str(size["object_bytes"])], size[field])
            yield g
        evicted = CounterMetricFamily("lmcache_mp_l1_size_evicted", "chunks evicted, per object size",
                                      labels=["object_bytes"])
        for size in l1["sizes"]:
            evicted.add_metric([str(size["object_bytes"])], size["evicted"])
        yield evicted
        yield GaugeMetricFamily("lmcache_mp_l1_objects", "committed chunk objects", value=l1["objects"])
        yield GaugeMetricFamily("lmcache_mp_l1_leases", "live lookup leases", value=l1["leases"])
        history = GaugeMetricFamily("lmcache_mp_eviction_history_bytes", "memory the eviction policy spends on "
                                    "keys it remembers (evicted keys, sampled new keys; bounded)", labels=["policy"])
        history.add_metric([l1["eviction"]["policy"]], l1["eviction"]["history_bytes"])
        yield history
        yield GaugeMetricFamily("lmcache_mp_l1_pinned_bytes", "page-locked bytes",
                                value=l1["pinning"]["bytes_pinned"])
        yield GaugeMetricFamily("lmcache_mp_l1_faulted_bytes", "bytes of L1 in memory ahead of use (faulted in, "
                                "or page-locked, in the background after the start)",
                                value=l1["pinning"]["bytes_faulted"])
        yield GaugeMetricFamily("lmcache_mp_l1_journal_backlog", "committed chunks not yet recorded in the L1 "
                                "journal (--l1-persist; a crash now would not re-attach them)",
                                value=l1["journal_backlog"])
        held = GaugeMetricFamily("lmcache_mp_engine_copies_held", "what engines that copy their own chunks hold on "
                                 "the server: slots reserved for their stores, chunks pinned for their reads",
                                 labels=["kind"])
        for kind in ("reservations", "reads"):
            held.add_metric([kind], st["engine_copies"][kind])
        yield held
        yield GaugeMetricFamily("lmcache_mp_registrations", "registered KV caches", value=len(st["registrations"]))
        yield GaugeMetricFamily("lmcache_mp_clients", "clients heard from recently", value=st["clients"])
        reasons = CounterMetricFamily("lmcache_mp_l1_removed", "chunks L1 let go, by reason: capacity (evicted for "
                                      "room), cleared (CLEAR), replaced (stored again in another layout)",
                                      labels=["reason"])
        for reason, field in (("capacity", "evicted"), ("cleared", "cleared"), ("replaced", "replaced")):
            reasons.add_metric([reason], l1[field])
        yield reasons
        for name, help_ in (("stored", "chunks stored"), ("evicted", "chunks evicted"), ("lookups", "lookups"),
                            ("hits", "chunks found by lookups"),
                            ("lookup_chunks", "chunks lookups asked for (the hit ratio: hits / these)"),
                            ("leases_expired", "leases that timed out"),
                            ("moved", "objects moved to another slot so that a slab could change size"),
                            ("slab_moves", "slabs drained for another object size"),
                            ("format_mismatches", "reads that stopped at a chunk stored in another format")):
            yield CounterMetricFamily(f"lmcache_mp_{name}", help_, value=l1[name])
        gcs = CounterMetricFamily("lmcache_mp_gc_collections", "garbage collections of the server process (each "
                                  "stops every thread), by generation", labels=["generation"])
        for gen, n in enumerate(st["gc"]["collections"]):
            gcs.add_metric([str(gen)], n)
        yield gcs
        yield CounterMetricFamily("lmcache_mp_gc_seconds", "time the server process spent in garbage collections",
                                  value=st["gc"]["seconds"])
        pinned = GaugeMetricFamily("lmcache_mp_hint_pinned_bytes", "L1 bytes the application's pins hold (hints), by "
                                   "tenant (\"\" on a server without tenants)", labels=["tenant"])
        for name, t in st["hints"]["tenants"].items():
            pinned.add_metric([name], t["pinned_bytes"])
        yield pinned
        if "l2" in st:
            yield from _l2_metrics(st["l2"])
        yield from _tenant_metrics(st.get("tenants", {}))  # (no series without --tenants)


def _tenant_metrics(tenants: dict):
    """Per tenant (a server with --tenants), the tenant as a label; "shared": the shared namespace."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    gauges = (("l1_bytes", "L1 bytes held by the tenant's chunks", lambda t: t["l1"]["bytes"]),
              ("l1_objects", "the tenant's chunk objects in L1", lambda t: t["l1"]["objects"]))
    for suffix, help_, value in gauges:
        g = GaugeMetricFamily(f"lmcache_mp_tenant_{suffix}", help_, labels=["tenant"])
        for name, t in tenants.items():
            g.add_metric([name], value(t))
        yield g
    tenants = {name: t for name, t in tenants.items() if "limits" in t}
    gauges = (("l1_min_bytes", "L1 bytes no other tenant's stores may evict (l1_min)", lambda t: t["limits"]["l1_min"]),
              ("l1_max_bytes", "L1 bytes beyond which the tenant evicts its own chunks (l1_max; 0: none)",
               lambda t: t["limits"]["l1_max"]),
              ("l1_max_ratio", "quota pressure: the tenant's L1 bytes / its l1_max (0 without one)",
               lambda t: t["l1"]["bytes"] / t["limits"]["l1_max"] if t["limits"]["l1_max"] else 0.0),
              ("l2_disk_bytes", "bytes of the tenant's files on the L2 disk tier", lambda t: t["l2_disk_bytes"]),
              ("l2_disk_max_bytes", "the tenant's cap on the L2 disk tier (l2_disk_max; 0: none)",
               lambda t: t["limits"]["l2_disk_max"]))
    for suffix, help_, value in gauges:
        g = GaugeMetricFamily(f"lmcache_mp_tenant_{suffix}", help_, labels=["tenant"])
        for name, t in tenants.items():
            g.add_metric([name], value(t))
        yield g
    tiers = (("l2_tier_bytes", "bytes of the tenant's objects this node wrote to a shared L2 tier (capped tenants)",
              lambda t, tier: t["l2_tiers"][tier]),
             ("l2_tier_max_bytes", "the tenant's cap on a shared L2 tier from this node (l2_valkey_max, "
              "l2_mooncake_max; 0: none)", lambda t, tier: t["limits"][f"l2_{tier}_max"]))
    for suffix, help_, value in tiers:
        g = GaugeMetricFamily(f"lmcache_mp_tenant_{suffix}", help_, labels=["tenant", "tier"])
        for name, t in tenants.items():
            for tier in t.get("l2_tiers", {}):
                g.add_metric([name, tier], value(t, tier))
        yield g
    namespaces, tenants = tenants, {name: t for name, t in tenants.items() if "inflight" in t}  # (shared: no requests)
    gauges = (("inflight", "the tenant's requests in flight", lambda t: t["inflight"]),
              ("registrations", "the tenant's registered KV caches", lambda t: t["registrations"]))
    for suffix, help_, value in gauges:
        g = GaugeMetricFamily(f"lmcache_mp_tenant_{suffix}", help_, labels=["tenant"])
        for name, t in tenants.items():
            g.add_metric([name], value(t))
        yield g
    counters = (("requests", "requests of the tenant", lambda t: t["requests"]),
                ("denied", "requests refused: not allowed, or over a limit of the tenant", lambda t: t["denied"]),
                ("lookup_chunks", "chunks the tenant's lookups asked for", lambda t: t["lookup_chunks"]),
                ("hit_chunks", "chunks the tenant's lookups found", lambda t: t["hit_chunks"]))
    for suffix, help_, value in counters:
        c = CounterMetricFamily(f"lmcache_mp_tenant_{suffix}", help_, labels=["tenant"])
        for name, t in tenants.items():
            c.add_metric([name], value(t))
        yield c
    c = CounterMetricFamily("lmcache_mp_tenant_store_skipped_chunks", "chunks of the tenant's stores not placed (its "
                            "l1_max, or no room)", labels=["tenant"])
    for name, t in namespaces.items():
        c.add_metric([name], t["l1"]["skipped"])
    yield c
    c = CounterMetricFamily("lmcache_mp_tenant_evicted", "the tenant's chunks evicted from L1, by cause (pressure: "
                            "another store needed room; l1_max: its own cap)", labels=["tenant", "cause"])
    for name, t in namespaces.items():
        for cause, n in t["l1"]["evicted"].items():
            c.add_metric([name, cause], n)
    yield c


def _l2_metrics(l2: dict):
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    yield GaugeMetricFamily("lmcache_mp_l2_queue_objects", "L2 writes listed (write-through) or in flight",
                            value=l2["queue_objects"])
    yield GaugeMetricFamily("lmcache_mp_l2_queue_bytes", "bytes of the L2 writes in flight", value=l2["queue_bytes"])
    yield GaugeMetricFamily("lmcache_mp_l2_prefetching", "lookups waiting for L2 chunks", value=l2["prefetching"])
    for name, help_ in (("written", "chunks written to L2"), ("write_errors", "L2 writes that failed"),
                        ("dropped_writes", "L2 writes dropped: chunks that left L1 unwritten, and the chunks after "
                                           "them in their prompts"),
                        ("loaded", "chunks loaded from L2 into L1"), ("prefetches", "lookups that loaded L2 chunks"),
                        ("prefetch_timeouts", "lookups answered at the prefetch deadline"),
                        ("prefetches_refused", "lookups answered from L1 alone: too many prefetches at once")):
        yield CounterMetricFamily(f"lmcache_mp_l2_{name}", help_, value=l2.get(name, 0))
    gauges = (("bytes_used", "bytes"), ("objects", "objects"), ("capacity", "capacity_bytes"))
    counters = (("hits", "hits"), ("misses", "misses"), ("read_corrupt", "corrupt"), ("read_errors", "read_errors"),
                ("errors", "errors"), ("evictions", "evictions"), ("read_bytes", "read_bytes"),
                ("write_bytes", "written_bytes"), ("written", "written_chunks"), ("dropped_writes", "dropped_writes"))
    for field, suffix in gauges:
        g = GaugeMetricFamily(f"lmcache_mp_l2_tier_{suffix}", f"L2 tier {field}", labels=["tier"])
        for t in l2["tiers"]:
            g.add_metric([t["name"]], t.get(field, 0))
        yield g
    for field, suffix in counters:
        c = CounterMetricFamily(f"lmcache_mp_l2_tier_{suffix}", f"L2 tier {field}", labels=["tier"])
        for t in l2["tiers"]:
            c.add_metric([t["name"]], t.get(field, 0))
        yield c
    for field, help_ in (("raw_bytes_written", "bytes of the chunks a tier's codec wrote, as L1 holds them"),
                         ("stored_bytes_written", "bytes the codec wrote to the tier for them"),
                         ("raw_bytes_read", "bytes of the chunks the codec read back, decoded"),
                         ("stored_bytes_read", "bytes the codec read from the tier for them"),
                         ("encode_seconds", "time spent encoding"), ("decode_seconds", "time spent decoding")):
        c = CounterMetricFamily(f"lmcache_mp_l2_tier_codec_{field}", f"L2 tier codec: {help_}",
                                labels=["tier", "codec"])
        for t in l2["tiers"]:
            codec = t.get("codec") or {}
            c.add_metric([t["name"], codec.get("name", "none")], codec.get(field, 0))
        yield c


def _request_metrics(snap: dict):
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

    from lmcache_mp.server.transport.request_stats import BUCKETS

    requests = CounterMetricFamily("lmcache_mp_requests", "replies by op and outcome (OK or the error code)",
                                   labels=["op", "outcome"])
    for (op, outcome), n in sorted(snap["counts"].items()):
        requests.add_metric([op, outcome], n)
    yield requests
    seconds = HistogramMetricFamily("lmcache_mp_request_seconds", "from a request's arrival to its reply, by op",
                                    labels=["op"])
    for op, hist in sorted(snap["hist"].items()):
        total, buckets = 0, []
        for bound, n in zip([*map(str, BUCKETS), "+Inf"], hist):
            total += n
            buckets.append((bound, total))
        seconds.add_metric([op], buckets, sum_value=snap["sums"][op])
    yield seconds
