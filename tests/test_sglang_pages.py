"""The SGLang backend's pieces that need no sglang: host-pool buffers as page runs (plain torch
tensors shaped as SGLang's host pools), and private CPU memory registered for engine-side copies."""

from __future__ import annotations

import pytest
import torch

from lmcache_mp import Client, Server, ServerConfig
from lmcache_mp.integration.sglang_keys import page_digests
from lmcache_mp.integration.sglang_pages import UnsupportedPool, plan_pages


@pytest.mark.parametrize("kind,layout,shape,runs", [
    ("mha", "layer_first", (2, 3, 64, 2, 8), 6),
    ("mha", "page_first", (2, 64, 3, 2, 8), 2),
    ("mha", "page_first_direct", (2, 4, 3, 16, 2, 8), 2),
    ("mla", "layer_first", (3, 64, 1, 8), 3),
    ("mla", "page_first", (64, 3, 1, 8), 1),
])
def test_a_page_is_its_runs_back_to_back(kind, layout, shape, runs):
    buf = torch.arange(torch.Size(shape).numel(), dtype=torch.int32).view(shape)
    plan = plan_pages(buf, kind=kind, layout=layout, page_size=16, chunk_size=16)
    assert len(plan.runs) == runs and plan.num_pages == 4
    assert all(r.data_ptr() >= buf.data_ptr() and r.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
               for r in plan.runs)  # views, no copies
    for page in range(4):
        got = torch.cat([r[page] for r in plan.runs])
        axis = {"layer_first": 2 if kind == "mha" else 1, "page_first": 1 if kind == "mha" else 0,
                "page_first_direct": 1}[layout]
        if layout == "page_first_direct":
            want = buf.narrow(axis, page, 1)
        else:
            want = buf.narrow(axis, page * 16, 16)
        assert torch.equal(got.sort().values, want.flatten().sort().values)  # the page's elements, all of them
        assert plan.page_bytes == want.numel() * 4


def test_pools_without_page_runs_are_refused():
    with pytest.raises(UnsupportedPool, match="not supported"):
        plan_pages(torch.zeros(2, 64, 3, 2, 8), kind="mha", layout="page_unified", page_size=16, chunk_size=16)
    with pytest.raises(UnsupportedPool, match="whole pages"):
        plan_pages(torch.zeros(2, 60, 3, 2, 8), kind="mha", layout="page_first", page_size=16, chunk_size=16)
    with pytest.raises(UnsupportedPool, match="chunk size"):
        plan_pages(torch.zeros(2, 64, 3, 2, 8), kind="mha", layout="page_first", page_size=16, chunk_size=4096)


def test_private_cpu_memory_registers_for_engine_copies_only(shm_files):
    srv = Server(ServerConfig(url="tcp://127.0.0.1:0", l1_size="32MiB", device="cpu", chunk_size=256))
    srv.start()
    try:
        pool = torch.randint(0, 1 << 30, (2, 64, 3, 2, 8), dtype=torch.int32)  # ordinary process memory
        runs = list(plan_pages(pool, kind="mha", layout="page_first", page_size=16, chunk_size=256).runs)
        with Client(srv.url) as c:
            with pytest.raises(ValueError, match="shared memory"):
                c.register_kv_cache(runs, model="m", layout="opaque", block_size=256)
            h = c.register_kv_cache(runs, model="m", layout="opaque", block_size=256, transfer="engine")
            assert h.transfer_mode == "engine"
            keys = page_digests(["a", "b"])
            assert c.store(h, keys, [2, 0]).result().stored == 2
            assert c.retrieve(h, keys, [1, 3]).result().loaded == 2
            assert torch.equal(pool[:, 16:32], pool[:, 32:48]) and torch.equal(pool[:, 48:64], pool[:, 0:16])
            c.unregister_kv_cache(h)
    finally:
        srv.stop()
