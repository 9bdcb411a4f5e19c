"""Block-outermost KV caches (vLLM's BLNHC / BLHNC layouts): per-layer views into one buffer in
which the layers of a block lie side by side. A registration of such views is one packed cache
whose block is one contiguous span, moved whole; its chunks never mix with per-layer ones.

Runs on the CPU device (caches in shared memory) and, marked gpu, on CUDA caches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmcache_mp import Client, Server, ServerConfig, chunk_hashes, shared_cpu_tensor
from lmcache_mp.layout import describe_kind
from test_gpu_server import cuda_server  # noqa: F401  (the GPU tests' server, for device cuda)

CHUNK = 64  # tokens per chunk (the GPU tests' server uses the same)
N = 16  # tokens per block
BPC = CHUNK // N
BLOCKS = 24
LAYERS, HEADS, HEAD = 3, 2, 32


def blocks_outermost(kind: str, device: str, layers: int = LAYERS, blocks: int = BLOCKS, seed: int = 0):
    """(the whole buffer [blocks, layers, ...page], the per-layer views vLLM hands over)."""
    shapes = {
        "blnhc": (N, HEADS, 2 * HEAD),  # page [tokens, heads, K+V]: vLLM's view [B, H, N, C] permuted
        "blhnc": (HEADS, N, 2 * HEAD),  # page [heads, tokens, K+V]
        "mla": (N, 4 * HEAD),  # page [tokens, dim]
        "flash": (2, N, HEADS, HEAD),  # page [K/V, tokens, heads, head]: the [2, B, N, H, D] view
    }
    shape = (blocks, layers, *shapes[kind])
    whole = (shared_cpu_tensor(shape, torch.bfloat16, fill=None) if device == "cpu"
             else torch.empty(shape, dtype=torch.bfloat16, device=device))
    g = torch.Generator().manual_seed(seed)
    whole.view(torch.int16).copy_(torch.randint(-(1 << 15), (1 << 15) - 1, shape, dtype=torch.int16, generator=g))
    if kind == "blnhc":
        views = [whole[:, i].permute(0, 2, 1, 3) for i in range(layers)]
    elif kind == "flash":
        views = [whole[:, i].transpose(0, 1) for i in range(layers)]
    else:
        views = [whole[:, i] for i in range(layers)]
    return whole, views


def same(a, b) -> bool:
    """Bitwise equality (random bits make NaNs, which torch.equal calls unequal)."""
    return torch.equal(a.cpu().view(torch.int16), b.cpu().view(torch.int16))


def layout_of(kind: str) -> str:
    return "mla" if kind == "mla" else "auto"


@pytest.fixture
def url(request):
    """A CPU server in this process, or (device cuda) the GPU tests' server process."""
    if request.param == "cpu":
        srv = Server(ServerConfig(url="tcp://127.0.0.1:0", device="cpu", l1_size="64MiB", chunk_size=CHUNK)).start()
        yield srv.url, "cpu"
        srv.stop()
    else:
        pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        yield request.getfixturevalue("cuda_server"), "cuda"


DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("url", DEVICES, indirect=True)
@pytest.mark.parametrize("kind", ["blnhc", "blhnc", "mla", "flash"])
def test_two_engines_of_one_block_outermost_layout_share_chunks_byte_exact(url, kind):
    url, device = url
    whole_a, views_a = blocks_outermost(kind, device, seed=1)
    whole_b, views_b = blocks_outermost(kind, device, seed=2)
    before_b = whole_b.clone()
    with Client(url) as a, Client(url) as b:
        ha = a.register_kv_cache(views_a, model=f"packed-{kind}", layout=layout_of(kind))
        hb = b.register_kv_cache(views_b, model=f"packed-{kind}", layout=layout_of(kind))
        assert ha.layout == hb.layout == "packed"
        assert ha.object_bytes == CHUNK * LAYERS * whole_a[0, 0].numel() * 2 // N
        reg = next(r for r in a.status()["registrations"] if r["model"] == f"packed-{kind}")
        assert reg["layers"] == LAYERS and reg["copy_bytes"] == LAYERS * whole_a[0, 0].numel() * 2
        assert reg["transfer_mode_reason"]
        hashes = chunk_hashes(np.arange(3 * CHUNK), CHUNK)
        src = np.array([5, 9, 1, 2, 20, 21, 22, 23, 0, 7, 3, 11])
        dst = np.array([12, 13, 14, 15, 3, 4, 6, 8, 16, 17, 18, 19])
        assert a.store(ha, hashes, src).result().stored == 3
        assert b.lookup(hashes, model=f"packed-{kind}") == 3
        assert b.retrieve(hb, hashes, dst).result().loaded == 3
        got, want = whole_b.cpu(), whole_a.cpu()
        for s, d in zip(src, dst):  # the whole span of a block: every layer's page
            assert same(got[d], want[s]), f"block {s} -> {d}"
        untouched = np.setdiff1d(np.arange(BLOCKS), dst)
        assert same(got[untouched], before_b.cpu()[untouched])


@pytest.mark.parametrize("url", DEVICES, indirect=True)
def test_per_layer_and_block_outermost_engines_of_one_model_never_mix_bytes(url):
    """Same model, same per-layer view shape, two formats: a chunk stored by one is a miss for
    the other (its bytes are never scattered into the other's blocks), and a store by the other
    replaces it."""
    url, device = url
    whole, packed_views = blocks_outermost("blhnc", device, seed=3)
    # The per-layer engine: one allocation per layer, the same [B, H, N, C] views.
    owners = [blocks_outermost("blhnc", device, layers=1, seed=10 + i) for i in range(LAYERS)]
    per_layer = [views[0] for _, views in owners]
    per_layer_before = [t.clone() for t in per_layer]
    with Client(url) as c:
        hp = c.register_kv_cache(packed_views, model="mixed")
        hl = c.register_kv_cache(per_layer, model="mixed")
        assert (hp.layout, hl.layout) == ("packed", "opaque")
        hashes = chunk_hashes(np.arange(2 * CHUNK), CHUNK)
        assert c.store(hp, hashes, np.arange(2 * BPC)).result().stored == 2
        assert c.retrieve(hl, hashes, np.arange(8, 8 + 2 * BPC)).result().loaded == 0
        for t, before in zip(per_layer, per_layer_before):
            assert same(t.cpu(), before.cpu())
        # The per-layer engine stores the same chunks: its format replaces the packed one
        assert c.store(hl, hashes, np.arange(2 * BPC)).result().stored == 2
        packed_before = whole.clone()
        assert c.retrieve(hp, hashes, np.arange(8, 8 + 2 * BPC)).result().loaded == 0
        assert same(whole.cpu(), packed_before.cpu())
        assert c.retrieve(hl, hashes, np.arange(8, 8 + 2 * BPC)).result().loaded == 2
        for t in per_layer:
            assert same(t[8:8 + 2 * BPC].cpu(), t[:2 * BPC].cpu())


@pytest.mark.parametrize("url", DEVICES, indirect=True)
def test_tensor_parallel_ranks_and_mla_stored_once(url):
    url, device = url
    hashes = chunk_hashes(np.arange(2 * CHUNK), CHUNK)
    ids = np.arange(2 * BPC) + 4
    with Client(url) as c:
        # MHA: each rank stores its own shard; a chunk counts once both ranks stored it
        mha = [blocks_outermost("blnhc", device, seed=20 + r) for r in range(2)]
        hm = [c.register_kv_cache(v, model="tp-packed", world_size=2, rank=r) for r, (_, v) in enumerate(mha)]
        assert not hm[0].shared
        assert c.store(hm[0], hashes, ids).result().stored == 2
        assert c.lookup(hashes, model="tp-packed", world_size=2) == 0
        assert c.store(hm[1], hashes, ids).result().stored == 2
        assert c.lookup(hashes, model="tp-packed", world_size=2) == 2
        # MLA: rank 0 stores, rank 1 reads the same object
        mla = [blocks_outermost("mla", device, seed=30 + r) for r in range(2)]
        hl = [c.register_kv_cache(v, model="tp-packed-mla", world_size=2, rank=r, layout="mla")
              for r, (_, v) in enumerate(mla)]
        assert hl[0].layout == "packed" and hl[0].shared and hl[1].shared
        assert c.store(hl[0], hashes, ids).result().stored == 2
        assert c.lookup(hashes, model="tp-packed-mla", world_size=2) == 2
        assert c.retrieve(hl[1], hashes, ids + 8).result().loaded == 2
        assert same(mla[1][0][ids + 8].cpu(), mla[0][0][ids].cpu())


@pytest.mark.parametrize("url", DEVICES, indirect=True)
def test_the_engine_copies_a_packed_cache_as_the_server_does(url):
    """transfer="engine" derives the same packed format: its chunks and the server's are one."""
    url, device = url
    whole_a, views_a = blocks_outermost("blnhc", device, seed=40)
    whole_b, views_b = blocks_outermost("blnhc", device, seed=41)
    hashes = chunk_hashes(np.arange(2 * CHUNK), CHUNK)
    with Client(url) as a, Client(url) as b:
        ha = a.register_kv_cache(views_a, model="engine-packed", transfer="engine")
        hb = b.register_kv_cache(views_b, model="engine-packed")
        assert ha.transfer_mode == "engine" and ha.layout == hb.layout == "packed"
        assert a.store(ha, hashes, np.arange(2 * BPC)).result().stored == 2
        assert b.retrieve(hb, hashes, np.arange(2 * BPC) + 10).result().loaded == 2
        assert same(whole_b[10:10 + 2 * BPC].cpu(), whole_a[:2 * BPC].cpu())
        assert b.store(hb, chunk_hashes(np.arange(2 * CHUNK) + 7, CHUNK), np.arange(2 * BPC) + 10).result().stored == 2
        assert a.retrieve(ha, chunk_hashes(np.arange(2 * CHUNK) + 7, CHUNK), np.arange(2 * BPC) + 16).result().loaded == 2
        assert same(whole_a[16:16 + 2 * BPC].cpu(), whole_b[10:10 + 2 * BPC].cpu())


def test_views_that_are_not_block_outermost_stay_per_layer():
    """Gaps between the layers' pages (padded pages), layers of separate allocations, and pages
    that are not one run each: every layer is its own cache, as before."""
    srv = Server(ServerConfig(url="tcp://127.0.0.1:0", device="cpu", l1_size="64MiB", chunk_size=CHUNK)).start()
    try:
        with Client(srv.url) as c:
            padded = shared_cpu_tensor((BLOCKS, LAYERS, HEADS * N * 2 * HEAD + 64), torch.bfloat16)
            views = [padded[:, i, : HEADS * N * 2 * HEAD].view(BLOCKS, HEADS, N, 2 * HEAD) for i in range(LAYERS)]
            assert c.register_kv_cache(views, model="padded").layout == "opaque"
            # K and V of a layer apart (K of every layer, then V of every layer): no page per layer
            split = shared_cpu_tensor((BLOCKS, 2, LAYERS, N, HEADS, HEAD), torch.bfloat16)
            views = [split[:, :, i].transpose(0, 1) for i in range(LAYERS)]
            h = c.register_kv_cache(views, model="split")
            assert h.layout == "mha"
            hashes = chunk_hashes(np.arange(CHUNK), CHUNK)
            split.view(torch.int16).copy_((torch.arange(split.numel()) % 30000).to(torch.int16).view(split.shape))
            assert c.store(h, hashes, np.arange(BPC)).result().stored == 1
            assert c.retrieve(h, hashes, np.arange(BPC) + 8).result().loaded == 1
            assert same(split[8:8 + BPC], split[:BPC])
            reg = next(r for r in c.status()["registrations"] if r["model"] == "split")
            assert reg["layout"] == "mha" and reg["layers"] == LAYERS
    finally:
        srv.stop()


def test_a_packed_cache_describes_itself():
    from lmcache_mp.layout import describe_layers

    class Ref:  # a layer as the protocol describes it
        def __init__(self, t, base):
            self.shape, self.strides, self.dtype = list(t.shape), list(t.stride()), "bfloat16"
            self.element_size = 2
            self.memory = type("M", (), {"kind": "shm", "name": "buf", "handle": b"",
                                         "offset": (t.data_ptr() - base)})()

    whole, views = blocks_outermost("blnhc", "cpu", layers=4)
    base = whole.data_ptr()
    order = [2, 0, 3, 1]  # registered in another order than memory's
    spec = describe_layers([Ref(views[i], base) for i in order])
    page = HEADS * N * 2 * HEAD * 2
    assert spec.kind == "packed" and spec.model_layers == 4 and spec.row_bytes == 4 * page
    assert spec.layer_order == (1, 3, 0, 2) and spec.addressed_layers() == [1]
    assert spec.block_stride == 4 * page and spec.segment_bytes == 4 * page
    assert "packed opaque" in describe_kind(spec)
    in_order = describe_layers([Ref(v, base) for v in views])
    assert in_order.layer_order == (0, 1, 2, 3)
    # Pages in another order of the layers mean other bytes: another format
    assert in_order.format_key() != spec.format_key()
    other, other_views = blocks_outermost("blhnc", "cpu", layers=4)
    hnd = describe_layers([Ref(v, other.data_ptr()) for v in other_views])
    assert hnd.kind == "packed" and hnd.format_key() != in_order.format_key()


def test_auto_takes_the_copy_engines_for_copies_of_768_kib_or_more():
    from lmcache_mp.layout import infer_layout, pack_layers
    from lmcache_mp.server.copies.transfer_mode import DMA_MIN_SEGMENT, choose_transfer_mode

    page = 16 * 8 * 256 * 2  # a Llama-3-8B layer's block of 16 tokens: 64 KiB
    per_layer = infer_layout((100, 8, 16, 256), (32 * 16 * 8 * 256, 256, 8 * 256, 1), 2, "bfloat16", 32, "opaque",
                             block_size=16)
    packed = pack_layers(per_layer, [i * page for i in range(32)])
    assert packed.segment_bytes == 32 * page >= DMA_MIN_SEGMENT
    mode, why = choose_transfer_mode(packed)
    assert mode == "dma" and "2.0 MiB" in why
    mode, why = choose_transfer_mode(per_layer)  # alone, a layer's block: 64 KiB
    assert mode == "staged" and "64.0 KiB" in why
    flash = infer_layout((2, 100, 16, 8, 128), (100 * 16 * 1024, 16 * 1024, 1024, 128, 1), 2, "bfloat16", 32)
    assert choose_transfer_mode(flash)[0] == "staged"  # 32 KiB per layer, K or V
    small = pack_layers(per_layer, [i * page for i in range(8)])  # 512 KiB spans
    assert choose_transfer_mode(small)[0] == "staged"
    assert choose_transfer_mode(pack_layers(per_layer, [i * page for i in range(12)]))[0] == "dma"  # 768 KiB


@pytest.mark.gpu
def test_a_cuda_cache_of_large_blocks_moves_by_copy_engines_only(cuda_server):  # noqa: F811
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    layers, blocks = 16, 40  # pages of 64 KiB: spans of 1 MiB
    with Client(cuda_server) as c:
        whole = torch.empty((blocks, layers, N, 8, 256), dtype=torch.bfloat16, device="cuda")
        whole.view(torch.int16).random_(-(1 << 15), (1 << 15) - 1)
        views = [whole[:, i].permute(0, 2, 1, 3) for i in range(layers)]
        h = c.register_kv_cache(views, model="dma-packed")
        assert (h.layout, h.transfer_mode) == ("packed", "dma")
        reg = next(r for r in c.status()["registrations"] if r["model"] == "dma-packed")
        assert reg["copy_bytes"] == 1 << 20 and "copy engines" in reg["transfer_mode_reason"]
        hashes = chunk_hashes(np.arange(3 * CHUNK), CHUNK)
        src = np.array([3, 4, 5, 6, 30, 2, 17, 9, 10, 11, 12, 0])  # adjacent runs merge, others do not
        dst = np.array([20, 21, 22, 23, 24, 26, 25, 39, 31, 32, 33, 34])
        assert c.store(h, hashes, src).result().stored == 3
        assert c.retrieve(h, hashes, dst).result().loaded == 3
        assert same(whole[dst], whole[src])
        c.unregister_kv_cache(h)


def test_packed_chunks_survive_in_the_disk_tier_and_stay_apart_there(tmp_path):
    """Their format key goes to L2 with them: a new server serves them to a packed cache of the
    same layout, and to a per-layer cache of the same model not at all."""
    settings = dict(url="tcp://127.0.0.1:0", device="cpu", l1_size="64MiB", chunk_size=CHUNK,
                    l2_disk=str(tmp_path / "l2"), l2_write="all")
    hashes = chunk_hashes(np.arange(2 * CHUNK), CHUNK)
    whole, views = blocks_outermost("blnhc", "cpu", seed=50)
    srv = Server(ServerConfig(**settings)).start()
    with Client(srv.url) as c:
        assert c.store(c.register_kv_cache(views, model="disk"), hashes, np.arange(2 * BPC)).result().stored == 2
    srv.stop()  # drains the writes
    srv = Server(ServerConfig(**settings)).start()
    try:
        with Client(srv.url) as c:
            owners = [blocks_outermost("blnhc", "cpu", layers=1, seed=60 + i) for i in range(LAYERS)]
            per_layer = c.register_kv_cache([v[0] for _, v in owners], model="disk")
            before = [w.clone() for w, _ in owners]
            assert c.retrieve(per_layer, hashes, np.arange(2 * BPC)).result().loaded == 0
            assert all(same(w, b) for (w, _), b in zip(owners, before))
            other, other_views = blocks_outermost("blnhc", "cpu", seed=51)
            assert c.retrieve(c.register_kv_cache(other_views, model="disk"), hashes,
                              np.arange(2 * BPC) + 5).result().loaded == 2
            assert same(other[5:5 + 2 * BPC], whole[:2 * BPC])
    finally:
        srv.stop()
