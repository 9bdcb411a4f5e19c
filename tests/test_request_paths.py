"""The short request path: a caller that waits reads its own reply, futures nobody waits on are
served by the client's I/O thread, small requests run on the server's socket thread, waiting
threads poll before they sleep, and traced requests report their stages."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import signal
import threading
import time

import numpy as np
import pytest

import cpu_workers as w
from lmcache_mp import Client, Server, ServerConfig, ServerUnavailable, chunk_hashes
from lmcache_mp import protocol as p
from lmcache_mp.native import spin_poll
from lmcache_mp.server.request import Request
from test_cli import ServerProcess
from test_server_e2e import CHUNK, blocks_of, register_mha, stopped, wait_until


@pytest.fixture
def server():
    """The default heartbeat timeout: a loaded test machine may hold a client's heartbeat for a
    second (test_hardening's server forgets a client after one)."""
    srv = Server(ServerConfig(url="tcp://127.0.0.1:0", device="cpu", l1_size="1MiB", chunk_size=CHUNK)).start()
    yield srv
    srv.stop()


def test_spin_poll_returns_the_ready_fd_or_times_out():
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    try:
        t0 = time.monotonic()
        assert spin_poll([r1, r2], 2000, 20) == []  # spins 2 ms, then sleeps the rest
        assert 0.015 < time.monotonic() - t0 < 1
        os.write(w2, b"x")
        assert spin_poll([r1, r2], 2000, 20) == [1]
        assert spin_poll([r1, r2], 0, -1) == [1]  # no spin, no limit: returns at once when ready
        threading.Timer(0.05, lambda: os.write(w1, b"x")).start()
        assert spin_poll([r1], 0, 5000) == [0]  # a sleeper is woken
        assert spin_poll([r1, r2], 0, 0) == [0, 1]
    finally:
        for fd in (r1, w1, r2, w2):
            os.close(fd)


@pytest.mark.parametrize("spin_us,lane", [(0, True), (2000, True), (2000, False)])
def test_every_way_of_waiting_gets_the_bytes_back(shm_files, server, spin_us, lane):  # noqa: F811
    c = Client(server.url, spin_us=spin_us, local_lane=lane)
    try:
        assert c._io.has_lane == lane
        kv, h = register_mha(c)
        prompts = [chunk_hashes(w.prompt(i, 2), CHUNK) for i in range(4)]
        src = [blocks_of(2, start=i * len(blocks_of(2))) for i in range(8)]  # 4 sources, 4 destinations
        for i in range(4):
            w.write_tokens(kv, "mha", src[i], w.reference(i, "mha", 2 * CHUNK))
        # result() on the calling thread
        assert c.store(h, prompts[0], src[0]).result(10).chunks == 2
        # concurrent.futures.wait, with nobody calling result(): the I/O thread reads the replies
        futs = [c.store(h, prompts[i], src[i]) for i in (1, 2)]
        done, _ = cf.wait(futs, timeout=10)
        assert len(done) == 2 and all(f.result(0).chunks == 2 for f in futs)
        # a callback, and result() on another thread
        called = threading.Event()
        fut = c.store(h, prompts[3], src[3])
        fut.add_done_callback(lambda f: called.set())
        with cf.ThreadPoolExecutor(1) as pool:
            assert pool.submit(fut.result, 10).result(10).chunks == 2
        assert called.wait(10)
        for i in range(4):  # byte-exact back, into other blocks
            dst = src[4 + i]
            assert c.retrieve(h, prompts[i], dst).result(10).loaded == 2
            assert np.array_equal(w.read_tokens(kv, "mha", dst), w.reference(i, "mha", 2 * CHUNK))
    finally:
        c.close()


@contextlib.contextmanager
def server_storing_with(store):
    """An in-process CPU server whose STOREs go through store(engine, request)."""
    srv = Server(ServerConfig(url="tcp://127.0.0.1:0", device="cpu", l1_size="4MiB", chunk_size=CHUNK)).start()
    srv.engine._handlers = {**srv.engine._handlers, p.Store: lambda request: store(srv.engine, request)}
    try:
        yield srv
    finally:
        srv.stop()


def assert_read_at_once(fut) -> None:
    """A store's future nobody waits on settles by itself, long before the next heartbeat (the
    clients here send one every 30 s)."""
    done, _ = cf.wait([fut], timeout=10)
    assert done and fut.result(0).chunks == 1


def test_a_reply_left_when_the_last_caller_stops_waiting_is_read_by_the_io_thread(shm_files):
    """While a caller waits, the I/O thread keeps off the socket; a reply that comes after the
    caller is done (nobody waits for it) is still read at once, not at the next heartbeat."""
    slow: set[int] = set()
    held: list = []  # the slow registration's reply, made but not sent
    made = threading.Event()

    def store(engine, request):  # the slow registration's replies leave when the test says
        if request.msg.kv_id in slow:
            engine.server_copies.store(Request(request.msg, lambda m: (held.append(lambda: request.reply(m)),
                                                                       made.set())))
        else:
            engine.server_copies.store(request)

    with server_storing_with(store) as srv:
        c = Client(srv.url, heartbeat_interval=30)
        try:
            kv, fast = register_mha(c)
            kv2, late = register_mha(c, model="m2")
            slow.add(late.kv_id)
            w.write_tokens(kv2, "mha", blocks_of(1), w.reference(0, "mha", CHUNK))
            pending = c.store(late, chunk_hashes(w.prompt(0, 1), CHUNK), blocks_of(1))
            assert c.store(fast, chunk_hashes(w.prompt(1, 1), CHUNK), blocks_of(1)).result(10).chunks == 1
            assert made.wait(10) and not pending.done()
            held[0]()  # its reply leaves after the caller is done: nobody waits for it
            assert_read_at_once(pending)
        finally:
            c.close()


def test_a_caller_that_leaves_with_its_reply_leaves_the_next_one_to_the_io_thread(shm_files):
    """Two lane replies land back to back while a caller waits for the first: it returns with its
    own at once, and the I/O thread reads the other (not at the next heartbeat)."""
    held: dict = {}

    def store(engine, request):  # the first reply is held until the second is ready: both leave together
        if not held:
            held["reply"] = request.reply
            engine.server_copies.store(Request(request.msg, lambda m: held.update(msg=m)))
        else:
            def both(m):
                threading.Timer(0.05, lambda: (held["reply"](held["msg"]), request.reply(m))).start()
            engine.server_copies.store(Request(request.msg, both))

    with server_storing_with(store) as srv:
        c = Client(srv.url, heartbeat_interval=30, spin_us=2000)
        try:
            assert c._io.has_lane
            kv, h = register_mha(c)
            first = c.store(h, chunk_hashes(w.prompt(0, 1), CHUNK), blocks_of(1))
            second = c.store(h, chunk_hashes(w.prompt(1, 1), CHUNK), blocks_of(1, start=len(blocks_of(1))))
            assert first.result(10).chunks == 1
            assert_read_at_once(second)
        finally:
            c.close()


def test_a_waiting_caller_gets_an_error_not_a_hang_when_the_server_stalls(shm_files):
    srv = ServerProcess(["--url", "tcp://127.0.0.1:0", "--device", "cpu", "--l1-size", "16MiB",
                         "--chunk-size", str(CHUNK)])
    url = srv.wait_ready()
    c = Client(url, spin_us=2000)
    try:
        kv, h = register_mha(c)
        hashes = chunk_hashes(w.prompt(1, 2), CHUNK)
        os.kill(srv.proc.pid, signal.SIGSTOP)
        wait_until(lambda: stopped(srv.proc.pid), 5, "the server to stop")  # SIGSTOP lands asynchronously
        try:
            fut = c.store(h, hashes, blocks_of(2), timeout=0.5)
            t0 = time.monotonic()
            with pytest.raises(ServerUnavailable):
                fut.result(10)
            assert 0.3 < time.monotonic() - t0 < 5
            with pytest.raises(ServerUnavailable):
                c.lookup(hashes, model="m", timeout=0.3)
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        assert c.store(h, hashes, blocks_of(2)).result(10).chunks == 2  # and it goes on afterwards
    finally:
        c.close()
        srv.kill()


@pytest.mark.parametrize("lane", [True, False])
def test_a_traced_request_reports_its_stages_in_order(shm_files, server, lane):  # noqa: F811
    c = Client(server.url, trace=True, local_lane=lane)
    try:
        kv, h = register_mha(c)
        hashes = chunk_hashes(w.prompt(1, 2), CHUNK)
        fut = c.store(h, hashes, blocks_of(2))
        fut.result(10)
        stages = [s for s, _ in fut.trace]
        assert stages == ["call", "client sent", "received", "decoded", "started", "checked", "in L1", "planned",
                          "copied", "replied", "sent", "client received", "client resolved"]
        times = [t for _, t in fut.trace]
        assert times[0] <= times[2] <= times[-1]  # one clock across both processes
        assert times[2:11] == sorted(times[2:11])
        c.lookup(hashes, model="m")
        resolved = ["client resolved"] if lane else []  # on the lane a lookup is a future read by its caller
        assert [s for s, _ in c.last_trace()] == ["call", "client sent", "received", "decoded", "replied", "sent",
                                                  "client received"] + resolved
    finally:
        c.close()


def test_the_local_lane_is_used_when_reachable_and_comes_back_after_a_restart(shm_files, tmp_path):
    url = f"ipc://{tmp_path}/srv.sock"
    args = ["--url", url, "--device", "cpu", "--l1-size", "16MiB", "--chunk-size", str(CHUNK)]
    srv = ServerProcess(args)
    srv.wait_ready()
    c = Client(url, heartbeat_interval=0.2)
    try:
        assert c.server_info["lane"] == f"{tmp_path}/srv.sock.lane" and c._io.has_lane
        kv, h = register_mha(c)
        hashes = chunk_hashes(w.prompt(1, 2), CHUNK)
        w.write_tokens(kv, "mha", blocks_of(2), w.reference(1, "mha", 2 * CHUNK))
        assert c.store(h, hashes, blocks_of(2)).result(10).chunks == 2
        assert c.lookup(hashes, model="m") == 2
        srv.kill()
        deadline = time.monotonic() + 10
        while c._io.has_lane:  # the client's I/O thread sees the lane close
            assert time.monotonic() < deadline, "a dead server's lane was kept"
            time.sleep(0.05)
        with pytest.raises(ServerUnavailable):
            c.lookup(hashes, model="m", timeout=0.5)
        srv = ServerProcess(args)
        srv.wait_ready()
        # Back means: the lane reconnected and the KV cache registered again. Until the client has
        # registered it, it still takes the server to be away (its requests would find no KV cache).
        deadline = time.monotonic() + 20
        while c.server_away or not c._io.has_lane:
            assert time.monotonic() < deadline, f"the client did not come back on the lane ({c.server_away})"
            time.sleep(0.05)
        assert h.kv_id in c.status()["mine"]
        assert c.lookup(hashes, model="m") == 0  # a new server: an empty cache
        assert c.store(h, hashes, blocks_of(2)).result(10).chunks == 2
        dst = blocks_of(2, start=len(blocks_of(2)))
        assert c.retrieve(h, hashes, dst).result(10).loaded == 2
        assert np.array_equal(w.read_tokens(kv, "mha", dst), w.reference(1, "mha", 2 * CHUNK))
    finally:
        c.close()
        srv.kill()


def test_without_a_reachable_lane_the_client_uses_zeromq(shm_files):
    srv = ServerProcess(["--url", "tcp://127.0.0.1:0", "--device", "cpu", "--l1-size", "16MiB",
                         "--chunk-size", str(CHUNK), "--no-local-lane"])
    url = srv.wait_ready()
    c = Client(url)
    try:
        assert c.server_info["lane"] == "" and not c._io.has_lane
        c._connect_lane("@lmcache-mp-lane-that-does-not-exist")
        assert not c._io.has_lane
        kv, h = register_mha(c)
        hashes = chunk_hashes(w.prompt(2, 1), CHUNK)
        assert c.store(h, hashes, blocks_of(1)).result(10).chunks == 1
        assert c.lookup(hashes, model="m") == 1
    finally:
        c.close()
        srv.kill()


def test_a_refused_lane_leaves_the_client_on_zeromq_without_reconnecting(shm_files, monkeypatch):
    from lmcache_mp import Server, ServerConfig
    from lmcache_mp.server.transport import lane

    monkeypatch.setattr(lane, "MAX_CONNECTIONS", 0)  # every lane connection is closed at once
    connects = []
    connect = Client._connect_lane
    monkeypatch.setattr(Client, "_connect_lane", lambda self, address: (connects.append(address),
                                                                          connect(self, address)))
    srv = Server(ServerConfig(url="tcp://127.0.0.1:0", device="cpu", l1_size="16MiB", chunk_size=CHUNK)).start()
    c = Client(srv.url, heartbeat_interval=0.2)
    try:
        wait_until(lambda: not c._io.has_lane, 5, "the client to see its lane closed")
        kv, h = register_mha(c)
        hashes = chunk_hashes(w.prompt(3, 1), CHUNK)
        time.sleep(0.5)  # heartbeats and the recovery check run meanwhile
        assert not c._io.has_lane and len(connects) == 1  # the same server refused it: no retries
        assert c.store(h, hashes, blocks_of(1)).result(10).chunks == 1
        assert c.lookup(hashes, model="m") == 1
    finally:
        c.close()
        srv.stop()


def test_an_idle_server_keeps_its_housekeeping_tick_and_sleeps(monkeypatch):
    from lmcache_mp import Server, ServerConfig
    from lmcache_mp.server import engine
    from lmcache_mp.server.transport import router as transport

    ticks, polls = [], []
    tick, poll = engine.MPCacheEngine.tick, transport.spin_poll
    monkeypatch.setattr(engine.MPCacheEngine, "tick", lambda self, *a: (ticks.append(time.monotonic()), tick(self, *a)))
    monkeypatch.setattr(transport, "spin_poll", lambda *a: (polls.append(1), poll(*a))[1])
    srv = Server(ServerConfig(url="tcp://127.0.0.1:0", device="cpu", l1_size="16MiB")).start()
    try:  # (not a sleep of 1.3 s, then two ticks: a loaded machine may be 0.3 s late)
        wait_until(lambda: len(ticks) >= 2, 10, "two housekeeping ticks without requests")
        polled = len(polls)
    finally:
        srv.stop()
    assert 0.45 <= ticks[1] - ticks[0] < 2.0, ticks  # every TICK_SECONDS (0.5 s), requests or not
    assert polled < 50  # and between ticks it sleeps


def test_closing_a_client_while_it_tries_to_reach_a_stopped_server_is_clean(tmp_path):
    """A client whose heartbeats find the server gone starts a recovery on a thread of its own;
    close() meanwhile used to close that thread's socket under it, and libzmq aborted the
    process. Run in a subprocess: an abort would take the test runner with it."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "close_during_recovery.py"
    script.write_text(textwrap.dedent("""
        import time
        from lmcache_mp import Client, Server, ServerConfig
        for _ in range(3):
            srv = Server(ServerConfig(url="tcp://127.0.0.1:0", device="cpu", l1_size="4MiB")).start()
            c = Client(srv.url, heartbeat_interval=0.05)
            srv.stop()
            time.sleep(0.3)  # heartbeats fail: recoveries start
            c.close()
        print("clean")
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "clean" in out.stdout, out.stdout + out.stderr
