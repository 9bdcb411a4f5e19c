"""The local-disk L2 tier against the disk it runs on, all measured in one run on one directory.

  ceiling   `dd` with O_DIRECT of the same bytes in objects of the same size (write, then read)
  tier      the disk tier alone (_C.DiskStore): a batch put of N objects from host memory, then a
            batch get back into it, byte-exact; GB/s and the ratio to the ceiling
  prefetch  a server in its own process whose chunks are only on disk (it was restarted): a
            lookup with lock of 1, 8 and 64 chunks, which loads them into L1 before it answers
  restore   that server's disk chunks retrieved end to end into the worker's KV cache (GPU blocks
            with --device cuda): a whole prefix of --prefix-tokens, GB/s against the read ceiling

    python bench/bench_l2.py --dir /mnt/nvme/bench [--device cpu|cuda] [--objects 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from lmcache_mp import Client, chunk_hashes
from lmcache_mp.native import HostArena

MiB = 1 << 20
LLAMA = dict(layers=32, heads=8, head_size=128)  # Llama-3-8B: 32 MiB per 256-token chunk in bf16
CHUNK = 256


def dd_ceiling(directory: str, object_bytes: int, count: int) -> dict:
    """dd with O_DIRECT, one file of count objects: write GB/s, then read GB/s."""
    path = os.path.join(directory, "dd-ceiling")
    bs = f"{object_bytes // MiB}M"

    def rate(args) -> float:
        out = subprocess.run(["dd", *args, f"bs={bs}", f"count={count}"], capture_output=True, text=True,
                             check=True).stderr
        m = re.search(r"(\d+) bytes .* copied, ([0-9.]+) s", out)
        return int(m.group(1)) / float(m.group(2)) / 1e9

    try:
        w = rate(["if=/dev/zero", f"of={path}", "oflag=direct", "conv=fsync"])
        r = rate([f"if={path}", "of=/dev/null", "iflag=direct"])
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return {"write_GBps": w, "read_GBps": r}


def tier_alone(directory: str, object_bytes: int, count: int, io_threads: int) -> dict:
    from lmcache_mp import _C

    path = os.path.join(directory, "tier")
    slab = max(object_bytes, 64 * MiB) // object_bytes * object_bytes  # whole objects, page multiples
    arena = HostArena(-(-count * object_bytes // slab) * slab, slab, False, -1)
    cls = arena.size_class(object_bytes)
    offs = [arena.allocate(cls) for _ in range(count)]
    rng = np.random.default_rng(0)
    want = []
    for o in offs:
        v = np.frombuffer(arena.view(o, object_bytes), dtype=np.uint8)
        v[:] = rng.integers(0, 256, object_bytes, dtype=np.uint8)
        want.append(v.copy())
    store = _C.DiskStore(path, 2 * count * (object_bytes + 4096), io_threads)
    keys = [f"k{i}".encode() for i in range(count)]
    fmts = [b"bench"] * count
    ptrs = [arena.base + o for o in offs]
    t0 = time.perf_counter()
    ok = store.put(keys, fmts, ptrs, [object_bytes] * count)
    t_write = time.perf_counter() - t0
    assert all(ok), store.stats()["last_error"]
    os.sync()
    for o in offs:
        np.frombuffer(arena.view(o, object_bytes), dtype=np.uint8)[:] = 0
    t0 = time.perf_counter()
    got = store.get(keys, fmts, ptrs, [object_bytes] * count)
    t_read = time.perf_counter() - t0
    exact = all(g == object_bytes for g in got) and all(
        np.array_equal(np.frombuffer(arena.view(o, object_bytes), dtype=np.uint8), w) for o, w in zip(offs, want))
    st = store.stats()
    del store
    shutil.rmtree(path, ignore_errors=True)
    total = count * object_bytes
    return {"write_GBps": total / t_write / 1e9, "read_GBps": total / t_read / 1e9, "exact": exact,
            "direct_writes": st["direct_writes"], "direct_reads": st["direct_reads"]}


class ServerProc:
    def __init__(self, args: list[str]):
        self.proc = subprocess.Popen([sys.executable, "-m", "lmcache_mp.server.cli", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in self.proc.stdout:
            if "ready: serving on" in line:
                self.url = line.split("serving on ")[1].strip()
                return
        raise RuntimeError("the server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(120)


def make_kv(device: str, num_blocks: int, layers: int):
    import torch

    from lmcache_mp import shared_cpu_tensor

    shape = (2, num_blocks, 16, LLAMA["heads"], LLAMA["head_size"])
    if device == "cuda":
        kv = [torch.empty(shape, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
        for t in kv:
            t.view(torch.int16).random_()
        return kv
    kv = [shared_cpu_tensor(shape, torch.bfloat16) for _ in range(layers)]
    for t in kv:
        t.view(torch.int16).random_()
    return kv


def through_server(directory: str, device: str, l1: str, prefix_tokens: int, repeat: int, layers: int) -> dict:
    import torch

    path = os.path.join(directory, "server-l2")
    url = f"ipc://{tempfile.mkdtemp()}/s.sock"
    args = ["--url", url, "--device", device, "--l1-size", l1, "--l2-disk", path, "--l2-write", "all",
            "--prefetch-timeout", "30"]
    n_prefix = prefix_tokens // CHUNK
    sizes = (1, 8, 64)
    prompts = {k: [np.random.default_rng(1000 * k + r).integers(0, 50000, k * CHUNK) for r in range(repeat)]
               for k in sizes}
    prefix = np.random.default_rng(7).integers(0, 50000, n_prefix * CHUNK)
    bpc = CHUNK // 16
    num_blocks = 2 * max(64, n_prefix) * bpc
    kv = make_kv(device, num_blocks, layers)
    srv = ServerProc(args)
    try:  # store everything, written through to disk
        c = Client(srv.url, timeout=300)
        while not c.status()["l1"]["pinning"]["done"]:  # L1 memory comes as it is pinned
            time.sleep(0.1)
        h = c.register_kv_cache(kv, model="bench", layout="mha")
        for p_ in [prefix] + [p_ for k in sizes for p_ in prompts[k]]:
            n = len(p_) // CHUNK
            hashes = chunk_hashes(p_, CHUNK)
            for end in range(min(n, 16), n + 16, 16):  # the write queue holds less than a long prompt
                end = min(end, n)
                got = c.store(h, hashes[:end], np.arange(end * bpc)).result()
                assert got.chunks == end, got
                while not c.status()["l2"]["idle"]:
                    time.sleep(0.01)
        written = sum(len(p_) // CHUNK for k in sizes for p_ in prompts[k]) + n_prefix
        assert c.status()["l2"]["written"] == written, c.status()["l2"]
        c.close()
    finally:
        srv.stop()
    srv = ServerProc(args)  # L1 is empty: every chunk is on disk only
    out: dict = {}
    try:
        c = Client(srv.url, timeout=300)
        while not c.status()["l1"]["pinning"]["done"]:
            time.sleep(0.1)
        h = c.register_kv_cache(kv, model="bench", layout="mha")
        for k in sizes:
            lat = []
            for p_ in prompts[k]:
                t0 = time.perf_counter()
                found = c.lookup(chunk_hashes(p_, CHUNK), model="bench", lock=True)
                lat.append(time.perf_counter() - t0)
                assert found == k, (found, k)
                c.release(lease=found)
            out[f"prefetch_{k}_ms_p50"] = statistics.median(lat) * 1e3
        if device == "cuda":
            torch.cuda.synchronize()
        dst = np.arange(n_prefix * bpc, 2 * n_prefix * bpc)
        t0 = time.perf_counter()
        got = c.retrieve(h, chunk_hashes(prefix, CHUNK), dst).result().loaded
        dt = time.perf_counter() - t0
        assert got == n_prefix, got
        nbytes = n_prefix * 2 * layers * CHUNK * LLAMA["heads"] * LLAMA["head_size"] * 2
        out.update(restore_tokens=n_prefix * CHUNK, restore_bytes=nbytes, restore_s=dt, restore_GBps=nbytes / dt / 1e9)
        out["server_l2"] = c.status()["l2"]
        c.close()
    finally:
        srv.stop()
        shutil.rmtree(path, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="a directory on the disk to measure")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--objects", type=int, default=64, help="objects of the tier and ceiling runs")
    ap.add_argument("--object-mib", type=int, default=32)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=32768)
    ap.add_argument("--l1-size", default="16GiB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--layers", type=int, default=LLAMA["layers"], help="of the server runs' KV cache (1 MiB each "
                    "per 256-token chunk)")
    ap.add_argument("--json")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    obj = args.object_mib * MiB
    ceiling = dd_ceiling(args.dir, obj, args.objects)
    print(f"dd O_DIRECT ceiling ({args.objects} x {args.object_mib} MiB): write {ceiling['write_GBps']:.2f} GB/s, "
          f"read {ceiling['read_GBps']:.2f} GB/s", flush=True)
    tier = tier_alone(args.dir, obj, args.objects, args.io_threads)
    print(f"disk tier: write {tier['write_GBps']:.2f} GB/s ({tier['write_GBps'] / ceiling['write_GBps']:.2f}x), "
          f"read {tier['read_GBps']:.2f} GB/s ({tier['read_GBps'] / ceiling['read_GBps']:.2f}x), "
          f"byte-exact {tier['exact']}, O_DIRECT writes {tier['direct_writes']} reads {tier['direct_reads']}",
          flush=True)
    srv = through_server(args.dir, args.device, args.l1_size, args.prefix_tokens, args.repeat, args.layers)
    print("lookup with lock, chunks only on disk (p50): " + ", ".join(
        f"{k} chunk(s) {srv[f'prefetch_{k}_ms_p50']:.1f} ms" for k in (1, 8, 64)))
    print(f"restore of a {srv['restore_tokens']}-token prefix from disk into the {args.device} KV cache: "
          f"{srv['restore_s'] * 1e3:.0f} ms, {srv['restore_GBps']:.2f} GB/s "
          f"({srv['restore_GBps'] / ceiling['read_GBps']:.2f}x the disk's read ceiling)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "bench_l2", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "config": vars(args),
                       "ceiling": ceiling, "tier": tier, "server": srv}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
