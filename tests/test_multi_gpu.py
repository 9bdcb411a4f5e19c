"""One server, two GPUs: tensor-parallel ranks on different GPUs, each worker seeing only its own
GPU (as device 0) while the server sees both, so registrations must be mapped by device UUID.

MHA ranks store and retrieve their own shards (a chunk counts for lookup only once both ranks
stored it); an MLA cache is stored once by rank 0 and retrieved by both. Every check is bit-exact.
"""

import contextlib
import multiprocessing as mp
import os
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.gpu

CHUNK = 64  # tests/gpu_workers.py's chunk size


@pytest.fixture(scope="module")
def gpu_uuids():
    """The UUIDs of the first two GPUs this process sees (skip with fewer than two)."""
    import torch

    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"needs at least 2 CUDA devices, {n} visible")
    return [f"GPU-{torch.cuda.get_device_properties(i).uuid}" for i in range(2)]


@pytest.fixture(scope="module")
def two_gpu_server(gpu_uuids, tmp_path_factory):
    """A server process that sees every GPU of this process (CUDA_VISIBLE_DEVICES inherited:
    unset, or the list this test run was given)."""
    from lmcache_mp import Client

    tmp = tmp_path_factory.mktemp("srv2")
    url = f"ipc://{tmp}/server.sock"
    env = dict(os.environ, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0")
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "lmcache_mp.server.cli", "--url", url, "--device", "cuda",
                             "--l1-size", "2GiB", "--chunk-size", str(CHUNK), "--log-level", "DEBUG"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while True:
        try:
            Client(url, connect_timeout=1).close()
            break
        except Exception:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError(f"server did not start: {(tmp / 'server.log').read_text()}")
            time.sleep(0.2)
    yield SimpleNamespace(url=url, log=tmp / "server.log")
    proc.terminate()
    assert proc.wait(60) == 0
    log.close()
    text = (tmp / "server.log").read_text()
    assert "Traceback" not in text, text


@contextlib.contextmanager
def _env(values: dict):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run_on_gpus(targets, timeout: float = 240):
    """targets: (fn, args, gpu_uuid); each process starts with CUDA_VISIBLE_DEVICES=gpu_uuid.
    Returns the infos in target order; fails on any worker error or silent death."""
    import queue

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = []
    for fn, args, uuid in targets:
        with _env({"CUDA_VISIBLE_DEVICES": uuid, "NCCL_NVLS_ENABLE": "0"}):  # inherited at spawn
            p = ctx.Process(target=fn, args=args + (q,))
            p.start()
        procs.append(p)
    results = []
    deadline = time.monotonic() + timeout
    dead_since = None
    try:
        while len(results) < len(procs):
            try:
                results.append(q.get(timeout=0.5))
                continue
            except queue.Empty:
                pass
            if any(not p.is_alive() for p in procs):
                dead_since = dead_since or time.monotonic()
                if time.monotonic() - dead_since > 10:
                    codes = [p.exitcode for p in procs]
                    pytest.fail(f"a worker exited without a result (exit codes {codes}); got {results}")
            assert time.monotonic() < deadline, f"workers gave no result within {timeout} s; got {results}"
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    failed = [info for status, info in results if status != "ok"]
    assert not failed, "\n\n".join(failed)
    return sorted((info for _, info in results), key=lambda i: i["rank"])


def test_tp_mha_ranks_on_two_gpus_store_and_retrieve_their_own_shards(two_gpu_server, gpu_uuids):
    import multi_gpu_workers as w

    barrier = mp.get_context("spawn").Barrier(2)
    infos = _run_on_gpus([
        (w.tp_mha_rank, (two_gpu_server.url, "mgpu-mha", r, 50, gpu_uuids[r], barrier), gpu_uuids[r])
        for r in range(2)
    ])
    assert [i["uuid"] for i in infos] == gpu_uuids  # really two GPUs, each seen as device 0
    assert all(i["nvls"] == "0" for i in infos)
    assert all(i["layout"] == "mha" and not i["shared"] for i in infos)
    assert [i["lookup_after_rank0"] for i in infos] == [0, 0]
    assert [i["lookup_after_both"] for i in infos] == [w.N_CHUNKS, w.N_CHUNKS]


def test_mla_stored_once_on_one_gpu_is_retrieved_on_both(two_gpu_server, gpu_uuids):
    import multi_gpu_workers as w

    barrier = mp.get_context("spawn").Barrier(2)
    infos = _run_on_gpus([
        (w.tp_mla_rank, (two_gpu_server.url, "mgpu-mla", r, 60, 777, gpu_uuids[r], barrier), gpu_uuids[r])
        for r in range(2)
    ])
    assert [i["uuid"] for i in infos] == gpu_uuids
    assert all(i["layout"] == "mla" and i["shared"] for i in infos)
    # rank 0's copy alone serves every rank
    assert [i["lookup_after_rank0"] for i in infos] == [w.N_CHUNKS, w.N_CHUNKS]


def test_one_server_sees_both_gpus_and_drops_closed_registrations(two_gpu_server):
    from lmcache_mp import Client

    m = re.search(r"(\d+) GPU\(s\) visible", two_gpu_server.log.read_text())
    assert m and int(m.group(1)) >= 2, "the server must see both GPUs"
    client = Client(two_gpu_server.url)
    status = client.status()
    client.close()
    assert status["device"] == "cuda"
    assert not [r for r in status["registrations"] if r["model"].startswith("mgpu-")]
