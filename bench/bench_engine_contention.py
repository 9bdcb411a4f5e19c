"""What our transfers cost an engine that computes non-stop, and what its compute costs them.

In production the engine's process keeps its GPU busy while KV moves in and out, and the server
is another process, so another CUDA context; without MPS a GPU time-slices between contexts. This
process plays the engine (as a vLLM worker does: it computes and runs the connector); each server
runs in its own process (`python -m lmcache_mp.server.cli`, one per server-side mode). The
engine's load runs on its own stream from a background thread:

  gemm     bf16 8192x8192x8192 matmuls back to back
  decode   a CUDA graph of 64 small GEMMs (batch 16 x 4096 x 4096 bf16, a decode step) replayed
           back to back

Transfer paths: server-staged and server-dma (the server copies with its own kernels / copy
engines), server-auto (when named: the mode the server chooses for the layout), engine (the
copies run in this process: register_kv_cache(..., transfer="engine")), and the reference
in-process (this process copies the same bytes per request, contiguous, device <-> pinned host
with copy_(non_blocking=True) on a side stream). For each path and layout (mha: Llama-3-8B, 32
layers, 8 KV heads x 128, flash-attention's per-layer [2, blocks, 16, 8, 128]; mla: --mla-layers x
576; mha-packed and mla-packed: the same models in vLLM's block-outermost BLNHC layout, per-layer
views into one [blocks, layers, 16, ...] buffer, which the server registers as one cache whose
blocks move whole; bf16, blocks of 16 tokens, 256-token chunks, random block ids):

  1. the engine's rate (steps completed per second, from CUDA events) alone, then while requests
     of --chunks chunks (64) stream both ways (one thread stores fresh requests back to back, one
     retrieves stored ones), then alone again: loaded / mean(alone before, alone after);
  2. the GB/s of each direction in that window and with the GPU idle, each also as a ratio to the
     ceiling: one contiguous pinned cudaMemcpyAsync of one request's bytes, idle, in this run;
  3. store and retrieve latency p50/p99 of 1-chunk and --chunks-chunk requests, --gap-ms apart
     (as an engine spaces them, not back to back), idle and beside each load.

Windows last --window seconds (1.5; --quick: 0.75); each server is started once and serves every
layout, the engine path sharing the staged server.

Every streaming window ends with a byte check (retrieved blocks against the blocks they were
stored from), and so does each latency series: a wrong byte fails the run (exit code 1).
--device cpu runs the same plumbing without a GPU (CPU matmuls as the load, KV in shared memory,
tiny sizes; the engine path copies with the CPU); its figures mean nothing.

    python bench/bench_engine_contention.py [--paths server-staged,server-dma,engine,in-process]
        [--layouts mha,mla,mha-packed,mla-packed] [--loads gemm,decode] [--quick] [--json out.json]
        [--device cpu]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import threading
import time
import traceback
from collections import deque

import numpy as np
import torch

from lmcache_mp import Client, chunk_hashes, shared_cpu_tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import server_process  # noqa: E402

CHUNK = 256
BLOCK = 16
BPC = CHUNK // BLOCK  # blocks per chunk
POOL = 2  # stored requests the retrieving thread cycles through
PATHS = {"cuda": ("server-staged", "server-dma", "engine", "in-process"), "cpu": ("server", "engine", "in-process")}
OTHER_PATHS = {"cuda": ("server-auto",), "cpu": ()}  # run when named: the mode the server chooses itself
LAYOUTS = ("mha", "mla", "mha-packed", "mla-packed")
# Variants of the engine path, by the client's tuning knobs (client/engine_copy.py): its copy
# streams at high priority, or its packing kernels on 16 CTAs instead of one per SM.
ENGINE_VARIANTS = {"engine": {}, "engine-high": {"LMCACHE_MP_COPY_PRIORITY": "high"},
                   "engine-ctas16": {"LMCACHE_MP_PACK_CTAS": "16"}}


def fresh_hashes(rng: np.random.Generator, n: int) -> list[bytes]:
    return chunk_hashes(rng.integers(0, 1 << 31, n * CHUNK), CHUNK)


def server_mode(path: str, device: str) -> str | None:
    """The server (by its --transfer-mode) a path uses; None: no server."""
    if path == "in-process":
        return None
    if device == "cpu":
        return "cpu"
    if path.startswith("server-"):
        return path.removeprefix("server-")
    return "staged"  # the engine path leaves the server's mode unused


class ServerProcess(server_process.ServerProcess):
    def __init__(self, mode: str, args, tmp: str):
        self.mode = mode
        flags = ["--url", f"ipc://{tmp}/{mode}.sock", "--device", args.device, "--l1-size", args.l1_size,
                 "--chunk-size", str(CHUNK), "--http-addr", "off", "--log-level", "WARNING"]
        if mode != "cpu":
            flags += ["--transfer-mode", mode]
        super().__init__(flags, log_path=f"{tmp}/{mode}.log")
        self.client: Client | None = None

    def connect(self, within: float = 120.0) -> None:
        try:
            self.client = super().connect(within, timeout=60)
            self.wait_pinned(self.client, within)
        except RuntimeError as e:
            raise RuntimeError(f"server {self.mode}: {e}") from None

    def stop(self) -> int:
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()
        return super().stop(60)


class EngineLoad:
    """The engine's compute on its own stream, from a background thread. marks: (time, steps
    completed), appended as each batch of steps completes on the device."""

    def __init__(self, kind: str, cuda: bool):
        self.kind, self.cuda = kind, cuda
        self.stream = torch.cuda.Stream() if cuda else None
        dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
        if kind == "gemm":
            n = 8192 if cuda else 512
            a, b = torch.randn(n, n, dtype=dtype, device=dev), torch.randn(n, n, dtype=dtype, device=dev)
            c = torch.empty(n, n, dtype=dtype, device=dev)
            self.step, self.batch = (lambda: torch.mm(a, b, out=c)), 2
        else:
            h = 4096 if cuda else 256
            x = torch.randn(16, h, dtype=dtype, device=dev)
            # 16 weights of 32 MiB cycled: more than L2 holds, so each GEMM reads HBM as a decode step does
            ws = [torch.randn(h, h, dtype=dtype, device=dev) for _ in range(16 if cuda else 2)]
            outs = [torch.empty(16, h, dtype=dtype, device=dev) for _ in range(64)]

            def decode_step():
                for i, out in enumerate(outs):
                    torch.mm(x, ws[i % len(ws)], out=out)

            self.step, self.batch = decode_step, 8
            if cuda:
                with torch.cuda.stream(self.stream):
                    decode_step()  # cuBLAS initialises outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    decode_step()
                self.step = graph.replay
                # The graph reads and writes these by address: they must outlive it (freed, their
                # memory would go to other tensors, the KV caches among them, and be overwritten).
                self._graph_tensors = (x, ws, outs)
        if not cuda:
            self.batch = 1
        self.marks: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self) -> None:
        self.marks, self._error = [], None
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"load-{self.kind}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            done, pending = 0, deque()
            with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
                while not self._stop.is_set():
                    for _ in range(self.batch):
                        self.step()
                    if not self.cuda:
                        done += 1
                        self.marks.append((time.perf_counter(), done))
                        continue
                    ev = torch.cuda.Event()
                    ev.record()
                    pending.append(ev)
                    if len(pending) > 2:  # two batches stay queued, so the GPU never waits for this thread
                        pending.popleft().synchronize()
                        done += self.batch
                        self.marks.append((time.perf_counter(), done))
            if self.cuda:
                self.stream.synchronize()
        except BaseException as e:  # noqa: BLE001 - re-raised by stop()
            self._error = e

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"engine load {self.kind} failed") from self._error

    def rate(self, t0: float, t1: float) -> float:
        """Steps per second from the last mark at or before t0 to the first at or after t1 (after stop())."""
        a = next((m for m in reversed(self.marks) if m[0] <= t0), self.marks[0] if self.marks else None)
        b = next((m for m in self.marks if m[0] >= t1), self.marks[-1] if self.marks else None)
        return (b[1] - a[1]) / (b[0] - a[0]) if a and b and b[0] > a[0] else math.nan


class CopyMover:
    """The reference path, and the ceiling: this process copies a request's bytes contiguously
    between device memory and pinned host memory, one buffer pair per direction."""

    checked, transfer_mode, registered_layout = False, "in-process copy", "-"

    def __init__(self, nbytes: int, chunk_bytes: int, cuda: bool):
        dev = "cuda" if cuda else "cpu"
        self.chunk_bytes = chunk_bytes
        self.dev = {d: torch.full((nbytes,), 1, dtype=torch.uint8, device=dev) for d in ("d2h", "h2d")}
        self.host = {d: torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda).fill_(2) for d in ("d2h", "h2d")}

    def copy(self, direction: str, nbytes: int, stream) -> None:
        dst, src = (self.host, self.dev) if direction == "d2h" else (self.dev, self.host)
        if stream is None:
            dst[direction][:nbytes].copy_(src[direction][:nbytes])
            return
        with torch.cuda.stream(stream):
            dst[direction][:nbytes].copy_(src[direction][:nbytes], non_blocking=True)
        stream.synchronize()

    def copy_both(self, nbytes: int, streams) -> None:
        if streams[0] is None:
            for d in ("d2h", "h2d"):
                self.copy(d, nbytes, None)
            return
        for (d, (dst, src)), stream in zip((("d2h", (self.host, self.dev)), ("h2d", (self.dev, self.host))), streams):
            with torch.cuda.stream(stream):
                dst[d][:nbytes].copy_(src[d][:nbytes], non_blocking=True)
        for stream in streams:
            stream.synchronize()

    def store(self, hashes, block_ids, stream) -> int:
        return self.copy("d2h", len(hashes) * self.chunk_bytes, stream) or len(hashes)

    def retrieve(self, hashes, block_ids, stream) -> int:
        return self.copy("h2d", len(hashes) * self.chunk_bytes, stream) or len(hashes)

    def close(self) -> None:
        pass


class ServerMover:
    """A registered KV cache moved by the server (transfer="server") or by this process ("engine")."""

    checked = True

    def __init__(self, client: Client, kv: list, layout: str, path: str, cpu: bool):
        self.client, want = client, ("engine" if path.startswith("engine") else "server")
        kw = dict(model=f"contention-{path}-{layout}", world_size=1, rank=0,
                  layout="mla" if layout.startswith("mla") else "auto")
        knobs = ENGINE_VARIANTS.get(path, {})
        saved = {k: os.environ.get(k) for k in knobs}
        os.environ.update(knobs)  # read when the copier is made, at registration
        try:
            self.h = client.register_kv_cache(kv, transfer=want, **kw)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        if (self.h.transfer_mode == "engine") != (want == "engine"):
            raise RuntimeError(f"asked for {want} copies, got transfer mode {self.h.transfer_mode}")
        client.pin_l1()  # the engine's page-locking of L1, before any timing
        self.transfer_mode, self.registered_layout = self.h.transfer_mode, self.h.layout

    def store(self, hashes, block_ids, stream) -> int:
        return self.client.store(self.h, hashes, block_ids, stream=stream).result().chunks

    def retrieve(self, hashes, block_ids, stream) -> int:
        return self.client.retrieve(self.h, hashes, block_ids, stream=stream).result().loaded

    def close(self) -> None:
        self.client.unregister_kv_cache(self.h)
        self.client.clear()


class LayoutRun:
    """One layout's KV caches (a source half of the blocks, a destination half), block ids, the
    stored pool, streams and the copy buffers of the reference and the ceiling."""

    def __init__(self, layout: str, args, failures: list):
        self.layout, self.big, self.cuda, self.failures = layout, args.chunks, args.device == "cuda", failures
        self.R = R = self.big * BPC
        mha = layout.startswith("mha")
        layers = args.mha_layers if mha else args.mla_layers
        page = (BLOCK, 8, 2 * 128) if mha else (BLOCK, 576)  # one layer's block: [tokens, heads, K+V] / [tokens, dim]
        self.chunk_bytes = layers * CHUNK * math.prod(page[1:]) * 2

        def alloc(shape):
            t = (torch.empty(shape, dtype=torch.bfloat16, device="cuda") if self.cuda
                 else shared_cpu_tensor(shape, torch.bfloat16, fill=None))
            t.view(torch.int16).random_(-(1 << 15), (1 << 15) - 1)
            return t

        if layout.endswith("-packed"):
            # vLLM's BLNHC: one buffer, the layers of a block side by side; the per-layer views
            # vLLM hands over ([blocks, heads, tokens, K+V] for MHA, [blocks, tokens, dim] for MLA)
            self.whole = alloc((2 * R, layers, *page))
            self.kv = [self.whole[:, i].permute(0, 2, 1, 3) if mha else self.whole[:, i] for i in range(layers)]
        else:
            self.whole = None
            shape = (2, 2 * R, BLOCK, 8, 128) if mha else (2 * R, *page)  # flash-attention [2, B, N, H, D] / MLA
            self.kv = [alloc(shape) for _ in range(layers)]
        rng = np.random.default_rng(0)
        self.src = [rng.permutation(R).astype(np.int64) for _ in range(POOL + 2)]
        self.dst = (R + rng.permutation(R)).astype(np.int64)
        self.pool = [fresh_hashes(rng, self.big) for _ in range(POOL)]
        self.streams = [torch.cuda.Stream(), torch.cuda.Stream()] if self.cuda else [None, None]
        self.copy = CopyMover(self.big * self.chunk_bytes, self.chunk_bytes, self.cuda)

    def blocks(self, t: torch.Tensor, ids) -> torch.Tensor:
        ids = torch.as_tensor(ids, device=t.device)
        return t.view(torch.int16)[:, ids] if self.layout == "mha" else t.view(torch.int16)[ids]

    def check(self, src, dst, label: str) -> None:
        """Blocks dst must hold exactly the bytes of blocks src (the retrieves have landed: wait="host")."""
        for layer, t in enumerate(self.kv):
            if not torch.equal(self.blocks(t, src), self.blocks(t, dst)):
                msg = f"{label}: WRONG BYTES in layer {layer} of {len(dst)} retrieved blocks"
                print(f"!!! {msg}", flush=True)
                self.failures.append(msg)
                return

    def clear_dst(self) -> None:
        for t in self.kv:
            (t[:, self.R:] if self.layout == "mha" else t[self.R:]).zero_()
        if self.cuda:  # the next retrieve orders itself after its own stream only
            torch.cuda.current_stream().synchronize()

    def ceiling(self, repeat: int = 5) -> dict:
        """GB/s of one request's bytes copied contiguously: each direction alone ("d2h", "h2d"), and
        per direction with both at once ("both": the ceiling of the streaming windows, which store
        and retrieve at the same time; PCIe carries less each way then)."""
        out = {}
        nbytes = self.big * self.chunk_bytes
        for d in ("d2h", "h2d", "both"):
            times = []
            for i in range(repeat + 1):
                t0 = time.perf_counter()
                if d != "both":
                    self.copy.copy(d, nbytes, self.streams[0])
                else:  # both queued at once, each on its stream, then both awaited
                    self.copy.copy_both(nbytes, self.streams)
                if i:  # the first is a warm-up
                    times.append(time.perf_counter() - t0)
            out[d] = nbytes / float(np.median(times)) / 1e9
        return out


def expect(got: int, want: int, what: str, failures: list) -> None:
    if got != want:
        msg = f"{what}: {got} of {want} chunks"
        print(f"!!! {msg}", flush=True)
        failures.append(msg)


def fill_pool(mover, lr: LayoutRun, label: str) -> None:
    """Store the requests the retrieving thread reads (also the warm-up), and check them."""
    for k, hashes in enumerate(lr.pool):
        expect(mover.store(hashes, lr.src[k], lr.streams[0]), lr.big, f"{label} pool store", lr.failures)
    for k, hashes in enumerate(lr.pool):
        lr.clear_dst()
        expect(mover.retrieve(hashes, lr.dst, lr.streams[0]), lr.big, f"{label} pool retrieve", lr.failures)
        if mover.checked:
            lr.check(lr.src[k], lr.dst, f"{label} pool {k}")


def stream_both(mover, lr: LayoutRun, args, label: str) -> dict:
    """One thread stores fresh requests back to back, another retrieves pool requests; GB/s per
    direction over the requests that ran within the window [t0, t1]."""
    stop, errors, last = threading.Event(), [], {}
    recs: dict = {"store": [], "retrieve": []}
    for k, hashes in enumerate(lr.pool):  # stored again if the requests since evicted them (same bytes)
        mover.store(hashes, lr.src[k], lr.streams[0])

    def loop(op: str) -> None:
        rng, i = np.random.default_rng(), 0
        try:
            while i == 0 or not stop.is_set():  # at least one request, however short the window
                if op == "store":
                    hashes, ids = fresh_hashes(rng, lr.big), lr.src[i % len(lr.src)]
                    t0 = time.perf_counter()
                    n = mover.store(hashes, ids, lr.streams[0])
                    last["store"] = (hashes, ids, n)
                else:
                    k = i % len(lr.pool)
                    t0 = time.perf_counter()
                    n = mover.retrieve(lr.pool[k], lr.dst, lr.streams[1])
                    last["retrieve"] = (k, n)
                recs[op].append((t0, time.perf_counter(), n))
                i += 1
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=loop, args=(op,), name=f"stream-{op}") for op in recs]
    for th in threads:
        th.start()
    time.sleep(args.settle)
    t0 = time.perf_counter()
    time.sleep(args.window)
    t1 = time.perf_counter()
    stop.set()
    for th in threads:
        th.join()
    if errors:
        raise RuntimeError(f"{label}: streaming failed") from errors[0]
    out: dict = {"window_s": t1 - t0}
    for op, rs in recs.items():
        inside = [r for r in rs if r[0] >= t0 and r[1] <= t1] or rs  # a request longer than the window: all
        chunks, busy = sum(r[2] for r in inside), sum(r[1] - r[0] for r in inside)
        out[op] = {"gbps": chunks * lr.chunk_bytes / busy / 1e9 if busy else math.nan, "requests": len(inside),
                   "short": sum(r[2] < lr.big for r in inside)}
        if out[op]["short"]:  # skipped (no memory) or evicted chunks: the GB/s count only what moved
            print(f"  {label}: WARNING: {out[op]['short']} {op}s moved fewer than {lr.big} chunks", flush=True)
    if mover.checked:  # the last retrieve is still in the blocks; then read back the last store
        k, n = last["retrieve"]
        lr.check(lr.src[k][:n * BPC], lr.dst[:n * BPC], f"{label} streamed retrieve")
        hashes, ids, n = last["store"]
        lr.clear_dst()
        got = mover.retrieve(hashes, lr.dst, lr.streams[0])
        expect(got, n, f"{label} reading back the last streamed store", lr.failures)
        lr.check(ids[:got * BPC], lr.dst[:got * BPC], f"{label} streamed store")
    return out, t0, t1


def latencies(mover, lr: LayoutRun, args, label: str) -> dict:
    """p50/p99 ms of stores and retrieves of fresh requests, --gap-ms apart, as an engine spaces them."""
    rng, out = np.random.default_rng(), {}
    for n, count in ((1, args.small_requests), (lr.big, args.big_requests)):
        lat: dict = {"store": [], "retrieve": []}
        for i in range(count):
            hashes, src, dst = fresh_hashes(rng, n), lr.src[i % len(lr.src)][:n * BPC], lr.dst[:n * BPC]
            for op, ids in (("store", src), ("retrieve", dst)):
                t0 = time.perf_counter()
                got = getattr(mover, op)(hashes, ids, lr.streams[0])
                lat[op].append((time.perf_counter() - t0) * 1e3)
                expect(got, n, f"{label} {n}-chunk {op}", lr.failures)
                time.sleep(args.gap_ms / 1e3)
        if mover.checked:
            lr.check(src, dst, f"{label} {n}-chunk latency")
        out[f"{n}ch"] = {op: {"p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99))}
                         for op, v in lat.items()}
    return out


def run_path(path: str, lr: LayoutRun, server: ServerProcess | None, loads: dict, ceiling: dict, args,
             rows: list) -> None:
    """Appends one row for the idle GPU and one per load."""
    label = f"{path}/{lr.layout}"
    mover = lr.copy if server is None else ServerMover(server.client, lr.kv, lr.layout, path, not lr.cuda)
    info = {"path": path, "layout": lr.layout, "transfer_mode": mover.transfer_mode,
            "registered_layout": mover.registered_layout}
    if server is not None and not path.startswith("engine") and server.mode not in (mover.transfer_mode, "cpu", "auto"):
        print(f"  {label}: WARNING: the server chose transfer mode {mover.transfer_mode!r}", flush=True)
    first = len(rows)
    try:
        fill_pool(mover, lr, label)
        idle = stream_both(mover, lr, args, label)[0]
        rows.append({**info, "load": "idle", "transfers": idle, "latency": latencies(mover, lr, args, label)})
        print_row(rows[-1], ceiling, rows[first])
        for name, load in loads.items():
            load.start()
            try:  # alone, with transfers, alone: clocks drift, so the loaded window is compared with both
                time.sleep(args.settle)
                t = time.perf_counter()
                time.sleep(args.window)
                alone = [(t, time.perf_counter())]
                xfer, t0, t1 = stream_both(mover, lr, args, f"{label} beside {name}")
                time.sleep(args.settle)
                t = time.perf_counter()
                time.sleep(args.window)
                alone.append((t, time.perf_counter()))
                lat = latencies(mover, lr, args, f"{label} beside {name}")
            finally:
                load.stop()
            before, after, loaded = load.rate(*alone[0]), load.rate(*alone[1]), load.rate(t0, t1)
            engine = {"alone_before": before, "loaded": loaded, "alone_after": after,
                      "ratio": loaded / ((before + after) / 2)}
            rows.append({**info, "load": name, "engine": engine, "transfers": xfer, "latency": lat})
            print_row(rows[-1], ceiling, rows[first])
    finally:
        mover.close()


COLUMNS = (("path", 14), ("layout", 6), ("load", 6), ("engine/s", 9), ("x alone", 7), ("store GB/s", 10),
           ("x mem", 5), ("x idle", 6), ("retr GB/s", 9), ("x mem", 5), ("x idle", 6), ("1ch st p50/p99", 14),
           ("1ch rt p50/p99", 14), ("x idle", 9), ("Nch st p50/p99", 15), ("Nch rt p50/p99", 15))
HEADER = " ".join(f"{name:{'<' if i < 3 else '>'}{w}s}" for i, (name, w) in enumerate(COLUMNS))


LEGEND = ("engine/s: steps/s alone (mean of the windows before and after); x alone: loaded / alone; x mem: GB/s "
          "/ the memcpy ceiling with both directions at once;\nx idle: / the same path on an idle GPU (latency: p50 of store/retrieve); latencies in "
          "ms; N: chunks of a big request")


def print_row(row: dict, ceiling: dict, idle: dict) -> None:
    e, cells = row.get("engine"), [row["path"], row["layout"], row["load"]]
    cells += [f"{(e['alone_before'] + e['alone_after']) / 2:.1f}", f"{e['ratio']:.3f}"] if e else ["-", "-"]
    for op in ("store", "retrieve"):  # streamed both ways at once: against the both-ways ceiling
        g = row["transfers"][op]["gbps"]
        cells += [f"{g:.1f}", f"{g / ceiling['both']:.2f}", f"{g / idle['transfers'][op]['gbps']:.2f}"]
    big = next(k for k in row["latency"] if k != "1ch")
    lat = {(n, op): row["latency"][n][op] for n in ("1ch", big) for op in ("store", "retrieve")}
    cells += [f"{lat['1ch', op]['p50']:.2f}/{lat['1ch', op]['p99']:.2f}" for op in ("store", "retrieve")]
    cells.append("/".join(f"{lat['1ch', op]['p50'] / idle['latency']['1ch'][op]['p50']:.2f}"
                          for op in ("store", "retrieve")))
    cells += [f"{lat[big, op]['p50']:.2f}/{lat[big, op]['p99']:.2f}" for op in ("store", "retrieve")]
    print(" ".join(f"{c:{'<' if i < 3 else '>'}{w}s}" for i, (c, (_, w)) in enumerate(zip(cells, COLUMNS))), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--paths", help="comma-separated; default: all of the device's paths")
    ap.add_argument("--layouts", default="mha,mla")
    ap.add_argument("--loads", default="gemm,decode", help="engine loads, comma-separated (empty: idle only)")
    ap.add_argument("--chunks", type=int, help="chunks of a big request (default 64; cpu 4)")
    ap.add_argument("--mha-layers", type=int, help="default 32 (cpu 2)")
    ap.add_argument("--mla-layers", type=int, help="default 61 (cpu 2)")
    ap.add_argument("--l1-size", help="each server's L1 (default 24GiB; cpu 256MiB)")
    ap.add_argument("--window", type=float, default=1.5, help="seconds of each measurement window")
    ap.add_argument("--settle", type=float, default=0.2, help="seconds before a window starts")
    ap.add_argument("--small-requests", type=int, default=60, help="1-chunk requests per latency series")
    ap.add_argument("--big-requests", type=int, default=12, help="big requests per latency series")
    ap.add_argument("--gap-ms", type=float, default=3.0, help="pause between latency requests")
    ap.add_argument("--quick", action="store_true", help="short windows, fewer latency requests")
    ap.add_argument("--json")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    args.chunks = args.chunks or (64 if cuda else 4)
    args.mha_layers = args.mha_layers or (32 if cuda else 2)
    args.mla_layers = args.mla_layers or (61 if cuda else 2)
    args.l1_size = args.l1_size or ("24GiB" if cuda else "256MiB")
    if args.quick:
        args.window, args.settle = min(args.window, 0.75), min(args.settle, 0.1)
        args.small_requests, args.big_requests = min(args.small_requests, 20), min(args.big_requests, 4)
    paths = args.paths.split(",") if args.paths else list(PATHS[args.device])
    layouts = [x for x in args.layouts.split(",") if x]
    load_names = [x for x in args.loads.split(",") if x]
    bad = ([p for p in paths if p not in PATHS[args.device] + OTHER_PATHS[args.device] and p not in ENGINE_VARIANTS]
           + [x for x in layouts if x not in LAYOUTS]
           + [x for x in load_names if x not in ("gemm", "decode")])
    if bad:
        ap.error(f"unknown for --device {args.device}: {bad} (paths: {', '.join(PATHS[args.device])}; "
                 f"layouts: {', '.join(LAYOUTS)}; loads: gemm, decode)")
    if not cuda:
        torch.set_num_threads(1)  # a small load on a small machine
    env = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "device": args.device, "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name(0) if cuda else None, "host": os.uname().nodename}
    print(f"# {env['gpu'] or 'CPU'}, torch {env['torch']}, {env['date']}; chunks of {CHUNK} tokens, blocks of "
          f"{BLOCK}; big requests of {args.chunks} chunks; windows of {args.window} s", flush=True)
    loads = {k: EngineLoad(k, cuda) for k in load_names}  # the graph is captured before any server runs
    failures: list[str] = []
    results, ceilings, server_exit = [], {}, {}
    with tempfile.TemporaryDirectory(prefix="lmcache-contention-") as tmp:
        servers = {}
        try:
            for mode in dict.fromkeys(server_mode(p, args.device) for p in paths):
                if mode is not None:
                    servers[mode] = ServerProcess(mode, args, tmp)
            for s in servers.values():  # they start and pin at the same time
                s.connect()
            for layout in layouts:
                lr = LayoutRun(layout, args, failures)
                ceil = ceilings[layout] = lr.ceiling()
                print(f"\n## {layout}: {len(lr.kv)} layers, {lr.chunk_bytes / 2**20:.2f} MiB per chunk; memcpy "
                      f"ceiling of one {args.chunks}-chunk request: {ceil['d2h']:.1f} GB/s d2h, {ceil['h2d']:.1f} "
                      f"GB/s h2d, {ceil['both']:.1f} GB/s each way with both at once (N = {args.chunks})\n{HEADER}",
                      flush=True)
                for path in paths:
                    try:  # a broken path is a failure, and the others still run
                        run_path(path, lr, servers.get(server_mode(path, args.device)), loads, ceil, args, results)
                    except Exception as e:  # noqa: BLE001
                        traceback.print_exc()
                        failures.append(f"{path}/{layout}: {type(e).__name__}: {e}")
                        print(f"!!! {failures[-1]}", flush=True)
                del lr
                if cuda:
                    torch.cuda.empty_cache()
        finally:
            for mode, s in servers.items():
                rc = server_exit[mode] = s.stop()
                if rc != 0:
                    failures.append(f"server {mode} exited with {rc}:\n{s.log_tail()}")
    print(f"\n# all rows ({env['gpu'] or 'CPU'}, {env['date']})\n{LEGEND}\n{HEADER}")
    for row in results:
        print_row(row, ceilings[row["layout"]],
                  next(r for r in results if r["path"] == row["path"] and r["layout"] == row["layout"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "bench_engine_contention", "env": env, "config": vars(args), "ceilings_gbps": ceilings,
                       "results": results, "server_exit_codes": server_exit, "failures": failures}, f, indent=1)
    if failures:
        print("\n!!! FAILED:\n" + "\n".join(failures), flush=True)
        return 1
    print("\nbyte-exact: ALL PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
