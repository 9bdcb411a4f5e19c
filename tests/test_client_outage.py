"""A client whose server goes away: while its heartbeat finds the server away, requests fail at
once (not after their timeouts), and once the server answers again (restarted, empty) the
client registers its KV caches again by itself and serves. With the local lane the client
notices a server that closed it at once; without it, its heartbeat does within a few seconds."""

from __future__ import annotations

import socket
import time

import pytest

torch = pytest.importorskip("torch")

from lmcache_mp import Client, Server, ServerConfig, ServerUnavailable, chunk_hashes, shared_cpu_tensor  # noqa: E402

CHUNK = 16
BLOCK = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(url: str) -> Server:
    return Server(ServerConfig(url=url, device="cpu", l1_size="64MiB", chunk_size=CHUNK, http_addr="off")).start()


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.parametrize("lane", [True, False], ids=["local_lane", "heartbeat_only"])
def test_requests_fail_at_once_while_the_server_is_away_and_work_when_it_is_back(shm_files, lane):
    url = f"tcp://127.0.0.1:{free_port()}"
    server = start(url)
    client = Client(url, timeout=10, local_lane=lane)
    kv = [shared_cpu_tensor((16, 2, BLOCK, 16), torch.float16)]  # vLLM's CPU layout [blocks, heads, tokens, 2*dim]
    try:
        handle = client.register_kv_cache(kv, model="m")
        hashes = chunk_hashes(list(range(2 * CHUNK)), CHUNK)
        blocks = [0, 1, 2, 3]
        assert client.store(handle, hashes, blocks).result(10).stored == 2
        assert client.server_away == ""
        server.stop()
        wait_until(lambda: client.server_away, 10, "the client to find the server away")
        requests = {
            "lookup": lambda: client.lookup(hashes, model="m", lock=True),
            "lookup_async": lambda: client.lookup_async(hashes, model="m").result(10),
            "store": lambda: client.store(handle, hashes, blocks).result(10),
            "retrieve": lambda: client.retrieve(handle, hashes, blocks).result(10),
            "release": lambda: client.release(lease=1),
            "status": lambda: client.status(),
            "events": lambda: client.events(0),
            "register": lambda: client.register_kv_cache(kv, model="other"),
        }
        for name, request in requests.items():
            t0 = time.monotonic()
            with pytest.raises(ServerUnavailable, match="is away"):
                request()
            # not its timeout (10 s), nor the next heartbeat (1 s): it takes well under a millisecond,
            # but a loaded machine, or a full collection of the whole suite's heap in this process,
            # may hold it up for more than 50 ms
            assert time.monotonic() - t0 < 0.5, name
        server = start(url)  # empty, at the same address
        wait_until(lambda: not client.server_away, 20, "the client to find the server back")
        # The KV cache was registered again before any request went out: the first store lands.
        assert client.store(handle, hashes, blocks).result(10).stored == 2
        assert client.lookup(hashes, model="m") == 2
    finally:
        client.close()
        server.stop()


@pytest.mark.parametrize("transport", ["ipc_lane", "tcp_lane", "tcp_zeromq"])
@pytest.mark.parametrize("dying", [False, True], ids=["dead", "still_dying"])
def test_the_first_requests_after_the_server_was_killed_fail_at_once(shm_files, socket_dir, transport, dying,
                                                                      monkeypatch):
    """A request made just after the server's process died, which found its way to ZeroMQ's queue
    (the lane's send failed, ZeroMQ has no connection to send on), fails once the client takes the
    server to be away (nothing listens at its address), not at its timeout; and the client sees
    that as soon as the connection drops (the lane's or ZeroMQ's), not at its next heartbeat.
    still_dying: its address still answers the first looks after the drop (a dying process closes
    its sockets one after another; on a loaded machine the listening one can be the last)."""
    from test_cli import ServerProcess

    if dying:
        from lmcache_mp.client import recovery

        looks = {"n": 0}

        def listening_a_while(url: str, timeout: float = 0.5) -> bool:
            looks["n"] += 1
            return looks["n"] > 5 and real(url, timeout)

        real = recovery.nothing_listens
        monkeypatch.setattr(recovery, "nothing_listens", listening_a_while)

    url = f"ipc://{socket_dir}/s.sock" if transport == "ipc_lane" else f"tcp://127.0.0.1:{free_port()}"
    srv = ServerProcess(["--url", url, "--device", "cpu", "--l1-size", "16MiB", "--chunk-size", str(CHUNK),
                         "--http-addr", "off"])
    try:
        srv.wait_ready()
        timeout = 8.0
        client = Client(url, timeout=timeout, local_lane=transport != "tcp_zeromq", heartbeat_interval=2.0)
        try:
            hashes = chunk_hashes(list(range(2 * CHUNK)), CHUNK)
            assert client.lookup(hashes, model="m") == 0
            srv.kill()
            waits = []
            for _ in range(20):  # 0 to ~0.2 s after the kill, and later
                t0 = time.monotonic()
                with pytest.raises(ServerUnavailable):
                    client.lookup(hashes, model="m")
                waits.append(time.monotonic() - t0)
                time.sleep(0.01)
            print(f"\n{transport}: waits after the kill {', '.join(f'{w * 1000:.1f}' for w in waits[:5])} ... "
                  f"max {max(waits) * 1000:.1f} ms")
            # (the heartbeat alone would find it away within one to two intervals, 2 to 4 s: the lane's
            # close or ZeroMQ's disconnect says it at once)
            assert max(waits) < 1.0, [round(w, 3) for w in waits]
            assert client.server_away
        finally:
            client.close()
    finally:
        srv.kill()
