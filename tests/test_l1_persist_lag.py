"""--l1-persist under load: the journal keeps up with the stores. The chunks of at most
MAX_LAG_STORES answered stores (of at most MAX_LAG_BYTES) wait for their records at any moment (a
store that finds no room sums its own bytes before it is answered), so a SIGKILL loses at most
that many, however busy the host; and what comes back is byte-exact."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import traceback

import numpy as np

from lmcache_mp import Client, chunk_hashes
from lmcache_mp.storage.l1_persist import MAX_LAG_STORES
from test_cli import ServerProcess
from test_l1_persist import persist_path  # noqa: F401

CHUNK, BLOCK = 256, 16
WIDTH = 512  # bf16 elements per token of one segment: 2 x 256 x 512 x 2 B = 512 KiB chunks
SETS = 4  # blocks of this many chunks per client, stored in turn


def _digest(worker: int, i: int) -> bytes:
    return chunk_hashes(np.random.default_rng((worker, i)).integers(0, 1 << 30, CHUNK), CHUNK)[0]


def _chunk(worker: int, j: int) -> np.ndarray:
    """The bytes (int16) of block set j of this client: [2, CHUNK // BLOCK, BLOCK, 1, WIDTH]."""
    return np.random.default_rng((worker, j, 7)).integers(-(1 << 15), 1 << 15, (2, CHUNK // BLOCK, BLOCK, 1, WIDTH),
                                                          dtype=np.int16)


def _blocks(j: int) -> np.ndarray:
    return np.arange(j * CHUNK // BLOCK, (j + 1) * CHUNK // BLOCK)


def _store_without_pause(q, url: str, worker: int, acks, start, stop) -> None:
    """A client process: once all are registered, one-chunk stores back to back until `stop` (or
    the server is gone); reports the indices of the stores it was answered for."""
    try:
        import torch

        from lmcache_mp import shared_cpu_tensor

        kv = shared_cpu_tensor((2, SETS * CHUNK // BLOCK, BLOCK, 1, WIDTH), torch.bfloat16)
        for j in range(SETS):
            kv.view(torch.int16).numpy()[:, _blocks(j)] = _chunk(worker, j)
        c = Client(url, timeout=60)
        h = c.register_kv_cache([kv], model="m")
        start.wait(120)
        answered, i = [], 0
        while not stop.is_set():
            try:
                got = c.store(h, [_digest(worker, i)], _blocks(i % SETS)).result(60).chunks
            except Exception:  # the server was killed
                break
            if got == 1:
                answered.append(i)
                with acks.get_lock():
                    acks.value += 1
            i += 1
        try:
            c.close()
        except Exception:
            pass
        del kv, h
        q.put(("ok", (worker, answered)))
    except Exception:
        q.put(("error", traceback.format_exc()))


def test_sigkill_under_load_loses_at_most_max_lag_acknowledged_stores(shm_files, tmp_path, persist_path):  # noqa: F811
    """Four client processes store 512 KiB chunks without pause into a server of its own
    process (2 cores: the server, the clients and whatever else runs here share them). The
    journal's backlog never passes MAX_LAG_STORES chunks (one per store here); after a SIGKILL at
    ~600 answered stores, a restarted server serves all but at most MAX_LAG_STORES of them, each
    byte-exact. (Unbounded, the summing
    thread fell hundreds of chunks behind here.)"""
    url = f"ipc://{tmp_path}/s.sock"
    args = ["--url", url, "--device", "cpu", "--chunk-size", str(CHUNK), "--l1-size", "1GiB", "--l1-persist",
            persist_path, "--http-addr", "off"]
    ctx = mp.get_context("spawn")
    q, acks, start, stop = ctx.Queue(), ctx.Value("l", 0), ctx.Barrier(5), ctx.Event()
    srv = ServerProcess(args)
    procs = []
    try:
        srv.wait_ready()
        procs = [ctx.Process(target=_store_without_pause, args=(q, url, k, acks, start, stop), daemon=True)
                 for k in range(4)]
        for p in procs:
            p.start()
        start.wait(120)
        watcher = Client(url, timeout=60)
        backlog, t0 = [], time.monotonic()
        while acks.value < 600:
            assert time.monotonic() - t0 < 120, f"only {acks.value} stores answered"
            backlog.append(watcher.status()["l1"]["journal_backlog"])
        os.kill(srv.proc.pid, signal.SIGKILL)
        stop.set()
        srv.proc.wait(30)
        watcher.close()
        results = [q.get(timeout=120) for _ in procs]
        assert all(status == "ok" for status, _ in results), results
    finally:
        stop.set()
        srv.kill()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    answered = {worker: got for _, (worker, got) in results}
    assert sum(map(len, answered.values())) >= 600
    assert max(backlog) <= MAX_LAG_STORES, max(backlog)

    srv = ServerProcess(args)
    try:
        srv.wait_ready()
        assert "re-attached" in srv.wait_for("L1 in")
        import torch

        from lmcache_mp import shared_cpu_tensor

        kv = shared_cpu_tensor((2, CHUNK // BLOCK, BLOCK, 1, WIDTH), torch.bfloat16)
        c = Client(url, timeout=60)
        h = c.register_kv_cache([kv], model="m")
        missing = 0
        for worker, got in answered.items():
            for i in got:
                kv.view(torch.int16).fill_(0)
                if c.retrieve(h, [_digest(worker, i)], _blocks(0)).result(60).loaded == 0:
                    missing += 1
                    continue
                assert np.array_equal(kv.view(torch.int16).numpy(), _chunk(worker, i % SETS)), (worker, i)
        c.close()
        del kv, h
    finally:
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(60)
    assert missing <= MAX_LAG_STORES, f"{missing} of {sum(map(len, answered.values()))} answered stores lost"


def test_stores_sum_their_own_chunks_while_the_summing_threads_are_stalled(persist_path, monkeypatch):  # noqa: F811
    """The mechanism, without timing: while the background sums are held, what waits for its
    records stays within MAX_LAG_STORES stores and MAX_LAG_BYTES, and every other chunk is recorded
    before commit returns (a store is answered after its commit), the first ones of a request
    first; a store that finds nothing waiting is queued whole, however large. Every record
    describes its chunk's bytes, and once the sums go on, every chunk is recorded."""
    from lmcache_mp.native import HostArena
    from lmcache_mp.storage import l1_persist
    from lmcache_mp.storage.l1 import L1Store, ObjectKey
    from lmcache_mp.storage.l1_journal import L1Journal, chunk_sum, replay

    size = 4096
    held = threading.Event()  # set: the background's sums are held
    real_sum = l1_persist.chunk_sum

    def gated_sum(data):
        if threading.current_thread().name.startswith(("lmcache-l1-journal-sums", "lmcache-l1-sum")):
            while held.is_set():
                time.sleep(0.005)
        return real_sum(data)

    monkeypatch.setattr(l1_persist, "chunk_sum", gated_sum)
    monkeypatch.setattr(l1_persist, "MAX_LAG_STORES", 3)
    monkeypatch.setattr(l1_persist, "MAX_LAG_BYTES", 40 * size)
    monkeypatch.setattr(l1_persist, "SUM_INLINE_BYTES", 16 << 10)  # 10 chunks a store sums: on its pool
    slab = 1 << 20
    journal = L1Journal(persist_path + ".journal", 8 * slab, slab)
    arena = HostArena(8 * slab, slab, False, -1, persist_path)
    l1 = L1Store(arena)
    l1.attach_journal(journal)
    l1.restore([])  # (writes the journal's header, as a server's start does)
    keys = iter(ObjectKey("m", 1, 0, i.to_bytes(16, "little"), b"") for i in range(10**6))
    stored: list = []

    def store(n: int) -> list:
        plan = l1.begin_store([next(keys) for _ in range(n)], size, ("f",))
        for obj in plan.objects:
            np.frombuffer(arena.view(obj.offset, size), dtype=np.uint8)[:] = np.random.randint(0, 256, size)
        l1.commit(plan)
        stored.extend(plan.objects)
        return plan.objects

    def recorded() -> set:
        with open(persist_path + ".journal", "rb") as f:
            live, _, why = replay(f.read(), 8 * slab, slab)
        assert why == ""
        for e in live.values():  # a record describes its chunk's bytes
            assert chunk_sum(arena.view(e.offset, e.object_bytes)) == e.checksum
        return {e.key for e in live.values()}

    def keys_of(objs) -> set:
        return {tuple(o.key) for o in objs}

    def sums_go_on() -> set:
        before = recorded()
        held.clear()
        assert l1.flush_journal(30) and l1.journal_backlog() == 0
        assert recorded() == keys_of(stored)
        held.set()
        return before

    held.set()
    try:
        store(20)  # nothing waits: queued
        store(1), store(1)  # 3 stores wait, 22 chunks
        alone = store(1)  # no room for a 4th store: summed by its store
        assert l1.journal_backlog() == 22 and l1.counters["summed_by_stores"] == 1
        assert sums_go_on() == keys_of(alone)

        before = set(keys_of(stored))
        big = store(50)  # nothing waits: queued whole, more than MAX_LAG_BYTES
        more = store(5)  # no bytes left: summed by its store
        assert l1.counters["journal_backlog_max"] == 50 and l1.counters["summed_by_stores"] == 6
        assert sums_go_on() == before | keys_of(more) and not keys_of(big) & before

        before = set(keys_of(stored))
        store(30)
        part = store(20)  # room for 10 more: its first 10 are summed by its store, its last 10 wait
        assert l1.journal_backlog() == 40 and l1.counters["summed_by_stores"] == 16
        assert sums_go_on() == before | keys_of(part[:10])
    finally:
        held.clear()
    l1.close_journal()
    assert recorded() == keys_of(stored)
