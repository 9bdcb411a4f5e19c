"""The client's I/O thread and its lifetime: futures nobody reads for resolve when their replies
come, whatever callers did before; synchronous calls leave the I/O thread asleep; a client left
open does not abort or hang the process at exit, whatever state its server is in."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import cpu_workers as w
from lmcache_mp import Client, Server, ServerConfig, chunk_hashes
from test_cli import ServerProcess
from test_server_e2e import CHUNK, blocks_of, register_mha, stopped, wait_until

# A future counts as late when it resolves this long after its request (here a reply takes well
# under a millisecond). Late ones used to wait for the next heartbeat (30 s in these tests) or for
# their own deadline.
LATE_S = 0.5


@pytest.fixture
def server():
    srv = Server(ServerConfig(url="tcp://127.0.0.1:0", device="cpu", l1_size="4MiB", chunk_size=CHUNK)).start()
    yield srv
    srv.stop()


def _resolved_within(fut, how: int, limit: float) -> float:
    """Seconds until fut resolved, without result(): concurrent.futures.wait, a callback, or
    polling done(); `limit` at most."""
    t0 = time.monotonic()
    if how == 0:
        cf.wait([fut], timeout=limit)
    elif how == 1:
        called = threading.Event()
        fut.add_done_callback(lambda f: called.set())
        called.wait(limit)
    else:
        while not fut.done() and time.monotonic() - t0 < limit:
            time.sleep(0.001)
    return time.monotonic() - t0


@pytest.mark.parametrize("lane", [True, False])
def test_futures_nobody_reads_for_resolve_when_their_reply_comes(server, lane):
    """A caller that reads its own reply keeps the I/O thread off the sockets meanwhile. The
    futures of the requests after it, which nobody reads for, must still resolve as soon as their
    replies come: not at the next heartbeat, nor at their deadline."""
    c = Client(server.url, heartbeat_interval=30, local_lane=lane)
    try:
        assert c._io.has_lane == lane
        late = []
        for i in range(30):
            hashes = chunk_hashes(w.prompt(i, 1), CHUNK)
            if i % 2:  # a synchronous call (on the lane: a future its caller reads)
                assert c.lookup(hashes, model="m") == 0
            else:  # result(): the caller reads the reply, on either socket
                assert c.lookup_async(hashes, model="m").result(10) == 0
            fut = c.lookup_async(hashes, model="m", timeout=20)
            waited = _resolved_within(fut, i % 3, limit=3)
            if waited > LATE_S:
                late.append((i, round(waited, 2)))
                if len(late) == 3:
                    break
            assert fut.result(20) == 0
        assert not late, f"futures resolved late (iteration, seconds): {late}"
    finally:
        c.close()


@pytest.mark.parametrize("lane", [True, False])
@pytest.mark.parametrize("before", ["lookup", "store"])
def test_a_future_nobody_reads_resolves_about_when_its_reply_comes(socket_dir, shm_files, lane, before):
    """From the server's send of the reply to the future's resolution (one clock: the traces),
    a future nobody reads takes about what one whose caller reads it with result() takes: the I/O
    thread watches the sockets from the request's send on, unless a caller reads them. (It used to
    wait a grace of a millisecond first, in case the caller came to read.)"""
    import statistics

    url = f"ipc://{socket_dir}/s.sock"
    srv = ServerProcess(["--url", url, "--device", "cpu", "--l1-size", "16MiB", "--chunk-size", str(CHUNK),
                         "--http-addr", "off"])
    try:
        srv.wait_ready()
        with Client(url, trace=True, local_lane=lane) as c:
            kv, h = register_mha(c)
            unread, read = [], []
            for i in range(120):
                hashes = chunk_hashes(w.prompt(i, 1), CHUNK)
                if before == "lookup":
                    c.lookup(hashes, model="m")
                else:
                    c.store(h, hashes, blocks_of(1)).result(10)
                fut = c.lookup_async(hashes, model="m")
                if i % 2:
                    fut.result(10)
                else:
                    assert _resolved_within(fut, i % 3, limit=10) < 10
                stamps = dict(fut.trace)
                (read if i % 2 else unread).append((stamps["client resolved"] - stamps["sent"]) / 1e6)
            c.unregister_kv_cache(h)
        nobody, reader = statistics.median(unread), statistics.median(read)
        assert nobody <= 3 * reader + 0.3, f"median ms after the reply: nobody reads {nobody:.3f}, result() {reader:.3f}"
    finally:
        srv.kill()


def test_synchronous_calls_leave_the_io_thread_asleep(server):
    """Synchronous calls on the lane cost no wake-up of the I/O thread (it would only take the
    GIL from the caller), whatever came before them."""
    c = Client(server.url, heartbeat_interval=30)
    try:
        assert c._io.has_lane
        hashes = chunk_hashes(w.prompt(1, 1), CHUNK)
        assert c.lookup(hashes, model="m") == 0  # its deadline is the earliest the thread knows: it looks once
        unread = c.lookup_async(hashes, model="m")  # read by the I/O thread: it watches the sockets
        assert cf.wait([unread], timeout=10).done == {unread}
        time.sleep(0.2)
        rounds = []
        send_queued = c._io._send_queued  # once per round of the I/O thread's loop
        c._io._send_queued = lambda: (rounds.append(1), send_queued())
        for _ in range(200):
            assert c.lookup(hashes, model="m") == 0
            assert c.ping() > 0
        assert len(rounds) <= 1, f"the I/O thread woke {len(rounds)} times"
    finally:
        c.close()


EXIT_SCRIPT = textwrap.dedent("""
    import sys, time
    from lmcache_mp import Client
    c = Client(sys.argv[1], local_lane=sys.argv[2] == "lane")
    assert c._io.has_lane == (sys.argv[2] == "lane")
    c.lookup([bytes(16)], model="m")
    print("connected", flush=True)
    sys.stdin.readline()  # the test has done to the server what it does
    time.sleep(1.2)  # heartbeats fail or find the lane closed; a recovery starts
""")


@pytest.mark.parametrize("server_state,lane,runs", [("killed", "lane", 3), ("killed", "zeromq", 2),
                                                    ("stopped", "lane", 1), ("alive", "lane", 1)])
def test_a_client_left_open_exits_cleanly(tmp_path, server_state, lane, runs):
    """A process that exits with a Client open (never closed) exits at once with status 0, its
    server killed, stopped or alive. Its finalizer used to destroy the ZeroMQ context under the
    recovery thread's socket: libzmq aborted the process, or it hung. In subprocesses: an abort
    would take the test runner with it."""
    script = tmp_path / "exit_with_a_client_open.py"
    script.write_text(EXIT_SCRIPT)
    for run in range(runs):
        srv = ServerProcess(["--url", "tcp://127.0.0.1:0", "--device", "cpu", "--l1-size", "16MiB"])
        child = None
        try:
            url = srv.wait_ready()
            child = subprocess.Popen([sys.executable, str(script), url, lane], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            assert child.stdout.readline().strip() == "connected", child.communicate(timeout=30)
            if server_state == "killed":
                srv.kill()
            elif server_state == "stopped":
                os.kill(srv.proc.pid, signal.SIGSTOP)
                wait_until(lambda: stopped(srv.proc.pid), 5, "the server to stop")
            t0 = time.monotonic()
            child.stdin.write("go\n")
            child.stdin.flush()
            try:
                out, err = child.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
                out, err = child.communicate()
                pytest.fail(f"run {run}: the process hung at exit\n{err}")
            elapsed = time.monotonic() - t0
            assert child.returncode == 0 and "Assertion failed" not in err, f"run {run}: {child.returncode}\n{err}"
            assert elapsed < 8, f"run {run}: exiting took {elapsed:.1f} s"
        finally:
            if child is not None and child.poll() is None:
                child.kill()
                child.wait(10)
            if srv.proc.poll() is None:
                os.kill(srv.proc.pid, signal.SIGCONT)
            srv.kill()


def test_an_error_in_the_io_thread_does_not_stop_it(server, caplog):
    """The I/O thread serves every future nobody reads for, timeouts and heartbeats: an error in
    one of its turns (a callback's, say) is logged, and the thread goes on."""
    c = Client(server.url, heartbeat_interval=0.05, local_lane=False)
    try:
        turns = {"n": 0}
        real = c._io._heartbeat

        def failing_once():
            turns["n"] += 1
            if turns["n"] == 1:
                raise RuntimeError("a heartbeat that fails")
            return real()

        c._io._heartbeat = failing_once
        deadline = time.monotonic() + 10
        while turns["n"] < 3:
            assert time.monotonic() < deadline, "the I/O thread stopped"
            time.sleep(0.01)
        fut = c.lookup_async(chunk_hashes(w.prompt(1, 1), CHUNK), model="m")
        cf.wait([fut], timeout=5)  # resolved by the I/O thread: nobody reads
        assert fut.done() and fut.result() == 0
        assert "error in the client's I/O thread" in caplog.text
    finally:
        c.close()
