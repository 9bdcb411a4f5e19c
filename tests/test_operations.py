"""What an operator relies on: the HTTP listener (/live, /health, /status, /metrics with values
after known traffic), socket files only this user (or one group) can open, and CURVE: a TCP bind
beyond loopback refuses to start without keys; with keys, only clients holding the right ones
get a handshake."""

from __future__ import annotations

import gc
import json
import os
import socket
import stat
import time
import urllib.error
import urllib.request

import pytest

import cpu_workers as w
from lmcache_mp import Client, ServerConfig, chunk_hashes
from lmcache_mp import protocol as p
from lmcache_mp.errors import RequestError, ServerUnavailable
from lmcache_mp.server.cli import main as cli_main
from test_l2_tier import retrieved_exact, store_prompts
from test_server_e2e import CHUNK, clients, no_internal_errors, register_mha, servers  # noqa: F401


def get(addr: str, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://{addr}{path}", timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def metric(text: str, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise AssertionError(f"no {name} {labels} in /metrics")


def test_every_request_series_is_exported_at_zero_before_any_request(servers):  # noqa: F811
    """Prometheus alerts on a series that does not exist never fire: each op's count and latency
    are there, at 0, before the first request."""
    srv = servers(http_addr="127.0.0.1:0")
    code, body = get(srv.engine.http, "/metrics")
    text = body.decode()
    assert code == 200
    for op in ("Lookup", "Store", "Retrieve", "RegisterKVCache", "Events"):
        assert metric(text, "lmcache_mp_requests_total", op=op, outcome="OK") == 0
        assert metric(text, "lmcache_mp_request_seconds_count", op=op) == 0
    assert metric(text, "lmcache_mp_hits_total") == 0 and metric(text, "lmcache_mp_lookups_total") == 0


def test_http_endpoints_after_known_traffic(shm_files, servers, clients, no_internal_errors):  # noqa: F811
    srv = servers(http_addr="127.0.0.1:0")
    addr = srv.engine.http
    assert get(addr, "/live") == (200, b"live\n")
    code, body = get(addr, "/health")
    assert code == 200 and json.loads(body)["state"] == "ready"
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=128)
    store_prompts(c, h, kv, [1, 2])
    assert c.lookup(chunk_hashes(w.prompt(1, 4), CHUNK), model="m") == 4
    assert c.lookup(chunk_hashes(w.prompt(3, 4), CHUNK), model="m") == 0  # 4 chunks asked, none there
    assert retrieved_exact(c, h, kv, 1) == 4
    # (a request is counted before its reply is sent: every reply the client holds is counted)
    code, body = get(addr, "/metrics")
    text = body.decode()
    assert code == 200
    assert metric(text, "lmcache_mp_stored_total") == 8 and metric(text, "lmcache_mp_l1_objects") == 8
    assert metric(text, "lmcache_mp_lookups_total") == 2 and metric(text, "lmcache_mp_hits_total") == 4
    assert metric(text, "lmcache_mp_lookup_chunks_total") == 8  # the hit ratio of the docs: 4 / 8
    assert metric(text, "lmcache_mp_registrations") == 1
    assert metric(text, "lmcache_mp_requests_total", op="Store", outcome="OK") == 2
    assert metric(text, "lmcache_mp_requests_total", op="Retrieve", outcome="OK") == 1
    assert metric(text, "lmcache_mp_request_seconds_count", op="Store") == 2
    assert metric(text, "lmcache_mp_request_seconds_bucket", op="Lookup", le="+Inf") == 2
    assert metric(text, "lmcache_mp_bytes_moved_total", direction="store", device="cpu") == 8 * h.object_bytes
    assert metric(text, "lmcache_mp_bytes_moved_total", direction="retrieve", device="cpu") == 4 * h.object_bytes
    code, body = get(addr, "/status")
    status = json.loads(body)
    assert code == 200 and status["url"] == srv.url and status["l1"]["objects"] == 8
    full_before = status["gc"]["collections"][2]
    gc.collect()  # the server runs in this process: a full collection of it
    gcs = json.loads(get(addr, "/status")[1])["gc"]
    text = get(addr, "/metrics")[1].decode()  # (read after the status: it counts every collection listed there)
    assert metric(text, "lmcache_mp_gc_collections_total", generation="2") >= full_before + 1
    start, length = next((g["start_ns"], g["length_ns"]) for g in reversed(gcs["recent"]) if g["generation"] == 2)
    assert 0 < length <= gcs["longest_ns"] and start <= time.monotonic_ns() - length
    assert gcs["longest_s"] == gcs["longest_ns"] / 1e9
    assert metric(text, "lmcache_mp_gc_seconds_total") >= length / 1e9  # (both nanosecond integers / 1e9)
    with pytest.raises(RequestError):  # an error reply: counted by its code
        c._call(p.Store(kv_id=1, hashes=b"h" * 16, block_ids=p.pack_block_ids(range(4)), client_id=c.client_id),
                p.StoreReply, 60)
    assert c.clear() == 8
    text = get(addr, "/metrics")[1].decode()
    assert metric(text, "lmcache_mp_requests_total", op="Clear", outcome="OK") == 1
    assert metric(text, "lmcache_mp_requests_total", op="Store", outcome="UNKNOWN_REGISTRATION") == 1
    assert metric(text, "lmcache_mp_l1_removed_total", reason="cleared") == 8
    assert get(addr, "/nope")[0] == 404
    endpoint = srv.engine.http_endpoint
    endpoint.ready = False  # as between binding and serving
    assert get(addr, "/health")[0] == 503 and json.loads(get(addr, "/health")[1])["state"] == "starting"
    endpoint.ready = True
    srv.engine._closed = True  # as while it drains: not ready, still live
    try:
        code, body = get(addr, "/health")
        assert code == 503 and json.loads(body)["state"] == "draining"
        assert get(addr, "/live")[0] == 200
    finally:
        srv.engine._closed = False


def test_health_reports_an_l2_tier_that_is_down_and_stays_ready(servers, tmp_path):  # noqa: F811
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    srv = servers(http_addr="127.0.0.1:0", l2_redis=f"redis://u:secret@127.0.0.1:{port}")
    code, body = get(srv.engine.http, "/health")
    health = json.loads(body)
    assert code == 200 and health["l2"][0]["name"] == "valkey" and health["l2"][0]["up"] is False
    status = get(srv.engine.http, "/status")[1].decode()
    assert "secret" not in status and ":***@" in status  # the password never shows


def test_the_default_http_address_taken_moves_to_a_free_port_naming_whose_it_is_another_an_error(
        servers, caplog, monkeypatch):  # noqa: F811
    """Every server on a machine starts with the default HTTP address: the second one serves
    HTTP on a free port of the same host and says, at WARNING, which server answers on the default
    (its /health names its url and pid); an address a setting named is an error when taken."""
    import logging

    from lmcache_mp import config

    with socket.socket() as s:  # a default of this test's own: other tests of this machine take the real one
        s.bind(("127.0.0.1", 0))
        DEFAULT_HTTP_ADDR = "127.0.0.1:%d" % s.getsockname()[1]
    monkeypatch.setattr(config, "DEFAULT_HTTP_ADDR", DEFAULT_HTTP_ADDR)
    caplog.set_level(logging.INFO, "lmcache_mp")
    first = servers(http_addr=DEFAULT_HTTP_ADDR)  # (as the default: no source named it)
    second = servers(http_addr=DEFAULT_HTTP_ADDR)
    assert first.engine.http == DEFAULT_HTTP_ADDR
    assert second.engine.http and second.engine.http != DEFAULT_HTTP_ADDR
    assert second.engine.http.startswith("127.0.0.1:")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith(f"HTTP: {DEFAULT_HTTP_ADDR} is "
                                                                                     "taken"))
    assert f"this server's /metrics, /health and /status are on {second.engine.http}" in line, line
    assert "set http_addr to pin an address of its own" in line  # the embedded server's setting, not a flag
    assert f"the lmcache-mp server at {first.url} (pid {os.getpid()}) answers there" in line, line
    with urllib.request.urlopen(f"http://{second.engine.http}/health", timeout=10) as r:
        assert json.loads(r.read())["url"] == second.url
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        with pytest.raises(ValueError, match=r"cannot serve HTTP on 127\.0\.0\.1:\d+ \(http_addr\)"):  # named
            servers(http_addr="127.0.0.1:%d" % s.getsockname()[1])


def test_ipc_socket_files_are_private_or_shared_with_one_group(tmp_path, servers):  # noqa: F811
    for group, mode in (("", 0o600), (str(os.getgid()), 0o660)):
        path = tmp_path / f"s{mode:o}.sock"
        servers(url=f"ipc://{path}", ipc_group=group)
        for f in (path, path.with_name(path.name + ".lane")):
            st = os.stat(f)
            assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == mode, (f, oct(st.st_mode))
            assert st.st_gid == os.getgid()


@pytest.mark.parametrize("url", ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://[::]:5555"])
def test_a_bind_beyond_loopback_needs_keys(url, capsys):
    with pytest.raises(ValueError, match="needs authentication"):
        ServerConfig(url=url, device="cpu")
    assert cli_main(["--url", url, "--device", "cpu"]) == 2
    assert "keygen" in capsys.readouterr().err


@pytest.fixture
def keys(tmp_path):
    assert cli_main(["keygen", str(tmp_path / "keys")]) == 0
    other = tmp_path / "other"
    assert cli_main(["keygen", str(other)]) == 0  # someone else's keys
    k = tmp_path / "keys"
    return dict(server_secret=str(k / "server.key_secret"), server_public=str(k / "server.key"),
                clients=str(k / "clients"), client_secret=str(k / "client-secret" / "client.key_secret"),
                other_server=str(other / "server.key"), other_client=str(other / "client-secret" / "client.key_secret"))


def test_curve_lets_in_only_clients_with_the_right_keys(shm_files, servers, clients, keys,  # noqa: F811
                                                        no_internal_errors):  # noqa: F811
    srv = servers(curve_secret_key=keys["server_secret"], curve_clients=keys["clients"])
    assert srv.engine.lane == ""  # the lane has no authentication: not offered
    c = clients(srv.url, curve_server_key=keys["server_public"], curve_client_key=keys["client_secret"])
    kv, h = register_mha(c, num_blocks=128)
    store_prompts(c, h, kv, [1])
    assert retrieved_exact(c, h, kv, 1) == 4
    refused = "the server refused this client's CURVE key"
    for kw, says in ((dict(), "the server probably requires CURVE"),  # plain text
                     (dict(curve_server_key=keys["server_public"]), refused),  # a key pair of its own, not let in
                     (dict(curve_server_key=keys["server_public"], curve_client_key=keys["other_client"]), refused),
                     (dict(curve_server_key=keys["other_server"], curve_client_key=keys["client_secret"]),
                      "is the server's public key")):
        t0 = time.monotonic()
        with pytest.raises(ServerUnavailable, match=f"no server (reachable )?at {srv.url}.*: .*{says}"):
            Client(srv.url, connect_timeout=60, **kw)
        assert time.monotonic() - t0 < 30, (kw, time.monotonic() - t0)  # known at once: no wait for the timeout
    assert srv.engine.status()["clients"] == 1  # no request of theirs reached the engine
    assert retrieved_exact(c, h, kv, 1) == 4


def test_curve_keys_from_the_environment_and_any_client_knowing_the_server_key(servers, keys, monkeypatch):  # noqa: F811
    srv = servers(curve_secret_key=keys["server_secret"])  # no client list
    monkeypatch.setenv("LMCACHE_MP_CURVE_SERVER_KEY", keys["server_public"])
    c = Client(srv.url, connect_timeout=60)
    try:
        assert c.curve and c.ping() >= 0
    finally:
        c.close()


def test_two_curve_servers_in_one_process(servers, keys):  # noqa: F811
    """Each server authenticates in a ZeroMQ context of its own (one ZAP endpoint per context)."""
    a = servers(curve_secret_key=keys["server_secret"], curve_clients=keys["clients"])
    b = servers(curve_secret_key=keys["server_secret"], curve_clients=keys["clients"])
    for srv in (a, b):
        with Client(srv.url, connect_timeout=60, curve_server_key=keys["server_public"],
                    curve_client_key=keys["client_secret"]) as c:
            assert c.ping() >= 0
        with pytest.raises(ServerUnavailable):  # and each still checks the client's key
            Client(srv.url, connect_timeout=0.5, curve_server_key=keys["server_public"],
                   curve_client_key=keys["other_client"])
    a.stop()
    with Client(b.url, connect_timeout=60, curve_server_key=keys["server_public"],
                curve_client_key=keys["client_secret"]) as c:
        assert c.ping() >= 0  # one stopping leaves the other's authenticator running


def test_per_client_limits_on_registrations_and_queued_requests(shm_files, servers, clients):  # noqa: F811
    from lmcache_mp.errors import RequestError
    from lmcache_mp.protocol import ErrorCode

    srv = servers(max_registrations_per_client=2, max_queued_requests=2)
    c, other = clients(srv.url), clients(srv.url)
    register_mha(c, num_blocks=64)
    _, second = register_mha(c, num_blocks=64)
    with pytest.raises(RequestError) as e:
        register_mha(c, num_blocks=64)
    assert e.value.code == ErrorCode.LIMIT_EXCEEDED and "max_registrations_per_client" in str(e.value)
    register_mha(other, num_blocks=64)  # a limit per client: the other one still registers
    c.unregister_kv_cache(second)
    register_mha(c, num_blocks=64)  # room again


def test_a_registration_refuses_requests_beyond_its_queue_limit():
    import threading

    from lmcache_mp.server.registry.registrations import Entry
    from lmcache_mp.server.validation import RequestFailure
    from lmcache_mp.server.copies.workers import SerialWorker

    entry = Entry(None, SerialWorker("test-entry"))
    gate, ran = threading.Event(), []
    entry.run(lambda: (gate.wait(10), ran.append(1)), limit=2)  # running, held at the gate
    entry.run(lambda: ran.append(2), limit=2)  # queued
    with pytest.raises(RequestFailure, match="max_queued_requests"):
        entry.run(lambda: ran.append(3), limit=2)
    entry.run(lambda: ran.append(4))  # internal work (no limit) is never refused
    gate.set()
    entry.worker.stop(timeout=10)
    assert ran == [1, 2, 4]
    entry.run(lambda: ran.append(5), limit=2, inline=True)  # room again (inline: the worker is gone)
    assert ran == [1, 2, 4, 5]


def test_settling_freezes_only_when_the_process_is_only_a_server():
    from lmcache_mp.server.ops.gc_pauses import settle, settle_after_setup

    frozen = gc.get_freeze_count()
    try:
        settle()  # an embedded server: the host program's heap is not ours to freeze
        assert gc.get_freeze_count() == frozen
        settle_after_setup(True)
        young = [[] for _ in range(10)]  # noqa: F841  (alive: frozen, not collected)
        settle()
        assert gc.get_freeze_count() >= frozen + 11 and gc.get_count()[0] < 10
    finally:
        settle_after_setup(False)
        if not frozen:  # nothing else here had frozen anything
            gc.unfreeze()


def test_listing_the_latest_collections_survives_a_collection_it_starts_itself():
    """The listing allocates (a dict per collection), so a young collection can start in the middle
    of it and append to what it lists: a status request once failed with 'deque mutated during
    iteration'."""
    from lmcache_mp.server.ops.gc_pauses import GCPauses

    pauses = GCPauses(keep=64)
    thresholds = gc.get_threshold()
    try:
        gc.set_threshold(1)  # a collection at nearly every allocation
        for _ in range(200):
            recent = pauses.stats()["recent"]
            assert 0 < len(recent) <= 64 and {"start_ns", "length_ns", "generation"} <= recent[0].keys()
    finally:
        gc.set_threshold(*thresholds)
        pauses.close()


def test_a_full_l1_settles_its_new_chunk_objects_so_young_collections_stay_small():
    """Once L1 is full every store frees as many old chunk objects as it makes, and CPython's
    young-collection count (allocations less deallocations of any age) stops growing: without
    settling, the young generation becomes the whole index, for the next collection to walk."""
    import os

    from lmcache_mp.native import HostArena
    from lmcache_mp.server.ops import gc_pauses
    from lmcache_mp.storage.l1 import L1Store, ObjectKey

    def young_after_churn(settling: bool) -> int:
        l1 = L1Store(HostArena(20000 * 256, 1 << 20), policy="lru")  # 20,480 objects of 256 B (no ghosts: every
        # eviction frees a key)
        if settling:
            l1.on_commit = gc_pauses.made_long_lived
        for _ in range(4000):  # 64,000 chunks: L1 filled three times over
            plan = l1.begin_store([ObjectKey("m", 1, 0, os.urandom(16), b"") for _ in range(16)], 256, ("f",))
            l1.commit(plan)
        assert l1.counters["evicted"] > 40000
        return len(gc.get_objects(0))

    frozen = gc.get_freeze_count()
    thresholds = gc.get_threshold()
    gc.set_threshold(700, 10, 1 << 30)  # lmcache-mp-server's (cli.tune_process)
    gc_pauses.settle_after_setup(True)
    pauses = gc_pauses.GCPauses()
    try:
        gc.collect()
        assert young_after_churn(settling=False) > 20000  # what the whole index is made of, or near
        gc.collect()
        settled = pauses.stats()["settled"]
        assert young_after_churn(settling=True) < 4 * gc_pauses.SETTLE_OBJECTS
        assert pauses.stats()["settled"] >= settled + 64000 // gc_pauses.SETTLE_OBJECTS
    finally:
        pauses.close()
        gc_pauses.settle_after_setup(False)
        gc.set_threshold(*thresholds)
        if not frozen:
            gc.unfreeze()


def test_an_l1_larger_than_the_machine_is_refused_with_its_memory():
    from lmcache_mp import Server
    from lmcache_mp.server.ops.resources import meminfo

    total = meminfo()["MemTotal"]
    with pytest.raises(ValueError, match=r"l1_size .* is more than this machine's memory allows: this machine has .* GiB"):
        Server(ServerConfig(url="tcp://127.0.0.1:0", device="cpu", http_addr="off", l1_size=2 * total)).start()


def test_a_disk_tier_larger_than_its_disk_warns_at_start(servers, tmp_path, caplog):  # noqa: F811
    import shutil

    free = shutil.disk_usage(tmp_path).free
    srv = servers(l2_disk=str(tmp_path / "l2"), l2_disk_size=2 * free + (1 << 30))
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "L2 disk" in r.getMessage()]
    assert len(warned) == 1 and "l2_disk_size" in warned[0] and "more than its disk can hold" in warned[0], warned
    assert srv.engine.status()["l2"]["tiers"][0]["name"] == "disk"  # it starts: the tier is lossy
    caplog.clear()
    servers(l2_disk=str(tmp_path / "l2b"), l2_disk_size="64MiB")
    assert not [r for r in caplog.records if "more than its disk" in r.getMessage()]


def test_a_curve_key_of_no_tenant_is_told_at_once_not_after_the_connect_timeout(servers, keys, tmp_path):  # noqa: F811
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.alice]\ncurve_keys = ["{keys["clients"]}/client.key"]\n')
    srv = servers(curve_secret_key=keys["server_secret"], tenants=str(tenants), http_addr="off")
    t0 = time.monotonic()
    with pytest.raises(ServerUnavailable, match=f"no server at {srv.url}: the server refused this client's CURVE key"):
        Client(srv.url, connect_timeout=60, curve_server_key=keys["server_public"],
               curve_client_key=keys["other_client"])
    assert time.monotonic() - t0 < 30  # (it was the whole connect timeout)
    Client(srv.url, connect_timeout=60, curve_server_key=keys["server_public"],
           curve_client_key=keys["client_secret"]).close()  # alice's key gets in


def test_refused_curve_clients_are_logged_at_most_once_a_minute_each_kind(servers, keys, caplog):  # noqa: F811
    import logging

    from lmcache_mp.server.transport.curve import fingerprint

    caplog.set_level(logging.WARNING, logger="lmcache_mp.server.transport.curve")
    srv = servers(curve_secret_key=keys["server_secret"], curve_clients=keys["clients"])
    for _ in range(2):  # a key pair not let in, twice: one line
        with pytest.raises(ServerUnavailable):
            Client(srv.url, connect_timeout=0.3, curve_server_key=keys["server_public"],
                   curve_client_key=keys["other_client"])
    with pytest.raises(ServerUnavailable):  # another server's public key: the handshake fails
        Client(srv.url, connect_timeout=0.3, curve_server_key=keys["other_server"],
               curve_client_key=keys["client_secret"])
    import zmq.auth

    other_public = zmq.auth.load_certificate(keys["other_client"])[0]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused a client")]
        if len(lines) >= 2:
            break
        time.sleep(0.05)
    keyed = [line for line in lines if "is not in --curve-clients" in line]
    assert len(keyed) == 1 and fingerprint(other_public) in keyed[0], lines
    assert any("handshake failed" in line for line in lines), lines


def test_the_bench_says_what_a_curve_server_said_not_that_none_runs(servers, keys, capsys):  # noqa: F811
    from lmcache_mp.loadgen import cli as bench

    srv = servers(curve_secret_key=keys["server_secret"], curve_clients=keys["clients"])
    assert bench.main(["--url", srv.url, "--connect-timeout", "0.5"]) == 1
    err = capsys.readouterr().err
    assert "requires CURVE" in err and "start one" not in err, err
