"""--l1-persist: L1 in a file with a journal, re-attached by a restarted server. Committed chunks
come back byte-exact after SIGTERM and, once recorded, after SIGKILL (with stores in flight: what
is served is exact, half-written chunks are dropped); a damaged journal keeps what comes before
the damage (tests/test_l1_damage.py: crashes and damage anywhere);
another arena size starts empty; one server per file."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import pytest

import cpu_workers as w
from lmcache_mp import Client, chunk_hashes
from test_cli import ServerProcess
from test_l2_tier import kill_with_stores_in_flight, retrieved_exact, store_prompts
from test_server_e2e import CHUNK, clients, register_mha, servers, wait_until  # noqa: F401


@pytest.fixture
def persist_path():
    path = Path("/dev/shm") / f"lmcache-mp-test-l1-{uuid.uuid4().hex[:8]}"
    yield str(path)
    for p in Path("/dev/shm").glob(path.name + "*"):  # the arena, its journal, their copies
        p.unlink(missing_ok=True)


@pytest.mark.parametrize("policy", ["adaptive", "lru", "arc", "s3fifo"])
def test_a_restarted_server_serves_the_chunks_at_once(shm_files, servers, clients, persist_path, policy):  # noqa: F811
    settings = dict(l1_size="4MiB", l1_persist=persist_path, eviction_policy=policy)
    srv = servers(**settings)
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=128)
    store_prompts(c, h, kv, [1, 2, 3])
    c.clear()  # ... then 3 cleared: its chunks must not come back
    store_prompts(c, h, kv, [1, 2])
    c.close()
    srv.stop()
    srv = servers(**settings)
    l1 = srv.engine.status()["l1"]
    assert l1["objects"] == 8 and l1["evictable"] == 8 and l1["eviction"]["policy"] == policy  # the policy's again
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=128)
    assert c.lookup(chunk_hashes(w.prompt(1, 4), CHUNK), model="m") == 4
    assert retrieved_exact(c, h, kv, 1) == 4 and retrieved_exact(c, h, kv, 2) == 4
    assert c.lookup(chunk_hashes(w.prompt(3, 4), CHUNK), model="m") == 0
    store_prompts(c, h, kv, [4])  # and it goes on storing next to them
    assert retrieved_exact(c, h, kv, 4) == 4


def test_sigkill_keeps_committed_chunks_and_drops_half_written_ones(tmp_path, persist_path):
    url = f"ipc://{tmp_path}/s.sock"
    args = ["--url", url, "--device", "cpu", "--chunk-size", str(CHUNK), "--l1-size", "4MiB", "--l1-persist",
            persist_path, "--http-addr", "off"]
    srv = ServerProcess(args)
    try:
        srv.wait_ready()
        c = Client(url)
        kv, h = register_mha(c, num_blocks=128)
        store_prompts(c, h, kv, list(range(100, 110)))
        # A commit is recorded once its bytes are summed, in the background, a moment later.
        wait_until(lambda: c.status()["l1"]["journal_backlog"] == 0, 10, "the commits to be recorded")
        kill_with_stores_in_flight(srv, c, h, kv, range(110, 114))
    finally:
        srv.kill()
    srv = ServerProcess(args)
    try:
        srv.wait_ready()
        assert "re-attached" in srv.wait_for("L1 in")
        c = Client(url)
        kv, h = register_mha(c, num_blocks=128)
        for seed in range(100, 110):  # committed before the kill: all back, byte-exact
            assert retrieved_exact(c, h, kv, seed) == 4
        for seed in range(110, 114):  # in flight: whatever is served is exact
            retrieved_exact(c, h, kv, seed)
        c.close()
    finally:
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(30)


def test_a_damaged_journal_keeps_what_comes_before(shm_files, servers, clients, persist_path):  # noqa: F811
    settings = dict(l1_size="4MiB", l1_persist=persist_path)
    srv = servers(**settings)
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=128)
    store_prompts(c, h, kv, [1])
    # commits are recorded a moment after the store's reply (once their bytes are summed): the
    # first prompt's records must all be in before the size marks where the second's begin
    assert srv.engine.l1.flush_journal(30)
    size = os.path.getsize(persist_path + ".journal")
    store_prompts(c, h, kv, [2])
    c.close()
    srv.stop()
    with open(persist_path + ".journal", "r+b") as f:  # a bit flip in the second prompt's records
        f.seek(size + 10)
        b = f.read(1)
        f.seek(size + 10)
        f.write(bytes([b[0] ^ 0x40]))
    srv = servers(**settings)
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=128)
    assert retrieved_exact(c, h, kv, 1) == 4
    assert c.lookup(chunk_hashes(w.prompt(2, 4), CHUNK), model="m") == 0


def test_another_arena_size_starts_empty_says_why_and_one_server_per_file(shm_files, servers, clients,  # noqa: F811
                                                                          persist_path, caplog):
    srv = servers(l1_size="4MiB", l1_persist=persist_path)
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=128)
    store_prompts(c, h, kv, [1])
    with pytest.raises(RuntimeError, match="in use by another server"):
        servers(l1_size="4MiB", l1_persist=persist_path)
    c.close()
    srv.stop()
    caplog.clear()
    srv = servers(l1_size="8MiB", l1_persist=persist_path)
    assert srv.engine.status()["l1"]["objects"] == 0
    why = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "L1" in r.getMessage()]
    assert len(why) == 1 and "the arena file was not of 8.0 MiB" in why[0] and "--l1-size" in why[0], why
    assert why[0].endswith("L1 starts empty")
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=128)
    store_prompts(c, h, kv, [2])
    c.close()
    srv.stop()
    os.unlink(persist_path)  # the arena file gone, its journal kept: the journal's chunks are not served
    caplog.clear()
    srv = servers(l1_size="8MiB", l1_persist=persist_path)
    assert srv.engine.status()["l1"]["objects"] == 0
    assert any("the arena file was not of" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


def test_moved_and_evicted_objects_are_journaled(persist_path):
    """A slab changing size moves an object and evicts others: after a "restart" (a new arena on
    the file, a new L1), exactly the resident objects come back, each with its own bytes."""
    import numpy as np

    from lmcache_mp.native import HostArena
    from lmcache_mp.storage.l1 import L1Store, ObjectKey
    from lmcache_mp.storage.l1_journal import L1Journal
    from test_l1_sizes import SLAB, _fill, key

    def open_l1():
        journal = L1Journal(persist_path + ".journal", 2 * SLAB, SLAB)
        arena = HostArena(2 * SLAB, SLAB, False, -1, persist_path)
        l1 = L1Store(arena)
        l1.attach_journal(journal)
        l1.restore(journal.read_live().values() if arena.reattached else [])
        return journal, arena, l1

    journal, arena, l1 = open_l1()
    small = [key(16000, i) for i in range(8)]  # both slabs full
    for i, k in enumerate(small):
        _fill(l1, arena, [k], 16000, i + 1)
    _, lease = l1.lookup("m16000", 1, [small[3].digest], lock=True, owner=b"a")  # leased: moved, not evicted
    for k in (small[0], small[4], small[5], small[6], small[7]):
        l1.lookup("m16000", 1, [k.digest])
    big = ObjectKey("big", 1, 0, b"x" * 16, b"")
    _fill(l1, arena, [big], 60000, 99)  # 4 evicted, 1 moved (test_l1_sizes tells which)
    assert l1.counters["moved"] == 1 and l1.counters["evicted"] == 4
    resident = [k for k in small if l1.contains(k)]
    assert small[3] in resident and l1.release(lease) == 1
    l1.close_journal()
    del l1, arena

    journal, arena, l1 = open_l1()
    assert arena.reattached and l1.stats()["objects"] == len(resident) + 1
    for i, k in enumerate(small):
        assert l1.contains(k) == (k in resident)
        if k in resident:
            obj = l1._get(k)
            assert (np.frombuffer(arena.view(obj.offset, 16000), dtype=np.uint8) == i + 1).all()
    (obj,) = l1.begin_read([big], ("t", 60000))
    assert (np.frombuffer(arena.view(obj.offset, 60000), dtype=np.uint8) == 99).all()
    l1.end_read([obj])
    l1.close_journal()


def _live_in_journal(path: str, arena_bytes: int, slab_bytes: int) -> dict:
    from lmcache_mp.storage.l1_journal import replay

    with open(path, "rb") as f:
        live, _, why = replay(f.read(), arena_bytes, slab_bytes)
    assert why == ""
    return {off: e.key for off, e in live.items()}


def test_the_journal_is_rewritten_in_the_background_and_keeps_what_happened_meanwhile(persist_path, monkeypatch):
    """Past its size limit the journal is rewritten by a thread that reads L1 a part at a time;
    stores, evictions and frees made while it writes its file are in the new journal too, which
    then says exactly what L1 holds, in a file a fraction of the old one's size."""
    import threading

    from lmcache_mp.native import HostArena
    from lmcache_mp.storage import l1_journal
    from lmcache_mp.storage.l1 import L1Store, ObjectKey
    from lmcache_mp.storage.l1_journal import L1Journal

    slab, objects = 1 << 20, 4096
    monkeypatch.setattr(l1_journal, "COMPACT_MIN_BYTES", 64 << 10)
    journal = L1Journal(persist_path + ".journal", 4 * slab, slab)
    l1 = L1Store(HostArena(4 * slab, slab, False, -1, persist_path))
    l1.attach_journal(journal)
    keys = iter(ObjectKey("m", 1, 0, i.to_bytes(16, "little"), b"") for i in range(10**6))

    def store(n: int) -> None:
        plan = l1.begin_store([next(keys) for _ in range(n)], 1000, ("f",))
        assert len(plan.objects) == n
        l1.commit(plan)

    written, meanwhile = threading.Event(), []
    real_write = L1Journal.write_rewrite

    def write_while_serving(self, records):
        meanwhile.append(journal.bytes)
        store(64)  # new chunks that evict old ones, while the snapshot is being written
        victim = next(o for o in l1._policy.order())
        l1.lookup("m", 1, [victim.key.digest], lock=True, owner=b"a")  # a leased chunk stays
        meanwhile.append(victim.key)
        real_write(self, records)
        store(16)
        written.set()

    monkeypatch.setattr(L1Journal, "write_rewrite", write_while_serving)
    while not journal.rewriting:
        store(16)
        l1.flush_journal()
        assert l1.counters["stored"] < 50 * objects, "no rewrite started"
    assert written.wait(30)  # (this thread stores nothing meanwhile: the rewrite's thread does)
    for t in threading.enumerate():  # it puts the new file in place right after writing it
        if t.name == "lmcache-l1-journal":
            t.join(30)
    assert not journal.rewriting and not os.path.exists(persist_path + ".journal.tmp")
    store(16)  # the new journal goes on as the old one did
    assert l1.flush_journal()
    resident = {o.offset: tuple(o.key) for o in l1._at.values() if o.committed}
    assert len(resident) == l1.stats()["objects"] and l1.counters["evicted"] > 0
    assert _live_in_journal(persist_path + ".journal", 4 * slab, slab) == resident
    assert tuple(meanwhile[1]) in resident.values()
    assert journal.bytes < meanwhile[0] / 2
    l1.close_journal()


def test_a_rewrite_that_ends_after_the_journal_closed_leaves_it_as_it_was(persist_path):
    from lmcache_mp.storage.l1 import ObjectKey
    from lmcache_mp.storage.l1_journal import L1Journal, commit_record

    journal = L1Journal(persist_path + ".journal", 1 << 20, 1 << 20)
    journal.rewrite([commit_record(0, 1000, ObjectKey("m", 1, 0, b"k" * 16, b""), ("f",), 12345)])
    journal.start_rewrite()
    journal.write_rewrite([])
    journal.close()  # shutdown while the rewrite was writing
    assert journal.finish_rewrite() == -1
    assert _live_in_journal(persist_path + ".journal", 1 << 20, 1 << 20) == {0: ("m", 1, 0, b"k" * 16, b"")}
