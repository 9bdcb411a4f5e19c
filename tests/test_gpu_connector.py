"""The connector's worker side on a GPU, without vLLM: vLLM-shaped CUDA KV caches registered
over CUDA IPC from the connector's background thread with a CUDA server process,
event-synchronised stores from one engine and loads into another, checked byte for byte. The
caches are every kind of test_connector_core's fake engine: vLLM's per-layer
`[blocks, heads, block_size, 2*head_size]` views (blocks head-major, token-major as vLLM 0.32
stores them on CUDA by default, split into kernel blocks, or block-outermost across layers), the
flash-attention `[2, blocks, block_size, heads, head_size]`, and MLA `[blocks, block_size, dim]`."""

import pytest
from test_connector_core import CS, LAYER_LAYOUTS, store_in_one_engine_load_in_another
from test_gpu_server import CHUNK, cuda_server  # noqa: F401  (the server fixture)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind", list(LAYER_LAYOUTS))
@pytest.mark.parametrize("world_size", [1, 2])
def test_cuda_engine_stores_and_another_loads(cuda_server, kind, world_size):  # noqa: F811
    assert CHUNK == CS
    store_in_one_engine_load_in_another(cuda_server, kind=kind, world_size=world_size, device="cuda")


def test_cuda_hybrid_groups_round_trip(cuda_server):  # noqa: F811
    from test_connector_core import hybrid_round_trip

    hybrid_round_trip(cuda_server, device="cuda")


def test_cuda_scratch_blocks_may_repeat_in_a_retrieve(cuda_server):  # noqa: F811
    """Several positions of a load may go to one block nobody reads (vLLM's null block); the
    other blocks get their bytes exactly."""
    import numpy as np
    import torch
    from gpu_kv import make_cuda_kv

    from lmcache_mp import Client, chunk_hashes

    kv = make_cuda_kv("mha", torch.bfloat16, layers=2, blocks=32, block_size=16)
    with Client(cuda_server) as client:
        h = client.register_kv_cache(kv.tensors, model="scratch", world_size=1, rank=0)
        hashes = chunk_hashes(np.arange(2 * CHUNK), client.chunk_size)
        assert client.store(h, hashes, list(range(1, 9))).result().stored == 2
        assert client.retrieve(h, hashes, [0, 0, 0, 12, 13, 14, 15, 16], scratch_blocks=[0]).result().loaded == 2
        for layer, t in enumerate(kv.tensors):  # [2, blocks, block_size, heads, head_size]
            bits = t.view(torch.int16)  # random bytes make NaNs: compare bit patterns
            wrong = [b for b in range(5) if not torch.equal(bits[:, 12 + b], bits[:, 4 + b])]
            assert not wrong, f"layer {layer}: blocks {[12 + b for b in wrong]} differ from {[4 + b for b in wrong]}"
        client.unregister_kv_cache(h)
