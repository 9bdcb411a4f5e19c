"""An ipc:// endpoint and its local lane are unix socket files: a second server must not take them
from a server that answers there (it would run on, out of reach, and lose the file when the second
stops), while a file left by a killed server is taken over, with a log line."""

import logging
import os
import socket
import time
from pathlib import Path

import pytest

from lmcache_mp import Client, Server, ServerConfig
from lmcache_mp.server.cli import main as cli_main


@pytest.fixture
def sock_path():
    path = Path(f"/tmp/lmcache-mp-ipc-{os.getpid()}-{time.monotonic_ns()}.sock")  # (short: unix paths are limited)
    yield path
    for p in (path, Path(f"{path}.lane")):
        p.unlink(missing_ok=True)


def config(path: Path) -> ServerConfig:
    return ServerConfig(url=f"ipc://{path}", l1_size="16MiB", device="cpu", http_addr="off")


def stale_socket_file(path: Path, kind: int) -> None:
    """A socket file nothing listens on, as a killed server leaves it."""
    with socket.socket(socket.AF_UNIX, kind) as s:
        s.bind(str(path))


def test_a_second_server_on_a_live_socket_is_refused_and_the_first_serves_on(sock_path):
    with Server(config(sock_path)) as first:
        with pytest.raises(OSError, match=f"another server answers on the endpoint {sock_path}"):
            Server(config(sock_path)).start()
        assert sock_path.exists() and Path(f"{sock_path}.lane").exists()
        with Client(first.url) as client:
            assert client.status()["pid"] == os.getpid()
            assert client._io.has_lane  # the first server's lane too


def test_doctor_says_a_server_answers_there(sock_path, capsys):
    with Server(config(sock_path)):
        assert cli_main(["doctor", "--device", "cpu", "--url", f"ipc://{sock_path}", "--http-addr", "off",
                         "--l1-size", "16MiB"]) == 1
    assert f"[FAIL] endpoint ipc://{sock_path}: another server answers there" in capsys.readouterr().out


def test_a_live_lane_alone_is_refused_too(sock_path):
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as lane:
        lane.bind(f"{sock_path}.lane")
        lane.listen(1)
        with pytest.raises(OSError, match=f"another server answers on the local lane {sock_path}.lane"):
            Server(config(sock_path)).start()
        assert not sock_path.exists()  # nothing was bound


def test_stale_socket_files_are_taken_over_and_said_so(sock_path, caplog):
    stale_socket_file(sock_path, socket.SOCK_STREAM)
    stale_socket_file(Path(f"{sock_path}.lane"), socket.SOCK_SEQPACKET)
    with caplog.at_level(logging.WARNING, logger="lmcache_mp.server.transport.socket_files"):
        with Server(config(sock_path)) as server, Client(server.url) as client:
            assert client.ping() > 0 and client._io.has_lane
    taken = [r.getMessage() for r in caplog.records if "taking the socket file over" in r.getMessage()]
    assert taken == [f"the endpoint {sock_path}: no server answers there (one was killed?): taking the socket file "
                     "over", f"the local lane {sock_path}.lane: no server answers there (one was killed?): taking "
                     "the socket file over"], caplog.text


def test_a_file_that_is_no_socket_is_left_alone(sock_path):
    sock_path.write_text("not a socket")
    with pytest.raises(OSError, match="exists and is not a socket"):
        Server(config(sock_path)).start()
    assert sock_path.read_text() == "not a socket"
