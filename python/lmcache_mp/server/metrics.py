"""Prometheus metrics, read from the engine's status on each scrape (nothing on the hot path)."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class _StatusCollector:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st = self.engine.status()
        l1 = st["l1"]
        yield GaugeMetricFamily("lmcache_mp_l1_capacity_bytes", "L1 host memory", value=l1["capacity"])
        yield GaugeMetricFamily("lmcache_mp_l1_used_bytes", "L1 bytes held by objects", value=l1["bytes_used"])
        yield GaugeMetricFamily("lmcache_mp_l1_objects", "committed chunk objects", value=l1["objects"])
        yield GaugeMetricFamily("lmcache_mp_l1_leases", "live lookup leases", value=l1["leases"])
        yield GaugeMetricFamily("lmcache_mp_l1_pinned_bytes", "page-locked bytes",
                                value=l1["pinning"]["bytes_pinned"])
        yield GaugeMetricFamily("lmcache_mp_registrations", "registered KV caches", value=len(st["registrations"]))
        yield GaugeMetricFamily("lmcache_mp_clients", "clients heard from recently", value=st["clients"])
        for name, help_ in (("stored", "chunks stored"), ("evicted", "chunks evicted"), ("lookups", "lookups"),
                            ("hits", "chunks found by lookups"), ("leases_expired", "leases that timed out")):
            yield CounterMetricFamily(f"lmcache_mp_{name}", help_, value=l1[name])


def serve_metrics(engine, port: int):
    """Serve /metrics on `port`; returns a function that stops the HTTP server."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatusCollector(engine))
    server, _thread = start_http_server(port, registry=registry)
    logger.info("Prometheus metrics on :%d/metrics", server.server_port)
    return server.shutdown
