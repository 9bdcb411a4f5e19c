"""SGLang's two ways into lmcache-mp on a GPU, in one run: the unified cache linker (device pools
<-> L1, copied by the server) against HiCache's storage tier (device pool -> HiCache's host pool ->
L1), both against a memcpy of the same bytes. Needs no sglang.

The device pool is shaped exactly like SGLang's `MHATokenToKVPool` (per layer a K and a V buffer
``[size + page_size, heads, head_dim]``, bf16; page 0 is SGLang's padding page) or, with
``--kind mla``, its `MLATokenToKVPool` (per layer ``[size + page_size, 1, 576]``). The server
runs in its own process (lmcache-mp-server), as deployed. Arms, each timed as SGLang waits for it:

- ``linker``: the pools described and registered as the linker does it (its own code:
  `sglang_linker_pools.describe_pools`, `registration_geometry`, the namespace and page keys of
  `sglang_keys`), the server mapping them (CUDA IPC; shared memory on ``--device cpu``) and
  copying. Offload: the forward's ready event, then the store of the request's pages, until the
  server says every page is in L1. Load: the retrieve of the leased pages into *other* device
  slots, as the linker's loader issues them (`sglang_linker_loads.load_batch`), until the last
  layer landed in device memory.
- ``linker-engine``: the same with ``lmcache_mp.transfer: engine`` (this process maps L1 and
  copies, its kernels in the engine's own CUDA context).
- ``linker-groups``: the linker with ``lmcache_mp.layer_groups`` (``--layer-groups``, 4): the KV
  pool registered as groups of layers, a load landing group by group; also reports when the first
  group's layers landed (when SGLang's forward could start).
- ``linker-split``: the linker with requests of ``--split`` pages each (all in flight at once)
  instead of its own size (about 32 MiB a request): with the default 64, a call of 64 pages is one
  request, as the linker sent it until 2026-12-07.
- ``hicache``: SGLang's HiCache path for the same pages. Offload: SGLang's device -> host-pool
  copy (emulated: the `layer_first` host pool ``[2, layers, tokens, heads, head_dim]`` in pinned
  memory, one torch copy per layer and K/V per run of consecutive pages, as SGLang's ``direct``
  I/O backend does), then our HiCache backend's `batch_set_v1` of those host pages (the same client
  calls: a host pool registration for engine-side copies, a store of the host pages). Load: the
  backend's `batch_get_v1` into other host pages, then the host -> device copy.
- ceiling: one contiguous pinned ``cudaMemcpyAsync`` of the same bytes, device -> host for the
  offloads and host -> device for the loads (bench_transfer.py's `Memcpy`); on ``--device cpu``
  one contiguous copy on lmcache_mp's copy threads.

Requests of 1 and 64 pages (``--pages``), interleaved rounds (medians), every load verified bit
for bit against the pages it came from. The server's L1 is fully pinned before timing.

    python bench/bench_sglang_gpu.py [--device cuda|cpu] [--kind mha|mla] [--pages 1,64]
        [--page-size 64] [--layers 32] [--heads 8] [--head-dim 128] [--repeat 7] [--quick]
        [--arms linker,linker-engine,linker-groups,hicache]
        [--layer-groups 4] [--in-flight 2] [--split 64] [--transfer-mode auto] [--trace] [--json out.json]

``--trace`` also prints where the linker arms' requests spend their time: the stage timestamps of
every store and retrieve (client and server, one clock), median and p99 per stage.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_sglang_storage import cpu_model, free_port  # noqa: E402  (no sglang import there at module level)
from server_process import ServerProcess  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from lmcache_mp import Client, _C, shared_cpu_tensor  # noqa: E402
from lmcache_mp.integration.sglang_keys import namespace, page_digest  # noqa: E402
from lmcache_mp.integration.sglang_linker_loads import IN_FLIGHT, load_batch, split_requests  # noqa: E402
from lmcache_mp.integration.sglang_linker_pools import (  # noqa: E402
    KV, describe_pools, page_rows, registration_geometry, split_layer_groups)
from lmcache_mp.integration.sglang_pages import plan_pages  # noqa: E402
from lmcache_mp.loadgen.trace import print_traces  # noqa: E402

ARMS = ("linker", "linker-engine", "linker-groups", "linker-split", "hicache")
MODEL = "bench"


class DevicePool:
    """The attributes of SGLang's MHATokenToKVPool / MLATokenToKVPool that the linker reads."""

    def __init__(self, kind: str, tokens: int, page_size: int, layers: int, heads: int, head_dim: int,
                 device: str):
        rows = tokens + page_size  # SGLang's pools keep one padding page in front
        shape = (rows, heads, head_dim) if kind == "mha" else (rows, 1, 576)

        def buf():
            if device == "cpu":  # the server maps CPU pools by name
                return shared_cpu_tensor(shape, torch.bfloat16)
            return torch.empty(shape, dtype=torch.bfloat16, device=device)

        self.kind, self.page_size, self.layer_num, self.start_layer = kind, page_size, layers, 0
        if kind == "mha":
            self.k_buffer = [buf() for _ in range(layers)]
            self.v_buffer = [buf() for _ in range(layers)]
        else:
            self.kv_buffer = [buf() for _ in range(layers)]
        g = torch.Generator(device=device).manual_seed(1)
        for b in self.buffers():
            b.view(torch.int16).random_(generator=g)

    def buffers(self) -> list:
        return [*self.k_buffer, *self.v_buffer] if self.kind == "mha" else list(self.kv_buffer)

    def pages(self, slots: torch.Tensor) -> list:
        """Every buffer's rows at these token slots, as raw bits."""
        return [b[slots].view(torch.int16) for b in self.buffers()]


def slots_of(pages, ps: int, device) -> torch.Tensor:
    """SGLang's token slots (int64) of whole pages, in order."""
    p = torch.as_tensor(pages, dtype=torch.int64)
    return (p[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1).to(device)


def runs(pages: list[int]) -> list[tuple[int, int]]:
    """(first page, count) of each run of consecutive pages."""
    out = []
    for p in pages:
        if out and out[-1][0] + out[-1][1] == p:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((p, 1))
    return out


class Server:
    """lmcache-mp-server in a process of its own (bench/server_process.py) and a client of it, once
    L1 is page-locked (nothing is timed before)."""

    def __init__(self, device: str, l1_bytes: int, transfer_mode: str, log: Path):
        args = ["--url", f"tcp://127.0.0.1:{free_port()}", "--device", device, "--l1-size", f"{l1_bytes >> 20}MiB",
                "--chunk-size", "256", "--http-addr", "off"]
        if device != "cpu":
            args += ["--transfer-mode", transfer_mode]
        self.process = ServerProcess(args, log_path=str(log))
        self.url, self.client = self.process.url, None
        try:
            self.client = self.process.connect(120, timeout=120)
            self.process.wait_pinned(self.client, 120)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
        self.process.stop(30)


class Issued:
    """A client whose retrieves are remembered (their futures carry the traces of a traced client)."""

    def __init__(self, client):
        self.client, self.futures = client, []

    def retrieve(self, *args, **kwargs):
        fut = self.client.retrieve(*args, **kwargs)
        self.futures.append(fut)
        return fut


class LinkerArm:
    """The linker's data plane over the device pool: registration, offload, load (its own code)."""

    def __init__(self, client, pool: DevicePool, transfer: str, groups: int = 1, in_flight: int = IN_FLIGHT,
                 batch: int | None = None):
        self.client, self.pool, self.ps, self.in_flight = client, pool, pool.page_size, in_flight
        self.batch = batch  # pages per request (None: the linker's, about 32 MiB each)
        self.last_traces: list = []  # the last offload's or load's request traces (a traced client)
        self.layout = describe_pools(pool, None, {"FULL"}, pool.page_size)
        if groups > 1:
            split_layer_groups(self.layout, groups)
        self.parts = self.layout.parts[KV]
        self.ns = {id(p): namespace(MODEL, p.tag) for p in self.parts}
        self.handles = {}
        for part in self.parts:
            block_size, chunk_size = registration_geometry(part, client.chunk_size)
            self.handles[id(part)] = client.register_kv_cache(
                list(part.runs), model=self.ns[id(part)], world_size=1, rank=0, layout="opaque",
                block_size=block_size, chunk_size=chunk_size, transfer=transfer)
        self.on_cuda = self.parts[0].runs[0].is_cuda

    def _ready(self) -> None:
        if self.on_cuda:  # the forward's writes come first (the linker waits on SGLang's ready events)
            ev = torch.cuda.Event()
            ev.record()
            ev.synchronize()

    def offload(self, keys: list[str], slots: torch.Tensor) -> float:
        digests = b"".join(page_digest(k) for k in keys)
        t0 = time.perf_counter()
        self._ready()
        rows = page_rows(slots, self.ps, "an offload")
        futures = [self.client.store(self.handles[id(p)], some, at)
                   for (p, _, _), some, at in split_requests([(p, digests, rows) for p in self.parts], self.batch)]
        results = [f.result() for f in futures]
        dt = time.perf_counter() - t0
        assert all(r.skipped == 0 for r in results), results
        self.last_traces = [f.trace for f in futures if getattr(f, "trace", None)]
        return dt

    def load(self, keys: list[str], slots: torch.Tensor) -> tuple[float, float]:
        """(seconds until every layer landed, seconds until the first layers did)."""
        digests = b"".join(page_digest(k) for k in keys)
        leases = []
        for part in self.parts:  # (SGLang's match, before the batch: leased until the load)
            found = self.client.lookup(digests, model=self.ns[id(part)], lock=True)
            assert int(found) == len(keys), (int(found), len(keys))
            leases.append(found.lease)
        first = []
        t0 = time.perf_counter()
        self._ready()
        rows = page_rows(slots, self.ps, "a load")
        issued = Issued(self.client)
        load_batch(issued, self.handles, [([(p, digests, rows) for p in self.parts], leases)],
                   self.layout.group_ends, lambda start, end: first.append(time.perf_counter()), timeout=120,
                   in_flight=self.in_flight, batch=self.batch)
        t1 = time.perf_counter()
        self.last_traces = [f.trace for f in issued.futures if getattr(f, "trace", None)]
        return t1 - t0, first[0] - t0


class HiCacheArm:
    """HiCache's path: device pool <-> HiCache's layer_first host pool (SGLang's copy, emulated),
    host pool <-> L1 (our storage backend's client calls)."""

    def __init__(self, client, pool: DevicePool, host_pages: int):
        self.client, self.pool, self.ps = client, pool, pool.page_size
        layers, tokens = pool.layer_num, host_pages * pool.page_size
        pin = pool.buffers()[0].is_cuda
        inner = pool.buffers()[0].shape[1:]
        shape = (2, layers, tokens, *inner) if pool.kind == "mha" else (layers, tokens, *inner)
        self.host = torch.empty(shape, dtype=torch.bfloat16, pin_memory=pin)
        self.host.view(torch.int16).fill_(7)
        self.host_layers = ([self.host[0, i] for i in range(layers)] + [self.host[1, i] for i in range(layers)]
                            if pool.kind == "mha" else [self.host[i] for i in range(layers)])
        self.plan = plan_pages(self.host, kind=pool.kind, layout="layer_first", page_size=self.ps,
                               chunk_size=client.chunk_size)
        self.ns = namespace(MODEL, self.plan.format_tag)
        self.handle = client.register_kv_cache(list(self.plan.runs), model=self.ns, world_size=1, rank=0,
                                               layout="opaque", block_size=client.chunk_size, transfer="engine")
        self.stream = torch.cuda.Stream() if pin else None

    def _copy(self, dev_pages: list[int], host_pages: list[int], to_host: bool) -> None:
        """SGLang's `direct` I/O backend for layer_first pools: per layer and K/V, one copy per
        run of pages consecutive on both sides."""
        ps = self.ps
        pairs, i = [], 0
        for start, n in runs(dev_pages):
            for hs, hn in runs(host_pages[i:i + n]):
                off = hs - host_pages[i]
                pairs.append((start + off, hs, hn))
            i += n

        def go():
            for dev, host in zip(self.pool.buffers(), self.host_layers):
                for d, h, n in pairs:
                    if to_host:
                        host[h * ps:(h + n) * ps].copy_(dev[d * ps:(d + n) * ps], non_blocking=True)
                    else:
                        dev[d * ps:(d + n) * ps].copy_(host[h * ps:(h + n) * ps], non_blocking=True)

        if self.stream is None:
            go()
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            go()
        self.stream.synchronize()

    def offload(self, keys: list[str], dev_pages: list[int], host_pages: list[int]) -> float:
        digests = b"".join(page_digest(k) for k in keys)
        t0 = time.perf_counter()
        self._copy(dev_pages, host_pages, to_host=True)
        r = self.client.store(self.handle, digests, np.asarray(host_pages, dtype=np.int32)).result()
        dt = time.perf_counter() - t0
        assert r.skipped == 0, r
        return dt

    def load(self, keys: list[str], dev_pages: list[int], host_pages: list[int]) -> float:
        digests = b"".join(page_digest(k) for k in keys)
        assert int(self.client.lookup(digests, model=self.ns)) == len(keys)  # (HiCache's prefetch check)
        t0 = time.perf_counter()
        loaded = self.client.retrieve(self.handle, digests, np.asarray(host_pages, dtype=np.int32)).result().loaded
        assert loaded == len(keys), (loaded, len(keys))
        self._copy(dev_pages, host_pages, to_host=False)
        return time.perf_counter() - t0


class Memcpy:
    """The ceiling: one contiguous pinned copy of the same bytes (bench_transfer.py's), or on the CPU
    one contiguous copy on lmcache_mp's copy threads."""

    def __init__(self, nbytes: int, device: str):
        self.device = device
        if device == "cpu":
            self.a = np.random.randint(0, 256, nbytes, dtype=np.uint8)
            self.b = np.ones_like(self.a)
            return
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.stream = torch.cuda.Stream()

    def run(self, to_host: bool, nbytes: int) -> float:
        if self.device == "cpu":
            src, dst = (self.a, self.b) if to_host else (self.b, self.a)
            t0 = time.perf_counter()
            _C.parallel_memcpy(dst.ctypes.data, src.ctypes.data, nbytes)
            return time.perf_counter() - t0
        t0 = time.perf_counter()
        with torch.cuda.stream(self.stream):
            if to_host:
                self.host[:nbytes].copy_(self.dev[:nbytes], non_blocking=True)
            else:
                self.dev[:nbytes].copy_(self.host[:nbytes], non_blocking=True)
        self.stream.synchronize()
        return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--kind", choices=("mha", "mla"), default="mha")
    ap.add_argument("--pages", default="1,64", help="pages per request (comma-separated)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="3 rounds (finishes in well under 90 s on a GPU)")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--transfer-mode", default="auto", help="the server's --transfer-mode (GPU)")
    ap.add_argument("--layer-groups", type=int, default=4, help="KV layer groups of the linker-groups arm")
    ap.add_argument("--in-flight", type=int, default=IN_FLIGHT, help="layer groups a load asks for at once")
    ap.add_argument("--order", choices=("contiguous", "shuffled"), default="contiguous",
                    help="device pages of a request: consecutive, or scattered over the pool")
    ap.add_argument("--split", type=int, default=64, help="pages per request of the linker-split arm")
    ap.add_argument("--trace", action="store_true", help="print the linker requests' stage times")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    assert set(arms) <= set(ARMS), f"arms are {ARMS}"
    counts = [int(c) for c in args.pages.split(",")]
    repeat = 3 if args.quick else args.repeat
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --device cpu)")
    if device == "cpu":  # small torch copies on a busy machine: one thread, no parallel region to wake
        torch.set_num_threads(1)
    ps, most = args.page_size, max(counts)
    dev_pages = 2 * most  # sources and load targets
    pool = DevicePool(args.kind, dev_pages * ps, ps, args.layers, args.heads, args.head_dim, device)
    page_bytes = sum(b[:ps].numel() * b.element_size() for b in pool.buffers())
    rng = np.random.default_rng(0)
    order = (rng.permutation(dev_pages) if args.order == "shuffled" else np.arange(dev_pages)) + 1  # page 0: padding
    src_pages, dst_pages = [int(p) for p in order[:most]], [int(p) for p in order[most:]]
    per_round = sum(counts) * page_bytes * len(arms)
    l1_bytes = max(2 * per_round, 1 << 30) + (512 << 20)
    mc = Memcpy(most * page_bytes, device)
    env = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": device, "cpu": cpu_model(), "cores": os.cpu_count(),
           "torch": torch.__version__}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
    print(f"# {env.get('gpu', env['cpu'])}: {args.kind} pool, {args.layers} layers, page {ps} tokens = "
          f"{page_bytes / 2**20:.2f} MiB ({len(pool.buffers())} runs), {args.order} pages, {repeat} rounds",
          flush=True)
    times: dict = {}
    traces: dict = {}  # "arm op pages" -> request traces (--trace)
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(device, l1_bytes, args.transfer_mode, Path(tmp) / "server.log")
        try:
            admin = server.client
            made, errors = {}, {}
            for arm in arms:  # one client per arm, as one SGLang worker would have
                try:
                    c = Client(server.url, timeout=120, trace=args.trace)
                    if arm == "hicache":
                        made[arm] = HiCacheArm(c, pool, 2 * most)
                    else:
                        made[arm] = LinkerArm(c, pool, "engine" if arm == "linker-engine" else "server",
                                              groups=args.layer_groups if arm == "linker-groups" else 1,
                                              in_flight=args.in_flight,
                                              batch=args.split if arm == "linker-split" else None)
                except Exception as e:  # noqa: BLE001 - one arm's failure is reported; the others still run
                    errors[arm] = f"{type(e).__name__}: {e}"
                    print(f"!! {arm}: {errors[arm]}", flush=True)
            modes = [f"{r['model']}: {r['transfer_mode']}" for r in admin.status()["registrations"]]
            for r in range(repeat + 1):  # interleaved rounds; the first warms up (L1 slots, mappings)
                admin.clear()
                for n in counts:
                    nbytes = n * page_bytes
                    src, dst = src_pages[:n], dst_pages[:n]
                    src_slots, dst_slots = slots_of(src, ps, device), slots_of(dst, ps, device)
                    rec = {"memcpy_d2h": mc.run(True, nbytes), "memcpy_h2d": mc.run(False, nbytes)}
                    for arm in [a for a in arms if a not in errors]:
                        a = made[arm]
                        keys = [f"{arm}-{r}-{n}-{i}" for i in range(n)]
                        for b in pool.buffers():  # every load must write its slots
                            b[dst_slots] = 0
                        try:
                            if arm == "hicache":
                                host_src, host_dst = list(range(n)), list(range(most, most + n))
                                rec[arm + "_offload"] = a.offload(keys, src, host_src)
                                rec[arm + "_load"] = a.load(keys, dst, host_dst)
                            else:
                                rec[arm + "_offload"] = a.offload(keys, src_slots)
                                if r:
                                    traces.setdefault(f"{arm} offload {n} pages", []).extend(a.last_traces)
                                rec[arm + "_load"], rec[arm + "_first"] = a.load(keys, dst_slots)
                                if r:
                                    traces.setdefault(f"{arm} load {n} pages", []).extend(a.last_traces)
                        except Exception as e:  # noqa: BLE001
                            errors[arm] = f"{type(e).__name__}: {e}"
                            print(f"!! {arm}: {errors[arm]}", flush=True)
                            continue
                        if device == "cuda":
                            torch.cuda.synchronize()
                        if not all(torch.equal(x, y) for x, y in zip(pool.pages(dst_slots), pool.pages(src_slots))):
                            failures.append(f"{arm} {n} pages round {r}: a load is not bit-exact")
                    if r:
                        for k, v in rec.items():
                            times.setdefault(n, {}).setdefault(k, []).append(v)
            for arm, a in made.items():
                a.client.close()
        finally:
            server.stop()

    results = []
    print(f"{'pages':>5s} {'MiB':>7s}  {'what':22s}{'GB/s':>8s}{'ms':>9s}{'x memcpy':>10s}")
    for n in counts:
        nbytes = n * page_bytes
        med = {k: statistics.median(v) for k, v in times[n].items()}
        row = {"pages": n, "bytes": nbytes, "memcpy_d2h_gbs": nbytes / med["memcpy_d2h"] / 1e9,
               "memcpy_h2d_gbs": nbytes / med["memcpy_h2d"] / 1e9}
        print(f"{n:5d} {nbytes / 2**20:7.1f}  {'memcpy d2h / h2d':22s}{row['memcpy_d2h_gbs']:8.2f}"
              f"{1e3 * med['memcpy_d2h']:9.2f}{1.0:10.2f}   h2d {row['memcpy_h2d_gbs']:.2f} GB/s "
              f"{1e3 * med['memcpy_h2d']:.2f} ms")
        for arm in [a for a in arms if a not in errors]:
            for op, ceil in (("offload", "memcpy_d2h"), ("load", "memcpy_h2d")):
                s = med[f"{arm}_{op}"]
                row[f"{arm}_{op}_ms"] = 1e3 * s
                row[f"{arm}_{op}_gbs"] = nbytes / s / 1e9
                row[f"{arm}_{op}_x_memcpy"] = med[ceil] / s
                print(f"{'':14s}{arm + ' ' + op:22s}{nbytes / s / 1e9:8.2f}{1e3 * s:9.2f}{med[ceil] / s:10.2f}")
            if f"{arm}_first" in med:  # when the forward could start: the first layers landed
                row[f"{arm}_first_layers_ms"] = 1e3 * med[f"{arm}_first"]
                print(f"{'':14s}{arm + ' first layers':22s}{'':8s}{1e3 * med[arm + '_first']:9.2f}")
        results.append(row)
    print("server transfer modes:", modes)
    if traces:
        print_traces(traces)
    for arm, err in errors.items():
        print(f"!! arm {arm} not measured: {err}")
    print("bit-exact:", "ALL PASS" if not failures else f"FAILED {failures}")
    out = {"benchmark": "bench_sglang_gpu", "env": env, "args": vars(args), "repeat": repeat,
           "page_bytes": page_bytes, "runs_per_page": len(pool.buffers()), "transfer_modes": modes,
           "results": results, "failures": failures, "errors": errors}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 1 if failures or errors else 0


if __name__ == "__main__":
    sys.exit(main())
