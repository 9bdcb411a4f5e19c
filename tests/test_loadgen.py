"""lmcache-mp-bench (lmcache_mp.loadgen) against a server running in this process."""

import json
import socket

import pytest

import lmcache_mp
from lmcache_mp import loadgen


@pytest.fixture
def server():
    srv = lmcache_mp.Server(lmcache_mp.ServerConfig(url="tcp://127.0.0.1:0", l1_size="512MiB", device="cpu",
                                                    chunk_size=64))
    srv.start()
    yield srv
    srv.stop()


def test_two_workers_store_and_retrieve_every_byte(server, tmp_path, capsys):
    out = tmp_path / "run.json"
    rc = loadgen.main(["--url", server.url, "--workers", "2", "--device", "cpu", "--layers", "2",
                       "--heads", "2", "--head-size", "64", "--block-size", "16", "--chunks", "4",
                       "--requests", "2", "--lookups", "20", "--json", str(out)])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    row = json.loads(out.read_text())["rows"][0]
    assert row["workers"] == 2
    assert row["mismatches"] == 0
    assert row["requested_chunks"] == row["stored_chunks"] == row["loaded_chunks"] == 2 * 2 * 4
    assert row["store_GBps"] > 0 and row["retrieve_GBps"] > 0
    assert row["store_ms_p50"] > 0 and row["lookup_us_p99"] > 0
    assert "store GB/s" in printed.out and "x D2H" not in printed.out  # no ceiling, no ratio columns
    assert server.engine.status()["registrations"] == []  # the workers unregistered their caches


def test_no_server_is_a_clear_error(capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"tcp://127.0.0.1:{port}"
    rc = loadgen.main(["--url", url, "--connect-timeout", "0.5"])
    assert rc != 0
    assert f"no lmcache-mp server answers at {url}" in capsys.readouterr().err
