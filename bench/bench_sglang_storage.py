"""The SGLang storage backend's batch_set_v1 / batch_get_v1 against a memcpy of the same bytes.

Needs sglang (the test virtualenv of tests/sglang_e2e). The host pool is SGLang's own
MHATokenToKVPoolHost (or MLA), allocated on the CPU; the backend is made by SGLang's storage
factory from the `dynamic` config; the server runs in its own process (lmcache-mp-server,
--device cpu), as in a deployment. Each timed call moves --pages pages: a store of new keys
(reserve, the copy into L1 in this process, commit), a load of stored keys (read, the copy out
of L1, done). The ceiling, in the same run: one contiguous copy of the same number of bytes on
the same copy threads (lmcache_mp's parallel memcpy, between two warmed buffers). Every load is
checked byte for byte against the pages it came from. The three are timed in interleaved rounds
(medians reported), so that a busy machine weighs on each alike.

    python bench/bench_sglang_storage.py [--pages 64] [--page-size 64] [--layers 32] [--heads 8]
        [--head-dim 128] [--layout page_first] [--kind mha|mla] [--repeat 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "sglang_e2e"))
sys.path.insert(0, str(HERE))
from server_process import ServerProcess  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def start_server(l1_bytes: int, chunk_size: int, log: Path) -> ServerProcess:
    server = ServerProcess(["--url", f"tcp://127.0.0.1:{free_port()}", "--device", "cpu", "--l1-size",
                            f"{l1_bytes >> 20}MiB", "--chunk-size", str(chunk_size), "--slab-size", "64MiB"],
                           log_path=str(log))
    server.wait_ready(60)
    return server


def build_pool(args):
    import torch
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _mha_host_inputs
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    tokens = 2 * args.pages * args.page_size  # host pool: twice this (hicache ratio 2): room for store and load
    if args.kind == "mha":
        dev = MHATokenToKVPool(size=tokens, page_size=args.page_size, dtype=torch.bfloat16, head_num=args.heads,
                               head_dim=args.head_dim, layer_num=args.layers, device="cpu", enable_memory_saver=False)
        cls, info, kw = _mha_host_inputs(dev)
        pool = cls(info, 2.0, 0, args.page_size, args.layout, pin_memory=False, device="cpu", **kw)
    else:
        dev = MLATokenToKVPool(size=tokens, page_size=args.page_size, dtype=torch.bfloat16, kv_lora_rank=512,
                               qk_rope_head_dim=64, layer_num=args.layers, device="cpu", enable_memory_saver=False)
        info = dev.get_device_pool_infos()[0].buffer_info
        pool = MLATokenToKVPoolHost(info, 2.0, 0, args.page_size, args.layout, pin_memory=False, device="cpu",
                                    override_kv_cache_dim=dev.kv_cache_dim, device_capacity_tokens=dev.size,
                                    start_layer=dev.start_layer, end_layer=dev.end_layer,
                                    target_layer_num=dev.layer_num)
    del dev  # only its geometry was needed
    return pool


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--kind", choices=("mha", "mla"), default="mha")
    ap.add_argument("--layout", default="page_first")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    from cpu_torchvision import allow_cpu_torchvision

    allow_cpu_torchvision()
    import numpy as np
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    from lmcache_mp import Client, _C

    pool = build_pool(args)
    pool.kv_buffer.view(torch.uint8).copy_(torch.randint(0, 256, pool.kv_buffer.view(torch.uint8).shape,
                                                         dtype=torch.uint8))
    page_bytes = pool.get_data_page(0, flat=True).numel() * pool.kv_buffer.element_size()
    total = args.pages * page_bytes
    chunk_size = 256
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(max(4 * total, 512 << 20) + (256 << 20), chunk_size, Path(tmp) / "server.log")
        url = server.url
        try:
            extra = {"backend_name": "lmcache_mp", "module_path": "lmcache_mp.integration.sglang",
                     "class_name": "LMCacheMPStorage", "interface_v1": 1, "lmcache_mp.url": url,
                     "lmcache_mp.request_timeout": 60}
            config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                          attn_cp_size=1, is_mla_model=args.kind == "mla",
                                          enable_storage_metrics=False, is_page_first_layout=True,
                                          model_name="bench", extra_config=extra)
            backend = StorageBackendFactory.create_backend("dynamic", config, pool)
            backend.register_mem_pool_host(pool)
            ps = args.page_size
            src_pages = list(range(0, args.pages))
            dst_pages = list(range(args.pages, 2 * args.pages))

            def indices(pages):
                return torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in pages])

            src_idx, dst_idx = indices(src_pages), indices(dst_pages)
            zero_page = torch.zeros_like(pool.get_data_page(0, flat=True))

            def page_view(page):
                return pool.get_data_page(page * ps, flat=True).contiguous().view(torch.uint8)

            # the ceiling: the same bytes, one contiguous copy on the same copy threads
            a = np.random.randint(0, 256, total, dtype=np.uint8)
            b = np.empty_like(a)
            b[:] = 1
            memcpy, sets, gets = [], [], []
            with Client(url) as admin:
                # Rounds of the three, interleaved, so that whatever else the machine runs weighs on
                # all of them alike; the first round warms up (L1 slots faulted in).
                for r in range(args.repeat + 1):
                    t0 = time.perf_counter()
                    _C.parallel_memcpy(b.ctypes.data, a.ctypes.data, total)
                    t_memcpy = time.perf_counter() - t0
                    keys = [f"bench-{r}-{i}" for i in range(args.pages)]
                    admin.clear()
                    t0 = time.perf_counter()
                    ok = backend.batch_set_v1(keys, src_idx)
                    t_set = time.perf_counter() - t0
                    assert ok == [True] * args.pages, ok
                    for d in dst_pages:  # (SGLang's own setter) so that every load must write its pages
                        pool.set_from_flat_data_page(d * ps, zero_page)
                    t0 = time.perf_counter()
                    ok = backend.batch_get_v1(keys, dst_idx)
                    t_get = time.perf_counter() - t0
                    assert ok == [True] * args.pages, ok
                    for s, d in zip(src_pages, dst_pages):  # bytes, not values: random bits hold NaNs
                        assert torch.equal(page_view(s), page_view(d)), f"page {d} differs from page {s}"
                    if r:
                        memcpy.append(t_memcpy)
                        sets.append(t_set)
                        gets.append(t_get)
            backend.close()
        finally:
            server.stop(30)

    def gbs(ts):
        return total / statistics.median(ts) / 1e9

    result = {
        "date": time.strftime("%Y-%m-%d"), "cpu": cpu_model(),
        "cores": os.cpu_count(), "kind": args.kind, "layout": args.layout, "pages": args.pages,
        "page_size": args.page_size, "page_bytes": page_bytes, "runs_per_page": len(backend.plan.runs),
        "bytes": total, "repeat": args.repeat,
        "memcpy_gbs": gbs(memcpy), "batch_set_gbs": gbs(sets), "batch_get_gbs": gbs(gets),
        "batch_set_ms": 1e3 * statistics.median(sets), "batch_get_ms": 1e3 * statistics.median(gets),
    }
    result["batch_set_x_memcpy"] = result["batch_set_gbs"] / result["memcpy_gbs"]
    result["batch_get_x_memcpy"] = result["batch_get_gbs"] / result["memcpy_gbs"]
    print(f"{args.kind} {args.layout}: {args.pages} pages of {args.page_size} tokens, {page_bytes / 2**20:.2f} MiB "
          f"each ({result['runs_per_page']} runs), {total / 2**20:.0f} MiB per call, median of {args.repeat}")
    print(f"{'':14s}{'GB/s':>8s}{'ms':>9s}{'x memcpy':>10s}")
    print(f"{'memcpy':14s}{result['memcpy_gbs']:8.2f}{1e3 * statistics.median(memcpy):9.1f}{1.0:10.2f}")
    for name in ("batch_set", "batch_get"):
        print(f"{name + '_v1':14s}{result[name + '_gbs']:8.2f}{result[name + '_ms']:9.1f}"
              f"{result[name + '_x_memcpy']:10.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
