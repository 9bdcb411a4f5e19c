"""What goes wrong on a bad day: state that belongs to nobody, leases taken by one engine used up by
another, and a stalled server writing into blocks after the engine gave up on the load."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

import cpu_workers as w
from lmcache_mp import Client, RequestError, Server, ServerConfig, chunk_hashes
from lmcache_mp import protocol as p
from test_cli import ServerProcess
from test_server_e2e import CHUNK, RawClient, blocks_of, register_mha, stopped, wait_until


@pytest.fixture
def server():
    # a silent client is forgotten within the test, but not before the test has looked at what it
    # holds (a second was little on a loaded machine, for that and for live clients' heartbeats)
    srv = Server(ServerConfig(url="tcp://127.0.0.1:0", device="cpu", l1_size="1MiB", chunk_size=CHUNK,
                              heartbeat_timeout=3.0)).start()
    yield srv
    srv.stop()


# ---- every registration and lease belongs to a live client ------------------------------------------


def _mappings_of(name: str) -> int:
    with open("/proc/self/maps") as f:
        return sum(name in line for line in f)


def test_state_without_a_live_owner_is_refused_or_reclaimed(shm_files, server):
    owner = Client(server.url, heartbeat_interval=0.2)
    kv, h = register_mha(owner)
    hashes = chunk_hashes(w.prompt(1, 2), CHUNK)
    owner.store(h, hashes, blocks_of(2)).result(10)
    layer = h.described.layers[0]
    raw = RawClient(server.url)
    register = lambda cid: p.encode(p.RegisterKVCache(  # noqa: E731
        client_id=cid, model="m", world_size=1, rank=0, device="cpu", device_uuid=b"", layout="auto",
        layers=[layer] * len(kv)))
    try:
        # an empty or malformed client id owns nothing: refused
        for cid in (b"", b"short", b"x" * 17):
            raw.expect_error(register(cid), p.ErrorCode.INVALID_ARGUMENT)
            raw.expect_error(p.encode(p.Lookup(client_id=cid, model="m", world_size=1, hashes=b"".join(hashes),
                                               lock=True)), p.ErrorCode.INVALID_ARGUMENT)
        # a client that registers and leases, then goes silent
        region = layer.memory.name
        mapped = _mappings_of(region)  # ours (the tensor) and the owner's registration
        silent = os.urandom(16)
        _, reply = raw.request(register(silent))
        assert isinstance(reply, p.RegisterReply), reply
        _, leased = raw.request(p.encode(p.Lookup(client_id=silent, model="m", world_size=1,
                                                  hashes=b"".join(hashes), lock=True)))
        assert leased.hits == 2 and leased.lease
        thread = f"lmcache-kv-{reply.kv_id & 0xFFFF:04x}"
        assert thread in {t.name for t in threading.enumerate()}
        assert _mappings_of(region) == mapped + 1
        assert len(server.engine.status()["registrations"]) == 2
        # ... is forgotten after the heartbeat timeout: registration, mapping, thread and lease
        wait_until(lambda: len(server.engine.status()["registrations"]) == 1, 15, "the registration to go")
        wait_until(lambda: thread not in {t.name for t in threading.enumerate()}, 10, "its worker thread to end")
        assert _mappings_of(region) == mapped
        assert server.engine.l1.lease(leased.lease) is None
        assert server.engine.status()["l1"]["leases"] == 0
        # the owner, which kept sending heartbeats, keeps everything
        assert owner.lookup(hashes, model="m") == 2 and server.engine.status()["registrations"][0]["id"] == f"{h.kv_id & 0xFFFF:04x}"
    finally:
        raw.close()
        owner.close()


# ---- a lease protects the request that took it ---------------------------------------------------


def test_a_lease_protects_its_engine_when_another_engine_used_up_its_own(shm_files, server):
    """A and B both lease chunk x; B retrieves x and releases; C stores enough to evict everything
    it may; A's retrieve still loads x (protocol 1 consumed A's protection with B's read)."""
    a, b, c = (Client(server.url, heartbeat_interval=0.2) for _ in range(3))
    try:
        kv_a, ha = register_mha(a, model="shared")
        kv_b, hb = register_mha(b, model="shared")
        kv_c, hc = register_mha(c, model="shared", num_blocks=256)
        x = chunk_hashes(w.prompt(1, 1), CHUNK)
        ref = w.reference(1, "mha", CHUNK)
        w.write_tokens(kv_a, "mha", blocks_of(1), ref)
        assert a.store(ha, x, blocks_of(1)).result(10).stored == 1
        lease_a = a.lookup(x, model="shared", lock=True)
        lease_b = b.lookup(x, model="shared", lock=True)
        assert lease_a == lease_b == 1 and lease_a.lease != lease_b.lease
        assert b.retrieve(hb, x, blocks_of(1, start=8), lease=lease_b).result(10).loaded == 1
        assert b.release(lease=lease_b) == 0  # B's lease ended with its read
        capacity = server.engine.arena.capacity // server.engine.arena.slot_bytes(
            server.engine.arena.size_class(hc.object_bytes))
        filler = chunk_hashes(w.prompt(2, capacity + 4), CHUNK)
        r = c.store(hc, filler, np.arange(len(filler) * 4) % 256).result(10)  # a store may reuse blocks
        assert r.skipped > 0  # memory ran out: everything that could go went
        dst = blocks_of(1, start=16)
        assert a.retrieve(ha, x, dst, lease=lease_a).result(10).loaded == 1, "A's leased chunk was evicted"
        assert np.array_equal(w.read_tokens(kv_a, "mha", dst), ref)
        assert server.engine.status()["l1"]["leases"] == 0
    finally:
        for cl in (a, b, c):
            cl.close()


# ---- no write after the engine gave up on a load --------------------------------------------------


def test_a_retrieve_past_its_deadline_writes_nothing(shm_files, server):
    c = Client(server.url)
    try:
        kv, h = register_mha(c)
        hashes = chunk_hashes(w.prompt(1, 2), CHUNK)
        w.write_tokens(kv, "mha", blocks_of(2), w.reference(1, "mha", 2 * CHUNK))
        c.store(h, hashes, blocks_of(2)).result(10)
        with pytest.raises(RequestError) as info:
            c.retrieve(h, hashes, blocks_of(2, start=8), deadline=time.monotonic() - 0.001).result(10)
        assert info.value.code == p.ErrorCode.DEADLINE_EXCEEDED
        assert w.blocks_equal(kv, "mha", blocks_of(2, start=8), 0)  # untouched
        assert c.retrieve(h, hashes, blocks_of(2, start=8), deadline=time.monotonic() + 10).result(10).loaded == 2
    finally:
        c.close()


def test_a_stalled_server_costs_a_scheduler_step_one_lookup_block_however_many_requests_wait():
    """The server stops answering (SIGSTOP) while eight new requests are looked up. A step of the
    engine's scheduler waits lookup_block for all of them together, not for each, and the next
    step has a budget of its own; once the server is back the lookups are answered."""
    from lmcache_mp.integration.connector_core import ConnectorConfig, SchedulerCore
    from test_connector_core import BS, CS, matched, prompt

    srv = ServerProcess(["--url", "tcp://127.0.0.1:0", "--device", "cpu", "--l1-size", "64MiB",
                         "--chunk-size", str(CS), "--heartbeat-timeout", "60"])
    url = srv.wait_ready()
    block = 0.2
    sched = SchedulerCore(ConnectorConfig(url=url, model="tiny", block_size=BS, lookup_block=block,
                                          lookup_timeout=30.0, connect_timeout=5.0))
    try:
        sched.start()
        assert matched(sched, "warm", prompt(99, 300), 0) == 0  # connected, chunk size known
        toks = {f"r{i}": prompt(i, 300) for i in range(8)}
        os.kill(srv.proc.pid, signal.SIGSTOP)
        wait_until(lambda: stopped(srv.proc.pid), 5, "the server to stop")  # SIGSTOP lands asynchronously
        try:
            for _ in range(2):  # two steps of the engine
                t0 = time.monotonic()
                got = [sched.num_new_matched_tokens(rid, t, 0) for rid, t in toks.items()]
                took = time.monotonic() - t0
                assert got == [None] * 8  # not known yet: the engine asks again at its next step
                assert block * 0.75 < took < 4 * block  # one budget for the step, not eight (8 * block)
                sched.build_plan([])
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        assert [matched(sched, rid, t, 0) for rid, t in toks.items()] == [0] * 8  # answered: misses
    finally:
        sched.close()
        srv.kill()


def test_a_stalled_server_never_writes_into_blocks_after_the_engine_gave_up(shm_files):
    """The server is stopped (SIGSTOP) while a load is in flight. The worker gives up at its
    deadline and the engine recomputes, but the request keeps its blocks until the server has
    answered; the server, resumed, starts no copy after the deadline; nothing lands late."""
    from test_connector_core import CS, LAYERS, Engine, ScheduledRequest, block_view, matched, prompt

    srv = ServerProcess(["--url", "tcp://127.0.0.1:0", "--device", "cpu", "--l1-size", "64MiB",
                         "--chunk-size", str(CS), "--heartbeat-timeout", "60"])
    url = srv.wait_ready()
    engines = []
    try:
        a = Engine(url)
        engines.append(a)
        toks = prompt(1, 300)
        a.prefill("r1", toks)
        a.finish("r1")
        b = Engine(url, load_timeout=0.5)
        engines.append(b)
        ext = matched(b.sched, "r1", toks, 0)
        assert ext == 4 * CS
        blocks = b.alloc(-(-len(toks) // 32))
        b.sched.on_allocated("r1", blocks, ext)
        plan = b.sched.build_plan([ScheduledRequest("r1", ext, len(toks) - ext, blocks)])
        (load,) = plan.loads
        worker = b.workers[0]
        os.kill(srv.proc.pid, signal.SIGSTOP)
        wait_until(lambda: stopped(srv.proc.pid), 5, "the server to stop")  # SIGSTOP lands asynchronously
        try:
            t0 = time.monotonic()
            worker.start_loads(plan)
            worker.wait_loads()
            assert 0.4 < time.monotonic() - t0 < 5
            assert worker.take_load_errors() == set(load.block_ids)  # the engine recomputes them
            # The engine moves on: here it writes a pattern a late copy would overwrite.
            for layer in range(LAYERS):
                for blk in load.block_ids:
                    block_view(b.caches[0][layer], blk, b.kind).fill_(7.0)
            assert b.sched.request_finished("r1") is True  # it had a load: blocks held
            for _ in range(10):
                assert worker.finished({"r1"}) == set(), "blocks released while the server may still write"
                time.sleep(0.05)
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        wait_until(lambda: "r1" in worker.finished(set()), 10, "the server's answer to release the blocks")
        for layer in range(LAYERS):
            for blk in load.block_ids:
                assert torch.all(block_view(b.caches[0][layer], blk, b.kind) == 7.0), "a copy landed late"
        log = "\n".join(srv.lines)
        assert "Traceback" not in log, log
    finally:
        for e in engines:
            e.close()
        srv.kill()


# ---- no store saves blocks the engine reused after giving up on it ---------------------------------


def test_a_stalled_server_never_saves_blocks_the_engine_reused_after_the_stores_timeout(shm_files):
    """The issue's reproduction: the server is stopped (SIGSTOP) when a store is sent with a short
    timeout; the future fails and the engine writes other bytes into those blocks; the resumed
    server must not save them under the store's keys (its deadline passed: nothing is copied)."""
    srv = ServerProcess(["--url", "tcp://127.0.0.1:0", "--device", "cpu", "--l1-size", "16MiB",
                         "--chunk-size", str(CHUNK), "--heartbeat-timeout", "60"])
    url = srv.wait_ready()
    c = Client(url)
    try:
        kv, h = register_mha(c)
        hashes = chunk_hashes(w.prompt(1, 2), CHUNK)
        w.write_tokens(kv, "mha", blocks_of(2), w.reference(1, "mha", 2 * CHUNK))  # X
        os.kill(srv.proc.pid, signal.SIGSTOP)
        wait_until(lambda: stopped(srv.proc.pid), 5, "the server to stop")  # SIGSTOP lands asynchronously
        try:
            fut = c.store(h, hashes, blocks_of(2), timeout=0.5)
            with pytest.raises(Exception):
                fut.result(10)
            w.fill_blocks(kv, "mha", blocks_of(2), 7)  # Y: the engine reuses the blocks
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        # A later store on the same registration is answered after the stale one was handled.
        other = chunk_hashes(w.prompt(2, 1), CHUNK)
        w.write_tokens(kv, "mha", blocks_of(1, start=32), w.reference(2, "mha", CHUNK))
        assert c.store(h, other, blocks_of(1, start=32)).result(10).stored == 1
        assert c.lookup(hashes, model="m") == 0
        assert c.retrieve(h, hashes, blocks_of(2, start=16)).result(10).loaded == 0
        assert "Traceback" not in "\n".join(srv.lines)
    finally:
        c.close()
        srv.kill()


def test_a_store_past_its_deadline_or_ending_after_it_keeps_nothing(shm_files, server, monkeypatch):
    c = Client(server.url)
    raw = RawClient(server.url)
    try:
        kv, h = register_mha(c)
        hashes = chunk_hashes(w.prompt(3, 2), CHUNK)
        w.write_tokens(kv, "mha", blocks_of(2), w.reference(3, "mha", 2 * CHUNK))

        def store(deadline: float) -> p.Error:
            _, reply = raw.request(p.encode(p.Store(kv_id=h.kv_id, hashes=b"".join(hashes),
                                                    block_ids=p.pack_block_ids(blocks_of(2)), client_id=c.client_id,
                                                    deadline=deadline)))
            return reply

        reply = store(time.monotonic() - 0.001)  # passed before it arrived: no copy starts
        assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.DEADLINE_EXCEEDED, reply
        ctx = server.engine.registrations.entry(h.kv_id, c.client_id).ctx
        real_copy = ctx.copy

        def stalled_copy(*args, **kwargs):  # the server stalls mid-copy, past the deadline
            real_copy(*args, **kwargs)
            time.sleep(2.0)

        monkeypatch.setattr(ctx, "copy", stalled_copy)
        reply = store(time.monotonic() + 1.0)  # (a second for the copy to start, even on a loaded machine)
        assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.DEADLINE_EXCEEDED, reply
        assert "after its deadline" in reply.message
        st = c.status()["l1"]
        assert st["objects"] == 0 and st["writing"] == 0  # the slots went back
        assert c.lookup(hashes, model="m") == 0
        monkeypatch.setattr(ctx, "copy", real_copy)
        assert isinstance(store(time.monotonic() + 10), p.StoreReply)
        assert c.retrieve(h, hashes, blocks_of(2, start=16)).result(10).loaded == 2
        assert (w.read_tokens(kv, "mha", blocks_of(2, start=16)) == w.reference(3, "mha", 2 * CHUNK)).all()
    finally:
        raw.close()
        c.close()


def test_the_connector_gives_blocks_back_at_a_stores_deadline_and_nothing_late_is_saved(shm_files):
    """Through the connector: a store stuck behind a stopped server is reported finished (its
    blocks go back to the engine) once its deadline passed; the engine reuses them; the resumed
    server saves nothing of that store."""
    from test_connector_core import BS, CS, LAYERS, Engine, ScheduledRequest, block_view, matched, prompt

    srv = ServerProcess(["--url", "tcp://127.0.0.1:0", "--device", "cpu", "--l1-size", "64MiB",
                         "--chunk-size", str(CS), "--heartbeat-timeout", "60"])
    url = srv.wait_ready()
    engines = []
    try:
        a = Engine(url, store_timeout=0.5)
        engines.append(a)
        toks = prompt(5, 300)
        worker = a.workers[0]
        assert matched(a.sched, "r1", toks, 0) == 0
        blocks = a.alloc(-(-len(toks) // BS))
        a.sched.on_allocated("r1", blocks, 0)
        plan = a.sched.build_plan([ScheduledRequest("r1", 0, len(toks), blocks)])
        assert plan.stores
        os.kill(srv.proc.pid, signal.SIGSTOP)
        wait_until(lambda: stopped(srv.proc.pid), 5, "the server to stop")  # SIGSTOP lands asynchronously
        try:
            a.execute(plan, compute=[(toks, blocks, 0, len(toks))])
            assert a.sched.request_finished("r1") is True  # a store in flight: blocks held
            assert worker.finished({"r1"}) == set()
            wait_until(lambda: "r1" in worker.finished(set()), 10, "the store's deadline to give the blocks back")
            for layer in range(LAYERS):  # the engine gives the blocks to another request
                for blk in blocks[: len(toks) // BS]:
                    block_view(a.caches[0][layer], blk, a.kind).fill_(7.0)
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        b = Engine(url)
        engines.append(b)
        assert b.workers[0].link.get().ping(timeout=10) >= 0
        assert matched(b.sched, "probe", toks, 0) == 0  # nothing of the late store was kept
        log = "\n".join(srv.lines)
        assert "Traceback" not in log, log
    finally:
        for e in engines:
            e.close()
        srv.kill()


# ---- a stall of the server itself ---------------------------------------------------------------


def test_a_stall_of_the_server_itself_forgets_no_client_that_kept_sending_heartbeats(shm_files):
    """The server's process is stopped for twice its heartbeat timeout while its clients keep
    sending heartbeats (on ZeroMQ, whose socket it reads a request at a time). Once it runs again
    it judges nobody silent for the time it was not listening: no client loses its registration
    or its lease. (They used to, in most runs: the first tick after the stall came while their
    heartbeats still waited in the socket. A loaded machine stalls a server now and then.)"""
    srv = ServerProcess(["--url", "tcp://127.0.0.1:0", "--device", "cpu", "--l1-size", "16MiB",
                         "--chunk-size", str(CHUNK), "--heartbeat-timeout", "1", "--http-addr", "off"])
    url = srv.wait_ready()
    clients = [Client(url, heartbeat_interval=0.25, local_lane=False) for _ in range(4)]
    try:
        held = []
        for i, c in enumerate(clients):
            kv, h = register_mha(c)
            hashes = chunk_hashes(w.prompt(i, 2), CHUNK)
            w.write_tokens(kv, "mha", blocks_of(2), w.reference(i, "mha", 2 * CHUNK))
            assert c.store(h, hashes, blocks_of(2)).result(10).stored == 2
            held.append((c, kv, h, h.kv_id, hashes, c.lookup(hashes, model="m", lock=True)))
        os.kill(srv.proc.pid, signal.SIGSTOP)
        wait_until(lambda: stopped(srv.proc.pid), 5, "the server to stop")
        time.sleep(2.0)  # twice the heartbeat timeout: the clients' heartbeats wait in the server's socket
        os.kill(srv.proc.pid, signal.SIGCONT)
        # (the clients took it to be away meanwhile: their heartbeats' replies say it is back)
        wait_until(lambda: not any(c.server_away for c in clients), 20, "the clients to find the server back")
        time.sleep(1.0)  # two housekeeping ticks more (a client forgotten would be so by now)
        for i, (c, kv, h, kv_id, hashes, lease) in enumerate(held):
            assert h.kv_id == kv_id, f"client {i} had to register again"
            assert c.retrieve(h, hashes, blocks_of(2, start=16), lease=lease).result(10).loaded == 2
            assert np.array_equal(w.read_tokens(kv, "mha", blocks_of(2, start=16)), w.reference(i, "mha", 2 * CHUNK))
        log = "\n".join(srv.lines)
        assert "went silent" not in log, log
    finally:
        for c in clients:
            c.close()
        srv.kill()
