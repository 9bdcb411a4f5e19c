"""Soak: client processes hammer one server with random requests while some are SIGKILLed mid-flight.

Every client registers a small CPU KV cache under one shared model name and loops, at random:
store a prompt, look it up (with or without a lease), retrieve it (under the lease or not),
release or abandon leases. A chunk's bytes are a function of its key alone, so whatever any
client reads was written by some client, and every byte read is checked. Every few seconds one
client is killed (SIGKILL: no goodbye, stores and retrieves in flight) and a new one starts.
At the end the survivors close, and after the server's heartbeat timeout nothing may be left:
no leases, registrations, clients or half-written objects, and the server's heap may not have
grown past a bound.

    python bench/soak.py --seconds 600 --clients 6 --kill-every 2   # starts its own server
    python bench/soak.py --url tcp://127.0.0.1:5555 ...             # or uses a running one
                                                                     # (heartbeat timeout <= 5 s)

tests/test_soak.py runs a short one in CI.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_process import ServerProcess  # noqa: E402

CHUNK = 16  # tokens per chunk; the server must use the same
BLOCK = 8
LAYERS, HEADS, HEAD = 2, 2, 8  # float16: 32 bytes per token per K/V per layer
PROMPTS = 48  # distinct prompts shared by all clients
MAX_CHUNKS = 6  # chunks per prompt
MODEL = "soak"
LEASE_TTL = 5.0  # of the server started here


def _content(prompt: int, num_chunks: int) -> np.ndarray:
    """The KV bytes of a prompt's first chunks: [layers, 2, tokens, 32], a function of the prompt
    alone (a chunk's key is a function of the prompt's tokens up to its end)."""
    rng = np.random.default_rng(prompt)
    full = rng.integers(0, 256, (LAYERS, 2, MAX_CHUNKS * CHUNK, HEADS * HEAD * 2), dtype=np.uint8)
    return full[:, :, : num_chunks * CHUNK]


def _tokens(prompt: int) -> np.ndarray:
    return np.random.default_rng(10_000 + prompt).integers(0, 32000, MAX_CHUNKS * CHUNK)


def _views(kv: list) -> list:
    import torch

    return [t.view(torch.uint8).numpy().reshape(2, t.shape[1], BLOCK, HEADS * HEAD * 2) for t in kv]


def _write(views, blocks, data: np.ndarray) -> None:
    for layer, v in enumerate(views):
        for j, b in enumerate(blocks):
            v[:, b] = data[layer, :, j * BLOCK:(j + 1) * BLOCK]


def _read(views, blocks) -> np.ndarray:
    return np.stack([np.concatenate([v[:, b] for b in blocks], axis=1) for v in views])


def client_main(url: str, seed: int, seconds: float, q) -> None:
    try:
        q.put(("ok", seed, _client(url, seed, seconds)))
    except BaseException:
        q.put(("error", seed, traceback.format_exc()))


def _client(url: str, seed: int, seconds: float) -> dict:
    import torch

    from lmcache_mp import Client, chunk_hashes, shared_cpu_tensor

    rng = random.Random(seed)
    bpc = CHUNK // BLOCK
    nblocks = 2 * MAX_CHUNKS * bpc
    kv = [shared_cpu_tensor((2, nblocks, BLOCK, HEADS, HEAD), torch.float16) for _ in range(LAYERS)]
    views = _views(kv)
    client = Client(url, timeout=30, heartbeat_interval=0.25, name=f"soak-{seed}")
    handle = client.register_kv_cache(kv, model=MODEL)
    src, dst = list(range(MAX_CHUNKS * bpc)), list(range(MAX_CHUNKS * bpc, nblocks))
    stats = {"ops": 0, "stores": 0, "lookups": 0, "retrieves": 0, "releases": 0, "bytes_checked": 0}
    leases: list = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        prompt = rng.randrange(PROMPTS)
        n = rng.randint(1, MAX_CHUNKS)
        hashes = chunk_hashes(_tokens(prompt)[: n * CHUNK], CHUNK)
        op = rng.random()
        if op < 0.35:
            _write(views, src[: n * bpc], _content(prompt, n))
            r = client.store(handle, hashes, src[: n * bpc]).result(30)
            assert r.stored + r.present + r.skipped == n, r
            stats["stores"] += 1
        elif op < 0.55:
            found = client.lookup(hashes, model=MODEL, lock=rng.random() < 0.5)
            assert 0 <= found <= n
            if found.lease:
                leases.append((found.lease, hashes[: int(found)], prompt, time.monotonic()))
            stats["lookups"] += 1
        elif op < 0.85:
            lease, names, p, taken = leases.pop(rng.randrange(len(leases))) if leases and rng.random() < 0.6 \
                else (0, hashes, prompt, 0.0)
            k = len(names)
            loaded = client.retrieve(handle, names, dst[: k * bpc], lease=lease).result(30).loaded
            if lease and time.monotonic() - taken < LEASE_TTL / 2:  # an older one may have expired
                assert loaded == k, f"a leased prefix of {k} chunks came back as {loaded}"
            if loaded:
                got = _read(views, dst[: loaded * bpc])
                want = _content(p, loaded)
                assert np.array_equal(got, want), f"prompt {p}: bytes differ in the first {loaded} chunks"
                stats["bytes_checked"] += got.nbytes
            stats["retrieves"] += 1
        elif leases:
            lease, names, _, _ = leases.pop(rng.randrange(len(leases)))
            client.release(names[: rng.randint(1, len(names))] if rng.random() < 0.5 else None, lease=lease)
            stats["releases"] += 1
        stats["ops"] += 1
    client.close()
    return stats


def _rss_anon_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    return 0


def run_soak(url: str, server_pid: int | None, *, clients: int = 4, seconds: float = 30.0,
             kill_every: float = 3.0, heartbeat_timeout: float = 1.0, seed: int = 0) -> dict:
    """Run the soak against a server; returns counts and what was left behind at the end."""
    from lmcache_mp import Client

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    rng = random.Random(seed)
    procs: dict[int, mp.Process] = {}
    next_seed = seed * 1000

    def spawn(left: float) -> None:
        nonlocal next_seed
        next_seed += 1
        proc = ctx.Process(target=client_main, args=(url, next_seed, left, q), daemon=True)
        proc.start()
        procs[next_seed] = proc

    watcher = Client(url, timeout=30)
    rss0 = _rss_anon_kib(server_pid) if server_pid else 0
    t0 = time.monotonic()
    for _ in range(clients):
        spawn(seconds)
    killed, results, errors = 0, [], []
    next_kill = t0 + kill_every
    while time.monotonic() < t0 + seconds:
        time.sleep(0.1)
        if time.monotonic() >= next_kill:
            next_kill += kill_every
            alive = [s for s, pr in procs.items() if pr.is_alive()]
            if alive:
                victim = rng.choice(alive)
                os.kill(procs[victim].pid, signal.SIGKILL)
                procs[victim].join(10)
                for f in Path("/dev/shm").glob(f"lmcache_mp_{procs[victim].pid}_*"):
                    f.unlink(missing_ok=True)  # a killed process cannot remove its caches
                del procs[victim]
                killed += 1
                spawn(max(1.0, t0 + seconds - time.monotonic()))
    deadline = time.monotonic() + 120
    while procs and time.monotonic() < deadline:
        try:
            status, s, payload = q.get(timeout=1)
        except Exception:  # noqa: BLE001 - queue.Empty: check who is still alive
            for s2 in [s2 for s2, pr in procs.items() if not pr.is_alive()]:
                errors.append(f"client {s2} exited with code {procs.pop(s2).exitcode} and no result")
            continue
        (results if status == "ok" else errors).append(payload)
        proc = procs.pop(s, None)
        if proc is not None:
            proc.join(10)
    while not q.empty():  # results of clients killed just after they finished
        status, _, payload = q.get()
        if status != "ok":
            errors.append(payload)
    # The killed clients are forgotten (their process seen gone, or their heartbeats missed) and
    # what they held goes: waited for, not slept on (a loaded machine takes longer); whatever is
    # still held after a generous while is reported as left behind.
    deadline = time.monotonic() + heartbeat_timeout + 30
    while True:
        st = watcher.status()
        if not (st["l1"]["leases"] or st["l1"]["writing"] or st["registrations"]) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    watcher.close()
    report = {
        "seconds": round(time.monotonic() - t0, 1),
        "clients_started": next_seed - seed * 1000,
        "clients_killed": killed,
        "ops": sum(r["ops"] for r in results),
        "stores": sum(r["stores"] for r in results),
        "lookups": sum(r["lookups"] for r in results),
        "retrieves": sum(r["retrieves"] for r in results),
        "releases": sum(r["releases"] for r in results),
        "bytes_checked": sum(r["bytes_checked"] for r in results),
        "errors": errors,
        "left_leases": st["l1"]["leases"],
        "left_leased_objects": st["l1"]["leased_objects"],
        "left_writing": st["l1"]["writing"],
        "left_registrations": len(st["registrations"]),
        "server_heap_growth_kib": _rss_anon_kib(server_pid) - rss0 if server_pid else None,
    }
    return report


def start_server(l1: str, heartbeat_timeout: float) -> ServerProcess:
    """A CPU-device server process (its log in a file: a long run never blocks on a full pipe)."""
    server = ServerProcess(["--device", "cpu", "--l1-size", l1, "--chunk-size", str(CHUNK),
                            "--heartbeat-timeout", str(heartbeat_timeout), "--lease-ttl", str(LEASE_TTL)])
    server.wait_ready()
    return server


def problems(report: dict, heap_bound_kib: int) -> list[str]:
    out = [f"client error: {e}" for e in report["errors"]]
    for k in ("left_leases", "left_leased_objects", "left_writing", "left_registrations"):
        if report[k]:
            out.append(f"{k} = {report[k]}")
    growth = report["server_heap_growth_kib"]
    if growth is not None and growth > heap_bound_kib:
        out.append(f"the server's heap grew by {growth} KiB (bound {heap_bound_kib})")
    if not report["bytes_checked"] or not report["clients_killed"]:
        out.append("nothing was checked or nobody was killed: the soak proved nothing")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (CPU device, chunk size 16); default: start one")
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--kill-every", type=float, default=3.0)
    ap.add_argument("--l1-size", default="8MiB", help="L1 of the server started here (small: evictions)")
    ap.add_argument("--heap-bound", type=int, default=64 << 10, help="KiB the server's heap may grow")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)
    server = None
    url, pid, hb = args.url, None, 1.0
    if url is None:
        server = start_server(args.l1_size, hb)
        url, pid = server.url, server.pid
    try:
        report = run_soak(url, pid, clients=args.clients, seconds=args.seconds, kill_every=args.kill_every,
                          heartbeat_timeout=hb if server else 5.0)
    finally:
        if server is not None:
            server.stop(30)
    print(json.dumps({k: v for k, v in report.items() if k != "errors"}, indent=1))
    bad = problems(report, args.heap_bound)
    for line in bad:
        print("!!", line[:2000], file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
