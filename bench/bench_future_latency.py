"""How long after its reply a future that nobody reads for (concurrent.futures.wait, callbacks,
polling done()) resolves, after each kind of call a caller may have made before it.

A caller that waits with result() reads its own reply; the futures of other requests are read by
the client's I/O thread. Measured from the traces (one clock across both processes): from the
server's "sent" stamp to the client's "client resolved" stamp. The server (CPU device) runs in
its own process. The ceiling, measured in the same run (every other request): the same request
whose caller waits with result(), reading its reply itself as soon as it can be read (what the
transport itself takes).

    python bench/bench_future_latency.py [--iters 300] [--heartbeat 1.0] [--json out.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import shutil
import tempfile

from lmcache_mp import Client, shared_cpu_tensor
from server_process import ServerProcess

CHUNK = 32


def start_server(sock: str) -> ServerProcess:
    server = ServerProcess(["--url", f"ipc://{sock}", "--device", "cpu", "--l1-size", "64MiB", "--chunk-size",
                            str(CHUNK)], log_path=os.path.join(os.path.dirname(sock), "server.log"))
    server.wait_ready(60)
    return server


def lateness_ms(fut) -> float:
    stamps = dict(fut.trace)
    return (stamps["client resolved"] - stamps["sent"]) / 1e6


def run(c: Client, before: str, iters: int) -> list[float]:
    import torch

    kv = [shared_cpu_tensor((2, 16, 8, 2, 8), torch.float16)]
    handle = c.register_kv_cache(kv, model="m")
    blocks = list(range(CHUNK // 8))
    late, reader = [], []
    for i in range(2 * iters):
        key = [i.to_bytes(16, "little")]
        if before == "lookup()":
            c.lookup(key, model="m")
        elif before == "store().result()":
            c.store(handle, key, blocks).result(10)
        fut = c.lookup_async(key, model="m")
        if i % 2:
            fut.result(30)  # the ceiling: the caller reads its reply itself
            reader.append(lateness_ms(fut))
            continue
        done, _ = cf.wait([fut], timeout=30)
        assert done, "a future did not resolve within 30 s"
        late.append(lateness_ms(fut))
    c.unregister_kv_cache(handle)
    return late, reader


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--heartbeat", type=float, default=1.0, help="the clients' heartbeat interval (s)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="lmc-futures-")
    sock = os.path.join(folder, "srv.sock")
    server = start_server(sock)
    rows = []
    try:
        for lane in (True, False):
            for before in ("nothing", "lookup()", "store().result()"):
                with Client(f"ipc://{sock}", heartbeat_interval=args.heartbeat, trace=True, local_lane=lane) as c:
                    assert c._io.has_lane == lane
                    late, reader = map(sorted, run(c, before, args.iters))
                n = len(late)
                rows.append({"transport": "lane" if lane else "zeromq", "before": before, "futures": n,
                             "p50_ms": late[n // 2], "p99_ms": late[int(n * 0.99)], "max_ms": late[-1],
                             "over_5ms": sum(x > 5 for x in late), "reader_p50_ms": reader[len(reader) // 2],
                             "reader_p99_ms": reader[int(len(reader) * 0.99)]})
    finally:
        server.proc.kill()
        server.proc.wait(10)
        shutil.rmtree(folder, ignore_errors=True)  # a killed server leaves its socket files
    print(f"futures nobody reads for: reply sent -> future resolved (heartbeat {args.heartbeat} s)")
    print(f"{'transport':>9} {'call before':>17} {'n':>5} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'> 5 ms':>7}"
          f" {'result() p50':>13} {'p99':>7}  {'p50 / result()':>14}")
    for r in rows:
        print(f"{r['transport']:>9} {r['before']:>17} {r['futures']:>5} {r['p50_ms']:8.3f} {r['p99_ms']:8.3f} "
              f"{r['max_ms']:8.3f} {r['over_5ms']:>7} {r['reader_p50_ms']:13.3f} {r['reader_p99_ms']:7.3f}  "
              f"{r['p50_ms'] / r['reader_p50_ms']:14.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"heartbeat_s": args.heartbeat, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
