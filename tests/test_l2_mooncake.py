"""The Mooncake Store tier against a real mooncake_master on loopback (TCP transport, started
and stopped by pid here): two servers share chunks through the pool, byte-exact; an absent
master is a miss, never a request error."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

import cpu_workers as w
from lmcache_mp import chunk_hashes
from test_l2_tier import retrieved_exact, store_prompts
from test_l2_valkey import answers, free_port
from test_server_e2e import CHUNK, clients, no_internal_errors, register_mha, servers, wait_until  # noqa: F401

# ImportError too: the package installs everywhere, but loads only where libibverbs is
mooncake = pytest.importorskip("mooncake.store", reason="the optional mooncake-transfer-engine-non-cuda package "
                               "(and libibverbs) provide Mooncake Store", exc_type=ImportError)


class MooncakeMaster:
    """mooncake_master with its HTTP metadata server on loopback ports; settings() for a server."""

    def __init__(self, log_dir):
        rpc, http, metrics = free_port(), free_port(), free_port()
        exe = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
        with open(log_dir / "master.log", "w") as log:
            self.proc = subprocess.Popen([exe, f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
                                          f"--http_metadata_server_port={http}",
                                          "--http_metadata_server_host=127.0.0.1", f"--metrics_port={metrics}"],
                                         stdout=log, stderr=subprocess.STDOUT)
        wait_until(lambda: answers(rpc) and answers(http), 20, "mooncake_master to listen")
        self.settings = dict(l2_mooncake=f"127.0.0.1:{rpc}", l2_mooncake_metadata=f"http://127.0.0.1:{http}/metadata",
                             l2_mooncake_segment="64MiB")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def master(tmp_path):
    m = MooncakeMaster(tmp_path)
    yield m.settings
    m.stop()


def test_two_servers_share_chunks_through_mooncake(shm_files, servers, clients, master, no_internal_errors):  # noqa: F811
    a = servers(l1_size="256KiB", l2_write="all", **master)
    b = servers(l1_size="256KiB", l2_write="all", **master)
    for srv in (a, b):  # each joins the pool in the background
        wait_until(lambda srv=srv: srv.engine.status()["l2"]["tiers"][0]["connected"], 30, "the Mooncake set-up")
    ca, cb = clients(a.url), clients(b.url)
    kv_a, ha = register_mha(ca, num_blocks=128)
    store_prompts(ca, ha, kv_a, [1, 2], srv=a)
    assert a.engine.status()["l2"]["written"] == 8
    kv_b, hb = register_mha(cb, num_blocks=128)
    found = cb.lookup(chunk_hashes(w.prompt(1, 4), CHUNK), model="m", lock=True)
    assert found == 4 and found.lease
    assert retrieved_exact(cb, hb, kv_b, 1, lease=found) == 4
    assert retrieved_exact(cb, hb, kv_b, 2) == 4
    tier = b.engine.status()["l2"]["tiers"][0]
    assert tier["name"] == "mooncake" and tier["reads"] == 8 and tier["corrupt"] == 0


def test_an_absent_master_is_a_miss(shm_files, servers, clients, no_internal_errors):  # noqa: F811
    port = free_port()
    srv = servers(l1_size="256KiB", l2_write="all", l2_mooncake=f"127.0.0.1:{port}",
                  l2_mooncake_metadata=f"http://127.0.0.1:{free_port()}/metadata", l2_mooncake_segment="64MiB")
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=128)
    store_prompts(c, h, kv, [1])
    t0 = time.monotonic()
    assert c.lookup(chunk_hashes(w.prompt(9, 4), CHUNK), model="m", lock=True) == 0
    assert time.monotonic() - t0 < 2
    assert retrieved_exact(c, h, kv, 1) == 4
    assert srv.engine.status()["l2"]["tiers"][0]["connected"] is False
