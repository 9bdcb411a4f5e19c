"""Settings and plans shared by the two halves of the lmcache-mp connector (plain data)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Sequence

FULL, SLIDING_WINDOW, CHUNKED_LOCAL = "full", "sliding_window", "chunked_local"
# A recurrent state (Mamba2, Gated DeltaNet) kept at block boundaries: the block of chunk c holds
# the state after the chunk's last token, one object that summarises the whole prefix.
STATE = "state"

DEFAULT_URL = "tcp://127.0.0.1:5555"
CONFIG_PREFIX = "lmcache_mp."


def _as_bool(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return bool(v)


def check_curve_keys(server_key: str, client_key: str) -> None:
    """Settings `curve_server_key` (the server's public key file) and `curve_client_key` (this
    engine's secret key file, whose public half names its tenant on a server with tenants): each
    given file must be a key file of its kind, said at once, naming the setting. Empty settings
    leave the client to LMCACHE_MP_CURVE_SERVER_KEY / LMCACHE_MP_CURVE_CLIENT_KEY (client/curve.py)."""
    for name, path in (("curve_server_key", server_key), ("curve_client_key", client_key)):
        if not path:
            continue
        setting = CONFIG_PREFIX + name
        if not os.path.isfile(path):
            what = "is not a file" if os.path.exists(path) else "does not exist"
            raise ValueError(f"{setting}: {path} {what}")
        import zmq.auth  # (only where keys are given)

        try:
            _, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"{setting}: {path} is not a CURVE key file (lmcache-mp-server keygen makes them): "
                             f"{e}") from None
        if name == "curve_client_key" and secret is None:
            raise ValueError(f"{setting}: {path} holds no secret key (the engine needs its .key_secret file, "
                             "made by lmcache-mp-server keygen)")
    if client_key and not server_key and not os.environ.get("LMCACHE_MP_CURVE_SERVER_KEY"):
        raise ValueError(f"{CONFIG_PREFIX}curve_client_key needs the server's public key: set "
                         f"{CONFIG_PREFIX}curve_server_key too")


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
    transfer: str = "auto"  # who copies: "server", or "engine" (the workers, in their CUDA context; docs/engine-copies.md)
    flush_timeout: float = 30.0  # longest shutdown (or a preemption) waits for stores in flight
    store_decode: bool = False  # also store chunks completed by generated tokens
    store_shared: bool = False  # store into the shared namespace (a server with tenants: docs/tenants.md)
    # Tensor-parallel-shared chunks (docs/tensor-parallel.md): one object per chunk with every KV
    # head, which engines of any TP size share; the model's KV heads and pipeline stages prove the
    # split (the engine fills them in).
    tp_shared: bool = False
    num_kv_heads: int = 0
    pipeline_size: int = 1
    loads: bool = True  # look up and load (vLLM: kv_role kv_both or kv_consumer)
    stores: bool = True  # store (vLLM: kv_role kv_both or kv_producer)
    recompute_on_load_error: bool = True  # engine recomputes what a load missed (else fails it)
    kv_events_interval: float = 0.5  # how often the scheduler reads the server's chunk events (KV events on)
    # CURVE credentials of every connection (scheduler's and workers'): the server's public key
    # file and this engine's secret key file (its tenant on a server with tenants). Empty: the
    # LMCACHE_MP_CURVE_SERVER_KEY / LMCACHE_MP_CURVE_CLIENT_KEY environment variables, if set.
    curve_server_key: str = ""
    curve_client_key: str = ""

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
        check_curve_keys(cfg.curve_server_key, cfg.curve_client_key)
        return cfg


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group of the engine: layers that share one block table.

    `index` is the engine's number of the group (its position in a request's tuple of block
    tables). `kind` says which tokens the group keeps: FULL every token; SLIDING_WINDOW the last
    `window` tokens before the next one (older blocks are freed while the request runs);
    CHUNKED_LOCAL the tokens of the current `window`-token attention chunk; STATE a recurrent
    state whose block `p` holds the state after `(p + 1) * block_size` tokens (only the block at
    the end of a hit is loaded; stores are the boundaries the engine names). `detail` says what
    a STATE group's pages hold (kind, shapes, dtypes): pages of another detail are another
    namespace, never loaded here."""

    index: int = 0
    kind: str = FULL
    block_size: int = 16
    window: int = 0
    detail: str = ""

    def __post_init__(self):
        if self.kind not in (FULL, SLIDING_WINDOW, CHUNKED_LOCAL, STATE):
            raise ValueError(f"unknown KV-cache group kind {self.kind!r}")
        if self.block_size <= 0 or (self.kind in (SLIDING_WINDOW, CHUNKED_LOCAL) and self.window <= 0):
            raise ValueError(f"a {self.kind} group needs a positive block size and window")

    @property
    def transient(self) -> bool:
        """The engine frees this group's blocks of old tokens while the request still runs."""
        return self.kind != FULL

    def first_needed_token(self, num_tokens: int) -> int:
        """The first token the layers of this group read to compute token `num_tokens`: KV of
        earlier tokens is never needed again once `num_tokens` tokens are computed."""
        if self.kind == SLIDING_WINDOW:
            return max(0, num_tokens - self.window + 1)
        if self.kind == CHUNKED_LOCAL:
            return num_tokens // self.window * self.window
        if self.kind == STATE:
            return max(0, num_tokens - 1)  # the block that holds the state after them
        return 0

    def describe(self) -> str:
        if self.kind == STATE:
            return f"{self.kind}={self.detail}"
        return self.kind if self.kind == FULL else f"{self.kind}={self.window}"


def connector_chunk_size(groups: Sequence[KVGroup], server_chunk_size: int) -> int:
    """Tokens per chunk of an engine with these groups on a server of this --chunk-size: the
    server's where every group's block size divides it; a model with state groups uses its block
    size (a state is kept at block boundaries only, and a hit ends on one); otherwise the
    smallest multiple of the block sizes' lcm that is at least the server's."""
    import math

    sizes = {g.block_size for g in groups}
    lcm = math.lcm(*sizes)
    if any(g.kind == STATE for g in groups):
        return lcm
    if server_chunk_size > 0 and server_chunk_size % lcm == 0:
        return server_chunk_size
    return lcm * max(1, -(-server_chunk_size // lcm))


def group_model_name(model: str, groups: Sequence[KVGroup], i: int) -> str:
    """The server namespace of group `i`: the model itself for a model of one group (so a cache
    made before groups existed stays valid); with several, one namespace per group, so a chunk
    of one group never counts as a hit for another."""
    if len(groups) == 1:
        return model
    g = groups[i]
    return f"{model}#group{g.index}:{g.describe()}"


def block_tables(ids: Any) -> list[list[int]] | None:
    """A request's block tables, one per group: a tuple of lists as vLLM gives them, or one flat
    list for an engine of one group."""
    if ids is None:
        return None
    ids = list(ids)
    if ids and isinstance(ids[0], (list, tuple)):
        return [list(t) for t in ids]
    return [ids]


@dataclass
class Transfer:
    """Chunks of one request and the blocks they occupy, in token order.

    `block_ids` has `len(hashes) * blocks_per_chunk` entries. For a load, the first
    `num_scratch_blocks` of them are a scratch block: the engine already holds those tokens
    (a local prefix hit ending inside the first chunk), so their bytes are written where
    nothing reads them. A load without hashes is one the scheduler could not plan: the worker
    reports all its blocks as failed. `lease`: the scheduler's lookup lease on a load's chunks,
    which the workers' retrieves consume.

    `group`: the position of the KV-cache group in the scheduler's list of groups.
    `scratch_block`: the block id that stands for "bytes nobody reads" (the engine's null
    block), which may appear several times: a sliding-window group's blocks of tokens outside
    the window are that block, in loads and stores alike. `pin`: nonzero for a store whose
    blocks the scheduler keeps from reuse until every rank reported the store settled.
    `parent`: for a store, the hash of the prompt's chunk before its first (empty when it starts
    the prompt), so that the server writes the prompt to L2 in prefix order across its stores."""

    req_id: str
    hashes: list[bytes]
    block_ids: list[int]
    num_scratch_blocks: int = 0
    lease: int = 0
    group: int = 0
    scratch_block: int | None = None
    pin: int = 0
    parent: bytes = b""


@dataclass
class StepPlan:
    loads: list[Transfer] = field(default_factory=list)
    stores: list[Transfer] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # The loads' requests wait outside the engine's steps until the workers report the loads
    # over (a model with state groups: a state must be in its block before the step that reads it).
    async_loads: bool = False

    def __bool__(self) -> bool:
        return bool(self.loads or self.stores or self.preempted)


@dataclass
class ScheduledRequest:
    """One request in one scheduling step, as the scheduler-side core needs to see it."""

    req_id: str
    num_computed_tokens: int  # tokens whose KV existed before this step (hits included)
    num_new_tokens: int  # tokens whose KV this step computes (no speculative tokens)
    # Block tables: one list per group (as vLLM's tuples), or one flat list for one group.
    block_ids: Sequence | None = None  # the request's whole block tables, if known
    new_block_ids: Sequence | None = None  # else: blocks added this step...
    resumed: bool = False  # ...which replace the tables (resumed after preemption)
    # States this step computes at block boundaries: (group index, block id, tokens before it).
    boundary_states: Sequence[tuple[int, int, int]] = ()


