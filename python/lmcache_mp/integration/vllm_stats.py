"""The connector's counters as vLLM's KVConnectorStats: in vLLM's periodic log line ("KV Transfer
metrics: ...") and as Prometheus counters (vllm:lmcache_mp_*_total) on vLLM's /metrics.

Each side reports what changed since its last report: the scheduler its lookups (prompt tokens
the server could supply, tokens loaded from it, tokens it had), every worker its loads and
stores (chunks, bytes, the time the forward pass waited for loads, the time stores took to be
answered, failures). vLLM sums the workers' reports and the scheduler's each step, then over its
logging interval. Every counter is on /metrics from the start, at 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

# counter -> what it counts (the Prometheus documentation)
COUNTERS = {
    "lookups": "prompts looked up on the lmcache-mp server",
    "lookup_tokens": "prompt tokens the lmcache-mp server could supply: whole chunks (never the last token) beyond "
                     "what vLLM's own prefix cache held",
    "hit_tokens": "prompt tokens loaded from the lmcache-mp server (hits); lookup_tokens minus hit_tokens are misses",
    "found_tokens": "prompt tokens the lmcache-mp server had, whether loaded or held by vLLM's own prefix cache "
                    "already",
    "loaded_chunks": "chunks loaded from the lmcache-mp server into the KV cache, all ranks",
    "failed_load_chunks": "chunks a load did not bring (recomputed by vLLM), all ranks",
    "loaded_bytes": "bytes loaded from the lmcache-mp server, all ranks",
    "load_seconds": "time forward passes waited for loads, summed over ranks",
    "loads": "loads (one per request and KV-cache group), all ranks",
    "stored_chunks": "chunks sent to the lmcache-mp server for storing, all ranks",
    "stored_bytes": "bytes the lmcache-mp server stored (chunks it had already are not counted), all ranks",
    "stores": "stores the lmcache-mp server answered, all ranks",
    "store_seconds": "time from sending a store to its answer, summed over stores",
    "store_errors": "stores that failed, all ranks",
}


class Deltas:
    """What a cumulative counter dict gained since the last call."""

    def __init__(self, counters: Mapping[str, float]):
        self._counters = counters
        self._last = {k: 0 for k in COUNTERS}

    def take(self) -> dict[str, float]:
        out = {}
        for key in COUNTERS:
            now = self._counters.get(key, 0)
            if now != self._last[key]:
                out[key] = now - self._last[key]
                self._last[key] = now
        return out


@dataclass
class LMCacheMPStats(KVConnectorStats):
    """`data`: counter -> increase over the interval (see COUNTERS)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "LMCacheMPStats":
        for key, value in (other.data or {}).items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        looked, hit = d.get("lookup_tokens", 0), d.get("hit_tokens", 0)
        loads, stores = d.get("loads", 0), d.get("stores", 0)
        return {
            "lmcache_mp_hit_tokens": int(hit),
            "lmcache_mp_miss_tokens": int(looked - hit),
            "lmcache_mp_hit_rate_%": round(100.0 * hit / looked, 1) if looked else 0.0,
            "lmcache_mp_found_tokens": int(d.get("found_tokens", 0)),
            "lmcache_mp_loaded_chunks": int(d.get("loaded_chunks", 0)),
            "lmcache_mp_failed_load_chunks": int(d.get("failed_load_chunks", 0)),
            "lmcache_mp_loaded_MiB": round(d.get("loaded_bytes", 0) / 2**20, 2),
            "lmcache_mp_avg_load_ms": round(1e3 * d.get("load_seconds", 0) / loads, 2) if loads else 0.0,
            "lmcache_mp_stored_chunks": int(d.get("stored_chunks", 0)),
            "lmcache_mp_stored_MiB": round(d.get("stored_bytes", 0) / 2**20, 2),
            "lmcache_mp_avg_store_ms": round(1e3 * d.get("store_seconds", 0) / stores, 2) if stores else 0.0,
            "lmcache_mp_store_errors": int(d.get("store_errors", 0)),
        }


class LMCacheMPPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per COUNTERS entry, labelled per engine as vLLM's own."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counters = {key: self._counter_cls(name=f"vllm:lmcache_mp_{key}_total", documentation=doc,
                                           labelnames=self._labelnames)
                    for key, doc in COUNTERS.items()}
        # Every engine's series from the start, at 0: alerts on an absent series would never fire.
        self._children = {(engine, key): counter.labels(*values)
                          for engine, values in per_engine_labelvalues.items() for key, counter in counters.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            child = self._children.get((engine_idx, key))
            if child is not None and value > 0:
                child.inc(value)
