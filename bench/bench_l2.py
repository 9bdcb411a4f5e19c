"""An L2 tier against its ceiling measured in the same run: the local disk, or a Valkey server (or
a cluster of --cluster N primaries) or Mooncake Store started here on loopback (--backend).

  ceiling   disk: `dd` with O_DIRECT of the same bytes in objects of the same size (write, then
            read); network: one raw loopback TCP stream of the same bytes to a reader that drops
            them (the median of three; N streams at once are shown beside it for a cluster)
  tier      the tier alone: a batch put of N objects from host (arena) memory, then a batch get
            back into it, byte-exact; GB/s and the ratio to the ceiling (network: the median of
            --tier-runs batches, and how a cluster's primaries shared the batch). Network: also a
            lookup of 64 chunks (one round trip per node) beside the smallest request's round trip
  prefetch  a server in its own process whose chunks are only in L2 (disk: it was restarted;
            network: a second server, another node, with its own empty L1): a lookup with lock of
            1, 8 and 64 chunks, which loads them into L1 before it answers
  restore   that server's L2 chunks retrieved end to end into the worker's KV cache (GPU blocks
            with --device cuda): a whole prefix of --prefix-tokens, GB/s against the read ceiling

    python bench/bench_l2.py --dir /mnt/nvme/bench [--device cpu|cuda] [--objects 64] [--json out.json]
    python bench/bench_l2.py --backend valkey|mooncake [--objects 16] [--prefix-tokens 8192] [--repeat 2]
    python bench/bench_l2.py --backend valkey --cluster 3 --objects 48 --tier-only --json out.json
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_resp import free_port, raw_tcp, start_valkey, start_valkey_cluster  # noqa: E402
from server_process import ServerProcess  # noqa: E402

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


class ServerProc(ServerProcess):
    def __init__(self, args: list[str]):
        super().__init__(args)
        self.wait_ready()


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


POOL = """
import sys, time
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
assert s.setup("127.0.0.1", sys.argv[2], int(sys.argv[3]), 16 << 20, "tcp", "", sys.argv[1]) == 0
print("ready", flush=True)
time.sleep(3600)
"""


class Backend:
    """A network L2 started here on loopback: the server flags that reach it and the tier itself."""

    def __init__(self, kind: str, work: str, arena_bytes: int, valkey_io_threads: int = 1, cluster: int = 0):
        self.kind, self.procs = kind, []
        if kind == "valkey" and cluster:
            procs, ports = start_valkey_cluster(cluster, work, maxmemory="24gb", io_threads=valkey_io_threads)
            self.procs += procs
            self.url = "redis://" + ",".join(f"127.0.0.1:{p}" for p in ports)
            self.args = ["--l2-redis", self.url, "--l2-redis-cluster", "true"]
        elif kind == "valkey":
            port = free_port()
            self.procs.append(start_valkey(port, work, maxmemory="24gb", io_threads=valkey_io_threads))
            self.url = f"redis://127.0.0.1:{port}"
            self.args = ["--l2-redis", self.url]
        else:
            import mooncake.store

            rpc, http, metrics = free_port(), free_port(), free_port()
            exe = os.path.join(os.path.dirname(mooncake.store.__file__), "mooncake_master")
            self.procs.append(subprocess.Popen([exe, f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
                                                f"--http_metadata_server_port={http}",
                                                "--http_metadata_server_host=127.0.0.1", f"--metrics_port={metrics}"],
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            self.master, self.metadata = f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata"
            self.args = ["--l2-mooncake", self.master, "--l2-mooncake-metadata", self.metadata]
            _wait_for(lambda: _listens(rpc) and _listens(http), 20, "mooncake_master")
            # the pool's memory, in a process of its own: the tier's bytes cross a socket as between nodes
            pool = subprocess.Popen([sys.executable, "-c", POOL, self.master, self.metadata,
                                     str(2 * arena_bytes + 256 * MiB)], stdout=subprocess.PIPE, text=True,
                                    env=dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1"))
            self.procs.append(pool)
            if pool.stdout.readline().strip() != "ready":
                raise RuntimeError("the Mooncake memory process did not start")

    def tier(self, arena, connections: int):
        if self.kind == "valkey":
            from lmcache_mp.storage.l2.valkey import ValkeyTier

            return ValkeyTier(self.url, prefix="bench", connections=connections, cluster="," in self.url)
        from lmcache_mp.storage.l2.mooncake import MooncakeTier

        t = MooncakeTier(self.master, self.metadata, arena, 0, prefix="bench")  # contributes no memory
        _wait_for(lambda: t.stats()["connected"], 30, "the Mooncake set-up")
        return t

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait(10)


def _listens(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def raw_tcp_streams(nbytes: int, count: int, buf: np.ndarray, streams: int) -> float:
    """GB/s of `streams` raw loopback TCP streams at once, count values of nbytes in all."""
    import threading

    rates: list[float] = []
    t0 = time.perf_counter()
    threads = [threading.Thread(target=lambda: rates.append(raw_tcp(nbytes, max(1, count // streams), buf)))
               for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return streams * max(1, count // streams) * nbytes / (time.perf_counter() - t0) / 1e9


def network_tier(backend: Backend, object_bytes: int, count: int, connections: int, runs: int = 3) -> dict:
    """Batch puts of count objects from arena slots and batch gets back (header and checksum
    included), byte-exact, after a few untimed ones that warm the connections up (TCP buffers
    grow with use; a running server's pooled connections are warm): the median of `runs`. Then a
    lookup of 64 chunks beside a lookup of 1 (one round trip each)."""
    arena = HostArena(2 * count * object_bytes, object_bytes, False, -1)
    cls = arena.size_class(object_bytes)
    src = [arena.allocate(cls) for _ in range(count)]
    dst = [arena.allocate(cls) for _ in range(count)]
    rng = np.random.default_rng(0)
    for o in src:
        np.frombuffer(arena.view(o, object_bytes), dtype=np.uint8)[:] = rng.integers(0, 256, object_bytes,
                                                                                    dtype=np.uint8)
    tier = backend.tier(arena, connections)
    keys = [b"chunk-%d" % i for i in range(count)]
    fmts, sizes = [b"bench"] * count, [object_bytes] * count
    warm = [b"warm-%d" % i for i in range(min(count, 4 * len(getattr(tier, "_seeds", [1]))))]
    tier.put(warm, fmts[:len(warm)], [arena.base + o for o in src[:len(warm)]], sizes[:len(warm)])
    tier.get(warm, fmts[:len(warm)], [arena.base + o for o in dst[:len(warm)]], sizes[:len(warm)])
    puts, gets, exact = [], [], True
    for _ in range(runs):
        for o in dst:  # touched, as the server's L1 is: no page faults in the measurement
            np.frombuffer(arena.view(o, object_bytes), dtype=np.uint8)[:] = 0
        t0 = time.perf_counter()
        ok = tier.put(keys, fmts, [arena.base + o for o in src], sizes)
        puts.append(time.perf_counter() - t0)
        assert all(ok), tier.stats()
        t0 = time.perf_counter()
        got = tier.get(keys, fmts, [arena.base + o for o in dst], sizes)
        gets.append(time.perf_counter() - t0)
        assert got == sizes, (got, tier.stats())
        exact = exact and all(np.array_equal(np.frombuffer(arena.view(a, object_bytes), dtype=np.uint8),
                                             np.frombuffer(arena.view(b, object_bytes), dtype=np.uint8))
                              for a, b in zip(src, dst))
    spread = {}
    if getattr(tier, "cluster", False):  # how the batch's keys fell on the primaries
        for k in keys:
            addr = "%s:%d" % tier._addr_of(tier._key(k))
            spread[addr] = spread.get(addr, 0) + 1
    many = [b"lookup-%d" % i for i in range(64)]  # distinct keys (a lookup reads only the header)
    assert all(tier.put(many, [b"bench"] * 64, [arena.base + src[0]] * 64, [4096] * 64))
    lat64, lat1 = [], []
    for _ in range(50):
        t0 = time.perf_counter()
        assert all(tier.lookup(many))
        lat64.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        assert all(tier.lookup(keys[:1]))
        lat1.append(time.perf_counter() - t0)
    tier.close()
    total = count * object_bytes
    return {"put_GBps": total / statistics.median(puts) / 1e9, "get_GBps": total / statistics.median(gets) / 1e9,
            "put_GBps_runs": [total / t / 1e9 for t in puts], "get_GBps_runs": [total / t / 1e9 for t in gets],
            "exact": exact, "keys_per_primary": spread,
            "lookup64_ms_p50": statistics.median(lat64) * 1e3, "lookup1_ms_p50": statistics.median(lat1) * 1e3}


def print_table(rows: list[tuple[str, float | None, float | None, str]]) -> None:
    """(what, GB/s, x ceiling, note) rows."""
    width = max(len(r[0]) for r in rows)
    print(f"{'what':{width}s}  {'GB/s':>6s}  {'x ceiling':>9s}  note")
    for what, rate, ratio, note in rows:
        print(f"{what:{width}s}  {'' if rate is None else f'{rate:6.2f}':>6s}  "
              f"{'' if ratio is None else f'{ratio:9.2f}':>9s}  {note}")


def through_server(l2_args: list[str], device: str, l1: str, prefix_tokens: int, repeat: int, layers: int,
                   restart: bool) -> dict:
    """Server A stores every prompt and writes it through to L2; server B (A restarted on the same
    disk, or a second node beside A) has an empty L1 and is measured."""
    import torch

    url = f"ipc://{tempfile.mkdtemp()}/s.sock"
    common = ["--device", device, "--l1-size", l1, *l2_args, "--l2-write", "all", "--prefetch-timeout", "30"]
    n_prefix = prefix_tokens // CHUNK
    sizes = (1, 8, 64)
    prompts = {k: [np.random.default_rng(1000 * k + r).integers(0, 50000, k * CHUNK) for r in range(repeat)]
               for k in sizes}
    prefix = np.random.default_rng(7).integers(0, 50000, n_prefix * CHUNK)
    bpc = CHUNK // 16
    num_blocks = 2 * max(64, n_prefix) * bpc
    kv = make_kv(device, num_blocks, layers)
    first = ServerProc(["--url", url, *common])
    try:  # store everything, written through to L2
        c = Client(first.url, timeout=300)
        while not c.status()["l1"]["pinning"]["done"]:  # L1 memory comes as it is pinned
            time.sleep(0.1)
        while not all(t.get("connected", True) for t in c.status()["l2"]["tiers"]):
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
        if restart:
            first.stop()
        srv = ServerProc(["--url", url if restart else f"ipc://{tempfile.mkdtemp()}/s.sock", *common])
    except BaseException:
        first.stop()
        raise
    out: dict = {}
    try:
        c = Client(srv.url, timeout=300)
        while not c.status()["l1"]["pinning"]["done"]:
            time.sleep(0.1)
        while not all(t.get("connected", True) for t in c.status()["l2"]["tiers"]):
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
        if not restart:
            first.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("disk", "valkey", "mooncake"), default="disk")
    ap.add_argument("--dir", help="disk: a directory on the disk to measure")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--objects", type=int, default=64, help="objects of the tier and ceiling runs")
    ap.add_argument("--object-mib", type=int, default=32)
    ap.add_argument("--io-threads", type=int, default=4, help="disk tier threads; valkey connections")
    ap.add_argument("--prefix-tokens", type=int, default=32768)
    ap.add_argument("--l1-size", default="16GiB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--layers", type=int, default=LLAMA["layers"], help="of the server runs' KV cache (1 MiB each "
                    "per 256-token chunk)")
    ap.add_argument("--valkey-io-threads", type=int, default=1, help="valkey-server's io-threads")
    ap.add_argument("--cluster", type=int, default=0, help="valkey: a cluster of this many primaries (no replicas)")
    ap.add_argument("--tier-runs", type=int, default=3, help="network: batches put and got (the median is shown)")
    ap.add_argument("--tier-only", action="store_true", help="network: the tier alone, no server runs")
    ap.add_argument("--json")
    args = ap.parse_args()
    obj = args.object_mib * MiB
    if args.cluster and args.backend != "valkey":
        ap.error("--cluster is for --backend valkey")
    if args.backend == "disk":
        if not args.dir:
            ap.error("--backend disk needs --dir")
        os.makedirs(args.dir, exist_ok=True)
        ceiling = dd_ceiling(args.dir, obj, args.objects)
        read_ceiling = ceiling["read_GBps"]
        print(f"dd O_DIRECT ceiling ({args.objects} x {args.object_mib} MiB): write {ceiling['write_GBps']:.2f} "
              f"GB/s, read {read_ceiling:.2f} GB/s", flush=True)
        tier = tier_alone(args.dir, obj, args.objects, args.io_threads)
        print(f"disk tier: write {tier['write_GBps']:.2f} GB/s ({tier['write_GBps'] / ceiling['write_GBps']:.2f}x), "
              f"read {tier['read_GBps']:.2f} GB/s ({tier['read_GBps'] / read_ceiling:.2f}x), "
              f"byte-exact {tier['exact']}, O_DIRECT writes {tier['direct_writes']} reads {tier['direct_reads']}",
              flush=True)
        path = os.path.join(args.dir, "server-l2")
        try:
            srv = through_server(["--l2-disk", path], args.device, args.l1_size, args.prefix_tokens, args.repeat,
                                 args.layers, restart=True)
        finally:
            shutil.rmtree(path, ignore_errors=True)
    else:
        work = tempfile.mkdtemp()
        backend = Backend(args.backend, work, args.objects * obj, args.valkey_io_threads, args.cluster)
        try:
            buf = np.random.default_rng(0).integers(0, 256, obj, dtype=np.uint8)
            read_ceiling = statistics.median(raw_tcp(obj, args.objects, buf) for _ in range(3))
            ceiling = {"tcp_GBps": read_ceiling}
            if args.cluster > 1:
                ceiling[f"tcp_{args.cluster}_streams_GBps"] = raw_tcp_streams(obj, args.objects, buf, args.cluster)
            tier = network_tier(backend, obj, args.objects, args.io_threads, args.tier_runs)
            name = f"valkey cluster of {args.cluster}" if args.cluster else args.backend
            rows = [(f"one raw loopback TCP stream ({args.objects} x {args.object_mib} MiB)", read_ceiling, 1.0,
                     "the ceiling (median of 3)")]
            if args.cluster > 1:
                n = ceiling[f"tcp_{args.cluster}_streams_GBps"]
                rows.append((f"{args.cluster} raw streams at once", n, n / read_ceiling, "for comparison"))
            note = f"median of {args.tier_runs}; {args.io_threads} connections per node; byte-exact {tier['exact']}"
            rows += [(f"{name} tier: put one batch", tier["put_GBps"], tier["put_GBps"] / read_ceiling, note),
                     (f"{name} tier: get one batch", tier["get_GBps"], tier["get_GBps"] / read_ceiling, note)]
            print_table(rows)
            if tier["keys_per_primary"]:
                print("keys of the batch per primary: " + ", ".join(
                    f"{a} {n}" for a, n in sorted(tier["keys_per_primary"].items())))
            print(f"lookup of 64 chunks {tier['lookup64_ms_p50']:.3f} ms p50, of 1 chunk "
                  f"{tier['lookup1_ms_p50']:.3f} ms", flush=True)
            srv = None
            if not args.tier_only:
                stored = (args.prefix_tokens // CHUNK + args.repeat * 73) * 2 * args.layers * CHUNK * 8 * 128 * 2
                extra = ["--l2-mooncake-segment", str(stored + stored // 4)] if args.backend == "mooncake" else []
                srv = through_server(backend.args + extra, args.device, args.l1_size, args.prefix_tokens,
                                     args.repeat, args.layers, restart=False)
        finally:
            backend.stop()
            shutil.rmtree(work, ignore_errors=True)
    if srv is None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"bench": "bench_l2", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "config": vars(args),
                           "ceiling": ceiling, "tier": tier}, f, indent=1, default=str)
        return 0 if tier["exact"] else 1
    where = "disk" if args.backend == "disk" else f"{args.backend} (written by another node)"
    print(f"lookup with lock, chunks only in L2 on {where} (p50): " + ", ".join(
        f"{k} chunk(s) {srv[f'prefetch_{k}_ms_p50']:.1f} ms" for k in (1, 8, 64)))
    print(f"restore of a {srv['restore_tokens']}-token prefix from {args.backend} into the {args.device} KV cache: "
          f"{srv['restore_s'] * 1e3:.0f} ms, {srv['restore_GBps']:.2f} GB/s "
          f"({srv['restore_GBps'] / read_ceiling:.2f}x the read ceiling)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "bench_l2", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "config": vars(args),
                       "ceiling": ceiling, "tier": tier, "server": srv}, f, indent=1, default=str)
    return 0 if tier["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
