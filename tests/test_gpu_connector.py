"""The connector's worker side on a GPU, without vLLM: vLLM-shaped CUDA KV caches (per-layer
`[blocks, heads, block_size, 2*head_size]` views into one allocation) registered over CUDA IPC
with a CUDA server process, event-synchronised stores from one engine and loads into another,
checked byte for byte. The fake engine is the one of test_connector_core."""

import pytest
from test_connector_core import CS, Engine, prompt
from test_gpu_server import CHUNK, cuda_server  # noqa: F401  (the server fixture)

pytestmark = pytest.mark.gpu


def _leases(url: str) -> int:
    from lmcache_mp import Client

    with Client(url, timeout=10) as c:
        return c.status()["l1"]["leases"]


@pytest.mark.parametrize("world_size", [1, 2])
def test_cuda_engine_stores_and_another_loads(cuda_server, world_size):  # noqa: F811
    assert CHUNK == CS
    a = Engine(cuda_server, world_size=world_size, device="cuda", lookup_timeout=5.0)
    toks = prompt(40 + world_size, 333)
    try:
        ext, _, plan = a.prefill("r1", toks)
        assert ext == 0 and [len(t.hashes) for t in plan.stores] == [333 // CS]
        assert a.finish("r1") is True  # stores in flight until the server has the bytes
    finally:
        a.close()
    b = Engine(cuda_server, world_size=world_size, device="cuda", lookup_timeout=5.0)
    try:
        b.free = b.free[::-1]  # other blocks than engine A's
        ext, blocks, plan = b.prefill("r1", toks)
        assert ext == (333 // CS) * CS
        assert b.load_errors == set()
        assert b.check(toks, blocks, 333)  # every rank got its own shard back, bit for bit
        assert _leases(cuda_server) == 0
        b.finish("r1")
    finally:
        b.close()
