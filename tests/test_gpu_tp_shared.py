"""Tensor-parallel-shared chunks on a GPU, through a server process in each transfer mode: two
registrations of one model with different world sizes on one GPU, a TP-2-shaped store read back
as TP 1 and the reverse, byte for byte (the CPU device's tests: test_tp_shared.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.gpu

CHUNK = 64
BLOCK = 16
LAYERS = 3
HEADS, HEAD_SIZE = 4, 64
NUM_BLOCKS = 48


@pytest.fixture(scope="module", params=["direct", "staged", "dma", "auto"])
def server_url(request, tmp_path_factory):
    from lmcache_mp import Client

    tmp = tmp_path_factory.mktemp(f"tp-{request.param}")
    url = f"ipc://{tmp}/server.sock"
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "lmcache_mp.server.cli", "--url", url, "--device", "cuda",
                             "--l1-size", "1GiB", "--chunk-size", str(CHUNK), "--transfer-mode", request.param],
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        try:
            Client(url, connect_timeout=1).close()
            break
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the server did not start: {(tmp / 'server.log').read_text()}") from None
            time.sleep(0.2)
    yield url
    proc.terminate()
    assert proc.wait(60) == 0, (tmp / "server.log").read_text()[-4000:]
    log.close()
    assert "Traceback" not in (tmp / "server.log").read_text()


def engine(client, world: int, seed: int) -> list:
    """The ranks of an engine at this TP size: (handle, per-layer tensors [2, NB, BS, H/world, D])."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    ranks = []
    for rank in range(world):
        kv = [torch.empty((2, NUM_BLOCKS, BLOCK, HEADS // world, HEAD_SIZE), dtype=torch.bfloat16, device="cuda")
              for _ in range(LAYERS)]
        for t in kv:
            t.view(torch.int16).random_(generator=g)
        handle = client.register_kv_cache(kv, model="m", world_size=world, rank=rank, tp_shared=True,
                                          num_kv_heads=HEADS)
        assert handle.tp_shared
        ranks.append((handle, kv))
    return ranks


def heads(ranks, layer: int, blocks):
    """Every head of these blocks of one layer, the ranks' heads side by side (bit patterns)."""
    import torch

    idx = torch.tensor(blocks, device="cuda")
    return torch.cat([kv[layer][:, idx] for _, kv in ranks], dim=-2).view(torch.int16)


@pytest.mark.parametrize("store_tp, load_tp", [(2, 1), (1, 2)])
def test_one_tp_size_loads_what_another_stored_on_one_gpu(server_url, store_tp, load_tp):
    import numpy as np
    import torch

    from lmcache_mp import Client, chunk_hashes

    client = Client(server_url)
    try:
        writers = engine(client, store_tp, seed=store_tp)
        readers = engine(client, load_tp, seed=10 + load_tp)
        tokens = np.random.default_rng(store_tp).integers(0, 30000, 3 * CHUNK)
        hashes = chunk_hashes(tokens, CHUNK)
        src = list(range(3 * CHUNK // BLOCK))
        dst = [NUM_BLOCKS - 1 - b for b in src]
        for handle, _ in writers:
            assert client.store(handle, hashes, src).result(timeout=60).chunks == 3
        assert client.lookup(hashes, model="m", world_size=load_tp, tp_shared=True) == 3
        for handle, _ in readers:
            assert client.retrieve(handle, hashes, dst).result(timeout=60).loaded == 3
        torch.cuda.synchronize()
        for layer in range(LAYERS):
            assert torch.equal(heads(readers, layer, dst), heads(writers, layer, src))
    finally:
        client.close()
