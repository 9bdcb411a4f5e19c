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
