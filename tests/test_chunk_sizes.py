"""Chunk sizes per registration: one server serves a dense model on its --chunk-size and hybrid
models whose block sizes (288, 544 tokens) do not divide it, each on the chunk size it registered."""

from __future__ import annotations

import numpy as np
import pytest

import cpu_workers as w
from lmcache_mp import chunk_hashes
from lmcache_mp.errors import RequestError
from test_server_e2e import clients, no_internal_errors, servers  # noqa: F401


def _prompt(seed: int, tokens: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 32000, tokens)


@pytest.mark.parametrize("layout", ["mha", "mla"])
def test_a_dense_model_and_two_hybrid_block_sizes_share_one_server(shm_files, servers, clients, no_internal_errors,
                                                                   layout):
    srv = servers(chunk_size=256, l1_size="64MiB")
    c = clients(srv.url)
    cases = []
    for model, block_size, chunk_size in (("dense", 16, 0), ("qwen3next", 288, 288), ("qwen35", 544, 544)):
        kv = w.make_kv(layout, 4 * (chunk_size or 256) // block_size, block_size)  # two prompts of two chunks
        h = c.register_kv_cache(kv, model=model, chunk_size=chunk_size)
        assert h.chunk_size == (chunk_size or 256)
        cases.append((model, block_size, h, kv))
    for seed, (model, block_size, h, kv) in enumerate(cases):
        chunks = 2
        bpc = h.chunk_size // block_size
        tokens = chunks * h.chunk_size
        hashes = chunk_hashes(_prompt(seed, tokens), h.chunk_size)
        ref = w.reference(seed, layout, tokens)
        w.write_tokens(kv, layout, range(chunks * bpc), ref)
        assert c.store(h, hashes, range(chunks * bpc)).result(10).stored == chunks
        assert h.object_bytes == w.SEGMENTS[layout] * w.LAYERS * h.chunk_size * w.TOKEN_BYTES
        assert c.lookup(hashes, model=model) == chunks
        dst = list(range(chunks * bpc, 2 * chunks * bpc))
        w.fill_blocks(kv, layout, dst, 0)
        assert c.retrieve(h, hashes, dst).result(10).loaded == chunks
        assert np.array_equal(w.read_tokens(kv, layout, dst), ref)
    status = srv.engine.status()
    assert status["l1"]["objects"] == 2 * len(cases)


def test_a_chunk_size_its_block_size_does_not_divide_is_refused_in_one_line(shm_files, servers, clients):
    srv = servers(chunk_size=256)
    c = clients(srv.url)
    with pytest.raises(RequestError, match="block size 288 does not divide the server's .--chunk-size. chunk size 256"):
        c.register_kv_cache(w.make_kv("mha", 4, 288), model="m")
    with pytest.raises(RequestError, match="block size 288 does not divide the registration's chunk size 500"):
        c.register_kv_cache(w.make_kv("mha", 4, 288), model="m", chunk_size=500)
    with pytest.raises(RequestError, match="chunk_size must be in"):
        c.register_kv_cache(w.make_kv("mha", 4, 16), model="m", chunk_size=-16)
    h = c.register_kv_cache(w.make_kv("mha", 4, 288), model="m", chunk_size=288)
    with pytest.raises(ValueError, match="1 chunks of 288 tokens need 1 block ids"):
        c.store(h, chunk_hashes(_prompt(1, 288), 288), [0, 1])
