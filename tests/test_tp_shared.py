"""Tensor-parallel-shared chunks on the CPU device: engines of TP 1, 2 and 4 store and load one
object per chunk, each rank its heads' slice (head_slices.py), byte for byte; a chunk is visible
only once every slice landed; a store whose peers never come is dropped; the per-rank format
still works beside it; L2 and tenants' namespaces keep them."""

from __future__ import annotations

import time

import numpy as np
import pytest

from lmcache_mp import Client, RequestError, Server, ServerConfig, chunk_hashes, shared_cpu_tensor
from test_tenants import Setup, keys  # noqa: F401 (keys: the tenants' CURVE keys, a fixture)

CHUNK = 32
BLOCK = 16
LAYERS = 3
HEAD_SIZE = 8  # float16: 16 bytes of one head of one token
HEAD_BYTES = HEAD_SIZE * 2
NUM_BLOCKS = 24


def new_server(**settings) -> Server:
    cfg = dict(url="tcp://127.0.0.1:0", device="cpu", l1_size="64MiB", chunk_size=CHUNK)
    cfg.update(settings)
    return Server(ServerConfig(**cfg)).start()


@pytest.fixture
def server():
    srv = new_server()
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    c = Client(server.url, heartbeat_interval=0.25)
    yield c
    c.close()


def heads_of(world: int, rank: int, heads: int) -> list[int]:
    """The KV heads rank holds at this TP size (vLLM's split; replicated when world > heads)."""
    if world <= heads:
        n = heads // world
        return list(range(rank * n, (rank + 1) * n))
    return [rank // (world // heads)]


# opaque layouts as vLLM's caches are: [blocks, heads, block_size, K and V of a head], heads
# outermost in memory (the CPU cache) or tokens outermost (its CUDA caches, token-major blocks)
OPAQUE = ("cpu_blocks", "token_major")


def reference(seed: int, layout: str, heads: int, tokens: int) -> np.ndarray:
    """A prompt's KV bytes for every head: [layers, segments, tokens, heads, head bytes]."""
    segments = 1 if layout == "mla" or layout in OPAQUE else 2
    width = heads * HEAD_BYTES if layout == "mla" else 2 * HEAD_BYTES if layout in OPAQUE else HEAD_BYTES
    return np.random.default_rng(seed).integers(0, 256, (LAYERS, segments, tokens, 1 if layout == "mla" else heads,
                                                          width), dtype=np.uint8)


class Rank:
    """One rank's KV cache (shared memory) at some TP size, with its view of a prompt's tokens."""

    def __init__(self, client: Client, model: str, layout: str, heads: int, world: int, rank: int,
                 tp_shared: bool = True, **register):
        import torch

        self.layout, self.heads, self.world, self.rank = layout, heads, world, rank
        self.mine = [0] if layout == "mla" else heads_of(world, rank, heads)
        h = len(self.mine)
        shape = {"mha": (2, NUM_BLOCKS, BLOCK, h, HEAD_SIZE), "block_major": (NUM_BLOCKS, 2, BLOCK, h, HEAD_SIZE),
                 "mla": (NUM_BLOCKS, BLOCK, heads * HEAD_SIZE), "cpu_blocks": (NUM_BLOCKS, h, BLOCK, 2 * HEAD_SIZE),
                 "token_major": (NUM_BLOCKS, BLOCK, h, 2 * HEAD_SIZE)}[layout]
        self.kv = [shared_cpu_tensor(shape, torch.float16) for _ in range(LAYERS)]
        views = [t.transpose(1, 2) for t in self.kv] if layout == "token_major" else self.kv
        if layout in OPAQUE:
            register.update(layout="opaque", block_size=BLOCK)
        self.handle = client.register_kv_cache(views, model=model, world_size=world, rank=rank, tp_shared=tp_shared,
                                                num_kv_heads=0 if layout == "mla" else heads, **register)
        self.client = client

    def _tokens(self, layer: int) -> np.ndarray:
        """[segments, blocks, block_size, heads, head bytes] view of one layer."""
        import torch

        a = self.kv[layer].view(torch.uint8).numpy()
        if self.layout == "mha":
            return a.reshape(2, NUM_BLOCKS, BLOCK, len(self.mine), HEAD_BYTES)
        if self.layout == "block_major":
            return a.reshape(NUM_BLOCKS, 2, BLOCK, len(self.mine), HEAD_BYTES).transpose(1, 0, 2, 3, 4)
        if self.layout == "cpu_blocks":
            return a.reshape(NUM_BLOCKS, len(self.mine), BLOCK, -1).transpose(0, 2, 1, 3)[None]
        if self.layout == "token_major":
            return a.reshape(1, NUM_BLOCKS, BLOCK, len(self.mine), -1)
        return a.reshape(1, NUM_BLOCKS, BLOCK, 1, -1)

    def write(self, blocks: list[int], ref: np.ndarray) -> None:
        for layer in range(LAYERS):
            v = self._tokens(layer)
            for j, b in enumerate(blocks):
                v[:, b] = ref[layer][:, j * BLOCK:(j + 1) * BLOCK][:, :, self.mine]

    def holds(self, blocks: list[int], ref: np.ndarray) -> bool:
        for layer in range(LAYERS):
            v = self._tokens(layer)
            for j, b in enumerate(blocks):
                if not np.array_equal(v[:, b], ref[layer][:, j * BLOCK:(j + 1) * BLOCK][:, :, self.mine]):
                    return False
        return True

    def clear_blocks(self) -> None:
        for t in self.kv:
            t.zero_()

    def store(self, hashes, blocks):
        return self.client.store(self.handle, hashes, blocks).result(timeout=30)

    def retrieve(self, hashes, blocks):
        return self.client.retrieve(self.handle, hashes, blocks).result(timeout=30)


def engine(client, model, layout, heads, world, **kw) -> list[Rank]:
    return [Rank(client, model, layout, heads, world, r, **kw) for r in range(world)]


def prompt(seed: int, chunks: int) -> tuple[list[bytes], list[int]]:
    tokens = np.random.default_rng(seed).integers(0, 30000, chunks * CHUNK)
    return chunk_hashes(tokens, CHUNK), list(range(chunks * CHUNK // BLOCK))


def store_all(ranks: list[Rank], hashes, blocks, ref) -> None:
    for r in ranks:
        r.write(blocks, ref)
    for r in ranks:
        r.store(hashes, blocks)


@pytest.mark.parametrize("layout, heads, store_tp, load_tp", [
    ("mha", 4, 2, 1), ("mha", 4, 1, 2), ("mha", 4, 1, 4), ("mha", 4, 4, 2),
    ("block_major", 8, 2, 1), ("block_major", 8, 1, 2), ("block_major", 8, 4, 1),
    ("mha", 2, 4, 1), ("mha", 2, 1, 4), ("mha", 2, 4, 2),  # TP 4 over 2 KV heads: each head on two ranks
    ("mla", 1, 2, 1), ("mla", 1, 1, 4),
    ("cpu_blocks", 4, 2, 1), ("cpu_blocks", 4, 1, 4), ("cpu_blocks", 2, 4, 1),
    ("token_major", 4, 2, 1), ("token_major", 4, 1, 2), ("token_major", 2, 1, 4),
])
def test_one_tp_size_loads_what_another_stored(client, layout, heads, store_tp, load_tp):
    hashes, blocks = prompt(1, 3)
    ref = reference(2, layout, heads, len(blocks) * BLOCK)
    writers = engine(client, "m", layout, heads, store_tp)
    store_all(writers, hashes, blocks, ref)
    assert client.lookup(hashes, model="m", world_size=load_tp, tp_shared=True) == 3
    readers = engine(client, "m", layout, heads, load_tp)
    other = [NUM_BLOCKS - 1 - b for b in blocks]  # other blocks than the writers used
    for r in readers:
        assert r.retrieve(hashes, other).loaded == 3
        assert r.holds(other, ref)


def test_a_chunk_is_visible_only_once_every_slice_landed(client, server):
    hashes, blocks = prompt(3, 2)
    ref = reference(4, "mha", 4, len(blocks) * BLOCK)
    r0, r1 = engine(client, "m", "mha", 4, 2)
    r0.write(blocks, ref)
    r1.write(blocks, ref)
    assert r0.store(hashes, blocks).stored == 2
    assert client.lookup(hashes, model="m", world_size=2, tp_shared=True) == 0
    (one,) = engine(client, "m", "mha", 4, 1)
    assert one.retrieve(hashes, blocks).loaded == 0  # half written: never served
    assert r0.store(hashes, blocks).present == 2  # its heads are there already: not written twice
    assert r1.store(hashes, blocks).stored == 2
    assert client.lookup(hashes, model="m", world_size=1, tp_shared=True) == 2
    assert one.retrieve(hashes, blocks).loaded == 2 and one.holds(blocks, ref)
    assert r1.store(hashes, blocks).present == 2


def test_a_store_whose_peers_never_come_is_dropped():
    srv = new_server(tp_shared_timeout=0.3)
    try:
        l1 = srv.engine.l1
        dead = Client(srv.url, heartbeat_interval=0.25)
        live = Client(srv.url, heartbeat_interval=0.25)
        hashes, blocks = prompt(5, 2)
        ref = reference(6, "mha", 4, len(blocks) * BLOCK)
        r0 = Rank(live, "m", "mha", 4, 2, 0)
        r1 = Rank(dead, "m", "mha", 4, 2, 1)
        r0.write(blocks, ref)
        assert r0.store(hashes, blocks).stored == 2
        dead.close()  # rank 1 went away before its store: its slices never come
        deadline = time.monotonic() + 30
        while l1.stats()["partial_dropped"] < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert l1.stats()["partial_dropped"] == 2
        assert l1.stats()["writing"] == 0 and l1.stats()["objects"] == 0  # their memory went back
        assert live.lookup(hashes, model="m", world_size=2, tp_shared=True) == 0
        # a late peer starts a new chunk, which again waits for every slice
        r1b = Rank(live, "m", "mha", 4, 2, 1)
        r1b.write(blocks, ref)
        assert r1b.store(hashes, blocks).stored == 2
        assert live.lookup(hashes, model="m", world_size=2, tp_shared=True) == 0
        assert r0.store(hashes, blocks).stored == 2
        assert live.lookup(hashes, model="m", world_size=2, tp_shared=True) == 2
        live.close()
    finally:
        srv.stop()


def test_a_failed_slice_leaves_the_chunk_to_its_peers(server):
    """A slice whose store fails gives its heads back and takes nothing of its peers' with it; the
    chunk becomes visible when another store brings those heads."""
    l1 = server.engine.l1
    keys = _keys([bytes(16)])
    fmt = ("tp-shared", 2, LAYERS, 4, HEAD_BYTES, "float16")
    first = l1.begin_store(keys, 4096, fmt, None, 0b0011, 0b1111)
    l1.commit(first)
    failed = l1.begin_store(keys, 4096, fmt, None, 0b1100, 0b1111)
    assert failed.objects == first.objects
    assert l1.begin_store(keys, 4096, fmt, None, 0b1100, 0b1111).present == 1  # being written
    l1.abort(failed)
    assert not l1.contains(keys[0]) and l1.stats()["writing"] == 1  # rank 0's slice is still there
    again = l1.begin_store(keys, 4096, fmt, None, 0b1100, 0b1111)
    assert again.objects == first.objects
    l1.commit(again)
    assert l1.contains(keys[0])
    alone = l1.begin_store(_keys([bytes(15) + b"x"]), 4096, fmt, None, 0b0011, 0b1111)
    l1.abort(alone)  # the only slice failed: nothing of the chunk is kept
    assert l1.stats()["writing"] == 0


def test_the_per_rank_format_works_beside_it(client):
    hashes, blocks = prompt(9, 2)
    ref = reference(10, "mha", 4, len(blocks) * BLOCK)
    old = engine(client, "m", "mha", 4, 2, tp_shared=False)
    new = engine(client, "m", "mha", 4, 2)
    store_all(old, hashes, blocks, ref)
    assert client.lookup(hashes, model="m", world_size=2) == 2
    assert client.lookup(hashes, model="m", world_size=2, tp_shared=True) == 0  # one format is not read as another
    store_all(new, hashes, blocks, ref)
    assert client.lookup(hashes, model="m", world_size=2, tp_shared=True) == 2
    for r in old + new:
        r.clear_blocks()
        assert r.retrieve(hashes, blocks).loaded == 2 and r.holds(blocks, ref)
    assert not old[0].handle.tp_shared and new[0].handle.tp_shared


def test_a_server_opts_every_registration_in():
    srv = new_server(tp_shared=True)
    try:
        c = Client(srv.url)
        hashes, blocks = prompt(11, 2)
        ref = reference(12, "mha", 4, len(blocks) * BLOCK)
        store_all(engine(c, "m", "mha", 4, 2, tp_shared=False), hashes, blocks, ref)
        assert c.lookup(hashes, model="m", world_size=1) == 2  # every lookup is of tp-shared chunks
        (one,) = engine(c, "m", "mha", 4, 1, tp_shared=False)
        assert one.handle.tp_shared and one.retrieve(hashes, blocks).loaded == 2 and one.holds(blocks, ref)
        c.close()
    finally:
        srv.stop()


@pytest.mark.parametrize("case, words", [
    (dict(layout="opaque", shape=(NUM_BLOCKS, BLOCK, 2 * HEAD_SIZE), heads=4), "opaque"),
    (dict(layout="mha", shape=(2, NUM_BLOCKS, BLOCK, 2, HEAD_SIZE), heads=0), "number of KV heads"),
    (dict(layout="mha", shape=(2, NUM_BLOCKS, BLOCK, 2, HEAD_SIZE), heads=8), "2 of 8 KV heads"),
    (dict(layout="mha", shape=(2, NUM_BLOCKS, BLOCK, 2, HEAD_SIZE), heads=4, pipeline_size=2), "pipeline"),
])
def test_what_cannot_be_split_is_refused_at_registration(client, case, words):
    import torch

    kv = [shared_cpu_tensor(case["shape"], torch.float16) for _ in range(LAYERS)]
    with pytest.raises(RequestError, match=words) as e:
        client.register_kv_cache(kv, model="m", world_size=2, rank=0, layout=case["layout"], tp_shared=True,
                                 num_kv_heads=case["heads"], pipeline_size=case.get("pipeline_size", 1),
                                 block_size=BLOCK if case["layout"] == "opaque" else None)
    assert "\n" not in str(e.value)


def test_block_outermost_views_are_sliced_per_layer(client):
    """Per-layer views into one block-outermost buffer (vLLM's BLNHC: found as one packed cache)
    are copied layer by layer into the object: a TP 2 engine of that layout and a TP 1 engine of
    per-layer tensors share chunks."""
    import torch

    heads = 4
    hashes, blocks = prompt(13, 2)
    ref = reference(14, "mha", heads, len(blocks) * BLOCK)
    ranks = []
    for r in range(2):
        h = heads // 2
        buf = shared_cpu_tensor((NUM_BLOCKS, LAYERS, 2, BLOCK, h, HEAD_SIZE), torch.float16)
        views = [buf[:, layer].permute(1, 0, 2, 3, 4) for layer in range(LAYERS)]  # [2, NB, BS, H, D] each
        handle = client.register_kv_cache(views, model="m", world_size=2, rank=r, tp_shared=True, num_kv_heads=heads)
        assert handle.tp_shared
        a = buf.view(torch.uint8).numpy().reshape(NUM_BLOCKS, LAYERS, 2, BLOCK, h, HEAD_BYTES)
        mine = heads_of(2, r, heads)
        for j, b in enumerate(blocks):
            for layer in range(LAYERS):
                a[b, layer] = ref[layer][:, j * BLOCK:(j + 1) * BLOCK][:, :, mine]
        ranks.append(handle)
    for handle in ranks:
        client.store(handle, hashes, blocks).result(timeout=30)
    (one,) = engine(client, "m", "mha", heads, 1)
    assert one.retrieve(hashes, blocks).loaded == 2 and one.holds(blocks, ref)


def test_l2_disk_keeps_them(tmp_path):
    srv = new_server(l2_disk=str(tmp_path / "l2"), l2_disk_size="64MiB", l2_write="all")
    try:
        c = Client(srv.url)
        hashes, blocks = prompt(15, 2)
        ref = reference(16, "mha", 4, len(blocks) * BLOCK)
        store_all(engine(c, "m", "mha", 4, 2), hashes, blocks, ref)
        l2 = srv.engine.l2
        deadline = time.monotonic() + 30
        while len(l2.find_keys(_keys(hashes))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        c.clear()  # L1 forgets them: only the disk has them
        assert c.lookup(hashes, model="m", world_size=1, tp_shared=True, lock=False) == 2
        (one,) = engine(c, "m", "mha", 4, 1)
        assert one.retrieve(hashes, blocks).loaded == 2 and one.holds(blocks, ref)
        c.close()
    finally:
        srv.stop()


def _keys(hashes):
    from lmcache_mp.storage.objects import SHARED_RANK, TP_SHARED_WORLD, ObjectKey

    return [ObjectKey("m", TP_SHARED_WORLD, SHARED_RANK, h, b"") for h in hashes]


def test_tenants_share_them_only_within_their_namespace(tmp_path, keys):  # noqa: F811
    s = Setup(tmp_path, keys)
    try:
        alice, bob = s.client("client"), s.client("b")
        hashes, blocks = prompt(17, 2)
        ref = reference(18, "mha", 4, len(blocks) * BLOCK)
        store_all(engine(alice, "m", "mha", 4, 2), hashes, blocks, ref)
        assert alice.lookup(hashes, model="m", world_size=1, tp_shared=True) == 2
        assert bob.lookup(hashes, model="m", world_size=1, tp_shared=True) == 0
        (theirs,) = engine(bob, "m", "mha", 4, 1)
        assert theirs.retrieve(hashes, blocks).loaded == 0
        (mine,) = engine(alice, "m", "mha", 4, 1)
        assert mine.retrieve(hashes, blocks).loaded == 2 and mine.holds(blocks, ref)
    finally:
        s.close()
