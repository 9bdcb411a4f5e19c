"""One load-generator worker process: a synthetic KV cache, timed store / lookup / retrieve
phases against a running server, and a bit-for-bit check of everything retrieved.

Spawned by `lmcache_mp.loadgen.runs.run_workers`. A CPU cache is NumPy arrays in shared memory, so
the bench needs no torch there; torch is imported only for a CUDA cache (inside functions: the
package must stay importable without it). Each worker fills its KV cache with random bits and
then, phases separated by barriers, each begun by WARM_UP untimed requests:

  store     `requests` requests of `chunks` chunks each (distinct tokens -> distinct chunk
            hashes), one at a time, each from a different permutation of the first half of
            the blocks
  lookup    `lookups` lookups of `chunks` hashes each
  retrieve  every stored request into the second half of the blocks (wait="host")

then checks every retrieved request against its source blocks (the last timed retrieve in
place, the others retrieved again untimed): chunks not loaded are *missing* (evicted, or never
stored), loaded chunks whose bits differ are *mismatches* (corruption). Last, a few traced
lookups and retrieves, each after 20 ms without requests (an engine sends its requests once per
step, and the server's threads may go to sleep in between).
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
import traceback

import numpy as np

from lmcache_mp.errors import LMCacheMPError, ServerUnavailable
from lmcache_mp.server.ops.gc_pauses import GCPauses

DTYPE_BYTES = 2  # bfloat16
WARM_UP = 3  # untimed requests that begin each phase, of chunks of their own
IDLE_REQUESTS, IDLE_GAP_S = 5, 0.02  # lookups and retrieves that each come after this long without requests
LAYOUTS = {
    "llama3-8b": dict(kind="mha", layers=32, heads=8, head_size=128, block_size=16),
    "mla": dict(kind="mla", layers=61, dim=576, block_size=16),
}


# ---- geometry -------------------------------------------------------------------------------

def kv_shape(lay: dict, num_blocks: int) -> tuple:
    if lay["kind"] == "mha":
        return (2, num_blocks, lay["block_size"], lay["heads"], lay["head_size"])
    return (num_blocks, lay["block_size"], lay["dim"])


def object_bytes(lay: dict, chunk: int) -> int:
    if lay["kind"] == "mha":
        return 2 * lay["layers"] * chunk * lay["heads"] * lay["head_size"] * DTYPE_BYTES
    return lay["layers"] * chunk * lay["dim"] * DTYPE_BYTES


def random_kv(lay: dict, num_blocks: int, cuda: bool, seed: int) -> list:
    """One KV tensor per layer full of random bits: bfloat16 on CUDA, or 16-bit integers in CPU
    shared memory (NumPy: only the bytes matter to the server)."""
    shape = kv_shape(lay, num_blocks)
    if not cuda:
        from lmcache_mp import shared_cpu_array

        rng = np.random.default_rng(seed)
        kv = [shared_cpu_array(shape, np.int16, fill=None) for _ in range(lay["layers"])]
        for a in kv:
            a[...] = rng.integers(-(1 << 15), 1 << 15, size=shape, dtype=np.int16)
        return kv
    import torch

    kv = [torch.empty(shape, dtype=torch.bfloat16, device="cuda") for _ in range(lay["layers"])]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for t in kv:
        t.view(torch.uint8).random_(0, 256, generator=gen)
    torch.cuda.synchronize()
    return kv


def bits(t):
    """A layer as 16-bit integers (random bits include NaNs, which never equal themselves: compare
    bit patterns), and how to index it with a NumPy array of block ids (on its device)."""
    if isinstance(t, np.ndarray):
        return t, np.asarray
    import torch

    return t.view(torch.int16), lambda ids: torch.as_tensor(ids, device=t.device)


def request_ids(seed: tuple, half: int, offset: int) -> np.ndarray:
    """A permutation of the `half` blocks starting at `offset` (a request's block table)."""
    return (offset + np.random.default_rng(list(seed)).permutation(half)).astype(np.int64)


def request_tokens(seed: tuple, n_tokens: int) -> np.ndarray:
    return np.random.default_rng(list(seed)).integers(0, 1 << 31, n_tokens, dtype=np.int64)


# ---- the worker process -----------------------------------------------------------------------

def count_mismatches(kv: list, kind: str, src: np.ndarray, dst: np.ndarray, n: int, loaded: int) -> int:
    """How many of the first `loaded` of n chunks (src and dst: their n * blocks-per-chunk block
    ids) differ from their source blocks in any bit. Chunks not loaded are missing, counted apart:
    a miss is not corruption. (Works on NumPy arrays and torch tensors alike.)"""
    if loaded == 0:
        return 0
    per = len(src) // n
    bad = None
    for t in kv:
        b, ids = bits(t)
        s, d = ids(src[: loaded * per]), ids(dst[: loaded * per])
        if kind == "mha":
            differ = (b[:, s] != b[:, d]).reshape(2, loaded, -1).any(2).any(0)
        else:
            differ = (b[s] != b[d]).reshape(loaded, -1).any(1)
        bad = differ if bad is None else bad | differ
    return int(bad.sum())


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def waited(fut):
    """The future, once it has its result."""
    fut.result()
    return fut


class Reporter:
    """What a worker tells the bench: the phase it begins (a failure names it) and the counts of
    each phase it finished (the bench prints them once every worker has)."""

    def __init__(self, wid: int, q):
        self.wid, self._q = wid, q
        self.phase = "start-up"

    def begin(self, phase: str) -> None:
        self.phase = phase
        self._q.put((self.wid, "phase", phase))

    def done(self, phase: str, **counts) -> None:
        self._q.put((self.wid, "progress", (phase, counts)))


def bench_worker(cfg: dict, wid: int, barrier, reporter: Reporter) -> dict:
    """cfg: url, device, geometry (a LAYOUTS entry), model (name prefix), chunks, requests,
    lookups, tp, workers, run, timeout, gpu_uuids (one per worker on cuda)."""
    from lmcache_mp import Client, chunk_hashes

    lay = cfg["geometry"]
    cuda = cfg["device"] == "cuda"
    info: dict = {"wid": wid, "pid": os.getpid()}
    reporter.begin("register")
    if cuda:
        import torch

        if torch.cuda.device_count() != 1:
            raise RuntimeError(f"worker {wid} sees {torch.cuda.device_count()} GPUs, expected exactly 1 "
                               f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})")
        torch.cuda.set_device(0)
        uuid = f"GPU-{torch.cuda.get_device_properties(0).uuid}"
        if uuid != cfg["gpu_uuids"][wid]:
            raise RuntimeError(f"worker {wid} is on {uuid}, expected {cfg['gpu_uuids'][wid]}")
        info["gpu_uuid"] = uuid
    timeout = cfg["timeout"]
    trace = bool(cfg.get("trace"))

    def traced(i: int) -> bool:
        """Tracing: every other request carries a trace; the others give the latencies (the
        stamps cost a few microseconds of their own)."""
        return trace and i % 2 == 1

    client = Client(cfg["url"], timeout=timeout, name=f"bench-w{wid}")
    traces: dict[str, list] = {"store": [], "lookup": [], "retrieve": []}
    spans: dict[str, list] = {"store": [], "lookup": [], "retrieve": []}  # (start, end) ns of the timed ones

    def timed(i: int, kind: str, latencies: list, call, trace_of):
        """call() as request i: traced (its trace, trace_of(result), goes to traces[kind]) or
        timed (into latencies and spans[kind])."""
        client.trace = traced(i)
        t0 = time.monotonic_ns()
        result = call()
        t1 = time.monotonic_ns()
        if client.trace:
            traces[kind].append(trace_of(result) + [("returned", t1)])
        else:
            latencies.append((t1 - t0) / 1e9)
            spans[kind].append((t0, t1))
        return result
    chunk = client.chunk_size
    bpc = chunk // lay["block_size"]
    n = cfg["chunks"]
    R = cfg["requests"]
    half = n * bpc
    nb = 2 * half + bpc  # the first half is the source, the second the destination, + warm-up
    tp = cfg["tp"]
    world, rank = (cfg["workers"], wid) if tp else (1, 0)
    model = cfg["model"] + ("" if tp else f"-w{wid}")
    # MLA under TP: every rank holds the same bytes (as in a real engine), stored once, read by all.
    shared = tp and lay["kind"] == "mla"
    data_seed = 1000 * cfg["run"] + (0 if shared else wid + 1)

    kv = random_kv(lay, nb, cuda, data_seed)
    handle = client.register_kv_cache(kv, model=model, world_size=world, rank=rank, layout=lay["kind"])
    reporter.done("registered", **{"KV caches": 1, "blocks": nb})
    info.update(model=model, rank=rank, world_size=world, layout=handle.layout, shared=handle.shared,
                object_bytes=handle.object_bytes, transfer_mode=handle.transfer_mode)
    obj = handle.object_bytes

    # Token ids: per request, and per worker unless the workers are ranks of one model.
    tok_seed = (cfg["run"],) if tp else (cfg["run"], wid + 1)
    hashes = [chunk_hashes(request_tokens(tok_seed + (r,), n * chunk), chunk) for r in range(R)]
    src = [request_ids((r, 0), half, 0) for r in range(R)]
    dst = [request_ids((r, 1), half, half) for r in range(R)]

    # Each phase starts with untimed requests of warm-up chunks (blocks of their own): after a
    # barrier the server's threads and the GPU have sat idle, and the first requests pay for
    # waking them (the idle requests at the end measure that on purpose).
    warm_ids = np.arange(2 * half, nb, dtype=np.int64)
    warm = [chunk_hashes(request_tokens(tok_seed + (R, 9, k), chunk), chunk) for k in range(WARM_UP)]

    # An engine freezes its start-up heap out of the garbage collector once warmed up (vLLM's
    # freeze_gc_heap), so a collection walks only what it allocated since: so does this one.
    gc.collect()
    gc.freeze()

    # (a) store
    gc_pauses = GCPauses(keep=None)  # the tails are checked against them
    reporter.begin("store")
    barrier.wait(timeout)
    if any(client.store(handle, h, warm_ids).result().chunks != 1 for h in warm):
        raise RuntimeError("warm-up store failed")
    # Every worker's warm-up chunks are older than any checked one: in a run that fills L1 they are
    # evicted first (the bench says so before it starts).
    barrier.wait(timeout)
    lat_store, stored, present, skipped = [], 0, 0, 0
    t_phase = time.perf_counter()
    for r in range(R):
        res = timed(r, "store", lat_store, lambda: waited(client.store(handle, hashes[r], src[r])),
                    lambda fut: fut.trace).result()
        stored, present, skipped = stored + res.stored, present + res.present, skipped + res.skipped
    store_wall = time.perf_counter() - t_phase
    reporter.done("store", requests=R, chunks=stored + present)
    barrier.wait(timeout)
    if wid == 0:  # every worker is registered now: the server says which transfer mode each uses
        info["status_registrations"] = [
            {k: reg.get(k) for k in ("model", "rank", "world_size", "layout", "device", "transfer_mode",
                                     "object_bytes")}
            for reg in client.status()["registrations"] if str(reg.get("model", "")).startswith(cfg["model"])
        ]

    # (b) lookup (a shared MLA chunk may be another rank's: every rank stored its own by now)
    reporter.begin("lookup")
    barrier.wait(timeout)
    for h in warm:  # (in a run that overflows L1 they may be gone: that is counted below, not here)
        client.lookup(h, model=model, world_size=world)
    lat_lookup, lat_bare, lookup_short = [], [], 0
    bare = BareRoundTrip(cfg["echo_url"], client, model, world, hashes[0]) if cfg.get("echo_url") else None
    for i in range(cfg["lookups"]):
        if bare is not None:  # alternately, so that both see the same machine state
            lat_bare.append(bare())
        hits = timed(i, "lookup", lat_lookup, lambda: client.lookup(hashes[i % R], model=model, world_size=world),
                     lambda _: client.last_trace())
        lookup_short += hits != n
    if bare is not None:
        bare.close()
    reporter.done("lookup", lookups=cfg["lookups"], **({"bare round trips": len(lat_bare)} if bare is not None else {}))

    # (c) retrieve
    reporter.begin("retrieve")
    barrier.wait(timeout)
    for h in warm:
        client.retrieve(handle, h, warm_ids).result()
    lat_retrieve, loaded_per_request = [], []
    t_phase = time.perf_counter()
    for r in range(R):
        res = timed(r, "retrieve", lat_retrieve,
                    lambda: waited(client.retrieve(handle, hashes[r], dst[r], wait="host")),
                    lambda fut: fut.trace).result()
        loaded_per_request.append(res.loaded)
    retrieve_wall = time.perf_counter() - t_phase
    reporter.done("retrieve", requests=R, chunks=int(sum(loaded_per_request)))
    gc_pauses.close()
    pauses = list(gc_pauses.recent)
    barrier.wait(timeout)  # nobody verifies while another worker is still timing

    # verification: the last timed retrieve in place, every other request retrieved again
    reporter.begin("verify")
    mismatches = count_mismatches(kv, lay["kind"], src[R - 1], dst[R - 1], n, loaded_per_request[R - 1])
    missing = n - loaded_per_request[R - 1]
    for r in range(R - 1):
        res = client.retrieve(handle, hashes[r], dst[r]).result()
        missing += n - res.loaded
        mismatches += count_mismatches(kv, lay["kind"], src[r], dst[r], n, res.loaded)
    reporter.done("verify", **{"chunks checked": R * n - missing, "missing": missing, "mismatching": mismatches})

    # after a quiet gap, as an engine's requests come (one per step, not back to back), traced;
    # the engine computes meanwhile, so this thread stays busy (a sleeping one would add its
    # own wake-up to the request)
    reporter.begin("requests after idle gaps")
    idle: dict[str, list] = {"lookup": [], "retrieve": []}
    client.trace = True
    for k in range(IDLE_REQUESTS):
        busy(IDLE_GAP_S)
        client.lookup(hashes[k % R], model=model, world_size=world)
        idle["lookup"].append(client.last_trace() + [("returned", time.monotonic_ns())])
        busy(IDLE_GAP_S)
        fut = waited(client.retrieve(handle, hashes[k % R], dst[k % R], wait="host"))
        idle["retrieve"].append(fut.trace + [("returned", time.monotonic_ns())])
    client.trace = False
    reporter.done("requests after idle gaps", lookups=IDLE_REQUESTS, retrieves=IDLE_REQUESTS)

    reporter.begin("unregister")
    barrier.wait(timeout)
    client.unregister_kv_cache(handle)
    client.close()
    info.update(
        store_latency_s=lat_store, retrieve_latency_s=lat_retrieve, lookup_latency_s=lat_lookup,
        bare_latency_s=lat_bare, traces=traces if trace else {}, idle_traces=idle, spans_ns=spans, gc_pauses_ns=pauses,
        store_wall_s=store_wall, retrieve_wall_s=retrieve_wall,
        stored_chunks=stored, present_chunks=present, skipped_chunks=skipped,
        loaded_chunks=int(sum(loaded_per_request)), requested_chunks=R * n,
        store_bytes=stored * obj, retrieve_bytes=int(sum(loaded_per_request)) * obj,
        lookups_short=int(lookup_short), missing=missing, mismatches=mismatches,
    )
    return info


class BareRoundTrip:
    """A bare pyzmq DEALER round trip, to an echo peer in its own process, of a lookup's size:
    the ceiling of a lookup."""

    def __init__(self, url: str, client, model: str, world: int, hashes: list[bytes]):
        import zmq

        from lmcache_mp import protocol as p

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.connect(url)
        self._frames = (p.pack_request_id(1), p.encode(p.Lookup(client_id=client.client_id, model=model,
                                                               world_size=world, hashes=b"".join(hashes))))
        for _ in range(20):
            self()

    def __call__(self) -> float:
        t0 = time.perf_counter()
        self._sock.send_multipart(self._frames)
        self._sock.recv_multipart()
        return time.perf_counter() - t0

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


def worker_main(cfg: dict, wid: int, barrier, q, body) -> None:
    """A worker process: body(cfg, wid, barrier, reporter)'s result on q as (wid, "ok", result),
    or (wid, "fail", {phase, error, traceback, after_another, server_gone}); the traceback only for
    an error that is not the server's or the connection's (a bug)."""
    reporter = Reporter(wid, q)
    try:
        q.put((wid, "ok", body(cfg, wid, barrier, reporter)))
    except BaseException as e:
        with contextlib.suppress(Exception):
            barrier.abort()  # the others stop waiting at the next barrier
        after_another = isinstance(e, threading.BrokenBarrierError)
        bug = not (after_another or isinstance(e, LMCacheMPError))
        q.put((wid, "fail", {"phase": reporter.phase, "error": f"{type(e).__name__}: {e}",
                             "traceback": traceback.format_exc() if bug else "", "after_another": after_another,
                             "server_gone": isinstance(e, ServerUnavailable)}))
