"""End to end through the server: real worker processes register KV caches (CUDA IPC, or shared
memory on the CPU device) and store, look up and retrieve whole requests through `Client`.

This script starts one server process (`python -m lmcache_mp.server.cli`) that serves every run,
measures a ceiling, and then runs the load generator of `lmcache-mp-bench` (lmcache_mp.loadgen)
once per worker count. For each run the workers are fresh spawned processes, spread round-robin
over --gpus GPUs, each seeing only its own GPU (CUDA_VISIBLE_DEVICES=<that GPU's UUID>; the
server sees them all and maps caches to its devices by UUID). Each worker fills its KV cache with
random bits and then, phases separated by barriers:

  store     --requests requests of --chunks chunks each (distinct tokens -> distinct chunk hashes),
            one at a time, each from a different permutation of the first half of the blocks
  lookup    --lookups lookups of --chunks hashes each
  retrieve  every stored request into the second half of the blocks (wait="host")

then checks every retrieved request bit for bit against its source blocks (the last timed
retrieve in place, the others retrieved again untimed). Aggregate GB/s of a phase = bytes moved
by all workers / the slowest worker's phase wall time. The ceiling, measured in this process
before the workers start: a contiguous pinned cudaMemcpyAsync of one request's bytes per GPU
used (several GPUs at once, one thread and stream each), or a NumPy copy on the CPU device.

    python bench/bench_server.py [--device cuda|cpu] [--workers 1,2,4] [--gpus 1] [--chunks 128]
        [--requests 4] [--layout llama3-8b|mla] [--tp] [--transfer-mode auto] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from lmcache_mp.loadgen import cli as loadgen_cli
from lmcache_mp.loadgen import runs as loadgen
from lmcache_mp.loadgen.trace import echo_peer
from lmcache_mp.loadgen.worker import LAYOUTS, WARM_UP, object_bytes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import server_process  # noqa: E402

CHUNK = 256
SLAB = 256 << 20
SLOT_ALIGN = 256  # the arena's slot alignment (csrc/host_arena.cpp)
GiB = 1 << 30


# ---- ceilings ---------------------------------------------------------------------------------

class GpuMemcpy:
    """One GPU's contiguous pinned copy of one request's bytes, on its own stream."""

    def __init__(self, index: int, nbytes: int):
        import torch

        self.index = index
        with torch.cuda.device(index):
            self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self.dev = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{index}")
            self.stream = torch.cuda.Stream(device=index)
            self.host.fill_(1)
            self.dev.fill_(2)
            torch.cuda.synchronize(index)

    def run(self, direction: str) -> None:
        import torch

        with torch.cuda.device(self.index), torch.cuda.stream(self.stream):
            if direction == "d2h":
                self.host.copy_(self.dev, non_blocking=True)
            else:
                self.dev.copy_(self.host, non_blocking=True)
        self.stream.synchronize()


def _median_seconds(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gpu_ceilings(gpus: int, counts: list[int], nbytes: int, repeat: int) -> dict:
    """GB/s of one GPU alone (each GPU), and of the first k GPUs copying at once (each k used)."""
    import torch

    copies = [GpuMemcpy(g, nbytes) for g in range(gpus)]
    out: dict = {"bytes_per_gpu": nbytes, "single": [], "concurrent": {}}
    pool = ThreadPoolExecutor(max(1, gpus))

    def together(group: list, direction: str) -> None:
        for f in [pool.submit(cp.run, direction) for cp in group]:
            f.result()

    def gbps(group: list, direction: str) -> float:
        return len(group) * nbytes / _median_seconds(lambda: together(group, direction), repeat) / 1e9

    try:
        out["single"] = [{d: gbps([cp], d) for d in ("d2h", "h2d")} for cp in copies]
        for k in sorted(set(counts)):
            out["concurrent"][k] = (dict(out["single"][0]) if k == 1
                                    else {d: gbps(copies[:k], d) for d in ("d2h", "h2d")})
    finally:
        pool.shutdown()
        copies.clear()  # free the buffers before the workers need the memory
        for g in range(gpus):
            with torch.cuda.device(g):
                torch.cuda.empty_cache()
        empty_host = getattr(torch._C, "_host_emptyCache", None)
        if empty_host is not None:
            empty_host()  # torch keeps freed pinned blocks cached otherwise
    return out


def cpu_ceiling(nbytes: int, repeat: int) -> dict:
    src = np.full(nbytes, 1, dtype=np.uint8)
    dst = np.full(nbytes, 2, dtype=np.uint8)
    gbps = nbytes / _median_seconds(lambda: np.copyto(dst, src), repeat) / 1e9
    return {"bytes_per_gpu": nbytes, "single": [], "concurrent": {1: {"d2h": gbps, "h2d": gbps}}}


# ---- the server process -----------------------------------------------------------------------

class ServerProcess(server_process.ServerProcess):
    def __init__(self, args, l1_bytes: int, slab_bytes: int, env: dict):
        self.dir = tempfile.mkdtemp(prefix="lmcache-bench-")
        flags = ["--url", f"ipc://{self.dir}/server.sock", "--device", args.device, "--l1-size", str(l1_bytes),
                 "--slab-size", str(slab_bytes), "--chunk-size", str(CHUNK), "--transfer-mode", args.transfer_mode,
                 "--log-level", "INFO"]
        self.persist = os.path.join(args.l1_persist, f"lmcache-bench-arena-{os.getpid()}") if args.l1_persist else ""
        if self.persist:
            flags += ["--l1-persist", self.persist]
        super().__init__(flags, log_path=os.path.join(self.dir, "server.log"), env=env)
        self.client = None

    def connect(self, within: float):
        self.client = super().connect(within, timeout=60, name="bench-parent")
        return self.client

    def wait_pinned(self, within: float) -> dict:
        return super().wait_pinned(self.client, within, lambda pin: print(
            f"  pinning L1: {pin.get('bytes_pinned', 0) / GiB:.1f} of {pin.get('bytes_total', 0) / GiB:.1f} GiB",
            flush=True))

    def stop(self) -> dict:
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()
        rc = super().stop(60)
        for path in (self.persist, self.persist + ".journal") if self.persist else ():
            with contextlib.suppress(OSError):
                os.unlink(path)
        text = open(self.log_path).read()
        return {"exit_code": rc, "tracebacks": text.count("Traceback"),
                "error_lines": sum(1 for ln in text.splitlines() if " ERROR " in ln), "log": self.log_path}


# ---- main -------------------------------------------------------------------------------------

def l1_plan(args, obj: int) -> tuple[int, int, int]:
    """(L1 bytes, slab bytes, objects) so that every worker's stored chunks fit at once."""
    slab = max(SLAB, -(-obj // 4096) * 4096)
    slot = -(-obj // SLOT_ALIGN) * SLOT_ALIGN
    per_slab = slab // slot
    objects = max(args.workers) * (args.requests * args.chunks + WARM_UP)  # + the warm-up chunks
    slabs = max(4, math.ceil(objects / per_slab) + 1)
    return slabs * slab, slab, objects


def journal_caught_up(client, timeout: float = 300) -> dict:
    """With --l1-persist: how long after the run the journal had recorded every commit, and the
    rate of the checksums behind it (since the server started)."""
    t0 = time.monotonic()
    while True:
        l1 = client.status()["l1"]
        if l1["journal_backlog"] == 0 or time.monotonic() - t0 > timeout:
            break
        time.sleep(0.01)
    return {"lag_s": time.monotonic() - t0, "backlog": l1["journal_backlog"],
            "summed_GiB": l1["summed_bytes"] / GiB, "summed_by_stores": l1.get("summed_by_stores", 0),
            "sum_GBps": l1["summed_bytes"] / l1["sum_seconds"] / 1e9 if l1["sum_seconds"] else 0.0}


def mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--workers", default="1,2,4", help="worker counts, one run each (default 1,2,4)")
    ap.add_argument("--gpus", type=int, default=1, help="spread the workers round-robin over this many GPUs")
    ap.add_argument("--chunks", type=int, default=128, help=f"chunks of {CHUNK} tokens per request")
    ap.add_argument("--requests", type=int, default=4, help="requests stored and retrieved per worker")
    ap.add_argument("--lookups", type=int, default=200)
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="llama3-8b")
    ap.add_argument("--layers", type=int, help="override the layout's layer count")
    ap.add_argument("--tp", action="store_true",
                    help="the workers are TP ranks of one model (default: separate models)")
    ap.add_argument("--l1-size", default=None, help="server L1 (default: enough for every stored chunk)")
    ap.add_argument("--transfer-mode", default="auto", choices=("auto", "direct", "staged", "dma"))
    ap.add_argument("--repeat", type=int, default=5, help="ceiling: timed copies (median)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds a worker waits on a request or barrier")
    loadgen_cli.add_tail_args(ap)
    ap.add_argument("--l1-persist", metavar="DIR", help="the server keeps L1 in a file in DIR (e.g. /dev/shm) "
                    "with its journal; each run reports how fast the journal's checksums were taken")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    args.workers = [int(w) for w in str(args.workers).split(",") if w.strip()]
    if not args.workers or min(args.workers) < 1 or args.chunks < 1 or args.requests < 1 or args.gpus < 1:
        ap.error("--workers, --chunks, --requests and --gpus must be positive")

    from lmcache_mp.config import format_size, parse_size
    from lmcache_mp.native import build_info

    loadgen.worker_env_defaults()
    lay = loadgen.geometry(args.layout, args.layers)
    obj = object_bytes(lay, CHUNK)
    req_bytes = args.chunks * obj
    l1, slab, objects = l1_plan(args, obj)
    if args.l1_size:
        given = parse_size(args.l1_size)
        if given < l1:
            print(f"warning: --l1-size {format_size(given)} is less than the {format_size(l1)} that holds every "
                  "stored chunk: evictions will show up as missing chunks", file=sys.stderr)
        l1 = given
    need = l1 + (args.gpus * req_bytes if args.device == "cuda" else 2 * req_bytes)
    if args.device == "cpu":
        need += max(args.workers) * (2 * req_bytes + obj)  # the workers' KV caches in shared memory
    avail = mem_available()
    if need > 0.85 * avail:
        print(f"error: this run needs about {format_size(need)} of host memory (L1 {format_size(l1)}), "
              f"{format_size(avail)} is available: lower --requests, --chunks or the worker count",
              file=sys.stderr)
        return 2

    uuids: list[str] = []
    gpu_names: list[str] = []
    if args.device == "cuda":
        try:
            uuids, gpu_names = loadgen.gpu_uuids(args.gpus)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    else:
        args.gpus = 1

    print(loadgen.banner(args, obj, req_bytes, gpu_names), flush=True)
    print(f"server: L1 {format_size(l1)} (slabs of {format_size(slab)}, for {objects} chunks), "
          f"transfer mode {args.transfer_mode}", flush=True)

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    server = ServerProcess(args, l1, slab, env)
    rows, runs, exit_code = [], [], 0
    result: dict = {}
    stack = contextlib.ExitStack()
    try:
        client = server.connect(120)
        t0 = time.monotonic()
        pin = server.wait_pinned(900)
        status = client.status()
        if pin.get("error"):
            print(f"warning: pinning L1 reported {pin['error']}", file=sys.stderr)
        print(f"server ready: pinned {pin.get('bytes_pinned', 0) / GiB:.1f} GiB in "
              f"{time.monotonic() - t0:.1f} s", flush=True)

        counts = sorted({min(w, args.gpus) for w in args.workers})
        if args.device == "cuda":
            ceilings = gpu_ceilings(args.gpus, counts, req_bytes, args.repeat)
        else:
            ceilings = cpu_ceiling(req_bytes, args.repeat)
        for k, c in sorted(ceilings["concurrent"].items()):
            print(f"ceiling ({'pinned cudaMemcpyAsync' if args.device == 'cuda' else 'NumPy copy'}, "
                  f"{k} GPU(s) at once): D2H {c['d2h']:.2f} GB/s, H2D {c['h2d']:.2f} GB/s", flush=True)

        modes = "?"
        echo = stack.enter_context(echo_peer())  # lookups are compared with a bare round trip to it
        for run, w in enumerate(args.workers):
            settings = loadgen.worker_settings(args, server.url, lay, f"bench-{args.layout}-run{run}", run)
            settings["echo_url"] = echo
            row, record, clean = loadgen.run_once(client, settings, w, uuids, CHUNK, ceilings)
            rows.append(row)
            runs.append(record)
            if "error" in row:
                print(f"--- server log (tail):\n{server.log_tail()}", file=sys.stderr)
                exit_code = 1
                break
            modes = row["transfer_mode"]
            if not clean:
                exit_code = 1
            if args.l1_persist:
                row["journal"] = journal_caught_up(client)
                j = row["journal"]
                print(f"  journal: every commit recorded {j['lag_s']:.2f} s after the run; checksums of "
                      f"{j['summed_GiB']:.1f} GiB at {j['sum_GBps']:.1f} GB/s in the background, "
                      f"{j['summed_by_stores']} chunks by their stores", flush=True)
            client.clear()  # the next run starts from an empty L1

        print()
        loadgen.print_table(rows, f"{loadgen.TABLE_NOTE}; x D2H / x H2D = ratio to the ceiling measured in this run")
        print(f"transfer mode (server status): {modes}")
        result = {
            "bench": "bench_server",
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "config": {**vars(args), "chunk_size": CHUNK, "object_bytes": obj, "request_bytes": req_bytes,
                       "l1_bytes": l1, "slab_bytes": slab},
            "host": {"platform": platform.platform(), "python": platform.python_version(),
                     "cpus": os.cpu_count(), "build": build_info(), "gpus": gpu_names, "gpu_uuids": uuids},
            "server": {"pinning": pin, "arena": status["l1"].get("arena"), "transfer_mode": modes},
            "ceilings": ceilings,
            "rows": rows,
            "runs": runs,
        }
    except BaseException:
        traceback.print_exc()
        print(f"--- server log (tail):\n{server.log_tail()}", file=sys.stderr)
        exit_code = 1
    finally:
        stack.close()
        stopped = server.stop()
    if stopped["exit_code"] != 0 or stopped["tracebacks"]:
        print(f"!! server exited with {stopped['exit_code']}, {stopped['tracebacks']} traceback(s) in its log "
              f"{stopped['log']}", file=sys.stderr)
        exit_code = 1
    if result:
        result["server"]["shutdown"] = stopped
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1, default=str)
            print(f"wrote {args.json}")
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
