"""A registered KV cache as the client keeps it (registered again after a server restart)."""

from __future__ import annotations

from lmcache_mp import protocol as p
from lmcache_mp.client.cuda_events import EventPool
from lmcache_mp.client.tensors import DescribedCache


class KVCacheHandle:
    """A registered KV cache. Keeps its tensors alive; re-registered after a server restart."""

    def __init__(self, tensors: list, model: str, world_size: int, rank: int, layout: str,
                 block_size: int | None, described: DescribedCache, transfer: str = "auto",
                 staging_bytes: int | None = None, pack_ctas: int = 0, chunk_size: int = 0):
        self.tensors = tensors
        self.model = model
        self.world_size = world_size
        self.rank = rank
        self.requested_layout = layout
        self.requested_block_size = block_size
        self.requested_transfer = transfer
        self.requested_chunk_size = chunk_size
        self.requested_tp: tuple[bool, int, int] = (False, 0, 1)  # tp_shared, num_kv_heads, pipeline_size
        self.staging_bytes = staging_bytes  # the engine-side copier's GPU ring (None: a few chunks)
        self.pack_ctas = pack_ctas
        self.copier = None  # an EngineCopier when this process copies (transfer_mode "engine")
        self.described = described
        self.kv_id = 0
        self.layout = ""
        self.object_bytes = 0
        self.transfer_mode = ""
        self.shared = False
        self.tp_shared = False  # its chunks are tp-shared objects (the server's answer)
        self.block_size = 0
        self.num_blocks = 0
        self.chunk_size = 0  # tokens per chunk of this registration
        self.events: EventPool | None = None
        self.closed = False

    @property
    def device(self) -> str:
        return self.described.device

    def _apply(self, r: p.RegisterReply) -> None:
        self.kv_id, self.layout, self.object_bytes = r.kv_id, r.layout, r.object_bytes
        self.transfer_mode, self.shared, self.tp_shared = r.transfer_mode, r.shared, r.tp_shared
        self.block_size, self.num_blocks = r.block_size, r.num_blocks
        self.chunk_size = r.chunk_size or self.requested_chunk_size or self.chunk_size

    def __repr__(self) -> str:
        return (f"KVCacheHandle(model={self.model!r}, rank={self.rank}/{self.world_size}, layout={self.layout}, "
                f"device={self.device}, kv_id={self.kv_id})")
