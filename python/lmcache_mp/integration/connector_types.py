"""Settings and plans shared by the two halves of the lmcache-mp connector (plain data)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Sequence

DEFAULT_URL = "tcp://127.0.0.1:5555"
CONFIG_PREFIX = "lmcache_mp."


def _as_bool(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return bool(v)


@dataclass
class ConnectorConfig:
    """Settings of both halves. Engine extra-config keys are `lmcache_mp.<field>`."""

    url: str = DEFAULT_URL
    model: str = "default"
    block_size: int = 16
    world_size: int = 1
    lookup_timeout: float = 2.0  # longest a request waits for its lookup (unscheduled; a miss after that)
    lookup_block: float = 0.005  # longest one scheduler step waits for lookups (all together); then next step
    request_timeout: float = 10.0  # client default for other calls
    connect_timeout: float = 2.0  # how long start-up waits for the first connection
    retry_interval: float = 5.0  # least time between connection attempts / after a failure
    load_timeout: float = 30.0  # longest a forward pass waits for its loads
    store_timeout: float = 10.0  # a store's deadline: the server keeps nothing of it after that, blocks go back
    flush_timeout: float = 30.0  # longest shutdown (or a preemption) waits for stores in flight
    store_decode: bool = False  # also store chunks completed by generated tokens
    recompute_on_load_error: bool = True  # engine recomputes what a load missed (else fails it)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None, **base: Any) -> "ConnectorConfig":
        """Build from engine-provided `base` values overridden by `lmcache_mp.*` keys."""
        cfg = cls(**base)
        types = {f.name: f.type for f in fields(cls)}
        for key, value in (extra or {}).items():
            if not key.startswith(CONFIG_PREFIX):
                continue
            name = key[len(CONFIG_PREFIX) :]
            if name not in types:
                raise ValueError(f"unknown lmcache-mp connector setting {key!r}")
            current = getattr(cfg, name)
            if isinstance(current, bool):
                value = _as_bool(value)
            elif isinstance(current, int):
                value = int(value)
            elif isinstance(current, float):
                value = float(value)
            else:
                value = str(value)
            setattr(cfg, name, value)
        if cfg.block_size <= 0 or cfg.world_size <= 0:
            raise ValueError("block_size and world_size must be positive")
        return cfg


@dataclass
class Transfer:
    """Chunks of one request and the blocks they occupy, in token order.

    `block_ids` has `len(hashes) * blocks_per_chunk` entries. For a load, the first
    `num_scratch_blocks` of them are a scratch block: the engine already holds those tokens
    (a local prefix hit ending inside the first chunk), so their bytes are written where
    nothing reads them. A load without hashes is one the scheduler could not plan: the worker
    reports all its blocks as failed. `lease`: the scheduler's lookup lease on a load's chunks,
    which the workers' retrieves consume."""

    req_id: str
    hashes: list[bytes]
    block_ids: list[int]
    num_scratch_blocks: int = 0
    lease: int = 0


@dataclass
class StepPlan:
    loads: list[Transfer] = field(default_factory=list)
    stores: list[Transfer] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.stores or self.preempted)


@dataclass
class ScheduledRequest:
    """One request in one scheduling step, as the scheduler-side core needs to see it."""

    req_id: str
    num_computed_tokens: int  # tokens whose KV existed before this step (hits included)
    num_new_tokens: int  # tokens whose KV this step computes (no speculative tokens)
    block_ids: Sequence[int] | None = None  # the request's whole block table, if known
    new_block_ids: Sequence[int] | None = None  # else: blocks added this step...
    resumed: bool = False  # ...which replace the table (resumed after preemption)


