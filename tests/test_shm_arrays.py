"""CPU KV caches as NumPy arrays in shared memory (`shared_cpu_array`): registered, stored and
retrieved like torch tensors, so that a CPU engine (or the load generator) needs no torch."""

import gc
import os

import numpy as np
import pytest

from lmcache_mp import Client, Server, ServerConfig, chunk_hashes, shared_cpu_array
from lmcache_mp.shm import SHM_DIR

CHUNK = 32


@pytest.fixture
def client():
    with Server(ServerConfig(url="tcp://127.0.0.1:0", l1_size="16MiB", device="cpu", chunk_size=CHUNK,
                             http_addr="off")) as server, Client(server.url) as c:
        yield c


def test_arrays_round_trip_byte_exact(client, shm_files):
    rng = np.random.default_rng(3)
    kv = [shared_cpu_array((2, 16, 16, 2, 8), np.float16, fill=None) for _ in range(3)]  # 16 blocks of 16 tokens
    for a in kv:
        a.view(np.uint16)[...] = rng.integers(0, 1 << 16, a.shape, dtype=np.uint16)
    handle = client.register_kv_cache(kv, model="np")
    assert handle.layout == "mha" and handle.block_size == 16
    hashes = chunk_hashes(np.arange(3 * CHUNK), CHUNK)
    assert client.store(handle, hashes, range(6)).result(10).stored == 3
    assert client.retrieve(handle, hashes, range(6, 12)).result(10).loaded == 3
    for a in kv:
        assert np.array_equal(a[:, 6:12].view(np.uint16), a[:, 0:6].view(np.uint16))
    client.unregister_kv_cache(handle)


def test_the_file_goes_with_the_array(shm_files):
    a = shared_cpu_array((4, 4), np.int32)
    assert (a == 0).all()
    names = [f for f in os.listdir(SHM_DIR) if f.startswith(f"lmcache_mp_{os.getpid()}_")]
    assert names
    del a
    gc.collect()
    assert not [f for f in os.listdir(SHM_DIR) if f in names]


def test_arrays_outside_shared_memory_or_reversed_are_refused(client, shm_files):
    with pytest.raises(ValueError, match="must live in shared memory.*shared_cpu_array"):
        client.register_kv_cache([np.zeros((2, 16, 16, 2, 8), np.float16)], model="np")
    a = shared_cpu_array((2, 16, 16, 2, 8), np.float16)
    with pytest.raises(ValueError, match="non-negative strides"):
        client.register_kv_cache([a[:, ::-1]], model="np")
