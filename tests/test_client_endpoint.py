"""What a client says about the URL it is given and, when no server answers, about what is there."""

import socket

import pytest

from lmcache_mp import Client, Server, ServerConfig, ServerUnavailable
from lmcache_mp.client.endpoint import check_url


@pytest.mark.parametrize("url, says", [
    ("http://127.0.0.1:5555", "the server speaks ZeroMQ, not http"),
    ("127.0.0.1:5555", "has no scheme"),
    ("localhost", "has no scheme"),
    ("tcp://127.0.0.1", "use tcp://HOST:PORT"),
    ("tcp://127.0.0.1:port", "use tcp://HOST:PORT"),
    ("ipc://", "names no socket file"),
])
def test_a_url_the_client_cannot_use_says_what_a_valid_one_looks_like(url, says):
    with pytest.raises(ValueError, match=says) as info:
        Client(url, connect_timeout=0.1)
    assert repr(url) in str(info.value) and "use " in str(info.value)  # what to write instead


@pytest.mark.parametrize("port", [0, 65536, 99999])
def test_a_port_out_of_range_is_refused(port):
    url = f"tcp://127.0.0.1:{port}"  # (ZeroMQ takes 99999 for 34463)
    with pytest.raises(ValueError, match=rf"port {port} of '{url}' is out of range \(1-65535\)"):
        Client(url, connect_timeout=0.1)


@pytest.mark.parametrize("url", ["tcp://127.0.0.1:5555", "tcp://127.0.0.1:65535", "tcp://[::1]:5555",
                                 "tcp://cache-node-3:5555", "ipc:///run/lmcache-mp/server.sock", "ipc://@abstract",
                                 "inproc://x"])
def test_valid_urls_pass(url):
    assert check_url(url) == url


@pytest.mark.parametrize("kind", ["tcp", "ipc"])
def test_nothing_listening_is_said_so_at_once(kind, tmp_path):
    """A refused connection is known at once: no wait for the whole connect timeout (it was)."""
    import time

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"tcp://127.0.0.1:{s.getsockname()[1]}" if kind == "tcp" else f"ipc://{tmp_path}/none.sock"
    t0 = time.monotonic()
    with pytest.raises(ServerUnavailable, match=f"no server at {url}: nothing listens there"):
        Client(url, connect_timeout=60)
    assert time.monotonic() - t0 < 30


def test_the_http_port_instead_of_the_server_is_said_so():
    srv = Server(ServerConfig(url="tcp://127.0.0.1:0", l1_size="16MiB", device="cpu", http_addr="127.0.0.1:0")).start()
    try:
        with pytest.raises(ServerUnavailable, match="does not speak ZeroMQ"):
            Client("tcp://" + srv.engine.http, connect_timeout=0.3)
    finally:
        srv.stop()


def test_a_missing_key_file_names_its_setting(tmp_path, monkeypatch):
    """pyzmq says only "Invalid certificate file"; the client names the setting and the fix."""
    monkeypatch.delenv("LMCACHE_MP_CURVE_CLIENT_KEY", raising=False)
    monkeypatch.delenv("LMCACHE_MP_CURVE_SERVER_KEY", raising=False)
    with pytest.raises(ValueError, match=f"curve_server_key {tmp_path}/server.key: no such file .*keygen"):
        Client("tcp://127.0.0.1:5555", curve_server_key=str(tmp_path / "server.key"))
    monkeypatch.setenv("LMCACHE_MP_CURVE_SERVER_KEY", str(tmp_path / "gone.key"))
    with pytest.raises(ValueError, match=f"LMCACHE_MP_CURVE_SERVER_KEY {tmp_path}/gone.key: no such file"):
        Client("tcp://127.0.0.1:5555")
    (tmp_path / "empty.key").write_text("")
    with pytest.raises(ValueError, match="curve_server_key .*empty.key: not a CURVE key file"):
        Client("tcp://127.0.0.1:5555", curve_server_key=str(tmp_path / "empty.key"))
