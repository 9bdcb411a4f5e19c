"""The SGLang HiCache storage backend against the real sglang package (pinned, CPU build).

Runs only where sglang is importable (`.ci/run` makes a virtualenv of its own for it from
sglang-0.5.23-cpu-lock.txt). The host pools are SGLang's own classes, allocated on the CPU
from SGLang's own device pools; the backend is made by SGLang's storage factory from the
`dynamic` config. Oracle: the pages' bytes as SGLang's own accessor (get_data_page) reads them.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed")

if importlib.util.find_spec("sglang") is not None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sglang_pools import (LAYOUTS, attach, fill_random, host_pool, page_bytes, page_indices,  # noqa: E402
                              storage_config)

    import torch  # noqa: E402
    from sglang.srt.mem_cache.hicache_storage import (HiCacheStorageExtraInfo, PoolName,  # noqa: E402
                                                      PoolTransfer)
    from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
else:  # collected without sglang: every test is skipped
    LAYOUTS = {}

from lmcache_mp import Client, Server, ServerConfig, chunk_hashes, shared_cpu_tensor  # noqa: E402

CHUNK = 256  # the server's chunk size: SGLang pages (16 tokens) are stored one per object whatever it is


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, **kw) -> Server:
    srv = Server(ServerConfig(url=f"tcp://127.0.0.1:{port}", l1_size=kw.pop("l1_size", "64MiB"), device="cpu",
                              chunk_size=CHUNK, heartbeat_timeout=5.0, **kw))
    srv.start()
    return srv


@pytest.fixture
def server():
    srv = start_server(free_port())
    yield srv
    srv.stop()


@pytest.fixture
def backends():
    made = []

    def make(pool, config):
        b = attach(pool, config)
        made.append(b)
        return b

    make.close_all = lambda: [b.close() for b in made]
    yield make
    make.close_all()


def wait_until(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def keys_of(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i:04d}" for i in range(n)]


def test_the_factory_makes_the_backend_from_the_dynamic_config(server, backends):
    from lmcache_mp.integration.sglang import LMCacheMPStorage

    pool = host_pool("mha", "page_first")
    b = backends(pool, storage_config(server.url))
    assert type(b) is LMCacheMPStorage
    assert b.namespace.startswith("sglang/tiny/mha.page_first.bfloat16.page16.")
    bad = storage_config(server.url)
    del bad.extra_config["interface_v1"]
    with pytest.raises(ValueError, match="interface_v1"):
        StorageBackendFactory.create_backend("dynamic", bad, pool)
    typo = storage_config(server.url, **{"lmcache_mp.urll": server.url})
    with pytest.raises(ValueError, match="lmcache_mp.urll"):
        StorageBackendFactory.create_backend("dynamic", typo, pool)


@pytest.mark.parametrize("kind,layout", [(k, lay) for k, lays in LAYOUTS.items() for lay in lays])
def test_two_instances_share_pages_byte_exact(server, backends, kind, layout):
    """Instance A stores pages of its host pool; instance B (its own pool, its own client) finds
    them and loads them into other slots; every page equals A's, and B's other pages stay
    untouched. Then the other way round."""
    a_pool, b_pool = host_pool(kind, layout), host_pool(kind, layout)
    fill_random(a_pool, 1)
    fill_random(b_pool, 2)
    a = backends(a_pool, storage_config(server.url, mla=kind == "mla", layout=layout))
    b = backends(b_pool, storage_config(server.url, mla=kind == "mla", layout=layout))
    keys = keys_of(f"{kind}-{layout}-", 6)
    a_pages, b_pages = [3, 7, 4, 20, 11, 0], [30, 2, 9, 17, 25, 5]
    assert b.batch_exists(keys) == 0
    assert a.batch_set_v1(keys, page_indices(a_pages)) == [True] * 6
    assert b.batch_exists(keys) == 6
    before = {p: page_bytes(b_pool, p) for p in range(b_pool.page_num)}
    assert b.batch_get_v1(keys, page_indices(b_pages)) == [True] * 6
    for src, dst in zip(a_pages, b_pages):
        assert page_bytes(b_pool, dst) == page_bytes(a_pool, src)
    for p in set(range(b_pool.page_num)) - set(b_pages):
        assert page_bytes(b_pool, p) == before[p], f"page {p} was written"
    back = keys_of(f"{kind}-{layout}-back-", 2)
    assert b.batch_set_v1(back, page_indices([1, 12])) == [True, True]
    assert a.batch_get_v1(back, page_indices([31, 30])) == [True, True]
    assert page_bytes(a_pool, 31) == page_bytes(b_pool, 1) and page_bytes(a_pool, 30) == page_bytes(b_pool, 12)


def test_longest_prefix(server, backends):
    pool, other = host_pool("mha", "page_first"), host_pool("mha", "page_first")
    fill_random(pool, 3)
    a = backends(pool, storage_config(server.url))
    b = backends(other, storage_config(server.url))
    keys = keys_of("prefix-", 7)
    assert a.batch_set_v1(keys[:4], page_indices([0, 1, 2, 3])) == [True] * 4
    assert a.batch_set_v1(keys[5:6], page_indices([5])) == [True]
    assert b.batch_exists(keys) == 4
    assert b.exists(keys[5]) and not b.exists(keys[4])
    # a load stops at the first page missing: the pages after it are not written
    before = page_bytes(other, 13)
    assert b.batch_get_v1([keys[0], keys[1], keys[4], keys[5]], page_indices([10, 11, 12, 13])) == \
        [True, True, False, False]
    assert page_bytes(other, 10) == page_bytes(pool, 0) and page_bytes(other, 11) == page_bytes(pool, 1)
    assert page_bytes(other, 13) == before


def test_tensor_parallel_ranks_mha_per_rank_mla_once(server, backends):
    """MHA: each TP rank stores its own shard, a page counts as present once every rank has it,
    and each rank loads its own bytes. MLA: one object per page serves every rank."""
    keys = keys_of("tp-", 3)
    ranks = [host_pool("mha", "layer_first", heads=1) for _ in range(2)]
    for r, pool in enumerate(ranks):
        fill_random(pool, 10 + r)
    mha = [backends(pool, storage_config(server.url, tp_rank=r, tp_size=2, layout="layer_first"))
           for r, pool in enumerate(ranks)]
    assert mha[0].batch_set_v1(keys, page_indices([1, 2, 3])) == [True] * 3
    assert mha[0].batch_exists(keys) == 0 and mha[1].batch_exists(keys) == 0  # rank 1's shard is missing
    assert mha[1].batch_set_v1(keys, page_indices([4, 5, 6])) == [True] * 3
    assert mha[0].batch_exists(keys) == 3 and mha[1].batch_exists(keys) == 3
    for r, pool in enumerate(ranks):
        assert mha[r].batch_get_v1(keys, page_indices([20, 21, 22])) == [True] * 3
        src = [1, 2, 3] if r == 0 else [4, 5, 6]
        assert [page_bytes(pool, p) for p in (20, 21, 22)] == [page_bytes(pool, p) for p in src]
    assert server.engine.status()["l1"]["objects"] == 6

    mla_pools = [host_pool("mla", "page_first") for _ in range(2)]
    fill_random(mla_pools[0], 20)
    mla = [backends(pool, storage_config(server.url, mla=True, tp_rank=r, tp_size=2))
           for r, pool in enumerate(mla_pools)]
    assert mla[0].batch_set_v1(keys, page_indices([1, 2, 3])) == [True] * 3  # SGLang: only rank 0 writes MLA
    assert server.engine.status()["l1"]["objects"] == 6 + 3
    assert mla[1].batch_exists(keys) == 3
    assert mla[1].batch_get_v1(keys, page_indices([7, 8, 9])) == [True] * 3
    assert [page_bytes(mla_pools[1], p) for p in (7, 8, 9)] == [page_bytes(mla_pools[0], p) for p in (1, 2, 3)]


def test_the_per_pool_interface_and_extra_pools(server, backends):
    """SGLang's hybrid cache controller speaks batch_*_v2 with PoolTransfers: the KV pool's work
    like v1; extra pools (Mamba, SWA, ...) are refused when registered, and never reported as hits."""
    from lmcache_mp.integration.sglang_pages import UnsupportedPool

    pool, other = host_pool("mha", "page_first"), host_pool("mha", "page_first")
    fill_random(pool, 4)
    a = backends(pool, storage_config(server.url))
    b = backends(other, storage_config(server.url))
    a.register_mem_host_pool_v2(pool, PoolName.KV)
    b.register_mem_host_pool_v2(other, PoolName.KV)
    for name in (PoolName.MAMBA, PoolName.SWA, PoolName.INDEXER):
        with pytest.raises(UnsupportedPool, match=f"{name.value} pool"):
            a.register_mem_host_pool_v2(host_pool("mha", "page_first"), name)
    keys = keys_of("v2-", 3)
    info = HiCacheStorageExtraInfo(prefix_keys=["before-1", "before-0"])
    out = a.batch_set_v2([PoolTransfer(name=PoolName.KV, keys=keys, host_indices=page_indices([6, 7, 8]))], info)
    assert out == {PoolName.KV: [True] * 3}
    res = b.batch_exists_v2(keys, [], info)
    assert (res.kv_hit_pages, res.extra_pool_hit_pages, res.restorable_prefix_pages) == (3, {PoolName.KV: 3}, [1, 2, 3])
    mamba = PoolTransfer(name=PoolName.MAMBA, keys=keys[-1:], host_indices=torch.tensor([0]))
    assert b.batch_exists_v2(keys, [mamba], info).kv_hit_pages == 0
    got = b.batch_get_v2([PoolTransfer(name=PoolName.KV, keys=keys, host_indices=page_indices([0, 1, 2])), mamba])
    assert got == {PoolName.KV: [True] * 3, PoolName.MAMBA: [False]}
    assert [page_bytes(other, p) for p in (0, 1, 2)] == [page_bytes(pool, p) for p in (6, 7, 8)]


def test_unsupported_layouts_are_refused_clearly():
    from lmcache_mp.integration.sglang_pages import UnsupportedPool, plan_pages

    pool = host_pool("mha", "page_first")
    with pytest.raises(UnsupportedPool, match="page_unified"):
        plan_pages(pool.kv_buffer, kind="mha", layout="page_unified", page_size=16, chunk_size=CHUNK)
    with pytest.raises(UnsupportedPool, match="chunk size"):
        plan_pages(pool.kv_buffer, kind="mha", layout="page_first", page_size=16, chunk_size=3 << 20)


def test_keys_are_kept_apart_from_vllm_chunks(server, backends):
    """A vLLM chunk and an SGLang page of the same model and even of the same key string never
    answer for each other."""
    from lmcache_mp.integration.sglang_keys import page_digest

    pool = host_pool("mha", "page_first")
    fill_random(pool, 5)
    s = backends(pool, storage_config(server.url, model="m"))
    with Client(server.url) as c:
        kv = [shared_cpu_tensor((2, CHUNK // 16, 16, 2, 64), torch.bfloat16, fill=1.0) for _ in range(2)]
        h = c.register_kv_cache(kv, model="m")
        digests = chunk_hashes(list(range(CHUNK)), CHUNK)
        assert c.store(h, digests, list(range(CHUNK // 16))).result().stored == 1
        assert s.batch_exists([d.hex() for d in digests]) == 0  # the same key string, as SGLang would name it
        assert s.batch_set_v1([digests[0].hex()], page_indices([2])) == [True]
        assert c.lookup(digests, model="m") == 1  # still exactly the vLLM chunk
        assert c.lookup([page_digest(digests[0].hex())], model="m") == 0  # nor under vLLM's namespace
        assert s.namespace != "m" and s.namespace.startswith("sglang/m/")
        c.unregister_kv_cache(h)


def test_a_server_restart_gives_misses_then_hits_never_wrong_bytes(backends):
    port = free_port()
    srv = start_server(port)
    pool, other = host_pool("mha", "page_first"), host_pool("mha", "page_first")
    fill_random(pool, 6)
    a = backends(pool, storage_config(srv.url))
    b = backends(other, storage_config(srv.url))
    keys = keys_of("restart-", 4)
    try:
        assert a.batch_set_v1(keys, page_indices([0, 1, 2, 3])) == [True] * 4
        srv.stop()
        # away: misses and failed stores, answered without raising
        before = page_bytes(other, 10)
        assert b.batch_exists(keys) == 0
        assert b.batch_get_v1(keys[:1], page_indices([10])) == [False]
        assert a.batch_set_v1(keys_of("lost-", 1), page_indices([4])) == [False]
        assert page_bytes(other, 10) == before
        srv = start_server(port)
        # back, empty: misses until the pages are stored again, then hits with the right bytes
        wait_until(lambda: a.batch_set_v1(keys, page_indices([0, 1, 2, 3])) == [True] * 4, 30,
                   "instance A to store again")
        assert wait_until(lambda: b.batch_exists(keys), 30, "instance B to see the pages") == 4
        assert b.batch_get_v1(keys, page_indices([10, 11, 12, 13])) == [True] * 4
        assert [page_bytes(other, p) for p in (10, 11, 12, 13)] == [page_bytes(pool, p) for p in (0, 1, 2, 3)]
    finally:
        backends.close_all()
        srv.stop()


def test_pages_come_back_from_the_disk_tier_after_a_restart(backends, tmp_path):
    """L2 below: pages written through to the disk tier are found after the server restarted
    with an empty L1, and load byte-exact."""
    port = free_port()
    disk = dict(l2_disk=str(tmp_path / "l2"), l2_disk_size="64MiB", l2_disk_write="all")
    srv = start_server(port, **disk)
    pool, other = host_pool("mla", "layer_first"), host_pool("mla", "layer_first")
    fill_random(pool, 7)
    a = backends(pool, storage_config(srv.url, mla=True, layout="layer_first"))
    keys = keys_of("disk-", 5)
    try:
        info = HiCacheStorageExtraInfo(prefix_keys=[])
        assert a.batch_set_v1(keys, page_indices([9, 8, 7, 6, 5]), info) == [True] * 5
        wait_until(lambda: srv.engine.status()["l2"]["idle"], 30, "the disk writes")
        srv.stop()
        srv = start_server(port, **disk)
        b = backends(other, storage_config(srv.url, mla=True, layout="layer_first"))
        assert srv.engine.status()["l1"]["objects"] == 0
        assert b.batch_exists(keys) == 5
        assert b.batch_get_v1(keys, page_indices([20, 21, 22, 23, 24])) == [True] * 5
        assert [page_bytes(other, p) for p in range(20, 25)] == [page_bytes(pool, p) for p in (9, 8, 7, 6, 5)]
    finally:
        backends.close_all()
        srv.stop()


def test_the_benchmark_moves_pages_near_memcpy_speed(tmp_path):
    """bench/bench_sglang_storage.py, small: every load is checked byte for byte inside it; the
    ratios to memcpy are printed for the log. The bound here is loose on purpose (a loaded 2-core
    machine): it catches a path that sends pages over the socket or copies them per token, not noise."""
    import json
    import subprocess

    out = tmp_path / "bench.json"
    bench = Path(__file__).resolve().parents[2] / "bench" / "bench_sglang_storage.py"
    run = subprocess.run([sys.executable, str(bench), "--layers", "4", "--repeat", "5", "--json", str(out)],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    print(run.stdout)
    r = json.loads(out.read_text())
    assert r["pages"] == 64 and r["bytes"] == 64 * r["page_bytes"]
    assert r["batch_set_x_memcpy"] > 0.3 and r["batch_get_x_memcpy"] > 0.3, r


def test_two_tenants_share_no_pages(backends, tmp_path):
    """A server with a tenants file (docs/tenants.md), two SGLang instances of two tenants, each
    with its client key in its storage config: the pages one stores are misses for the other
    (same keys, same model), whose engine-side copies map a window of its own tenant's only."""
    from lmcache_mp.server.cli import main as cli_main

    keys = tmp_path / "keys"
    assert cli_main(["keygen", str(keys)]) == 0
    assert cli_main(["keygen", str(keys), "--client", "bob"]) == 0
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.alice]\ncurve_keys = ["{keys}/clients/client.key"]\n'
                       f'[tenants.bob]\ncurve_keys = ["{keys}/clients/bob.key"]\n')
    srv = Server(ServerConfig(url=f"ipc://{tmp_path}/srv.sock", l1_size="64MiB", device="cpu", chunk_size=CHUNK,
                              heartbeat_timeout=5.0, tenants=str(tenants), curve_secret_key=f"{keys}/server.key_secret",
                              http_addr="off"))
    srv.start()
    try:
        def config(secret: str):
            return storage_config(srv.url, **{"lmcache_mp.curve_server_key": f"{keys}/server.key",
                                              "lmcache_mp.curve_client_key": f"{keys}/client-secret/{secret}"})

        a_pool, a2_pool, b_pool = (host_pool("mha", "page_first") for _ in range(3))
        fill_random(a_pool, 1)
        fill_random(b_pool, 2)
        a = backends(a_pool, config("client.key_secret"))
        a2 = backends(a2_pool, config("client.key_secret"))
        b = backends(b_pool, config("bob.key_secret"))
        names = keys_of("tenant-", 4)
        assert a.batch_set_v1(names, page_indices([3, 7, 4, 20])) == [True] * 4
        assert a2.batch_exists(names) == 4  # alice's other instance finds them
        assert a2.batch_get_v1(names, page_indices([1, 2, 5, 6])) == [True] * 4
        assert page_bytes(a2_pool, 1) == page_bytes(a_pool, 3)
        assert b.batch_exists(names) == 0  # bob: the same keys and model, nothing
        before = page_bytes(b_pool, 9)
        assert b.batch_get_v1(names[:1], page_indices([9])) == [False]
        assert page_bytes(b_pool, 9) == before
        assert b.batch_set_v1(names, page_indices([10, 11, 12, 13])) == [True] * 4  # his own copies
        assert a2.batch_get_v1(names[:1], page_indices([8])) == [True] and page_bytes(a2_pool, 8) == page_bytes(
            a_pool, 3)  # alice's pages are still alice's
        status = srv.engine.status()
        assert set(status["engine_copies"]["tenant_windows"]) == {"alice", "bob"}
        assert status["tenants"]["alice"]["l1"]["objects"] == 4 and status["tenants"]["bob"]["l1"]["objects"] == 4
    finally:
        backends.close_all()
        srv.stop()


VLLM_PYTHON = os.environ.get("E2E_VLLM_PYTHON", "")


@pytest.mark.skipif(not VLLM_PYTHON, reason="E2E_VLLM_PYTHON names no Python with vLLM (.ci/run sets it)")
def test_a_vllm_engine_and_an_sglang_instance_are_two_tenants_of_one_server(backends, tmp_path):
    """One server with a tenants file; a real vLLM engine (in the vLLM virtualenv, its key in its
    connector config) and an SGLang instance (its key in its storage config) store through it.
    Each one's chunks are found with its own key and are misses with the other's; SGLang's
    engine-side copies go through its tenant's window."""
    import json
    import random
    import subprocess

    from lmcache_mp.integration.sglang_keys import page_digests
    from lmcache_mp.server.cli import main as cli_main

    keys = tmp_path / "keys"
    assert cli_main(["keygen", str(keys)]) == 0
    for name in ("vllm", "sglang"):
        assert cli_main(["keygen", str(keys), "--client", name]) == 0
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.vllm]\ncurve_keys = ["{keys}/clients/vllm.key"]\n'
                       f'[tenants.sglang]\ncurve_keys = ["{keys}/clients/sglang.key"]\n')
    srv = Server(ServerConfig(url=f"ipc://{tmp_path}/srv.sock", l1_size="256MiB", device="cpu", chunk_size=64,
                              tenants=str(tenants), curve_secret_key=f"{keys}/server.key_secret", http_addr="off"))
    srv.start()
    creds = {name: dict(curve_server_key=f"{keys}/server.key",
                        curve_client_key=f"{keys}/client-secret/{name}.key_secret") for name in ("vllm", "sglang")}
    try:
        vllm_e2e = Path(__file__).resolve().parents[1] / "vllm_e2e"
        model = tmp_path / "tiny-llama"
        subprocess.run([VLLM_PYTHON, str(vllm_e2e / "make_tiny_model.py"), str(model), "--arch", "llama"],
                       check=True, timeout=300, stdout=subprocess.DEVNULL)
        rng = random.Random(4)
        prompts = [[rng.randrange(3, 512) for _ in range(300)] for _ in range(2)]
        (tmp_path / "prompts.json").write_text(json.dumps(prompts))
        extra = {f"lmcache_mp.{k}": v for k, v in creds["vllm"].items()}
        engine = subprocess.run([VLLM_PYTHON, str(vllm_e2e / "run_engine.py"), "--model", str(model), "--prompts",
                                 str(tmp_path / "prompts.json"), "--out", str(tmp_path / "out.json"), "--max-tokens",
                                 "4", "--connector-url", srv.url, "--extra-config", json.dumps(extra)],
                                capture_output=True, text=True, timeout=600)
        assert engine.returncode == 0, engine.stdout[-4000:] + engine.stderr[-4000:]
        hashes = [chunk_hashes(p, 64) for p in prompts]
        with Client(srv.url, **creds["vllm"]) as c:
            assert [c.lookup(h, model=str(model)).hits for h in hashes] == [4, 4]  # stored by the engine
        with Client(srv.url, **creds["sglang"]) as c:
            assert [c.lookup(h, model=str(model)).hits for h in hashes] == [0, 0]

        pool = host_pool("mha", "page_first")
        fill_random(pool, 5)
        s = backends(pool, storage_config(srv.url, **{f"lmcache_mp.{k}": v for k, v in creds["sglang"].items()}))
        names = keys_of("both-", 4)
        assert s.batch_set_v1(names, page_indices([2, 3, 5, 8])) == [True] * 4
        with Client(srv.url, **creds["sglang"]) as c:
            assert c.lookup(page_digests(names), model=s.namespace).hits == 4
        with Client(srv.url, **creds["vllm"]) as c:
            assert c.lookup(page_digests(names), model=s.namespace).hits == 0
        status = srv.engine.status()
        assert status["tenants"]["vllm"]["l1"]["objects"] == 8 and status["tenants"]["sglang"]["l1"]["objects"] == 4
        assert set(status["engine_copies"]["tenant_windows"]) == {"sglang"}  # vLLM's CPU connector: server copies
    finally:
        backends.close_all()
        srv.stop()
