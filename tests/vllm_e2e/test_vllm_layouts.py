"""The KV-cache layout the connector asks vLLM for, and what the server makes of the views vLLM
then hands over: vLLM's own allocator (`allocate_kv_cache`) builds the caches here, on the CPU.

Block-outermost layouts (BLNHC, BLHNC) give per-layer views into one buffer whose blocks hold
every layer's page side by side: each KV-cache group registers as one packed cache and a block
of all its layers moves as one copy. Layer-outermost ones (vLLM's CPU backend: LBHNC) register
per layer, as before.
"""

from __future__ import annotations

import importlib.util
import types

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

CHUNK, BLOCK = 64, 16


def backend(layouts):
    """An attention backend that declares these layouts (None: it takes any)."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    declared = None if layouts is None else tuple(KVCacheLayout[name] for name in layouts)
    return type("Backend", (), {"supported_kv_cache_layouts": classmethod(lambda cls: declared)})


@pytest.mark.parametrize("declared,asked,said", [
    ([None], "BLNHC", "BLNHC"),  # flash-attention and most backends: any layout, vLLM's preference order
    ([("LBHNC", "BLHNC")], "BLHNC", "BLHNC"),  # head-major block interiors only (FlashInfer on Blackwell)
    ([("LBHNC",)], None, "accepts only the KV-cache layouts LBHNC"),  # vLLM's CPU backend
    ([("BHLNC", "LBNHC")], None, "none block-outermost"),  # BHLNC: block-outermost, but a layer's page is not one run
    ([None, ("LBNHC", "BLNHC", "BLHNC")], "BLNHC", "BLNHC"),  # two backends: what both take
])
def test_the_connector_asks_for_the_first_block_outermost_layout_every_backend_takes(monkeypatch, declared, asked,
                                                                                   said):
    import vllm.distributed.kv_transfer.kv_connector.utils as kv_utils

    from lmcache_mp.integration.vllm import LMCacheMPConnector
    from lmcache_mp.integration.vllm_layout import choose_kv_cache_layout

    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    monkeypatch.setattr(kv_utils, "get_current_attn_backends", lambda config: [backend(d) for d in declared])
    layout, why = choose_kv_cache_layout(types.SimpleNamespace())
    assert layout == asked and said in why
    assert LMCacheMPConnector.get_required_kvcache_layout(types.SimpleNamespace()) == asked


def test_an_explicit_layout_or_an_unknown_backend(monkeypatch):
    import vllm.distributed.kv_transfer.kv_connector.utils as kv_utils

    from lmcache_mp.integration.vllm_layout import choose_kv_cache_layout

    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "LBNHC")  # vLLM takes it whatever the connector asks
    layout, why = choose_kv_cache_layout(types.SimpleNamespace())
    assert layout is None and "VLLM_KV_CACHE_LAYOUT=LBNHC" in why and "apart" in why
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "BLHNC")
    assert "one copy" in choose_kv_cache_layout(types.SimpleNamespace())[1]
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT")

    def unknown(config):
        raise RuntimeError("no layers")

    monkeypatch.setattr(kv_utils, "get_current_attn_backends", unknown)
    assert choose_kv_cache_layout(types.SimpleNamespace())[0] == "BLNHC"  # vLLM drops it if refused


def test_vllm_adopts_the_layout_the_connector_asks_for(monkeypatch):
    """vLLM's own resolution, with workers whose backends take any layout: the connector's."""
    from vllm.v1.attention.backends import utils as attn_utils

    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    monkeypatch.setattr(attn_utils, "get_kv_connector_cache_layout", lambda config: "BLNHC")
    config = types.SimpleNamespace(cache_config=types.SimpleNamespace(kv_cache_layout=None))
    every = [["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC"]]
    assert attn_utils.resolve_kv_cache_layout(config, every).name == "BLNHC"
    config.cache_config.kv_cache_layout = None
    assert attn_utils.resolve_kv_cache_layout(config, [["LBHNC"]]).name == "LBHNC"  # the CPU backend's


def vllm_caches(layout_name: str, specs: dict, num_blocks: int = 24) -> dict:
    """{layer name: view}, as vLLM's worker allocates them for these {group: (spec, layers)}."""
    import torch
    from vllm.v1 import kv_cache_interface as kv
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    layout = KVCacheLayout[layout_name]
    cache = types.SimpleNamespace(get_resolved_kv_cache_layout=lambda: layout, num_gpu_blocks_override=num_blocks,
                                  prefix_cache_retention_interval=None)
    config = types.SimpleNamespace(cache_config=cache, attention_config=types.SimpleNamespace(hisparse_config=None))
    groups = [kv.KVCacheGroupSpec(names, spec) for spec, names in specs.values()]
    kv_config = get_kv_cache_config_from_groups(config, groups, 1 << 30)
    views = allocate_kv_cache(kv_config, torch.device("cpu"), layout)
    g = torch.Generator().manual_seed(len(views))
    for tensor in {v.untyped_storage().data_ptr(): v for v in views.values()}.values():
        raw = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    return {group: [views[n] for n in names] for group, (_, names) in specs.items()}


def model_specs(kind: str) -> dict:
    import torch
    from vllm.v1 import kv_cache_interface as kv

    attn = dict(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    if kind == "mha":
        return {"full": (kv.FullAttentionSpec(**attn), [f"layers.{i}.attn" for i in range(3)])}
    if kind == "mla":
        return {"full": (kv.MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=96, dtype=torch.bfloat16),
                         [f"layers.{i}.attn" for i in range(3)])}
    return {"full": (kv.FullAttentionSpec(**attn), [f"layers.{i}.attn" for i in (0, 2, 4)]),  # a hybrid model
            "window": (kv.SlidingWindowSpec(**attn, sliding_window=64), [f"layers.{i}.attn" for i in (1, 3)])}


@pytest.mark.parametrize("layout_name,kind,packed", [
    ("BLNHC", "mha", True), ("BLHNC", "mha", True), ("BLNHC", "mla", True), ("BLNHC", "hybrid", True),
    ("BLHNC", "hybrid", True), ("LBHNC", "mha", False), ("LBNHC", "hybrid", False),
])
def test_vllm_views_register_as_packed_caches_and_round_trip(layout_name, kind, packed):
    """Two engines of one model, caches from vLLM's allocator in one layout: each group of the
    first stores, the second's loads; every layer's bytes of those blocks arrive."""
    import torch

    from lmcache_mp import Client, Server, ServerConfig, chunk_hashes
    from lmcache_mp.integration.cpu_shm import move_to_shared_memory, release_shared_memory

    src = np.array([3, 9, 4, 1, 20, 21, 7, 8])
    dst = np.array([12, 13, 14, 15, 5, 6, 10, 11])
    hashes = chunk_hashes(np.arange(2 * CHUNK), CHUNK)
    engines = [vllm_caches(layout_name, model_specs(kind)) for _ in range(2)]
    shared = [move_to_shared_memory([t for group in e.values() for t in group]) for e in engines]
    srv = Server(ServerConfig(url="tcp://127.0.0.1:0", device="cpu", l1_size="64MiB", chunk_size=CHUNK)).start()
    try:
        with Client(srv.url) as c:
            for group in engines[0]:
                layout = "mla" if kind == "mla" else "auto"
                model = f"{kind}-{layout_name}-{group}"
                views = [e[group] if kind != "mla" else [t.squeeze(1) for t in e[group]] for e in engines]
                ha, hb = (c.register_kv_cache(v, model=model, layout=layout) for v in views)
                assert (ha.layout == "packed") == packed and hb.layout == ha.layout
                assert c.store(ha, hashes, src).result().stored == 2
                assert c.retrieve(hb, hashes, dst).result().loaded == 2
                for a, b in zip(*views):  # per layer, as the attention kernels read them
                    assert torch.equal(b[dst].view(torch.int16), a[src].view(torch.int16))
                c.unregister_kv_cache(ha)
                c.unregister_kv_cache(hb)
    finally:
        srv.stop()
        for buffers in shared:
            release_shared_memory(buffers)
