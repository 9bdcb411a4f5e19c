"""The L2 tiers end to end on the CPU device, with a real directory: chunks L1 evicts go to disk
and come back byte-exact, lookups continue into L2 and lease what a prefetch brings back within
its deadline, a restarted server finds the disk's chunks again, and damaged files, a disk that
cannot be written or a slow one never fail a request."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import numpy as np

import cpu_workers as w
from lmcache_mp import Client, chunk_hashes
from lmcache_mp.storage.l1 import ObjectKey
from lmcache_mp.storage.l2 import L2Backend
from test_cli import ServerProcess
from test_server_e2e import CHUNK, blocks_of, clients, no_internal_errors, register_mha, servers, wait_until  # noqa: F401

L1_CHUNKS = 16  # 64 KiB of L1 in 4 KiB objects (one MHA chunk of the test caches)


def l2_settings(path: Path, **kw) -> dict:
    return {"l1_size": f"{L1_CHUNKS * 4}KiB", "l2_disk": str(path), "l2_disk_size": "64MiB", **kw}


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
    assert l2["tiers"][0]["objects"] >= 16 and l2["tiers"][0]["write_seconds"] > 0  # (GB/s: 0.0 on a slow disk)
    from lmcache_mp.server.ops.metrics import StatusCollector

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
    # every chunk is in L1 now and leased: more stores cannot push it out before the retrieve (they
    # evict the others, once the writer has read them: a chunk being written to disk stays)
    writer_idle(srv)
    store_prompts(c, h, kv, [4], chunks=2, srv=srv)
    assert retrieved_exact(c, h, kv, 1, chunks=12, lease=found) == 12
    assert srv.engine.status()["l2"]["prefetches"] == 1


class SlowTier(L2Backend):
    """A real tier whose reads take `delay` seconds (and writes `put_delay`)."""

    def __init__(self, inner: L2Backend, delay: float, put_delay: float = 0.0):
        self.inner, self.delay, self.put_delay, self.name = inner, delay, put_delay, inner.name

    def put(self, *a):
        time.sleep(self.put_delay)
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


class FirstWriteFails(SlowTier):
    """A real tier that fails the write of each batch's first chunk (writes the rest, as a tier
    writing a batch in parallel may)."""

    def __init__(self, inner: L2Backend):
        super().__init__(inner, 0.0)

    def put(self, keys, formats, ptrs, sizes):
        return [False] + self.inner.put(keys[1:], formats[1:], ptrs[1:], sizes[1:])


def test_nothing_more_of_a_prompt_is_written_after_a_failed_chunk(shm_files, servers, clients, tmp_path,  # noqa: F811
                                                                   no_internal_errors):  # noqa: F811
    srv = servers(**l2_settings(tmp_path / "l2", l2_write="all"))
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=128)
    writer = srv.engine.l2.writers[0]
    writer.tier = FirstWriteFails(writer.tier)
    store_prompts(c, h, kv, [1])
    writer_idle(srv)
    st = srv.engine.status()["l2"]  # chunk 0 failed; 1-3 went out with it, in parallel
    assert (st["write_errors"], st["written"], st["tiers"][0]["written_after_failed"]) == (1, 3, 3)
    # the rest of that prompt is not written after them
    src = blocks_of(6)
    w.write_tokens(kv, "mha", src, w.reference(1, "mha", 6 * CHUNK))
    hashes = chunk_hashes(w.prompt(1, 6), CHUNK)
    assert c.store(h, hashes[4:], src[4 * (CHUNK // 8):], parent=hashes[3]).result(10).chunks == 2
    writer_idle(srv)
    assert on_disk(srv, 1, chunks=6) == 3 and srv.engine.status()["l2"]["written"] == 3


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
    l2 = srv.engine.l2
    l2.tiers[0] = SlowTier(l2.tiers[0], 0.5)
    loads, real_load = [], l2.load
    l2.load = lambda found, then: (loads.append(len(found)), real_load(found, then))[1]  # a retrieve's
    lookup = c.lookup_async(chunk_hashes(w.prompt(1, 4), CHUNK), model="m", lock=True)
    dst = blocks_of(4, start=64)
    load = c.retrieve(h, chunk_hashes(w.prompt(2, 4), CHUNK), dst)
    # both wait on the slow disk now (the server took them: not a sleep that a loaded machine outlasts)
    wait_until(lambda: srv.engine.status()["l2"]["prefetches"] == 1 and loads == [4], 10,
               "the lookup's prefetch and the retrieve's load to be queued")
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
    warnings = [r for r in caplog.records if "L2 writes to disk failing" in r.getMessage()]
    assert len(warnings) == 1  # once per incident, not per chunk


def on_disk(srv, seed: int, chunks: int = 4) -> int:
    """How many chunks of this prompt the disk tier holds (from its index)."""
    from lmcache_mp.storage.l2.tiers import key_bytes

    keys = [key_bytes(ObjectKey("m", 1, 0, d, b"")) for d in chunk_hashes(w.prompt(seed, chunks), CHUNK)]
    return sum(got is not None for got in srv.engine.l2.tiers[0].lookup(keys))


def test_a_burst_keeps_whole_prompts_on_disk_and_says_what_it_dropped(shm_files, servers, clients, tmp_path,  # noqa: F811
                                                                      caplog, no_internal_errors):  # noqa: F811
    """96 prompts of 4 chunks back to back into an L1 of 64 chunks, on a disk that takes 0.2 s per
    write: most prompts cannot be written before L1 evicts them. Every prompt on disk afterwards
    is whole, every chunk written belongs to one, and one WARNING says how many were dropped."""
    srv = servers(**l2_settings(tmp_path / "l2", l1_size=f"{64 * 4}KiB"))
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=128)
    writer = srv.engine.l2.writers[0]
    writer.tier = SlowTier(writer.tier, 0, put_delay=0.2)
    t0 = time.monotonic()
    store_prompts(c, h, kv, range(96))
    assert time.monotonic() - t0 < 10  # no store waited for the disk
    writer_idle(srv)
    st = srv.engine.status()["l2"]
    counts = [on_disk(srv, seed) for seed in range(96)]
    assert set(counts) <= {0, 4}, counts  # whole prompts or nothing, never a fragment
    assert st["tiers"][0]["objects"] == sum(counts) == st["written"] > 0  # every chunk written is in one
    assert st["dropped_writes"] > 0 and st["written"] + st["dropped_writes"] <= 96 * 4
    warnings = [r.getMessage() for r in caplog.records if "chunk writes dropped" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("L2 disk: "), warnings  # once a minute at most
    from lmcache_mp.server.ops.metrics import StatusCollector

    metrics = {(smp.name, smp.labels.get("tier")): smp.value
               for fam in StatusCollector(srv.engine).collect() for smp in fam.samples}
    assert metrics["lmcache_mp_l2_dropped_writes_total", None] == st["dropped_writes"]
    assert metrics["lmcache_mp_l2_tier_dropped_writes_total", "disk"] == st["dropped_writes"]
    for seed in (s for s, n in enumerate(counts) if n == 4):  # what the disk holds comes back
        assert retrieved_exact(c, h, kv, seed) == 4
        break


def test_prompts_stored_in_pieces_reach_the_disk_as_prefixes(shm_files, servers, clients, tmp_path,  # noqa: F811
                                                              no_internal_errors):  # noqa: F811
    """An engine stores a prompt as it grows: each later piece names the chunk before it
    (`parent`). In the burst above, stored in two pieces each, a prompt whose first piece was
    dropped has its second dropped too: what the disk holds of each prompt is a prefix of it."""
    from lmcache_mp.storage.l2.tiers import key_bytes

    srv = servers(**l2_settings(tmp_path / "l2", l1_size=f"{64 * 4}KiB"))
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=128)
    writer = srv.engine.l2.writers[0]
    writer.tier = SlowTier(writer.tier, 0, put_delay=0.2)
    bpc = CHUNK // 8
    for seed in range(96):
        src = blocks_of(4)
        w.write_tokens(kv, "mha", src, w.reference(seed, "mha", 4 * CHUNK))
        hashes = chunk_hashes(w.prompt(seed, 4), CHUNK)
        assert c.store(h, hashes[:2], src[: 2 * bpc]).result(10).chunks == 2
        assert c.store(h, hashes[2:], src[2 * bpc :], parent=hashes[1]).result(10).chunks == 2
    writer_idle(srv)
    held = []
    for seed in range(96):
        keys = [key_bytes(ObjectKey("m", 1, 0, d, b"")) for d in chunk_hashes(w.prompt(seed, 4), CHUNK)]
        held.append("".join("x" if got is not None else "." for got in srv.engine.l2.tiers[0].lookup(keys)))
    assert all(re.fullmatch(r"x*\.*", p) for p in held), held  # no gap before a chunk
    assert srv.engine.status()["l2"]["dropped_writes"] > 0 and "xxxx" in held
    for seed in (s for s, p in enumerate(held) if p == "xxxx"):  # and they come back whole
        assert retrieved_exact(c, h, kv, seed) == 4
        break


def test_stores_slower_than_the_disk_lose_nothing(shm_files, servers, clients, tmp_path,  # noqa: F811
                                                  no_internal_errors):  # noqa: F811
    """A store every 50 ms through an L1 of 64 chunks that evicts all the time: the writer keeps the
    chunks near the eviction end written ahead (from when less than 32 chunks are free: 400 ms of
    stores, a wide margin on a loaded machine), so eviction finds them clean and drops nothing."""
    srv = servers(**l2_settings(tmp_path / "l2", l1_size=f"{64 * 4}KiB", l2_queue_size="128KiB"))
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=128)
    for seed in range(32):
        store_prompts(c, h, kv, [seed])
        time.sleep(0.05)
    writer_idle(srv)
    st = srv.engine.status()
    assert st["l1"]["evicted"] >= 64 and st["l2"]["dropped_writes"] == 0, st["l2"]
    assert all(on_disk(srv, seed) == 4 for seed in range(16))  # every evicted prompt is on disk
    assert retrieved_exact(c, h, kv, 0) == 4


def test_a_locked_lookup_of_a_disk_prefix_longer_than_l1_leases_what_fits(shm_files, servers, clients,  # noqa: F811
                                                                          tmp_path, no_internal_errors):  # noqa: F811
    path = tmp_path / "l2"
    srv = servers(**l2_settings(path, l2_write="all", l1_size=f"{64 * 4}KiB"))
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=256)
    store_prompts(c, h, kv, [1], chunks=40, srv=srv)
    assert srv.engine.status()["l2"]["written"] == 40
    srv.stop()
    srv = servers(**l2_settings(path, prefetch_timeout=30.0))  # L1 empty, 40 chunks on disk, L1 holds 16
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=256)
    hashes = chunk_hashes(w.prompt(1, 40), CHUNK)
    assert c.lookup(hashes, model="m") == 40  # without lock: what L2 holds
    found = c.lookup(hashes, model="m", lock=True)
    assert found == L1_CHUNKS and found.lease  # the longest prefix that fits, loaded and leased
    assert retrieved_exact(c, h, kv, 1, chunks=40, lease=found) == L1_CHUNKS
    again = c.lookup(hashes, model="m", lock=True)
    assert again == L1_CHUNKS
    c.release(lease=again)
    assert retrieved_exact(c, h, kv, 1, chunks=40) == L1_CHUNKS  # a retrieve alone loads what fits too


def test_the_l2_queue_size_is_a_quarter_of_l1_unless_set_and_at_most_half(servers, tmp_path):  # noqa: F811
    capacity = L1_CHUNKS * 4096
    assert servers(**l2_settings(tmp_path / "a")).engine.status()["l2"]["queue_limit"] == capacity // 4
    assert servers(**l2_settings(tmp_path / "b", l2_queue_size="8KiB")).engine.status()["l2"]["queue_limit"] == 8192
    assert servers(**l2_settings(tmp_path / "c", l2_queue_size="1GiB")).engine.status()["l2"]["queue_limit"] == \
        capacity // 2


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


def test_a_clean_stop_leaves_the_disk_holding_what_l1_held(tmp_path):
    """The documented disk tier (write policy evicted, the default; FP8 codec): chunks stored, then
    SIGTERM, no eviction ever wrote them. The stop writes what L1 holds that the disk lacks (within
    FLUSH_SECONDS), and a restarted server serves them; the start-up lines name each tier's codec."""
    path = tmp_path / "l2"
    url = f"ipc://{tmp_path}/s.sock"
    args = ["--url", url, "--device", "cpu", "--chunk-size", str(CHUNK), "--l1-size", "1MiB", "--http-addr", "off",
            "--l2-disk", str(path), "--l2-disk-codec", "fp8"]
    srv = ServerProcess(args)
    try:
        srv.wait_ready()
        assert "codec fp8, writes evicted (a clean stop writes what L1 holds" in srv.wait_for("L2 disk: codec")
        with Client(url) as c:
            kv, h = register_mha(c, num_blocks=128)
            store_prompts(c, h, kv, [3])  # 4 chunks, far from filling L1: nothing is written ahead of eviction
            assert not _kv_files(path)
    finally:
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0
    assert "wrote 4 chunks" in srv.wait_for("of L1 at shutdown")
    assert len(_kv_files(path)) == 4
    srv2 = ServerProcess(args)
    try:
        srv2.wait_ready()
        with Client(url) as c:
            kv, h = register_mha(c, num_blocks=128)
            assert c.lookup(chunk_hashes(w.prompt(3, 4), CHUNK), model="m", lock=True) == 4
    finally:
        srv2.proc.send_signal(signal.SIGTERM)
        srv2.proc.wait(60)
