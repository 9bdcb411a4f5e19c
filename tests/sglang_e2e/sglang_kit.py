"""SGLang's own UnifiedRadixCache test kit (sglang.test.kits.unified_radix_cache), run on the CPU
for the linker tests: its `build_fixture` makes SGLang's device pools, allocators and tree (full
attention, with Mamba state beside it) exactly as SGLang's unit tests do.

The kit's modules import two things a CPU-only test environment lacks: `datasets` (for
`sglang.test.test_utils`' benchmark helpers, which the kit never calls; a stand-in module is put
in its place here when it is not installed), and an accelerator (`get_device()`; the kit's
pools are made on "cpu" instead). Nothing of SGLang's cache code is changed.
"""

from __future__ import annotations

import importlib.util
import sys
import types

from cpu_torchvision import allow_cpu_torchvision

allow_cpu_torchvision()

if importlib.util.find_spec("datasets") is None:
    _stand_in = types.ModuleType("datasets")
    _stand_in.load_dataset = None
    sys.modules["datasets"] = _stand_in

import sglang.test.kits.unified_radix_cache.fixtures as _fixtures  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType  # noqa: E402
from sglang.test.kits.unified_radix_cache.config import CacheConfig  # noqa: E402

from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator  # noqa: E402

_fixtures.get_device = lambda *args, **kwargs: "cpu"
# SGLang allocates whole pages when its page size is over 1 (PagedTokenToKVPoolAllocator); the
# kit's hybrid and dense fixtures use the token allocator, whose slots are not page-aligned.
_fixtures.TokenToKVPoolAllocator = lambda size, dtype, device, kvcache, need_sort: PagedTokenToKVPoolAllocator(
    size, kvcache.page_size, dtype, device, kvcache, need_sort)

PAGE = 16


def hybrid_config(**kw) -> CacheConfig:
    """Full attention on layers 1, 3, 5 and Mamba2 on 0, 2, 4 (SGLang's kit shapes, fewer layers)."""
    return CacheConfig(page_size=PAGE, components=(ComponentType.FULL, ComponentType.MAMBA),
                       enable_mamba_extra_buffer=True, mamba_cache_size=24, num_layers=6,
                       full_attention_layer_ids=(1, 3, 5), kv_size=512, max_context_len=512, **kw)


def swa_config(**kw) -> CacheConfig:
    """Full attention on layers 1, 3 and a sliding window of one page on 0, 2."""
    return CacheConfig(page_size=PAGE, components=(ComponentType.FULL, ComponentType.SWA), sliding_window_size=PAGE,
                       num_layers=4, full_attention_layer_ids=(1, 3), kv_size=512, max_context_len=512, **kw)


def swa_mamba_config(**kw) -> CacheConfig:
    """Full attention on layers 1, 3, 5; a window of one page and Mamba2 on 0, 2, 4 (the kit puts
    both on its non-full layers)."""
    return CacheConfig(page_size=PAGE, components=(ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA),
                       sliding_window_size=PAGE, enable_mamba_extra_buffer=True, mamba_cache_size=24, num_layers=6,
                       full_attention_layer_ids=(1, 3, 5), kv_size=512, max_context_len=512, **kw)


def dense_config(**kw) -> CacheConfig:
    return CacheConfig(page_size=PAGE, components=(ComponentType.FULL,), num_layers=4, kv_size=512,
                       max_context_len=512, **kw)


def build(cfg: CacheConfig):
    """(cache, allocator, req_to_token_pool) from SGLang's kit, on the CPU."""
    return _fixtures.build_fixture(cfg)


# ---- one SGLang instance with the lmcache-mp linker attached, as SGLang's registry attaches it ----

import itertools  # noqa: E402
from array import array  # noqa: E402

import torch  # noqa: E402
from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import (InitLoadBackParams, InsertParams,  # noqa: E402
                                                    MatchPrefixParams)
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

_rids = itertools.count()


def linker_config(url: str, **more) -> dict:
    """`--unified-cache-external-linker-config` for the dynamic backend."""
    return {"linker": "LMCacheMPLinker", "linker_module_path": "lmcache_mp.integration.sglang_linker",
            "linker_extra_config": {"lmcache_mp.url": url, "lmcache_mp.model": "tiny",
                                    "lmcache_mp.request_timeout": 30.0, "lmcache_mp.connect_timeout": 30.0,
                                    "lmcache_mp.retry_interval": 0.3, **more}}  # generous: a loaded 2-core machine


class Instance:
    """SGLang's tree, pools and allocator from the kit, its device pools filled from `seed`, and
    the linker made by SGLang's factory and attached as SGLang's registry attaches it."""

    def __init__(self, url: str, *, hybrid: bool = True, seed: int = 0, config: dict | None = None,
                 swa: bool = False):
        if swa:
            self.cfg = swa_mamba_config() if hybrid else swa_config()
        else:
            self.cfg = hybrid_config() if hybrid else dense_config()
        self.cache, self.allocator, self.req_pool = build(self.cfg)
        self.kvcache = self.allocator.get_kvcache()
        self.fill(seed)
        self.linker = create_unified_cache_linker(
            ServerArgs(model_path="dummy"), self.cache.cache_init_params, backend="dynamic",
            config=config or linker_config(url), components=set(self.cache.components))
        self.cache.init_cache_linker(self.linker)
        self.kvcache.register_layer_transfer_counter(self.linker.layer_done_counter)

    @property
    def attention_pool(self):
        return getattr(self.kvcache, "full_kv_pool", self.kvcache)

    def state_tensors(self) -> list:
        if not self.cfg.has_mamba:
            return []
        states = self.req_pool.mamba_pool.mamba_cache
        return [states.temporal, *states.conv]

    def fill(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        pool = self.attention_pool
        swa = getattr(self.kvcache, "swa_kv_pool", None)
        window = [*swa.k_buffer, *swa.v_buffer] if swa is not None else []
        for t in [*pool.k_buffer, *pool.v_buffer, *window, *self.state_tensors()]:
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))

    def swa_at(self, full_slots) -> list:
        """The window layers' KV of these (full-attention) slots, through SGLang's full-to-SWA map."""
        swa = self.kvcache.swa_kv_pool
        rows = self.allocator.full_to_swa_index_mapping[full_slots.to(torch.int64)]
        return [b[rows].clone() for b in [*swa.k_buffer, *swa.v_buffer]]

    @classmethod
    def reference(cls, *, hybrid: bool, seed: int) -> "Instance":
        """Pools of the same shapes filled from the same seed, with no linker: what an instance
        of another process holds."""
        self = cls.__new__(cls)
        self.cfg = hybrid_config() if hybrid else dense_config()
        self.cache, self.allocator, self.req_pool = build(self.cfg)
        self.kvcache = self.allocator.get_kvcache()
        self.fill(seed)
        return self

    def kv_at(self, slots) -> list:
        pool = self.attention_pool
        return [b[slots].clone() for b in [*pool.k_buffer, *pool.v_buffer]]

    def state_at(self, slot) -> list:
        return [t[:, slot].clone() for t in self.state_tensors()]

    def request(self) -> Req:
        req = Req(rid=f"r{next(_rids)}", origin_input_text="", origin_input_ids=array("q"),
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
        self.req_pool.alloc([req])
        return req

    def insert(self, tokens: list[int]):
        """A finished request's KV (and its Mamba state) into the tree: SGLang's write-through
        then offloads the new node through the linker. Returns (slots, state slot)."""
        if self.cfg.has_swa:  # (as the kit's own _alloc: SWA's allocator allocates pages through alloc_extend)
            slots = self.allocator.full_attn_allocator.alloc(len(tokens))
            self.allocator.full_to_swa_index_mapping[slots] = self.allocator.swa_attn_allocator.alloc(len(tokens))
        else:
            slots = self.allocator.alloc(len(tokens))
        params = InsertParams(key=RadixKey(array("q", tokens)), value=slots)
        state = None
        if self.cfg.has_mamba:
            state = self.request().kv.mamba_pool_idx.unsqueeze(0)
            params.mamba_value = state
        self.cache.insert(params)
        return slots, state

    def settle_offloads(self, timeout: float = 60.0) -> int:
        """Wait for the linker's offloads, then let the tree take their results (its per-step poll)."""
        import time

        deadline = time.monotonic() + timeout
        while self.linker.num_completed_offloads() < len(self.cache.linker.pending_offloads):
            if time.monotonic() > deadline:
                raise AssertionError("offloads did not complete")
            time.sleep(0.01)
        done = len(self.cache.linker.pending_offloads)
        self.cache.check_hicache_events()
        return done

    def match(self, tokens: list[int]):
        """The scheduler's match of a new request: (request, match result)."""
        req = self.request()
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)), req=req))
        req.prefix_len, req.last_node = m.device_prefix_len, m.last_device_node
        req.last_host_node, req.best_match_node = m.last_host_node, m.best_match_node
        req.host_hit_length, req.swa_host_hit_length = m.host_hit_length, m.swa_host_hit_length
        req.mamba_host_hit_length = m.mamba_host_hit_length
        return req, m

    def load_back(self, req: Req):
        """The scheduler's admission (init_load_back): tokens queued and their private slots."""
        n, _ = self.cache.init_load_back(InitLoadBackParams(best_match_node=req.best_match_node,
                                                            host_hit_length=req.host_hit_length, req=req))
        return n, self.cache.linker.private_load_indices.get(req.rid)

    def run_batch(self, reqs: list[Req]) -> list[Req]:
        """Start the batch's loads, let a forward wait on every layer as the KV pool does, and
        finish: the requests whose KV did not land."""
        index = self.cache.ready_to_load_host_cache()
        counter = self.linker.layer_done_counter
        counter.set_consumer(index)
        for layer in range(self.linker.num_layers):
            counter.wait_until(layer)
        return self.cache.finish_external_linker_loads(reqs)

    def close(self) -> None:
        self.cache.linker.close()


def prompt(seed: int, pages: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 30000, (pages * PAGE,), generator=g).tolist()
