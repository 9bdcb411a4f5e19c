"""The server on a GPU with real worker processes: CUDA IPC registration, event-synchronised
stores and retrieves, TP ranks, MLA sharing, and devices mapped by UUID."""

import multiprocessing as mp
import os
import subprocess
import sys
import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

CHUNK = 64


def _wait_for_server(url: str, proc, timeout: float = 120) -> None:
    from lmcache_mp import Client

    deadline = time.time() + timeout
    while True:
        try:
            Client(url, connect_timeout=1).close()
            return
        except Exception:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the server at {url} did not start") from None
            time.sleep(0.2)


@pytest.fixture(scope="module")
def cuda_server(tmp_path_factory):
    """A server process whose CUDA_VISIBLE_DEVICES names the GPU by UUID (the workers use the
    index), so registration must map devices by UUID."""
    import torch

    tmp = tmp_path_factory.mktemp("srv")
    url = f"ipc://{tmp}/server.sock"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=f"GPU-{torch.cuda.get_device_properties(0).uuid}",
               PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "lmcache_mp.server.cli", "--url", url, "--device", "cuda",
                             "--l1-size", "2GiB", "--chunk-size", str(CHUNK), "--log-level", "DEBUG"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for_server(url, proc)
    except RuntimeError:
        raise RuntimeError(f"server did not start: {(tmp / 'server.log').read_text()}") from None
    yield url
    proc.terminate()
    code = proc.wait(60)
    log.close()
    text = (tmp / "server.log").read_text()
    assert code == 0, f"the server exited with {code}:\n{text[-6000:]}"
    assert "Traceback" not in text, text


def _run(targets):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=fn, args=args + (q,), kwargs=kw) for fn, args, kw in targets]
    for p in procs:
        p.start()
    results = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    for status, info in results:
        assert status == "ok", info
    return [info for _, info in results]


TRANSFERS = ["engine", "server"]  # the engine's own copies, and the server's


@pytest.mark.parametrize("transfer", TRANSFERS)
def test_two_workers_share_one_server(cuda_server, transfer):
    import gpu_workers

    infos = _run([
        (gpu_workers.roundtrip, (cuda_server, f"model-a-{transfer}", 0, 1, "mha", 11), {"transfer": transfer}),
        (gpu_workers.roundtrip, (cuda_server, f"model-b-{transfer}", 0, 1, "block_major", 12),
         {"transfer": transfer}),
    ])
    assert {i["layout"] for i in infos} == {"mha", "block_major"}


@pytest.mark.parametrize("transfer", TRANSFERS)
def test_tensor_parallel_ranks_mha_each_store_their_shard(cuda_server, transfer):
    import gpu_workers

    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    infos = _run([
        (gpu_workers.roundtrip, (cuda_server, f"tp-mha-{transfer}", r, 2, "mha", 20 + r),
         {"token_seed": 77, "barrier": barrier, "transfer": transfer})
        for r in range(2)
    ])
    assert all(not i["shared"] for i in infos)


@pytest.mark.parametrize("transfer", TRANSFERS)
def test_mla_is_stored_once_and_read_by_every_rank(cuda_server, transfer):
    import gpu_workers

    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    infos = _run([
        (gpu_workers.roundtrip, (cuda_server, f"tp-mla-{transfer}", r, 2, "mla", 30 + r),
         {"token_seed": 99, "data_seed": 99, "barrier": barrier, "transfer": transfer})
        for r in range(2)
    ])
    assert all(i["shared"] for i in infos)


def test_engine_and_server_copies_share_chunks_and_a_small_ring_waits_for_its_slots(cuda_server):
    """TP ranks of one model, one copying itself through a ring of two chunks (a request of four
    waits for free slots on the GPU, no error), the other through the server: each reads what
    the other stored."""
    import gpu_workers

    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    _run([
        (gpu_workers.roundtrip, (cuda_server, "mixed", 0, 2, "mla", 40),
         {"token_seed": 5, "data_seed": 5, "barrier": barrier, "transfer": "engine", "staging_bytes": 1}),
        (gpu_workers.roundtrip, (cuda_server, "mixed", 1, 2, "mla", 41),
         {"token_seed": 5, "data_seed": 5, "barrier": barrier, "transfer": "server"}),
    ])


def test_a_cpu_server_serves_an_engine_that_copies_itself(tmp_path):
    """The server on --device cpu (no CUDA context of its own, no IPC) and a CUDA engine that
    moves its bytes itself."""
    import gpu_workers

    url = f"ipc://{tmp_path}/cpu.sock"
    proc = subprocess.Popen([sys.executable, "-m", "lmcache_mp.server.cli", "--url", url, "--device", "cpu",
                             "--l1-size", "1GiB", "--chunk-size", str(CHUNK), "--http-addr", "off"])
    try:
        _wait_for_server(url, proc)
        _run([(gpu_workers.roundtrip, (url, "cpu-server", 0, 1, "mha", 50), {"transfer": "engine"})])
    finally:
        proc.terminate()
        assert proc.wait(60) == 0


def test_an_engine_killed_with_its_copy_queued_leaves_nothing_and_its_slots_come_back(cuda_server):
    import signal

    import gpu_workers

    from lmcache_mp import Client, chunk_hashes

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=gpu_workers.store_and_die, args=(cuda_server, q))
    proc.start()
    c = Client(cuda_server)
    try:
        status, info = q.get(timeout=120)
        assert status == "ok", info
        assert c.status()["engine_copies"]["reservations"] >= 1, (info, c.status()["engine_copies"])
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        deadline = time.time() + 30
        while c.status()["engine_copies"]["reservations"] and time.time() < deadline:
            time.sleep(0.1)
        st = c.status()
        assert st["engine_copies"]["reservations"] == 0 and st["l1"]["writing"] == 0
        tokens = np.random.default_rng(3).integers(0, 50000, 4 * CHUNK)  # the worker's prompt
        assert c.lookup(chunk_hashes(tokens, c.chunk_size), model="killed") == 0
    finally:
        c.close()
        if proc.is_alive():
            proc.kill()


@pytest.mark.parametrize("storing", [False, True], ids=["idle", "mid_stores"])
def test_a_killed_engines_gpu_memory_is_free_again_within_a_second(cuda_server, storing):
    """The server's CUDA IPC mappings keep a dead engine's KV cache allocated; it watches the
    engine's process and closes them as soon as the process exits (after the copies queued on
    them), so the memory is free again about when the process is gone, not after the heartbeat
    timeout (10 s). Seen from another process (this one), as a restarted vLLM would size its cache."""
    import signal

    import gpu_workers
    import torch

    gib = 8
    free_before, _ = torch.cuda.mem_get_info()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=gpu_workers.hold_a_large_cache, args=(cuda_server, q, gib, storing))
    proc.start()
    try:
        status, info = q.get(timeout=120)
        assert status == "ok", info
        time.sleep(0.5)
        held, _ = torch.cuda.mem_get_info()
        assert free_before - held >= (gib - 1) << 30, (free_before, held)
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        while torch.cuda.mem_get_info()[0] < free_before - (1 << 30):
            assert time.monotonic() - killed < 30, "the killed engine's memory was not freed"
            time.sleep(0.02)
        freed = time.monotonic() - killed
        proc.join(30)
        print(f"\n{'idle' if not storing else 'mid-stores'}: {gib} GiB free again {freed:.2f} s after SIGKILL")
        assert freed < 2.0, freed
    finally:
        if proc.is_alive():
            proc.kill()


def test_lookup_counts_a_chunk_only_when_every_rank_stored_it(cuda_server):
    import gpu_workers

    from lmcache_mp import Client, chunk_hashes

    tokens = np.random.default_rng(5).integers(0, 50000, 3 * CHUNK)
    client = Client(cuda_server)
    hashes = chunk_hashes(tokens, client.chunk_size)
    _run([(gpu_workers.store_only, (cuda_server, "tp-count", 0, 2, 5), {})])
    assert client.lookup(hashes, model="tp-count", world_size=2) == 0
    _run([(gpu_workers.store_only, (cuda_server, "tp-count", 1, 2, 5), {})])
    assert client.lookup(hashes, model="tp-count", world_size=2) == 3
    client.close()


def test_bad_block_ids_are_rejected_before_any_copy(cuda_server):
    import torch
    from gpu_kv import make_cuda_kv

    from lmcache_mp import Client, RequestError, chunk_hashes

    client = Client(cuda_server)
    kv = make_cuda_kv("mha", torch.bfloat16, layers=2, blocks=32, block_size=16)
    before = kv.all_bytes()
    h = client.register_kv_cache(kv.tensors, model="bad", world_size=1, rank=0)
    hashes = chunk_hashes(np.arange(CHUNK), client.chunk_size)
    for ids in ([0, 1, 2, 32], [0, 1, 2, -1]):
        with pytest.raises((RequestError, ValueError)):
            client.retrieve(h, hashes, ids).result()
    assert client.store(h, hashes, [0, 1, 2, 3]).result().stored == 1
    with pytest.raises((RequestError, ValueError), match="out of range"):  # (engine-side: before any slot)
        client.store(h, chunk_hashes(np.arange(CHUNK) + 1, client.chunk_size), [0, 1, 2, 99]).result()
    assert all(np.array_equal(a, b) for a, b in zip(before, kv.all_bytes()))
    client.close()


def test_a_store_whose_copy_ends_after_its_deadline_keeps_nothing(cuda_server):
    """The server queues the copy before the deadline, but it waits for the engine's stream,
    which is busy for longer: the copy ends after the deadline (the engine had given up on the
    store and may have reused the blocks), so nothing of it is kept."""
    import torch
    from gpu_kv import make_cuda_kv

    from lmcache_mp import Client, ServerUnavailable, chunk_hashes

    client = Client(cuda_server)
    kv = make_cuda_kv("mha", torch.bfloat16, layers=2, blocks=32, block_size=16)
    h = client.register_kv_cache(kv.tensors, model="late", world_size=1, rank=0, transfer="server")
    hashes = chunk_hashes(np.arange(2 * CHUNK) + 7, client.chunk_size)
    busy = torch.cuda.Stream()
    with torch.cuda.stream(busy):
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time before the KV is there
    fut = client.store(h, hashes, list(range(8)), stream=busy, timeout=0.2)
    with pytest.raises(ServerUnavailable):
        fut.result()
    busy.synchronize()
    deadline = time.time() + 10
    while client.status()["l1"]["writing"] and time.time() < deadline:
        time.sleep(0.05)
    assert client.lookup(hashes, model="late") == 0
    assert client.store(h, hashes, list(range(8))).result().stored == 2  # in time: kept
    assert client.lookup(hashes, model="late") == 2
    client.close()


def test_l1_persist_on_the_gpu_survives_sigkill(tmp_path):
    """--l1-persist with page-locked L1: chunks stored from GPU blocks, the server killed, a new
    one re-attaches them (after pinning) and retrieves them into GPU blocks byte-exact."""
    import signal

    from gpu_workers import persisted

    from lmcache_mp import Client

    path = f"/dev/shm/lmcache-mp-gpu-persist-{os.getpid()}"
    url = f"ipc://{tmp_path}/server.sock"
    cmd = [sys.executable, "-m", "lmcache_mp.server.cli", "--url", url, "--device", "cuda", "--l1-size", "1GiB",
           "--chunk-size", str(CHUNK), "--l1-persist", path, "--http-addr", "off"]

    def start(n):
        log = open(tmp_path / f"server{n}.log", "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        deadline = time.time() + 120
        while True:
            try:
                Client(url, connect_timeout=1).close()
                return proc
            except Exception:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError((tmp_path / f"server{n}.log").read_text())
                time.sleep(0.2)

    try:
        proc = start(1)
        assert _run([(persisted, (url, "store", 7), {})]) == [4]
        with Client(url) as c:  # commits are recorded a moment later, once their bytes are summed
            deadline = time.time() + 30
            while c.status()["l1"]["journal_backlog"] and time.time() < deadline:
                time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        proc = start(2)
        assert "re-attached 4 chunks" in (tmp_path / "server2.log").read_text()
        assert _run([(persisted, (url, "retrieve", 7), {})]) == [4]
        proc.terminate()
        assert proc.wait(60) == 0
    finally:
        for f in (path, path + ".journal"):
            if os.path.exists(f):
                os.unlink(f)


def test_a_tenants_copies_on_the_gpu_go_through_its_window(tmp_path):
    """A CUDA server with a tenants file (the test's uid is the tenant): a worker that copies
    itself maps its tenant's window (page-locked in its own context), not L1; another copies
    through the server. Each reads what the other stored, byte exact."""
    import gpu_workers

    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.me]\nuids = [{os.getuid()}]\nengine_window = "256MiB"\nadmin = true\n')
    url = f"ipc://{tmp_path}/tenants.sock"
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "lmcache_mp.server.cli", "--url", url, "--device", "cuda",
                             "--l1-size", "2GiB", "--chunk-size", str(CHUNK), "--http-addr", "off",
                             "--tenants", str(tenants)], stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for_server(url, proc)
        ctx = mp.get_context("spawn")
        barrier = ctx.Barrier(2)
        _run([
            (gpu_workers.roundtrip, (url, "tenant", 0, 2, "mla", 70),
             {"token_seed": 7, "data_seed": 7, "barrier": barrier, "transfer": "engine"}),
            (gpu_workers.roundtrip, (url, "tenant", 1, 2, "mla", 71),
             {"token_seed": 7, "data_seed": 7, "barrier": barrier, "transfer": "server"}),
        ])
        from lmcache_mp import Client

        with Client(url) as c:
            status = c.status()  # (an admin tenant's: the whole server's)
        assert status["engine_copies"]["tenant_windows"]["me"]["capacity"] == 256 << 20
        assert status["tenants"]["me"]["l1"]["objects"] > 0
    finally:
        proc.terminate()
        code = proc.wait(60)
        log.close()
    text = (tmp_path / "server.log").read_text()
    assert code == 0 and "Traceback" not in text, text[-6000:]


@pytest.mark.parametrize("transfer", TRANSFERS)
def test_hybrid_pages_of_attention_and_state_groups_round_trip_exact(cuda_server, transfer):
    """A hybrid model's cache as vLLM lays it out: one buffer of [layers, blocks, page] whose
    pages serve an attention group and a state group (each block belongs to one of them at a
    time), each group a registration of opaque pages with chunks of one block (a state's
    boundary). 64 blocks of each group go out and come back into other blocks, byte exact."""
    import torch

    from lmcache_mp import Client, chunk_hashes

    layers, blocks, block_size = 4, 256, 544
    page = block_size * 512  # vLLM's pages hold whole tokens: a state page is padded to the attention page
    buf = torch.empty((layers, blocks, page), dtype=torch.uint8, device="cuda")
    buf.view(torch.int32).random_()
    views = [buf[i] for i in range(layers)]
    with Client(cuda_server) as client:
        handles = [client.register_kv_cache(views, model=f"hybrid-{transfer}#{group}", layout="opaque", block_size=block_size,
                                            chunk_size=block_size, transfer=transfer) for group in ("attn", "state")]
        assert all(h.chunk_size == block_size and h.object_bytes == layers * page for h in handles)
        rng = np.random.default_rng(3)
        ids = rng.permutation(blocks)
        for g, h in enumerate(handles):  # each group's blocks: its own quarter of the pool, out and back
            src, dst = ids[g * 64:(g + 1) * 64].tolist(), ids[128 + g * 64:128 + (g + 1) * 64].tolist()
            hashes = chunk_hashes(rng.integers(0, 50000, 64 * block_size), block_size)
            want = buf[:, src].clone()
            torch.cuda.synchronize()
            assert client.store(h, hashes, src).result(60).stored == 64
            buf[:, dst] = 0
            torch.cuda.synchronize()
            assert client.retrieve(h, hashes, dst).result(60).loaded == 64
            torch.cuda.synchronize()
            assert torch.equal(buf[:, dst], want)
        for h in handles:
            client.unregister_kv_cache(h)
