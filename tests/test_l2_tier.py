"""The L2 tiers end to end on the CPU device, with a real directory: chunks L1 evicts go to disk
and come back byte-exact, lookups continue into L2 and lease what a prefetch brings back within
its deadline, a restarted server finds the disk's chunks again, and damaged files, a disk that
cannot be written or a slow one never fail a request."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np

import cpu_workers as w
from lmcache_mp import Client, chunk_hashes
from lmcache_mp.storage.l1 import L1Store, ObjectKey
from lmcache_mp.storage.l2 import L2Backend
from test_cli import ServerProcess
from test_server_e2e import CHUNK, blocks_of, clients, no_internal_errors, register_mha, servers, wait_until  # noqa: F401

L1_CHUNKS = 16  # 64 KiB of L1 in 4 KiB objects (one MHA chunk of the test caches)


def l2_settings(path: Path, **kw) -> dict:
    return dict(l1_size=f"{L1_CHUNKS * 4}KiB", l2_disk=str(path), l2_disk_size="64MiB", **kw)


def store_prompts(c, h, kv, seeds, chunks=4, srv=None):
    """Store these prompts; with srv, 4 chunks at a time (a longer prompt as growing prefixes),
    letting its L2 writer finish after each store: the write queue holds 4 chunks here."""
    for i in seeds:
        src = blocks_of(chunks)
        w.write_tokens(kv, "mha", src, w.reference(i, "mha", chunks * CHUNK))
        hashes = chunk_hashes(w.prompt(i, chunks), CHUNK)
        for end in range(4, chunks + 4, 4) if srv is not None else [chunks]:
            end = min(end, chunks)
            assert c.store(h, hashes[:end], src[: end * (CHUNK // 8)]).result(10).chunks == end
            if srv is not None:
                writer_idle(srv)


def kill_with_stores_in_flight(srv, c, h, kv, seeds):
    """Start these 4-chunk stores without waiting for them, each from blocks of its own (nothing
    overwrites them before the copy), SIGKILL the server process meanwhile, and close the client."""
    for j, seed in enumerate(seeds):
        src = blocks_of(4, start=16 * j)
        w.write_tokens(kv, "mha", src, w.reference(seed, "mha", 4 * CHUNK))
        c.store(h, chunk_hashes(w.prompt(seed, 4), CHUNK), src)
    os.kill(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait(10)
    c.close()


def writer_idle(srv):
    wait_until(lambda: srv.engine.status()["l2"]["idle"], 10, "the L2 writer to be idle")


def retrieved_exact(c, h, kv, seed, chunks=4, lease=0) -> int:
    dst = blocks_of(chunks, start=64)
    w.fill_blocks(kv, "mha", dst, 0)
    got = c.retrieve(h, chunk_hashes(w.prompt(seed, chunks), CHUNK), dst, lease=lease).result(10).loaded
    n = got * CHUNK
    assert np.array_equal(w.read_tokens(kv, "mha", dst)[:, :, :n], w.reference(seed, "mha", chunks * CHUNK)[:, :, :n])
    return got


def test_evicted_chunks_come_back_from_disk_byte_exact(shm_files, servers, clients, tmp_path, no_internal_errors):  # noqa: F811
    srv = servers(**l2_settings(tmp_path / "l2"))
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=128)
    store_prompts(c, h, kv, range(8), srv=srv)  # 32 chunks through an L1 of 16
    status = srv.engine.status()
    assert status["l1"]["evicted"] >= 16 and status["l2"]["dropped_writes"] == 0
    assert status["l2"]["written"] >= 16
    for seed in range(8):  # the oldest are on disk only: lookup counts them, retrieve loads them
        assert c.lookup(chunk_hashes(w.prompt(seed, 4), CHUNK), model="m") == 4
        assert retrieved_exact(c, h, kv, seed) == 4
    l2 = srv.engine.status()["l2"]
    assert l2["loaded"] >= 16 and l2["tiers"][0]["hits"] >= 16 and l2["write_errors"] == 0
    assert l2["tiers"][0]["objects"] >= 16 and l2["tiers"][0]["write_GBps"] > 0
    from lmcache_mp.server.metrics import StatusCollector

    metrics = {(smp.name, smp.labels.get("tier")): smp.value
               for fam in StatusCollector(srv.engine).collect() for smp in fam.samples}
    assert metrics["lmcache_mp_l2_written_total", None] == l2["written"]
    assert metrics["lmcache_mp_l2_loaded_total", None] == l2["loaded"]
    assert metrics["lmcache_mp_l2_tier_hits_total", "disk"] == l2["tiers"][0]["hits"]
    assert metrics["lmcache_mp_l2_tier_objects", "disk"] == l2["tiers"][0]["objects"]


def test_the_scheduler_never_waits_for_a_prefetch(shm_files, servers, clients, tmp_path, no_internal_errors):  # noqa: F811
    """vLLM's scheduler asks for a prompt whose chunks are on a slow disk: it gets None at once
    (ask again later) instead of waiting, and the hits once they are in memory."""
    from lmcache_mp.integration.connector_types import ConnectorConfig
    from lmcache_mp.integration.scheduler_core import SchedulerCore

    srv = servers(**l2_settings(tmp_path / "l2", l2_write="all", prefetch_timeout=2.0))
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=128)
    store_prompts(c, h, kv, [1], srv=srv)
    store_prompts(c, h, kv, range(2, 7), srv=srv)  # prompt 1 leaves L1
    assert not srv.engine.l1.contains(ObjectKey("m", 1, 0, chunk_hashes(w.prompt(1, 4), CHUNK)[0], b""))
    tiers = srv.engine.l2.tiers
    tiers[0] = SlowTier(tiers[0], 1.0)
    sched = SchedulerCore(ConnectorConfig(url=srv.url, model="m", block_size=8, lookup_timeout=5.0))
    sched.start()
    try:
        tokens = list(w.prompt(1, 4)) + [1]  # one more token: all four chunks may hit
        t0 = time.monotonic()
        assert sched.num_new_matched_tokens("r", tokens, 0) is None  # not known yet: it did not wait for the disk
        while (n := sched.num_new_matched_tokens("r", tokens, 0)) is None:
            time.sleep(0.01)
        assert n == 4 * CHUNK and time.monotonic() - t0 >= 0.9
        assert sched.stats["lookup_us_max"] < 800_000  # no call waited for the disk's 1 s
    finally:
        tiers[0] = tiers[0].inner
        sched.close()


def test_lookup_with_lock_prefetches_and_leases_the_whole_prefix(shm_files, servers, clients, tmp_path,  # noqa: F811
                                                                  no_internal_errors):  # noqa: F811
    srv = servers(**l2_settings(tmp_path / "l2", l2_write="all"))
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=128)
    store_prompts(c, h, kv, [1], chunks=12, srv=srv)  # written through to disk
    assert srv.engine.status()["l2"]["written"] == 12
    store_prompts(c, h, kv, [2, 3])  # pushes most of prompt 1 out of L1
    hashes = chunk_hashes(w.prompt(1, 12), CHUNK)
    assert not all(srv.engine.l1.contains(ObjectKey("m", 1, 0, d, b"")) for d in hashes)
    found = c.lookup(hashes, model="m", lock=True)
    assert found == 12 and found.lease
    # every chunk is in L1 now and leased: more stores cannot push it out before the retrieve
    store_prompts(c, h, kv, [4], chunks=2, srv=srv)
    assert retrieved_exact(c, h, kv, 1, chunks=12, lease=found) == 12
    assert srv.engine.status()["l2"]["prefetches"] == 1


class SlowTier(L2Backend):
    """A real tier whose reads take `delay` seconds."""

    def __init__(self, inner: L2Backend, delay: float):
        self.inner, self.delay, self.name = inner, delay, inner.name

    def put(self, *a):
        return self.inner.put(*a)

    def get(self, *a):
        time.sleep(self.delay)
        return self.inner.get(*a)

    def lookup(self, keys):
        return self.inner.lookup(keys)

    def remove(self, keys):
        return self.inner.remove(keys)

    def stats(self):
        return self.inner.stats()


def test_a_slow_disk_is_waited_for_only_until_the_prefetch_deadline(shm_files, servers, clients, tmp_path,  # noqa: F811
                                                                    no_internal_errors):  # noqa: F811
    srv = servers(**l2_settings(tmp_path / "l2", l2_write="all", prefetch_timeout=0.3))
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=128)
    store_prompts(c, h, kv, [1], chunks=8, srv=srv)
    assert srv.engine.status()["l2"]["written"] == 8
    store_prompts(c, h, kv, [2, 3, 4])  # 12 newer chunks: at most 4 of prompt 1 stay in L1
    hashes = chunk_hashes(w.prompt(1, 8), CHUNK)
    tiers = srv.engine.l2.tiers
    tiers[0] = SlowTier(tiers[0], 3.0)
    t0 = time.monotonic()
    found = c.lookup(hashes, model="m", lock=True)
    waited = time.monotonic() - t0
    assert 0.25 < waited < 3.0, waited  # answered at --prefetch-timeout (0.5 s), not once the disk's 3 s are over
    assert found < 8  # answered at the deadline with what was resident
    assert srv.engine.status()["l2"]["prefetch_timeouts"] == 1
    # the load finishes in the background: afterwards the whole prompt is in L1
    wait_until(lambda: srv.engine.status()["l2"]["prefetching"] == 0, 10, "the prefetch to end")
    tiers[0] = tiers[0].inner
    assert c.lookup(hashes, model="m") == 8
    assert retrieved_exact(c, h, kv, 1, chunks=8) == 8


def test_stopping_the_server_answers_the_loads_in_flight(shm_files, servers, clients, tmp_path,  # noqa: F811
                                                          no_internal_errors):  # noqa: F811
    srv = servers(**l2_settings(tmp_path / "l2", l2_write="all", prefetch_timeout=5.0))
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=128)
    store_prompts(c, h, kv, [1, 2], srv=srv)
    srv.stop()
    srv = servers(**l2_settings(tmp_path / "l2", prefetch_timeout=5.0))
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=128)
    tiers = srv.engine.l2.tiers
    tiers[0] = SlowTier(tiers[0], 0.5)
    lookup = c.lookup_async(chunk_hashes(w.prompt(1, 4), CHUNK), model="m", lock=True)
    dst = blocks_of(4, start=64)
    load = c.retrieve(h, chunk_hashes(w.prompt(2, 4), CHUNK), dst)
    time.sleep(0.1)  # both wait on the slow disk now
    t0 = time.monotonic()
    srv.stop()
    assert time.monotonic() - t0 < 5
    assert lookup.result(5) == 4  # answered once loaded, before the server went
    assert load.result(5).loaded == 4
    assert np.array_equal(w.read_tokens(kv, "mha", dst), w.reference(2, "mha", 4 * CHUNK))


def test_a_restarted_server_serves_the_disk_chunks(shm_files, servers, clients, tmp_path, no_internal_errors):  # noqa: F811
    path = tmp_path / "l2"
    srv = servers(**l2_settings(path, l2_write="all"))
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=128)
    store_prompts(c, h, kv, [7, 8], srv=srv)
    c.close()
    srv.stop()  # drains the write queue
    srv2 = servers(**l2_settings(path, l2_write="all"))
    c2 = clients(srv2.url)
    kv2, h2 = register_mha(c2, num_blocks=128)
    assert srv2.engine.status()["l2"]["tiers"][0]["objects"] == 8
    # retrieve without a lookup first: the chunks are only on disk
    assert retrieved_exact(c2, h2, kv2, 7) == 4
    assert c2.lookup(chunk_hashes(w.prompt(8, 4), CHUNK), model="m", lock=True) == 4
    assert retrieved_exact(c2, h2, kv2, 8) == 4


def _kv_files(path: Path) -> list[Path]:
    return sorted(path.glob("*/*.kv"))


def test_damaged_files_are_dropped_and_counted_never_served(shm_files, servers, clients, tmp_path,  # noqa: F811
                                                            no_internal_errors):  # noqa: F811
    path = tmp_path / "l2"
    srv = servers(**l2_settings(path, l2_write="all"))
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=128)
    for seed in range(4):  # four one-chunk prompts: four files
        store_prompts(c, h, kv, [seed], chunks=1)
    c.close()
    srv.stop()
    files = _kv_files(path)
    assert len(files) == 4
    by_seed = {}
    for seed in range(4):
        key = ObjectKey("m", 1, 0, chunk_hashes(w.prompt(seed, 1), CHUNK)[0], b"")
        from lmcache_mp import _C
        from lmcache_mp.storage.l2.tiers import key_bytes

        name = _C.DiskStore.name_of(key_bytes(key))
        by_seed[seed] = path / name[:2] / f"{name}.kv"
    data = bytearray(by_seed[0].read_bytes())
    data[-100] ^= 0xFF  # a bit flip in the payload: found at read time
    by_seed[0].write_bytes(bytes(data))
    with open(by_seed[1], "r+b") as f:  # torn: shorter than its header says
        f.truncate(4096 + 100)
    (path / "ab").mkdir(exist_ok=True)
    (path / "ab" / ("ab" + "0" * 30 + ".kv.tmp.1")).write_bytes(b"half")  # a crash mid-write
    srv2 = servers(**l2_settings(path))
    c2 = clients(srv2.url)
    kv2, h2 = register_mha(c2, num_blocks=128)
    tier = srv2.engine.status()["l2"]["tiers"][0]
    assert tier["objects"] == 3 and tier["dropped_at_scan"] == 2
    assert not by_seed[1].exists()
    assert retrieved_exact(c2, h2, kv2, 0, chunks=1) == 0  # corrupt: a miss, the file is removed
    assert not by_seed[0].exists()
    assert srv2.engine.status()["l2"]["tiers"][0]["read_corrupt"] == 1
    assert retrieved_exact(c2, h2, kv2, 2, chunks=1) == 1
    assert retrieved_exact(c2, h2, kv2, 3, chunks=1) == 1


def test_an_unwritable_disk_leaves_l1_serving(shm_files, servers, clients, tmp_path, caplog):  # noqa: F811
    path = tmp_path / "l2"
    path.mkdir()
    for i in range(256):  # a file where every subdirectory should go: every write fails
        (path / f"{i:02x}").write_bytes(b"")
    srv = servers(**l2_settings(path, l2_write="all"))
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=128)
    store_prompts(c, h, kv, range(6))  # 24 chunks: L1 evicts, the disk takes nothing
    wait_until(lambda: srv.engine.status()["l2"]["write_errors"] >= 8, 10, "failed writes")
    assert srv.engine.status()["l2"]["written"] == 0
    assert retrieved_exact(c, h, kv, 5) == 4  # the newest chunks are still in L1
    warnings = [r for r in caplog.records if "L2 writes failing" in r.getMessage()]
    assert len(warnings) == 1  # once per incident, not per chunk


def test_a_full_write_queue_drops_writes_instead_of_waiting(shm_files, servers, clients, tmp_path,  # noqa: F811
                                                            no_internal_errors):  # noqa: F811
    srv = servers(**l2_settings(tmp_path / "l2", l2_write="all", l2_queue_size="8KiB"))
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=128)
    tiers = srv.engine.l2.tiers
    tiers[0] = SlowTier(tiers[0], 2.0)
    t0 = time.monotonic()
    store_prompts(c, h, kv, range(3))
    assert time.monotonic() - t0 < 2.0  # no store waited for the disk (one write takes 2 s)
    writer_idle(srv)
    st = srv.engine.status()["l2"]
    assert st["dropped_writes"] >= 1 and st["written"] + st["dropped_writes"] == 12


def test_admission_keeps_one_off_chunks_off_the_disk(shm_files, servers, clients, tmp_path,  # noqa: F811
                                                     no_internal_errors):  # noqa: F811
    srv = servers(**l2_settings(tmp_path / "l2", l2_admit=2))
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=128)
    store_prompts(c, h, kv, [1])
    assert c.lookup(chunk_hashes(w.prompt(1, 4), CHUNK), model="m") == 4  # prompt 1 used twice
    store_prompts(c, h, kv, range(2, 7), srv=srv)  # 20 one-off chunks evict everything older
    writer_idle(srv)
    assert srv.engine.status()["l2"]["written"] == 4
    assert retrieved_exact(c, h, kv, 1) == 4
    assert retrieved_exact(c, h, kv, 2) == 0


def test_readers_and_writers_of_the_same_chunks_at_once(shm_files, servers, tmp_path, no_internal_errors):  # noqa: F811
    srv = servers(**l2_settings(tmp_path / "l2", l2_write="all"))
    errors: list = []

    def worker(k: int) -> None:
        try:
            c = Client(srv.url)
            kv, h = register_mha(c, model="m", num_blocks=128)
            for round_ in range(6):
                seed = round_ % 3  # every worker stores and reads the same three prompts
                store_prompts(c, h, kv, [seed])
                found = c.lookup(chunk_hashes(w.prompt(seed, 4), CHUNK), model="m", lock=True)
                retrieved_exact(c, h, kv, seed, lease=found)
                store_prompts(c, h, kv, [10 + 4 * k + round_ % 4])  # churn L1
            c.close()
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def test_sigkill_during_writes_then_restart_serves_only_whole_objects(tmp_path):
    path = tmp_path / "l2"
    url = f"ipc://{tmp_path}/s.sock"
    args = ["--url", url, "--device", "cpu", "--chunk-size", str(CHUNK), "--l1-size", "1MiB",
            "--l2-disk", str(path), "--l2-disk-size", "64MiB", "--l2-write", "all"]
    srv = ServerProcess(args)
    try:
        srv.wait_ready()
        c = Client(url)
        kv, h = register_mha(c, num_blocks=128)
        seed = 100
        while len(_kv_files(path)) < 20:
            store_prompts(c, h, kv, [seed])
            seed += 1
        kill_with_stores_in_flight(srv, c, h, kv, range(seed, seed + 4))  # their disk writes too
    finally:
        srv.kill()
    srv2 = ServerProcess(args)
    try:
        srv2.wait_ready()
        c = Client(url)
        kv, h = register_mha(c, num_blocks=128)
        served = 0
        for seed in range(100, seed + 4):
            got = retrieved_exact(c, h, kv, seed)  # byte-exact for whatever is served
            served += got == 4
        assert served >= 4
        c.close()
    finally:
        srv2.proc.send_signal(signal.SIGTERM)
        srv2.proc.wait(30)


def test_an_evicted_chunk_stays_readable_until_written_and_stays_if_used_again():
    from lmcache_mp.native import HostArena

    l1 = L1Store(HostArena(3 * 4096, 4096))
    offers = []
    l1.offer_l2 = lambda obj, evicting: evicting and not offers and not offers.append(obj)  # takes one
    fmt = ("tokens", 2, 1, 16, "uint8")
    key = [ObjectKey("m", 1, 0, bytes([i + 1]) * 16, b"") for i in range(7)]
    for i in range(3):
        l1.commit(l1.begin_store([key[i]], 4096, fmt))
    l1.commit(l1.begin_store([key[3]], 4096, fmt))  # key 0 is queued for L2, key 1 makes room
    assert [o.key for o in offers] == [key[0]] and l1.stats()["spilled"] == 1
    assert l1.contains(key[0]) and not l1.contains(key[1])  # still served from L1 meanwhile
    assert l1.lookup("m", 1, [key[0].digest]) == (1, 0)  # used again: it stays after its write
    l1.l2_written([(offers[0], True)])
    assert l1.contains(key[0])
    offers.clear()
    l1.commit(l1.begin_store([key[4]], 4096, fmt))  # key 2 queued, key 3 makes room
    assert [o.key for o in offers] == [key[2]]
    l1.l2_written([(offers[0], True)])  # written and not used since: it leaves now
    assert not l1.contains(key[2]) and l1.stats()["evicted"] == 3
    l1.commit(l1.begin_store([key[5]], 4096, fmt))  # fills the slot key 2 left
    l1.commit(l1.begin_store([key[6]], 4096, fmt))  # key 0 is in L2 already: freed at once
    assert not offers[1:] and not l1.contains(key[0]) and l1.contains(key[4])
