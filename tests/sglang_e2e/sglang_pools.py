"""SGLang's own KV pools, made on the CPU for the tests: a device pool (SGLang's
MHATokenToKVPool / MLATokenToKVPool with device="cpu"), then the HiCache host pool that SGLang
builds from it (hybrid_pool_assembler's inputs, the same host classes), and the storage
backend made by SGLang's factory from the `dynamic` config, registered as SGLang's cache
controller registers it."""

from __future__ import annotations

from cpu_torchvision import allow_cpu_torchvision

allow_cpu_torchvision()

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _mha_host_inputs  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

PAGE = 16
LAYERS = 3
MHA_HEADS, MHA_DIM = 2, 64
MLA_RANK, MLA_ROPE = 96, 32  # kv_cache_dim 128
DEVICE_TOKENS = 256  # the host pool holds twice as many (hicache ratio 2), plus SGLang's padding page
LAYOUTS = {"mha": ["layer_first", "page_first", "page_first_direct", "page_head"],
           "mla": ["layer_first", "page_first", "page_first_direct"]}


def host_pool(kind: str, layout: str, *, heads: int = MHA_HEADS, layers: int = LAYERS):
    if kind == "mha":
        dev = MHATokenToKVPool(size=DEVICE_TOKENS, page_size=PAGE, dtype=torch.bfloat16, head_num=heads,
                               head_dim=MHA_DIM, layer_num=layers, device="cpu", enable_memory_saver=False)
        cls, info, kw = _mha_host_inputs(dev)
        return cls(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu", **kw)
    dev = MLATokenToKVPool(size=DEVICE_TOKENS, page_size=PAGE, dtype=torch.bfloat16, kv_lora_rank=MLA_RANK,
                           qk_rope_head_dim=MLA_ROPE, layer_num=layers, device="cpu", enable_memory_saver=False)
    info = dev.get_device_pool_infos()[0].buffer_info
    return MLATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                override_kv_cache_dim=dev.kv_cache_dim, device_capacity_tokens=dev.size,
                                start_layer=dev.start_layer, end_layer=dev.end_layer, target_layer_num=dev.layer_num)


def extra_config(url: str, **more) -> dict:
    return {"backend_name": "lmcache_mp", "module_path": "lmcache_mp.integration.sglang",
            "class_name": "LMCacheMPStorage", "interface_v1": 1, "lmcache_mp.url": url,
            "lmcache_mp.retry_interval": 0.3, "lmcache_mp.request_timeout": 30.0,
            "lmcache_mp.connect_timeout": 30.0, **more}  # generous: a loaded 2-core machine


def storage_config(url: str, *, mla: bool = False, tp_rank: int = 0, tp_size: int = 1, model: str = "tiny",
                   layout: str = "page_first", **more) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=layout.startswith("page_first"), model_name=model,
                                extra_config=extra_config(url, **more))


def attach(pool, config: HiCacheStorageConfig):
    """What SGLang's cache controller does on attach: the factory, then the host pool."""
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def fill_random(pool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    buf = pool.kv_buffer
    buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))


def page_indices(pages: list[int]) -> torch.Tensor:
    """SGLang's host indices (token slots) of these pages, in order."""
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages]) if pages else torch.empty(0, dtype=torch.int64)


def page_bytes(pool, page: int) -> bytes:
    """One page as SGLang's own accessor gives it (flat, in the pool's layout)."""
    return pool.get_data_page(page * PAGE, flat=True).contiguous().view(torch.uint8).numpy().tobytes()
