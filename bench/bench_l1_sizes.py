"""L1 shared by two object sizes: a new layout's working set after an old layout filled L1, and two
layouts at once next to an ideal LRU by bytes. Starts its own server, then runs lmcache-mp-bench.

  1. --big-runs runs of Llama-3-8B chunks (32 MiB), each --workers x --big-requests requests of
     16 chunks: together more than L1, so L1 ends full of them;
  2. one run of MLA chunks (--mla-layers layers, 2.25 MiB at 8) whose working set fits L1 well:
     it must find every chunk again (0 missing), the old Llama chunks making room;
  3. lmcache-mp-bench --mix: both layouts at once, engine-like requests, hit ratios next to an
     ideal LRU by bytes replaying the same requests.

    python bench/bench_l1_sizes.py --device cuda --l1-size 16GiB --json l1_sizes.json
    python bench/bench_l1_sizes.py --device cpu --l1-size 1GiB --workers 1 --big-requests 10 \\
        --big-chunks 4 --mla-requests 12
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from lmcache_mp import Client
from lmcache_mp.loadgen import cli as loadgen
from server_process import ServerProcess


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--l1-size", default="16GiB")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--big-runs", type=int, default=2)
    ap.add_argument("--big-chunks", type=int, default=16)
    ap.add_argument("--big-requests", type=int, default=5)
    ap.add_argument("--mla-layers", type=int, default=8)
    ap.add_argument("--mla-requests", type=int, default=20)
    ap.add_argument("--mix-prompts", type=int, default=64)
    ap.add_argument("--mix-requests", type=int, default=300)
    ap.add_argument("--json", help="write every run's figures here")
    args = ap.parse_args(argv)

    server = ServerProcess(["--device", args.device, "--l1-size", args.l1_size])
    out: dict = {"config": vars(args), "runs": []}
    try:
        url = server.wait_ready(60)
        client = Client(url, timeout=60)
        _wait_pinned(client)
        tmp = Path(tempfile.mkdtemp())
        common = ["--url", url, "--workers", str(args.workers)]
        runs = [("llama", common + ["--chunks", str(args.big_chunks), "--requests", str(args.big_requests)])
                for _ in range(args.big_runs)]
        runs.append(("mla", common + ["--layout", "mla", "--layers", str(args.mla_layers), "--chunks", "16",
                                      "--requests", str(args.mla_requests)]))
        for i, (name, argv_) in enumerate(runs):
            path = tmp / f"run{i}.json"
            rc = loadgen.main(argv_ + ["--json", str(path)])
            row = json.loads(path.read_text())["rows"][0]
            keep = {k: row.get(k) for k in ("requested_chunks", "stored_chunks", "loaded_chunks", "missing",
                                             "mismatches", "evicted", "lookups_short", "store_GBps", "retrieve_GBps")}
            out["runs"].append({"layout": name, "rc": rc, **keep, "sizes_after": client.status()["l1"]["sizes"]})
            print(f"== {name}: {keep}", flush=True)
        path = tmp / "mix.json"
        rc = loadgen.main(["--url", url, "--workers", "1", "--chunks", "4", "--mix", f"mla:{args.mla_layers}",
                           "--prompts", str(args.mix_prompts), "--requests", str(args.mix_requests), "--json",
                           str(path)])
        out["mix"] = {"rc": rc, "rows": json.loads(path.read_text())["rows"]}
        out["l1_after"] = client.status()["l1"]
        client.close()
    finally:
        server.stop(120)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    bad = [r for r in out["runs"][args.big_runs:] if r["missing"] or r["mismatches"]]
    return 1 if bad or any(r["mismatches"] for r in out["runs"]) else 0


def _wait_pinned(client: Client, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not client.status()["l1"]["pinning"]["done"] and time.monotonic() < deadline:
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
