"""What page-locking host memory in an engine's process costs that process.

An engine that copies its own chunks (transfer="engine") page-locks the server's L1 in its own
process (cudaHostRegister, a slab at a time). This measures, on a shared-memory file like L1:

  register      seconds per slab, and GB/s
  launches      the longest gap between kernel launches of another thread of the process (an
                engine's forward) while slabs are registered, against the same loop without
  capture       whether a CUDA graph captured by another thread (torch's default, global capture
                mode) survives a registration made meanwhile

    python bench/bench_host_register.py [--gib 8] [--slab-mib 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import threading
import time

import torch

from lmcache_mp import _C


def launch_gaps(seconds: float, stop: threading.Event | None = None) -> list[float]:
    """Host seconds per launch of a tiny kernel, back to back, on a stream of this thread."""
    s = torch.cuda.Stream()
    x = torch.zeros(1, device="cuda")
    gaps = []
    end = time.perf_counter() + seconds
    with torch.cuda.stream(s):
        while time.perf_counter() < end and not (stop and stop.is_set()):
            t0 = time.perf_counter()
            x.add_(1)
            gaps.append(time.perf_counter() - t0)
            if len(gaps) % 256 == 0:
                s.synchronize()
    s.synchronize()
    return gaps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=int, default=8)
    ap.add_argument("--slab-mib", type=int, default=256)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.cuda.init()
    slab = args.slab_mib << 20
    size = args.gib << 30
    fd = os.memfd_create("lmcache-bench-register")
    os.ftruncate(fd, size)
    m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    base = torch.frombuffer(m, dtype=torch.uint8).data_ptr()
    out: dict = {"gpu": torch.cuda.get_device_name(0), "gib": args.gib, "slab_mib": args.slab_mib}

    quiet = launch_gaps(1.0)
    out["launch_us_quiet"] = {"p50": statistics.median(quiet) * 1e6, "max": max(quiet) * 1e6}

    stop, times = threading.Event(), []
    registered = []

    def register_all() -> None:
        for off in range(0, size, slab):
            t0 = time.perf_counter()
            _C.cuda.host_register(base + off, slab, 0)
            times.append(time.perf_counter() - t0)
            registered.append(off)
        stop.set()

    th = threading.Thread(target=register_all)
    th.start()
    busy = launch_gaps(600.0, stop)
    th.join()
    out["register_s_per_slab"] = {"p50": statistics.median(times), "max": max(times)}
    out["register_GBps"] = size / sum(times) / 1e9
    out["launch_us_while_registering"] = {"p50": statistics.median(busy) * 1e6, "max": max(busy) * 1e6}
    for off in registered:
        _C.cuda.host_unregister(base + off, 0)

    # a graph captured while another thread registers a slab
    a = torch.randn(1024, 1024, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.mm(a, a)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    go, done = threading.Event(), threading.Event()
    error = []

    def register_once() -> None:
        go.wait()
        try:
            _C.cuda.host_register(base, slab, 0)
            _C.cuda.host_unregister(base, 0)
        except Exception as e:  # noqa: BLE001 - reported
            error.append(repr(e))
        done.set()

    t = threading.Thread(target=register_once)
    t.start()
    try:
        with torch.cuda.graph(g):
            for _ in range(200):
                torch.mm(a, a)
            go.set()
            done.wait(30)
            for _ in range(200):
                torch.mm(a, a)
        g.replay()
        torch.cuda.synchronize()
        out["capture"] = "survived" + (f" (the registration failed: {error[0]})" if error else "")
    except Exception as e:  # noqa: BLE001 - the finding
        out["capture"] = f"broken: {e!r}"[:300] + (f"; registration: {error[0]}" if error else "")
    t.join()
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
