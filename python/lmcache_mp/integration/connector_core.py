"""Engine-agnostic core of the lmcache-mp KV connector: request tracking, load/store plans, and
their execution through `lmcache_mp.Client`. No engine imports; `vllm.py` adapts it to vLLM.

Two halves, as engines split them:

- `SchedulerCore` (one per engine, beside the scheduler) looks up each new prompt's full chunks
  on the server, leasing the hits, tells the scheduler how many tokens it can supply, and turns
  every scheduling step into a `StepPlan`: chunks to load into newly allocated blocks, and
  newly computed full chunks to store.
- `WorkerCore` (one per rank, beside the KV cache) registers the rank's KV cache with the
  server and executes plans: loads before the forward pass (waited for), stores after it (not
  waited for; the engine keeps the blocks alive until `finished()` reports the request).

Token positions map to blocks as the engine's paged cache does: block `i` of a request holds
tokens `[i * block_size, (i + 1) * block_size)`; a chunk is `chunk_size // block_size` blocks.
"""

from lmcache_mp.integration.connector_types import (
    CONFIG_PREFIX,
    DEFAULT_URL,
    ConnectorConfig,
    KVGroup,
    ScheduledRequest,
    StepPlan,
    Transfer,
)
from lmcache_mp.integration.link import ClientLink
from lmcache_mp.integration.scheduler_core import SchedulerCore
from lmcache_mp.integration.worker_core import WorkerCore

__all__ = [
    "CONFIG_PREFIX",
    "DEFAULT_URL",
    "ClientLink",
    "ConnectorConfig",
    "KVGroup",
    "ScheduledRequest",
    "SchedulerCore",
    "StepPlan",
    "Transfer",
    "WorkerCore",
]
