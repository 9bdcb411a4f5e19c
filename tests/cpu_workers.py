"""KV caches in shared memory and engine-worker processes for the CPU end-to-end tests.

Each worker runs in its own process (multiprocessing 'spawn'), owns its KV caches made by
`shared_cpu_tensor`, talks to the server through its own `Client`, and checks every byte it gets
back against a reference it can recompute from a seed. Workers report ("ok", info) or
("error", traceback) on a queue.
"""

from __future__ import annotations

import time
import traceback

import numpy as np

CHUNK = 32  # tokens per chunk of the e2e servers
LAYERS = 2
HEADS, HEAD_SIZE = 2, 8  # float16: 32 bytes per token of one segment of one layer
TOKEN_BYTES = HEADS * HEAD_SIZE * 2
SEGMENTS = {"mha": 2, "block_major": 2, "mla": 1}


def make_kv(layout: str, num_blocks: int, block_size: int) -> list:
    import torch

    from lmcache_mp import shared_cpu_tensor

    shape = {
        "mha": (2, num_blocks, block_size, HEADS, HEAD_SIZE),
        "block_major": (num_blocks, 2, block_size, HEADS, HEAD_SIZE),
        "mla": (num_blocks, block_size, HEADS * HEAD_SIZE),
    }[layout]
    return [shared_cpu_tensor(shape, torch.float16) for _ in range(LAYERS)]


def reference(seed: int, layout: str, num_tokens: int) -> np.ndarray:
    """The KV bytes of a prompt: [layers, segments, tokens, bytes per token]."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (LAYERS, SEGMENTS[layout], num_tokens, TOKEN_BYTES), dtype=np.uint8)


def _token_view(t, layout: str) -> np.ndarray:
    """A writable [segments, blocks, block_size, bytes per token] view of one layer tensor."""
    import torch

    a = t.view(torch.uint8).numpy()
    if layout == "mha":
        return a.reshape(2, a.shape[1], a.shape[2], TOKEN_BYTES)
    if layout == "block_major":
        return a.reshape(a.shape[0], 2, a.shape[2], TOKEN_BYTES).transpose(1, 0, 2, 3)
    return a.reshape(1, a.shape[0], a.shape[1], TOKEN_BYTES)


def write_tokens(kv: list, layout: str, block_ids, ref: np.ndarray) -> None:
    """Put ref's tokens into these blocks, in token order."""
    for layer, t in enumerate(kv):
        v = _token_view(t, layout)
        bs = v.shape[2]
        for j, b in enumerate(block_ids):
            v[:, b] = ref[layer, :, j * bs:(j + 1) * bs]


def read_tokens(kv: list, layout: str, block_ids) -> np.ndarray:
    """The tokens held in these blocks, shaped like reference()."""
    views = [_token_view(t, layout) for t in kv]
    return np.stack([np.concatenate([v[:, b] for b in block_ids], axis=1) for v in views])


def fill_blocks(kv: list, layout: str, block_ids, value: int) -> None:
    for t in kv:
        v = _token_view(t, layout)
        for b in block_ids:
            v[:, b] = value


def blocks_equal(kv: list, layout: str, block_ids, value: int) -> bool:
    return all((_token_view(t, layout)[:, list(block_ids)] == value).all() for t in kv)


def prompt(seed: int, num_chunks: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 32000, num_chunks * CHUNK)


def _report(q, fn, *args, **kwargs) -> None:
    try:
        q.put(("ok", fn(*args, **kwargs)))
    except BaseException:
        q.put(("error", traceback.format_exc()))


# ---- tensor-parallel ranks ------------------------------------------------------------------------


def tp_rank(q, url: str, rank: int, barrier) -> None:
    _report(q, _tp_rank, url, rank, barrier)


def _tp_rank(url: str, rank: int, barrier) -> dict:
    """One of two TP ranks of one engine. MHA: each rank stores its own shard of every chunk.
    MLA: the cache is identical on every rank; rank 0's store serves both."""
    from lmcache_mp import Client, chunk_hashes

    n, bs = 3, 8
    bpc = CHUNK // bs
    client = Client(url, heartbeat_interval=0.25)
    hashes = chunk_hashes(prompt(777, n), client.chunk_size)  # the same prompt on both ranks
    mha, mla = make_kv("mha", 32, bs), make_kv("mla", 32, bs)
    src = list(range(n * bpc))
    mine = reference(100 + rank, "mha", n * CHUNK)  # this rank's heads
    latent = reference(555, "mla", n * CHUNK)  # identical on every rank
    write_tokens(mha, "mha", src, mine)
    write_tokens(mla, "mla", src, latent)
    h_mha = client.register_kv_cache(mha, model="tp-mha", world_size=2, rank=rank)
    h_mla = client.register_kv_cache(mla, model="tp-mla", world_size=2, rank=rank)
    assert (h_mha.layout, h_mha.shared, h_mla.layout, h_mla.shared) == ("mha", False, "mla", True)
    barrier.wait(60)
    if rank == 0:
        assert client.store(h_mha, hashes, src).result(30).stored == n
        assert client.lookup(hashes, model="tp-mha", world_size=2) == 0, "counted before rank 1 stored"
        assert client.store(h_mla, hashes, src).result(30).stored == n
        assert client.lookup(hashes, model="tp-mla", world_size=2) == n, "one MLA store serves every rank"
    barrier.wait(60)
    if rank == 1:
        assert client.store(h_mha, hashes, src).result(30).stored == n
        r = client.store(h_mla, hashes, src).result(30)
        assert (r.stored, r.present) == (0, n), "MLA chunks are stored once"
    barrier.wait(60)
    assert client.lookup(hashes, model="tp-mha", world_size=2) == n
    assert client.lookup(hashes, model="tp-mla", world_size=2) == n
    assert client.lookup(hashes, model="tp-mha", world_size=1) == 0  # another world size, another cache
    # retrieve into other blocks, in shuffled order
    dst = list(np.random.default_rng(rank).permutation(np.arange(16, 16 + n * bpc)))
    assert client.retrieve(h_mha, hashes, dst).result(30).loaded == n
    assert client.retrieve(h_mla, hashes, dst).result(30).loaded == n
    assert np.array_equal(read_tokens(mha, "mha", dst), mine), "got another rank's shard"
    assert np.array_equal(read_tokens(mla, "mla", dst), latent)
    untouched = [b for b in range(32) if b not in src and b not in dst]
    assert blocks_equal(mha, "mha", untouched, 0) and blocks_equal(mla, "mla", untouched, 0)
    barrier.wait(60)
    client.close()
    return {"rank": rank}


# ---- separate engine instances ------------------------------------------------------------------


def engine_instance(q, url: str, name: str, layout: str, block_size: int, my_seed: int, other_seed: int,
                    barrier) -> None:
    _report(q, _engine_instance, url, name, layout, block_size, my_seed, other_seed, barrier)


def _engine_instance(url, name, layout, block_size, my_seed, other_seed, barrier) -> dict:
    """An engine instance of its own (world_size 1) sharing the cache with another instance of the
    same model that uses another layout and block size: each reads what the other stored."""
    from lmcache_mp import Client, chunk_hashes

    n, nb = 4, 128
    bpc = CHUNK // block_size
    client = Client(url, name=name, heartbeat_interval=0.25)
    kv = make_kv(layout, nb, block_size)
    handle = client.register_kv_cache(kv, model="shared-model", layout=layout)
    assert handle.block_size == block_size
    mine = chunk_hashes(prompt(my_seed, n), client.chunk_size)
    src = list(range(n * bpc))
    write_tokens(kv, layout, src, reference(my_seed, layout, n * CHUNK))
    assert client.store(handle, mine, src).result(30).stored == n

    # many requests in flight at once: one chunk each, from both instances concurrently
    many = [chunk_hashes(prompt(my_seed * 1000 + i, 1), client.chunk_size) for i in range(8)]
    blocks = [list(range(nb - (i + 1) * bpc, nb - i * bpc)) for i in range(8)]
    for i in range(8):
        write_tokens(kv, layout, blocks[i], reference(my_seed * 1000 + i, layout, CHUNK))
    futures = [client.store(handle, many[i], blocks[i]) for i in range(8)]
    assert [f.result(30).stored for f in futures] == [1] * 8

    barrier.wait(60)  # both instances have stored
    theirs = chunk_hashes(prompt(other_seed, n), client.chunk_size)
    assert client.lookup(theirs, model="shared-model") == n
    dst = list(range(n * bpc, 2 * n * bpc))
    fill_blocks(kv, layout, dst, 0xEE)
    assert client.retrieve(handle, theirs, dst).result(30).loaded == n
    got = read_tokens(kv, layout, dst)
    assert np.array_equal(got, reference(other_seed, layout, n * CHUNK)), "the other instance's bytes differ"

    # the other instance's pipelined chunks, all retrieves in flight together
    others = [chunk_hashes(prompt(other_seed * 1000 + i, 1), client.chunk_size) for i in range(8)]
    dsts = [list(range(2 * n * bpc + i * bpc, 2 * n * bpc + (i + 1) * bpc)) for i in range(8)]
    futures = [client.retrieve(handle, others[i], dsts[i]) for i in range(8)]
    assert [f.result(30).loaded for f in futures] == [1] * 8
    for i in range(8):
        assert np.array_equal(read_tokens(kv, layout, dsts[i]), reference(other_seed * 1000 + i, layout, CHUNK))
    barrier.wait(60)
    client.close()
    return {"name": name, "layout": layout}


# ---- a client that dies -------------------------------------------------------------------------


def lease_holder(q, url: str, seen: bool = True) -> None:
    """Store, lease what it stored, say so, then keep stores in flight until it is killed. seen:
    the server may watch its process; else it is as a client in a pid namespace the server does
    not see (its HELLO names no namespace, and it keeps off the local lane)."""
    try:
        from lmcache_mp import Client, chunk_hashes

        if not seen:
            import lmcache_mp.client.client as client_module

            client_module.own_pid_namespace = lambda: 0
        client = Client(url, heartbeat_interval=0.25, local_lane=seen)
        kv = make_kv("mha", 64, 8)
        handle = client.register_kv_cache(kv, model="doomed")
        hashes = chunk_hashes(prompt(1, 4), client.chunk_size)
        assert client.store(handle, hashes, list(range(16))).result(30).stored == 4
        assert client.lookup(hashes, model="doomed", lock=True) == 4
        q.put(("ok", {"client_id": client.client_id.hex()}))
        i = 0
        while True:
            i += 1
            futures = [client.store(handle, chunk_hashes(prompt(1000 + i * 4 + j, 1), client.chunk_size),
                                    list(range(16 + 4 * j, 20 + 4 * j))) for j in range(4)]
            for f in futures:
                f.result(30)
    except BaseException:
        q.put(("error", traceback.format_exc()))


def lane_only_lease_holder(q, url: str) -> None:
    """lease_holder whose HELLO names no pid namespace, on the local lane (as a client of another
    pid namespace whose lane connection the kernel names to the server)."""
    import lmcache_mp.client.client as client_module

    client_module.own_pid_namespace = lambda: 0
    lease_holder(q, url)


# ---- a client that keeps working ----------------------------------------------------------------


def steady_client(q, url: str, stop, rounds_min: int) -> None:
    _report(q, _steady_client, url, stop, rounds_min)


def _steady_client(url: str, stop, rounds_min: int) -> dict:
    """Store, look up and retrieve fresh prompts (byte-exact) until told to stop."""
    from lmcache_mp import Client, chunk_hashes

    client = Client(url, heartbeat_interval=0.25)
    kv = make_kv("mha", 32, 8)
    handle = client.register_kv_cache(kv, model="steady")
    rounds = 0
    t0 = time.monotonic()
    while rounds < rounds_min or not stop.is_set():
        seed = 10_000 + rounds
        hashes = chunk_hashes(prompt(seed, 2), client.chunk_size)
        ref = reference(seed, "mha", 2 * CHUNK)
        write_tokens(kv, "mha", range(8), ref)
        assert client.store(handle, hashes, list(range(8))).result(10).stored == 2
        assert client.lookup(hashes, model="steady", lock=True) == 2
        fill_blocks(kv, "mha", range(8, 16), 0)
        assert client.retrieve(handle, hashes, list(range(8, 16))).result(10).loaded == 2
        assert np.array_equal(read_tokens(kv, "mha", range(8, 16)), ref)
        rounds += 1
        if time.monotonic() - t0 > 60:
            raise AssertionError("the test never said stop")
    client.close()
    return {"rounds": rounds}
