"""The SGLang linker's offload and load of device pages against a memcpy of the same bytes (CPU).

Needs sglang (the test virtualenv of tests/sglang_e2e). The device pool is SGLang's own
MHATokenToKVPool on the CPU (what the linker registers: the server maps it from shared memory and
copies); the linker is made by SGLang's `dynamic` factory; the server runs in its own process
(lmcache-mp-server --device cpu), as in a deployment. Each timed call moves --pages pages: an
offload of new keys (queued, then its result taken, as SGLang's write-through and per-step poll
do), then a load of them into other slots (queued, started, finished, as SGLang's admission and
forward do). The ceiling, in the same run: one contiguous copy of the same bytes on lmcache_mp's
copy threads. Every load is checked byte for byte. Rounds are interleaved (medians reported).

    python bench/bench_sglang_linker.py [--pages 64] [--page-size 64] [--layers 16] [--heads 8]
        [--head-dim 128] [--repeat 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "sglang_e2e"))

from bench_sglang_storage import cpu_model, start_server  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--transfer", choices=("server", "engine"), default="server",
                    help="who copies: the server (default), or this process (engine-side copies)")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    from cpu_torchvision import allow_cpu_torchvision

    allow_cpu_torchvision()
    import numpy as np
    import torch
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker
    from sglang.srt.server_args import ServerArgs

    from lmcache_mp import Client, _C

    ps, n = args.page_size, args.pages
    pool = MHATokenToKVPool(size=2 * n * ps, page_size=ps, dtype=torch.bfloat16, head_num=args.heads,
                            head_dim=args.head_dim, layer_num=args.layers, device="cpu", enable_memory_saver=False)
    buffers = [*pool.k_buffer, *pool.v_buffer]
    for b in buffers:
        b.view(torch.uint8).copy_(torch.randint(0, 256, b.view(torch.uint8).shape, dtype=torch.uint8))
    page_bytes = sum(b[:ps].numel() * b.element_size() for b in buffers)
    total = n * page_bytes
    src = torch.arange(ps, (n + 1) * ps)  # (SGLang keeps page 0 as its padding page)
    dst = torch.arange((n + 1) * ps, (2 * n + 1) * ps)
    params = SimpleNamespace(token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: pool),
                             req_to_token_pool=None, page_size=ps, pp_size=1, attn_cp_size=1)
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(max(4 * total, 512 << 20) + (256 << 20), 256, Path(tmp) / "server.log")
        url = server.url
        try:
            config = {"linker": "LMCacheMPLinker", "linker_module_path": "lmcache_mp.integration.sglang_linker",
                      "linker_extra_config": {"lmcache_mp.url": url, "lmcache_mp.request_timeout": 60,
                                              "lmcache_mp.model": "bench", "lmcache_mp.transfer": args.transfer}}
            linker = create_unified_cache_linker(ServerArgs(model_path="dummy"), params, backend="dynamic",
                                                 config=config, components={ComponentType.FULL})
            a = np.random.randint(0, 256, total, dtype=np.uint8)
            b = np.empty_like(a)
            b[:] = 1
            memcpy, offloads, loads = [], [], []
            with Client(url) as admin:
                for r in range(args.repeat + 1):  # interleaved rounds; the first warms up
                    t0 = time.perf_counter()
                    _C.parallel_memcpy(b.ctypes.data, a.ctypes.data, total)
                    t_memcpy = time.perf_counter() - t0
                    keys = [f"bench-{r}-{i}" for i in range(n)]
                    admin.clear()
                    t0 = time.perf_counter()
                    assert linker.offload([PoolTransfer(name=PoolName.KV, keys=keys, device_indices=src)])
                    while linker.num_completed_offloads() == 0:
                        time.sleep(0.0002)
                    t_offload = time.perf_counter() - t0
                    assert linker.pop_completed_offload() is True
                    for buf in buffers:
                        buf[dst] = 0
                    assert linker.lookup("r", [PoolTransfer(name=PoolName.KV, keys=keys)])[-1] == n
                    t0 = time.perf_counter()
                    assert linker.load("r", [PoolTransfer(name=PoolName.KV, keys=keys, device_indices=dst)])
                    assert linker.finish_layer_wise_loading(linker.start_layer_wise_loading())
                    t_load = time.perf_counter() - t0
                    for buf in buffers:  # bytes, not values: random bits hold NaNs
                        assert torch.equal(buf[dst].view(torch.uint8), buf[src].view(torch.uint8))
                    if r:
                        memcpy.append(t_memcpy)
                        offloads.append(t_offload)
                        loads.append(t_load)
            linker.close()
        finally:
            server.stop(30)

    def gbs(ts):
        return total / statistics.median(ts) / 1e9

    result = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_model(), "cores": os.cpu_count(),
              "transfer": args.transfer, "pages": n,
              "page_size": ps, "layers": args.layers, "page_bytes": page_bytes, "runs_per_page": len(buffers),
              "bytes": total, "repeat": args.repeat, "memcpy_gbs": gbs(memcpy), "offload_gbs": gbs(offloads),
              "load_gbs": gbs(loads), "offload_ms": 1e3 * statistics.median(offloads),
              "load_ms": 1e3 * statistics.median(loads)}
    result["offload_x_memcpy"] = result["offload_gbs"] / result["memcpy_gbs"]
    result["load_x_memcpy"] = result["load_gbs"] / result["memcpy_gbs"]
    print(f"mha, {args.transfer} copies: {n} pages of {ps} tokens, {page_bytes / 2**20:.2f} MiB each ({len(buffers)} runs), "
          f"{total / 2**20:.0f} MiB per call, median of {args.repeat}")
    print(f"{'':10s}{'GB/s':>8s}{'ms':>9s}{'x memcpy':>10s}")
    print(f"{'memcpy':10s}{result['memcpy_gbs']:8.2f}{1e3 * statistics.median(memcpy):9.1f}{1.0:10.2f}")
    for name in ("offload", "load"):
        print(f"{name:10s}{result[name + '_gbs']:8.2f}{result[name + '_ms']:9.1f}{result[name + '_x_memcpy']:10.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
