"""The connector's view of vLLM's KV-cache groups, over vLLM's own spec objects (no engine).

Runs where vLLM is importable. Model kinds vLLM's CPU build cannot run (Mamba1, chunked local
attention) are covered here: which groups are cached, which refused at start-up, and that the
connector's idea of which tokens a group still reads is vLLM's (hybrids that do run:
test_vllm_hybrid.py).
"""

from __future__ import annotations

import importlib.util
import types

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


@pytest.fixture(scope="module")
def kv():
    import torch
    from vllm.v1 import kv_cache_interface as kv

    attn = dict(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)

    def config(*specs, transfer=None):
        groups = [kv.KVCacheGroupSpec([f"layers.{i}.attn"], spec) for i, spec in enumerate(specs)]
        for i, flag in (transfer or {}).items():
            groups[i].enable_kv_transfer = flag
        return kv.KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)

    return types.SimpleNamespace(mod=kv, attn=attn, config=config, torch=torch)


def test_attention_groups_are_cached_with_their_windows(kv):
    from lmcache_mp.integration.connector_types import KVGroup
    from lmcache_mp.integration.vllm_specs import kv_groups

    m = kv.mod
    cfg = kv.config(m.SlidingWindowSpec(**kv.attn, sliding_window=80), m.FullAttentionSpec(**kv.attn),
                    m.ChunkedLocalAttentionSpec(**kv.attn, attention_chunk_size=128),
                    m.MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=kv.torch.bfloat16))
    assert kv_groups(cfg, 16) == [KVGroup(0, "sliding_window", 32, 80), KVGroup(1, "full", 32),
                                  KVGroup(2, "chunked_local", 32, 128), KVGroup(3, "full", 32)]
    # vLLM's hybrid manager off: a window layer is full attention with a window, all blocks kept.
    assert kv_groups(kv.config(m.FullAttentionSpec(**kv.attn, sliding_window=80)), 16) == [KVGroup(0, "full", 32)]
    # A group vLLM does not transfer is left out; no config at all is one full group.
    assert kv_groups(kv.config(m.FullAttentionSpec(**kv.attn), m.FullAttentionSpec(**kv.attn),
                               transfer={1: False}), 16) == [KVGroup(0, "full", 32)]
    assert kv_groups(None, 16) == [KVGroup(0, "full", 16)]


def _mamba(kv, kind="MAMBA2", mode="align", **kw):
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    return kv.mod.MambaSpec(block_size=32, shapes=((4, 8), (8, 16)), dtypes=(kv.torch.bfloat16, kv.torch.float32),
                            mamba_type=MambaAttentionBackendEnum[kind], mamba_cache_mode=mode, **kw)


def test_mamba2_and_gdn_states_are_state_groups_named_by_what_their_pages_hold(kv):
    from lmcache_mp.integration.connector_types import STATE
    from lmcache_mp.integration.vllm_specs import kv_groups

    groups = kv_groups(kv.config(_mamba(kv, "GDN_ATTN"), _mamba(kv), kv.mod.FullAttentionSpec(**kv.attn)), 16)
    assert [(g.index, g.kind, g.block_size) for g in groups] == [(0, STATE, 32), (1, STATE, 32), (2, "full", 32)]
    assert groups[0].describe() == "state=GDN_ATTN:4x8:bfloat16,8x16:float32:page576"
    assert groups[1].detail.startswith("MAMBA2:")
    # Pages of another dtype (vLLM's CPU build picks the SSM dtype by host) are another namespace.
    other = kv.mod.MambaSpec(block_size=32, shapes=((4, 8), (8, 16)), dtypes=(kv.torch.bfloat16,) * 2,
                             mamba_type=_mamba(kv).mamba_type, mamba_cache_mode="align")
    assert kv_groups(kv.config(other), 16)[0].detail != groups[1].detail


@pytest.mark.parametrize("case, said", [
    (dict(mode="none"), "start vLLM with --enable-prefix-caching"),
    (dict(kind="MAMBA1"), r"MambaSpec \(MAMBA1\): restoring this state kind is not tested"),
    (dict(kind="SHORT_CONV"), r"MambaSpec \(SHORT_CONV\)"),
    (dict(num_speculative_blocks=1), "speculative decoding's extra state blocks"),
])
def test_states_that_cannot_be_restored_are_refused_naming_the_group(kv, case, said):
    from lmcache_mp.integration.vllm_specs import UnsupportedKVCache, kv_groups

    with pytest.raises(UnsupportedKVCache, match=r"cannot cache KV-cache group 1 \(layers\.1\.attn\): .*" + said):
        kv_groups(kv.config(kv.mod.FullAttentionSpec(**kv.attn), _mamba(kv, **case)), 16)


@pytest.mark.parametrize("kind", ["mamba", "cross", "non_causal", "mixed_uniform"])
def test_groups_that_cannot_be_cached_are_refused_naming_the_group(kv, kind):
    from lmcache_mp.integration.vllm_specs import UnsupportedKVCache, kv_groups

    m = kv.mod
    bad = {
        "mamba": lambda: m.MambaSpec(block_size=32, shapes=((4, 8), (8, 16)), dtypes=(kv.torch.float32,) * 2),
        "cross": lambda: m.CrossAttentionSpec(**kv.attn),
        "non_causal": lambda: m.FullAttentionSpec(**kv.attn, non_causal=True),
        "mixed_uniform": lambda: m.UniformTypeKVCacheSpecs(block_size=32, kv_cache_specs={
            "a": m.FullAttentionSpec(**kv.attn), "b": m.SlidingWindowSpec(**kv.attn, sliding_window=64)}),
    }[kind]()
    with pytest.raises(UnsupportedKVCache, match=r"cannot cache KV-cache group 1 \(layers\.1\.attn\)"):
        kv_groups(kv.config(m.FullAttentionSpec(**kv.attn), bad), 16)


@pytest.mark.parametrize("window", [64, 80, 200])
def test_first_needed_token_is_what_vllm_keeps(window):
    """vLLM frees a group's blocks of tokens before get_num_skipped_tokens(n); the connector
    stores and loads from first_needed_token(n) on: never a token vLLM dropped."""
    from vllm.v1.core.single_type_kv_cache_manager import ChunkedLocalAttentionManager, SlidingWindowManager

    from lmcache_mp.integration.connector_types import KVGroup

    swa = types.SimpleNamespace(sliding_window=window, extra_retained_tokens=0)
    local = types.SimpleNamespace(attention_chunk_size=window)
    for n in range(0, 1024, 7):
        assert KVGroup(0, "sliding_window", 32, window).first_needed_token(n) == \
            SlidingWindowManager.get_num_skipped_tokens(swa, n)
        assert KVGroup(0, "chunked_local", 32, window).first_needed_token(n) == \
            ChunkedLocalAttentionManager.get_num_skipped_tokens(local, n)


def test_the_connector_declares_hma_and_keeps_blocks_through_the_all_groups_hook():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA, supports_hma

    from lmcache_mp.integration.vllm import LMCacheMPConnector

    assert issubclass(LMCacheMPConnector, SupportsHMA) and supports_hma(LMCacheMPConnector)
    calls = []
    fake = types.SimpleNamespace(request_finished=lambda request, block_ids: calls.append(block_ids) or (True, None))
    assert LMCacheMPConnector.request_finished_all_groups(fake, "req", ([1, 2], [0, 3])) == (True, None)
    assert calls == [[1, 2]]


def test_pinned_blocks_stay_out_of_vllms_free_pool_until_unpinned():
    """A window group's block freed by vLLM while a store reads it is not handed out again
    before the store is over."""
    from vllm.v1.core.block_pool import BlockPool

    from lmcache_mp.integration.vllm import LMCacheMPConnector

    pool = BlockPool(num_gpu_blocks=8, enable_caching=False, hash_block_size=32)
    sched = types.SimpleNamespace(scratch_block_id=None, pin_blocks=None, unpin_blocks=None)
    LMCacheMPConnector.bind_gpu_block_pool(types.SimpleNamespace(_scheduler=sched), pool)
    assert sched.scratch_block_id == pool.null_block.block_id == 0
    blocks = pool.get_new_blocks(3)  # a request's window blocks
    ids = [b.block_id for b in blocks]
    sched.pin_blocks(ids)  # a store of them is planned
    pool.free_blocks(blocks)  # the window moved on
    assert pool.get_num_free_blocks() == 7 - 3
    sched.unpin_blocks(ids)  # the store is over
    assert pool.get_num_free_blocks() == 7


def test_stats_reach_vllms_log_line_and_prometheus_counters():
    from prometheus_client import REGISTRY
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm

    ktc = KVTransferConfig(kv_connector="LMCacheMPConnector", kv_connector_module_path="lmcache_mp.integration.vllm",
                           kv_role="kv_both")
    scheduler = {"lookups": 2, "lookup_tokens": 512, "hit_tokens": 384, "found_tokens": 448}
    rank = {"loaded_chunks": 3, "loaded_bytes": 3 << 20, "loads": 2, "load_seconds": 0.004, "stored_chunks": 1,
            "stored_bytes": 1 << 20, "stores": 1, "store_seconds": 0.002}
    from lmcache_mp.integration.vllm import LMCacheMPConnector

    # One step: two ranks and the scheduler, summed as vLLM sums them.
    step = LMCacheMPConnector.build_kv_connector_stats(dict(rank))
    step = step.aggregate(LMCacheMPConnector.build_kv_connector_stats(dict(rank)))
    step = step.aggregate(LMCacheMPConnector.build_kv_connector_stats(scheduler))
    logging_ = KVConnectorLogging(ktc)
    logging_.observe(step.to_dict())
    lines = []
    logging_.log(lambda fmt, *args: lines.append(fmt % args))
    assert lines == ["KV Transfer metrics: lmcache_mp_hit_tokens=384, lmcache_mp_miss_tokens=128, "
                     "lmcache_mp_hit_rate_%=75.0, lmcache_mp_found_tokens=448, "
                     "lmcache_mp_loaded_chunks=6, lmcache_mp_failed_load_chunks=0, "
                     "lmcache_mp_loaded_MiB=6.0, lmcache_mp_avg_load_ms=2.0, lmcache_mp_stored_chunks=2, "
                     "lmcache_mp_stored_MiB=2.0, lmcache_mp_avg_store_ms=2.0, lmcache_mp_store_errors=0"]
    prom = KVConnectorProm(types.SimpleNamespace(kv_transfer_config=ktc), ["engine"], {0: ["0"], 1: ["1"]})
    from lmcache_mp.integration.vllm_stats import COUNTERS

    for key in COUNTERS:  # every counter of every engine exists from the start, at 0
        for engine in ("0", "1"):
            assert REGISTRY.get_sample_value(f"vllm:lmcache_mp_{key}_total", {"engine": engine}) == 0, key
    prom.observe(step.to_dict(), 0)
    assert REGISTRY.get_sample_value("vllm:lmcache_mp_hit_tokens_total", {"engine": "0"}) == 384
    assert REGISTRY.get_sample_value("vllm:lmcache_mp_loaded_bytes_total", {"engine": "0"}) == 6 << 20


def test_the_connector_refuses_a_mamba_hybrid_when_vllm_creates_it(kv):
    """The error vLLM shows when it starts a Qwen3-Next-like model with this connector."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from lmcache_mp.integration.vllm import LMCacheMPConnector
    from lmcache_mp.integration.vllm_specs import UnsupportedKVCache

    m = kv.mod
    config = types.SimpleNamespace(
        kv_transfer_config=KVTransferConfig(kv_connector="LMCacheMPConnector", kv_role="kv_both",
                                            kv_connector_module_path="lmcache_mp.integration.vllm"),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        cache_config=types.SimpleNamespace(block_size=32),
        model_config=types.SimpleNamespace(served_model_name="m", model="m", use_mla=False))
    hybrid = kv.config(m.FullAttentionSpec(**kv.attn),
                       m.MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(kv.torch.float32,)))
    said = r"group 1 \(layers\.1\.attn\): MambaSpec \(MAMBA2\): vLLM keeps no state at block boundaries"
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(UnsupportedKVCache, match=said):
            LMCacheMPConnector(config, role, hybrid)
