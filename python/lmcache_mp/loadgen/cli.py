"""lmcache-mp-bench: a load generator for a running lmcache-mp server, in the spirit of
redis-benchmark.

Starts --workers worker processes, each with a synthetic KV cache (CPU shared memory, or a GPU
on --device cuda, spread round-robin over --gpus GPUs with each worker seeing only its own),
which store, look up and retrieve whole requests through `Client`, then verify every byte they
got back (see lmcache_mp.loadgen.worker for the phases). Prints aggregate GB/s per phase (bytes
moved by all workers / the slowest worker's phase wall time) and request latency percentiles.

    lmcache-mp-server --device cpu --url tcp://127.0.0.1:5555 --l1-size 8GiB &
    lmcache-mp-bench --url tcp://127.0.0.1:5555 --workers 2 --chunks 8 --requests 4

Each run uses model names of its own, so runs never see each other's chunks; what they store
stays in the server's L1 until evicted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import signal
import sys
import threading
import time

from lmcache_mp.sizes import format_size
from lmcache_mp.loadgen.mix import bench_mix
from lmcache_mp.loadgen.runs import (DEFAULT_URL, TABLE_NOTE, banner, geometry, gpu_uuids, print_table, run_once,
                                     worker_env_defaults, worker_settings)
from lmcache_mp.loadgen.trace import echo_peer
from lmcache_mp.loadgen.worker import LAYOUTS, WARM_UP, object_bytes
from lmcache_mp.native import ARENA_SLOT_ALIGN

# ---- lmcache-mp-bench -------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lmcache-mp-bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=DEFAULT_URL, help=f"the server's endpoint (default {DEFAULT_URL})")
    ap.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None,
                    help="where the workers' KV caches live (default: the server's device)")
    ap.add_argument("--gpus", type=int, default=1, help="cuda: spread the workers round-robin over this many GPUs")
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="llama3-8b")
    ap.add_argument("--layers", type=int, help="override the layout's layer count")
    ap.add_argument("--heads", type=int, help="override the layout's KV heads (MHA)")
    ap.add_argument("--head-size", type=int, help="override the layout's head size (MLA: latent dim)")
    ap.add_argument("--block-size", type=int, help="override the layout's tokens per block")
    ap.add_argument("--chunks", type=int, default=16, help="chunks per request (default 16)")
    ap.add_argument("--requests", type=int, default=4, help="requests stored and retrieved per worker (default 4)")
    ap.add_argument("--lookups", type=int, default=200, help="lookups per worker (default 200)")
    ap.add_argument("--tp", action="store_true",
                    help="the workers are TP ranks of one model (default: separate models)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds a worker waits on a request or barrier")
    ap.add_argument("--connect-timeout", type=float, default=5, help="seconds to wait for the server's handshake")
    ap.add_argument("--mix", metavar="LAYOUT[:LAYERS]",
                    help="run --workers workers of this second layout beside those of --layout, as engines "
                         "serving prompts (lookup, retrieve the hits, store the rest), and compare hit ratios "
                         "with an ideal LRU by bytes")
    ap.add_argument("--prompts", type=int, default=32, help="--mix: distinct prompts per worker (default 32)")
    ap.add_argument("--skew", type=float, default=1.0,
                    help="--mix: prompt popularity ~ 1/rank**skew (0: uniform; default 1)")
    add_tail_args(ap)
    ap.add_argument("--json", help="write the results here")
    return ap


def add_tail_args(ap: argparse.ArgumentParser) -> None:
    """--trace and --stall-probe (also bench/bench_server.py's)."""
    ap.add_argument("--trace", action="store_true",
                    help="time the stages of every other request on client and server and print the medians "
                         "(the latencies come from the untraced ones)")
    ap.add_argument("--stall-probe", action="store_true",
                    help="run a process that only reads the clock beside the workers, and check the slow "
                         "requests against its stalls (it takes a CPU core of its own)")


class Stopped(KeyboardInterrupt):
    """SIGTERM, taken as Ctrl-C: the bench unwinds, ending its workers and helpers on the way."""


def _stop(signum, frame):
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)  # the clean-up on the way out runs once, uninterrupted
    raise Stopped(signum)


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if min(args.workers, args.chunks, args.requests, args.gpus) < 1 or args.lookups < 0:
        ap.error("--workers, --chunks, --requests and --gpus must be positive")
    try:
        lay = geometry(args.layout, args.layers, args.heads, args.head_size, args.block_size)
        mix = None
        if args.mix:
            name, _, layers = args.mix.partition(":")
            if name not in LAYOUTS:
                raise ValueError(f"--mix: unknown layout {name!r} (one of {', '.join(sorted(LAYOUTS))})")
            mix = geometry(name, int(layers) if layers else None, block_size=args.block_size)
    except ValueError as e:
        ap.error(str(e))
    if args.prompts < 1 or args.skew < 0:
        ap.error("--prompts must be positive and --skew not negative")
    from lmcache_mp.client.endpoint import check_url

    try:
        check_url(args.url)
    except ValueError as e:
        print(f"lmcache-mp-bench: --url: {e}", file=sys.stderr)
        return 2
    handlers = {}
    if threading.current_thread() is threading.main_thread():  # (main() called from a thread: no signals)
        handlers = {s: signal.signal(s, _stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _connect_and_run(args, lay, mix)
    except KeyboardInterrupt as e:
        signum = e.args[0] if isinstance(e, Stopped) else signal.SIGINT
        print(f"lmcache-mp-bench: stopped by {signal.Signals(signum).name}; its workers and helpers have ended",
              file=sys.stderr)
        return 128 + signum
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)


def _connect_and_run(args, lay: dict, mix: dict | None) -> int:
    from lmcache_mp import Client, ProtocolMismatch, ServerUnavailable
    from lmcache_mp.client.endpoint import nothing_listens

    try:
        client = Client(args.url, connect_timeout=args.connect_timeout, timeout=60, name="lmcache-mp-bench")
    except ServerUnavailable as e:  # the client says what is there (nothing, a server refusing its CURVE keys)
        start = f" (start one with: lmcache-mp-server --url {args.url})" if nothing_listens(args.url) else ""
        print(f"lmcache-mp-bench: {e}{start}", file=sys.stderr)
        return 1
    except ProtocolMismatch as e:
        print(f"lmcache-mp-bench: {e}", file=sys.stderr)
        return 1
    try:
        if mix is None:
            return _bench(args, lay, client)
        return bench_mix(args, lay, mix, client)
    finally:
        client.close()


def l1_holds(l1: dict, object_bytes: int) -> int:
    """How many chunk objects of this size the server's L1 holds (in whole slabs of slots)."""
    slab = l1["arena"]["slab_bytes"]
    slot = -(-object_bytes // ARENA_SLOT_ALIGN) * ARENA_SLOT_ALIGN
    return l1["capacity"] // slab * (slab // slot) if slot <= slab else 0


def _bench(args, lay: dict, client) -> int:
    status = client.status()
    server_device = status["device"]
    args.device = args.device or server_device
    if args.device != server_device:
        print(f"lmcache-mp-bench: the server at {args.url} runs on device {server_device}; --device {args.device} "
              f"needs a server started with --device {args.device}", file=sys.stderr)
        return 2
    chunk = client.chunk_size
    if chunk % lay["block_size"]:
        print(f"lmcache-mp-bench: the server's chunk of {chunk} tokens is not a whole number of blocks of "
              f"{lay['block_size']} tokens (--block-size)", file=sys.stderr)
        return 2
    obj = object_bytes(lay, chunk)
    req_bytes = args.chunks * obj
    capacity = status["l1"].get("capacity", 0)
    fits = l1_holds(status["l1"], obj)
    checked = args.workers * args.requests * args.chunks
    warm = args.workers * WARM_UP  # stored before the checked ones: the first to be evicted
    if checked > fits:
        print(f"warning: this run stores {checked} chunks of {format_size(obj)} and checks them all, more than the "
              f"server's L1 of {format_size(capacity)} holds ({fits}): evictions will show up as missing chunks",
              file=sys.stderr)
    elif checked + warm > fits:
        print(f"note: the server's L1 holds {fits} chunks of {format_size(obj)}: beside the {checked} this run checks, "
              f"{checked + warm - fits} of its {warm} warm-up chunks will be evicted (they are stored first)",
              file=sys.stderr)
    uuids: list[str] = []
    gpu_names: list[str] = []
    if args.device == "cuda":
        worker_env_defaults()
        try:
            uuids, gpu_names = gpu_uuids(args.gpus)
        except RuntimeError as e:
            print(f"lmcache-mp-bench: {e}", file=sys.stderr)
            return 2
    else:
        args.gpus = 1

    print(banner(args, obj, req_bytes, gpu_names), flush=True)
    print(f"server {args.url}: device {server_device}, chunk {chunk} tokens, L1 {format_size(capacity)} "
          f"({format_size(status['l1'].get('bytes_used', 0))} in use)", flush=True)
    model = f"bench-{args.layout}-{secrets.token_hex(4)}"  # chunks of this run only
    with echo_peer() as args.echo_url:
        settings = worker_settings(args, args.url, lay, model, run=0)
        row, record, clean = run_once(client, settings, args.workers, uuids, chunk, own_l1=False)
    if "error" in row:  # run_once said why
        return 1
    print()
    print_table([row], TABLE_NOTE)
    print(f"transfer mode (server status): {row['transfer_mode']}")
    if args.json:
        result = {
            "bench": "lmcache-mp-bench",
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "config": {**vars(args), "chunk_size": chunk, "geometry": lay, "model": model, "object_bytes": obj,
                       "request_bytes": req_bytes},
            "host": {"platform": platform.platform(), "python": platform.python_version(),
                     "cpus": os.cpu_count(), "gpus": gpu_names, "gpu_uuids": uuids},
            "server": {k: status.get(k) for k in ("version", "pid", "device", "chunk_size")}
                      | {"l1_before": status["l1"]},
            "rows": [row],
            "runs": [record],
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"wrote {args.json}")
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
