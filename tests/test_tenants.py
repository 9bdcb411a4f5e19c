"""Tenants (docs/tenants.md): two tenants on one server see nothing of each other's, whatever they send.

The adversary B knows A's exact chunk hashes, model name and salt. Each tenant has its own CURVE
key (and, on ipc://, its own group: the kernel says which). Everything runs on the CPU device (shared-memory KV caches).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import cpu_workers as w
from lmcache_mp import Client, Server, ServerConfig, chunk_hashes
from lmcache_mp.errors import RequestError, ServerUnavailable
from lmcache_mp.server.cli import main as cli_main
from test_server_e2e import CHUNK, no_internal_errors, wait_until  # noqa: F401


BPC = CHUNK // 8  # blocks per chunk (block size 8)


@pytest.fixture
def keys(tmp_path):
    d = tmp_path / "keys"
    assert cli_main(["keygen", str(d)]) == 0
    for name in ("b", "c", "w"):
        assert cli_main(["keygen", str(d), "--client", name]) == 0
    return d


def tenants_file(tmp_path, keys, extra: dict[str, str] | None = None, body: str | None = None) -> str:
    path = tmp_path / "tenants.toml"
    extra = extra or {}
    text = body if body is not None else "".join(
        f'[tenants.{name}]\ncurve_keys = ["{keys}/clients/{key}.key"]\n{extra.get(name, "")}\n'
        for name, key in (("alice", "client"), ("bob", "b")))
    path.write_text(text)
    return str(path)


class Setup:
    def __init__(self, tmp_path, keys, url="tcp://127.0.0.1:0", l1_size="64MiB", extra=None, **settings):
        self.tmp, self.keys = tmp_path, keys
        self.tenants = tenants_file(tmp_path, keys, extra)
        self.audit = str(tmp_path / "audit.jsonl")
        self.settings = dict(url=url, device="cpu", l1_size=l1_size, chunk_size=CHUNK, tenants=self.tenants,
                             curve_secret_key=f"{keys}/server.key_secret", audit_log=self.audit, http_addr="off",
                             **settings)
        self.server = Server(ServerConfig(**self.settings)).start()
        self.clients: list[Client] = []

    def client(self, key: str, **kw) -> Client:
        kw.setdefault("heartbeat_interval", 0.25)
        c = Client(self.server.url, curve_server_key=f"{self.keys}/server.key",
                   curve_client_key=f"{self.keys}/client-secret/{key}.key_secret", **kw)
        self.clients.append(c)
        return c

    def restart(self) -> None:
        self.close_clients()
        self.server.stop()
        self.server = Server(ServerConfig(**self.settings)).start()

    def audit_lines(self) -> list[dict]:
        with open(self.audit) as f:
            return [json.loads(line) for line in f]

    def close_clients(self) -> None:
        for c in self.clients:
            c.close()
        self.clients = []

    def close(self) -> None:
        self.close_clients()
        self.server.stop()


@pytest.fixture
def setups():
    made: list[Setup] = []

    def make(*args, **kw) -> Setup:
        s = Setup(*args, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def engine_of(client: Client, seed: int, chunks: int, model="m", blocks=64):
    """A registered KV cache holding the prompt `seed`'s KV in its first blocks; its hashes."""
    kv = w.make_kv("mha", blocks, 8)
    handle = client.register_kv_cache(kv, model=model)
    ref = w.reference(seed, "mha", chunks * CHUNK)
    ids = list(range(chunks * BPC))
    w.write_tokens(kv, "mha", ids, ref)
    return kv, handle, ref, chunk_hashes(w.prompt(seed, chunks), CHUNK), ids


def test_a_tenant_finds_loads_overwrites_and_releases_nothing_of_another(tmp_path, keys, setups,
                                                                         no_internal_errors):  # noqa: F811
    s = setups(tmp_path, keys)
    a, b = s.client("client"), s.client("b")
    kv_a, h_a, ref_a, hashes, ids = engine_of(a, seed=1, chunks=3)
    assert a.store(h_a, hashes, ids, salt=b"s").result().stored == 3
    lease = a.lookup(hashes, model="m", salt=b"s", lock=True)
    assert lease.hits == 3 and lease.lease

    kv_b, h_b, _, _, _ = engine_of(b, seed=2, chunks=3)  # B: the same model, A's hashes and salt
    assert b.lookup(hashes, model="m", salt=b"s").hits == 0
    assert b.lookup(hashes, model="m", salt=b"s", lock=True).hits == 0
    w.fill_blocks(kv_b, "mha", ids, 7)
    assert b.retrieve(h_b, hashes, ids, salt=b"s").result().loaded == 0
    assert w.blocks_equal(kv_b, "mha", ids, 7)  # nothing of A's came in
    # B stores other bytes under A's keys: its own copy, A's stays
    assert b.store(h_b, hashes, ids, salt=b"s").result().stored == 3
    w.fill_blocks(kv_a, "mha", ids, 0)
    assert a.retrieve(h_a, hashes, ids, salt=b"s").result().loaded == 3
    assert np.array_equal(w.read_tokens(kv_a, "mha", ids), ref_a)
    # A's lease, named by B (a lease id that leaked): B releases nothing of it
    from lmcache_mp import protocol as p

    assert b.release(lease=lease.lease) == 0
    assert s.server.engine.l1.lease(lease.lease) is not None
    # B saying goodbye with A's client id drops nothing of A's
    b._call(p.Bye(client_id=a.client_id), p.ByeReply)
    assert s.server.engine.l1.lease(lease.lease) is not None
    assert a.lookup(hashes, model="m", salt=b"s").hits == 3


def test_events_and_status_show_a_tenant_only_its_own(tmp_path, keys, setups, no_internal_errors):  # noqa: F811
    s = setups(tmp_path, keys, kv_events=4096)
    a, b = s.client("client"), s.client("b")
    _, h_a, _, hashes, ids = engine_of(a, seed=1, chunks=2, model="secret-model")
    a.store(h_a, hashes, ids).result()
    _, h_b, _, hashes_b, ids_b = engine_of(b, seed=2, chunks=1, model="m")
    b.store(h_b, hashes_b, ids_b).result()
    mine = b.events()
    assert mine.models == ["m"] and len(mine.events) == 1 and mine.events[0].digest == hashes_b[0]
    assert b.events(models=["secret-model"]).events == []
    theirs = a.events()
    assert theirs.models == ["secret-model"] and len(theirs.events) == 2
    status = b.status()
    assert status["tenant"] == "bob" and [r["model"] for r in status["registrations"]] == ["m"]
    assert set(status["tenants"]) == {"bob"} and "l1" not in status
    assert "secret-model" not in json.dumps(status)
    full = s.server.engine.status()  # the operator's view (HTTP /status): every tenant
    assert full["tenants"]["alice"]["l1"]["objects"] == 2 and full["tenants"]["bob"]["l1"]["objects"] == 1
    from lmcache_mp.server.ops.metrics import StatusCollector

    series = {(x.name, tuple(sorted(x.labels.items()))): x.value
              for m in StatusCollector(s.server.engine).collect() for x in m.samples}
    assert series[("lmcache_mp_tenant_l1_objects", (("tenant", "alice"),))] == 2
    assert series[("lmcache_mp_tenant_l1_objects", (("tenant", "bob"),))] == 1
    assert series[("lmcache_mp_tenant_hit_chunks_total", (("tenant", "bob"),))] == 0
    assert series[("lmcache_mp_tenant_evicted_total", (("cause", "pressure"), ("tenant", "alice")))] == 0


def test_unknown_keys_are_refused_at_the_handshake_and_audited(tmp_path, keys, setups):
    s = setups(tmp_path, keys)
    with pytest.raises(ServerUnavailable, match="tenants file"):
        Client(s.server.url, connect_timeout=1, curve_server_key=f"{keys}/server.key",
               curve_client_key=f"{keys}/client-secret/c.key_secret")
    a = s.client("client")
    a.ping()
    events = s.audit_lines()
    refused = [e for e in events if e["event"] == "connection_refused"]
    accepted = [e for e in events if e["event"] == "connection_accepted"]
    assert refused and refused[0]["reason"] == "credential in no tenant" and refused[0]["fingerprint"].startswith("curve:")
    assert accepted and all(e["tenant"] == "alice" for e in accepted)
    assert events[0]["event"] == "server_start"


def test_admin_only_clear_and_no_engine_side_copies(tmp_path, keys, setups):
    s = setups(tmp_path, keys, extra={"alice": "admin = true"})
    a, b = s.client("client"), s.client("b")
    with pytest.raises(RequestError, match="PERMISSION_DENIED.*clear"):
        b.clear()
    assert a.clear() == 0


_WINDOW_PROBE = """
import importlib.machinery, json, os, sys
sys.path.insert(0, "tests")
import numpy as np
from lmcache_mp import Client, chunk_hashes
import cpu_workers as w
import lmcache_mp.client.endpoint, lmcache_mp.client.engine_copy, lmcache_mp.client.engine_transfers, zmq.utils.monitor
import torch
url, chunk = sys.argv[1], int(sys.argv[2])
kv = [torch.zeros((2, 64, 8, w.HEADS, w.HEAD_SIZE), dtype=torch.float16) for _ in range(w.LAYERS)]  # private memory
os.setgroups([]); os.setgid(65534)  # its tenant: the group the kernel reports for it
c = Client(url)
h = c.register_kv_cache(kv, model="m", transfer="engine")
ids = list(range(2 * chunk // 8))
theirs = chunk_hashes(w.prompt(1, 2), chunk)
out = {"tenant": c.status()["tenant"], "lookup": c.lookup(theirs, model="m").hits,
       "read": c.retrieve(h, theirs, ids).result().loaded}
ref = w.reference(2, "mha", 2 * chunk)
w.write_tokens(kv, "mha", ids, ref)
mine = chunk_hashes(w.prompt(2, 2), chunk)
out["stored"] = c.store(h, mine, ids).result().stored
w.fill_blocks(kv, "mha", ids, 0)
out["loaded"] = c.retrieve(h, mine, ids).result().loaded
out["exact"] = bool(np.array_equal(w.read_tokens(kv, "mha", ids), ref))
window = bytes(c._engine._use.arena._view)  # all this process has mapped of the server
out["window_bytes"] = len(window)
out["own_found"] = window.find(ref[0, 0, :chunk].tobytes()) >= 0
theirs_ref = w.reference(1, "mha", 2 * chunk)
out["theirs_found"] = any(window.find(theirs_ref[l, s, i * chunk:(i + 1) * chunk].tobytes()) >= 0
                          for l in range(theirs_ref.shape[0]) for s in range(2) for i in range(2))
print(json.dumps(out))
c.close()
"""


def test_engine_side_copies_map_the_tenants_own_window_never_l1(tmp_path, socket_dir):
    if os.getuid() != 0:
        pytest.skip("needs root: a client process of another group")
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenants.root]\ngids = [0]\nengine_window = "4MiB"\n[tenants.nobody]\ngids = [65534]\n'
                       'engine_window = "4MiB"\n')
    with Server(ServerConfig(url=f"ipc://{socket_dir}/srv.sock", device="cpu", l1_size="64MiB", chunk_size=CHUNK,
                             tenants=str(tenants), http_addr="off")) as srv, Client(srv.url) as a:
        kv = w.make_kv("mha", 64, 8)
        h = a.register_kv_cache(kv, model="m", transfer="engine")
        assert h.transfer_mode == "engine"
        ids = list(range(2 * BPC))
        ref = w.reference(1, "mha", 2 * CHUNK)
        w.write_tokens(kv, "mha", ids, ref)
        hashes = chunk_hashes(w.prompt(1, 2), CHUNK)
        assert a.store(h, hashes, ids).result().stored == 2
        w.fill_blocks(kv, "mha", ids, 0)
        assert a.retrieve(h, hashes, ids).result().loaded == 2  # through root's window, byte exact
        assert np.array_equal(w.read_tokens(kv, "mha", ids), ref)
        out = subprocess.run([sys.executable, "-c", _WINDOW_PROBE, srv.url, str(CHUNK)], capture_output=True,
                             text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got["tenant"] == "nobody" and got["lookup"] == 0 and got["read"] == 0
        assert got["stored"] == 2 and got["loaded"] == 2 and got["exact"]
        windows = srv.engine.status()["engine_copies"]["tenant_windows"]
        assert got["window_bytes"] == windows["nobody"]["capacity"] < srv.engine.arena.capacity  # not L1
        assert got["own_found"] and not got["theirs_found"]  # the scan sees its own bytes and none of root's
        assert set(windows) == {"root", "nobody"} and all(w_["bytes_used"] == 0 for w_ in windows.values())
        a.unregister_kv_cache(h)


@pytest.mark.parametrize("window, server_slab", [(256 << 20, 128 << 20), (256 << 20, 2 << 20), (6 << 20, 4 << 20)])
def test_a_tenants_window_is_the_size_its_file_gives(window, server_slab):
    """engine_window is the window's size, whatever the server's slab (a GPU server's is 128 MiB:
    four of them made a 256 MiB window 512 MiB)."""
    from lmcache_mp.server.tenancy.windows import Window

    w_ = Window(window, server_slab)
    try:
        assert w_.stats()["capacity"] == window
        slots = w_.take(1 << 20, 3)
        assert len(slots.offsets) == 3 and slots.release() == 3
    finally:
        w_.arena.release_memory()


def test_a_removed_key_is_cut_off_within_a_second_and_a_bad_reload_changes_nothing(tmp_path, keys, setups):
    s = setups(tmp_path, keys)
    a, b = s.client("client"), s.client("b")
    _, h_b, _, hashes, ids = engine_of(b, seed=2, chunks=2)
    b.store(h_b, hashes, ids).result()
    lease = b.lookup(hashes, model="m", lock=True).lease
    tenancy = s.server.engine.tenancy

    with open(s.tenants, "a") as f:
        f.write("[tenants.carol\n")  # broken: the running configuration stays
    assert not tenancy.reload()
    assert b.lookup(hashes, model="m").hits == 2
    # (connections the clients open meanwhile are audited too, in any order)
    assert [e["event"] for e in s.audit_lines() if e["event"] != "connection_accepted"][-1] == "tenants_reload_failed"

    tenants_file(tmp_path, keys, body=f'[tenants.alice]\ncurve_keys = ["{keys}/clients/client.key"]\n'
                                        f'[tenants.carol]\ncurve_keys = ["{keys}/clients/c.key"]\n')
    t0 = time.monotonic()
    assert tenancy.reload()
    assert refused_within(lambda: b.lookup(hashes, model="m"), t0 + 1.0)
    deadline = t0 + 1.0
    while s.server.engine.l1.lease(lease) is not None or s.server.engine.status()["registrations"]:
        assert time.monotonic() < deadline, "bob's lease and registration outlived its key by a second"
        time.sleep(0.01)
    c = s.client("c")  # a key added by the reload gets in
    assert c.lookup(hashes, model="m").hits == 0
    assert a.ping() >= 0
    events = [e["event"] for e in s.audit_lines()]
    assert "tenants_reloaded" in events and "credential_revoked" in events


def test_a_revoked_keys_zeromq_connection_is_closed_after_its_refusal(tmp_path, keys, setups):
    """ROUTER cannot drop a peer; the server shuts down the connection a revoked key's request
    came on, once the refusal is out. The client's ZeroMQ reconnects, ZAP refuses it, and libzmq
    does not try again."""
    import zmq
    import zmq.auth
    from zmq.utils.monitor import recv_monitor_message

    from lmcache_mp import protocol as p

    s = setups(tmp_path, keys)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.curve_serverkey = zmq.auth.load_certificate(f"{keys}/server.key")[0]
    sock.curve_publickey, sock.curve_secretkey = zmq.auth.load_certificate(f"{keys}/client-secret/b.key_secret")
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    sock.connect(s.server.url)

    def ping(rid: int):
        sock.send_multipart([p.pack_request_id(rid), p.encode(p.Ping(client_id=b"c" * 16))])
        assert sock.poll(30_000), "no reply to a Ping"
        return p.decode_reply(sock.recv_multipart()[1])

    try:
        assert isinstance(ping(1), p.PingReply)
        tenants_file(tmp_path, keys, body=f'[tenants.alice]\ncurve_keys = ["{keys}/clients/client.key"]\n')
        assert s.server.engine.tenancy.reload()
        assert not monitor.poll(1000)  # the reload closes nothing by itself: the connection is idle
        refusal = ping(2)
        assert refusal.code == p.ErrorCode.PERMISSION_DENIED and refusal.message.startswith("credential revoked")
        events = []
        deadline = time.monotonic() + 30
        while zmq.EVENT_HANDSHAKE_FAILED_AUTH not in events:
            assert time.monotonic() < deadline, f"the revoked key's connection stayed open (events {events})"
            if monitor.poll(200):
                events.append(recv_monitor_message(monitor)["event"])
        while monitor.poll(1500):  # (the refused one's own DISCONNECTED; no more reconnections)
            events.append(recv_monitor_message(monitor)["event"])
        assert events[0] == zmq.EVENT_DISCONNECTED and events.count(zmq.EVENT_HANDSHAKE_FAILED_AUTH) == 1, events
        assert s.client("client").ping() >= 0  # alice is served on
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
        ctx.term()


def test_a_revoked_client_says_credential_revoked_in_one_line(tmp_path, keys, setups, caplog):
    """The client of a removed key (issue 49's symptom: 'recovering from a server restart failed'
    and a traceback) says once, in one WARNING line, that its credential was revoked, and every
    request fails at once with CredentialRevoked."""
    import logging

    from lmcache_mp import CredentialRevoked

    s = setups(tmp_path, keys)
    b = s.client("b")
    _, h_b, _, hashes, ids = engine_of(b, seed=2, chunks=2)
    assert b.store(h_b, hashes, ids).result().stored == 2
    caplog.set_level(logging.DEBUG, logger="lmcache_mp")
    tenants_file(tmp_path, keys, body=f'[tenants.alice]\ncurve_keys = ["{keys}/clients/client.key"]\n')
    assert s.server.engine.tenancy.reload()
    wait_until(lambda: b.server_away.startswith("credential revoked"), 30, "the client to notice")
    for call in (lambda: b.lookup(hashes, model="m"), lambda: b.store(h_b, hashes, ids).result(timeout=30),
                 lambda: b.retrieve(h_b, hashes, ids).result(timeout=30), b.ping):
        with pytest.raises(CredentialRevoked, match=r"^\[PERMISSION_DENIED\] credential revoked: ") as e:
            call()
        assert isinstance(e.value, RequestError) and e.value.code == 12
    # the server closes the connection the refusals came on, and refuses the reconnection
    wait_until(lambda: s.server.engine.tenancy is not None and any(
        "refused a reconnection" in r.getMessage() for r in caplog.records), 30, "the reconnection's refusal")
    mine = [r for r in caplog.records if r.name.startswith("lmcache_mp.client")]
    loud = [r for r in mine if r.levelno >= logging.WARNING]
    assert len(loud) == 1 and "credential revoked" in loud[0].getMessage(), [r.getMessage() for r in loud]
    assert "\n" not in loud[0].getMessage() and not any(r.exc_info for r in mine)
    assert not any("restart" in r.getMessage() for r in mine if r.levelno >= logging.INFO)


def refused_within(call, deadline: float) -> bool:
    """Whether call() is refused before the deadline: PERMISSION_DENIED, or the client's own
    ServerUnavailable (its lane was closed; its ZeroMQ requests, heartbeats included, are refused)."""
    while time.monotonic() < deadline:
        try:
            call()
        except RequestError as e:
            assert "PERMISSION_DENIED" in str(e)
            return True
        except ServerUnavailable:
            return True
        time.sleep(0.01)
    return False


def _store_prompts(client, seeds, chunks=8):
    """Register a KV cache of the client's and store these prompts through it."""
    kv = w.make_kv("mha", 256, 8)
    handle = client.register_kv_cache(kv, model="m")
    ids = list(range(chunks * BPC))
    for seed in seeds:
        w.write_tokens(kv, "mha", ids, w.reference(seed, "mha", chunks * CHUNK))
        client.store(handle, chunk_hashes(w.prompt(seed, chunks), CHUNK), ids).result()


@pytest.mark.parametrize("protected", [True, False])
def test_a_flood_of_stores_leaves_another_tenants_l1_min_fully_cached(tmp_path, keys, setups, protected):
    # One chunk of this cache is 4 KiB; L1 holds 2 MiB (512 chunks). A keeps 40 chunks under an
    # l1_min of 256 KiB; B stores 1000 chunks. Without the l1_min the flood evicts A's (the control).
    chunks = 8
    extra = {"alice": 'l1_min = "256KiB"'} if protected else {}
    s = setups(tmp_path, keys, l1_size="2MiB", extra=extra)
    a, b = s.client("client"), s.client("b")
    _store_prompts(a, range(5), chunks)
    working_set = [chunk_hashes(w.prompt(seed, chunks), CHUNK) for seed in range(5)]
    assert all(a.lookup(hs, model="m").hits == chunks for hs in working_set)
    _store_prompts(b, range(100, 225), chunks)
    hits = sum(a.lookup(hs, model="m").hits for hs in working_set)
    if protected:
        assert hits == 5 * chunks
        stats = s.server.engine.tenants_status()
        assert stats["bob"]["l1"]["evicted"]["pressure"] > 0 and stats["alice"]["l1"]["evicted"]["pressure"] == 0
    else:
        assert hits < 5 * chunks


def test_l1_max_makes_a_tenant_evict_its_own_chunks_first(tmp_path, keys, setups):
    s = setups(tmp_path, keys, l1_size="4MiB", extra={"bob": 'l1_max = "512KiB"'})
    a, b = s.client("client"), s.client("b")
    _store_prompts(a, range(5))
    _store_prompts(b, range(100, 150))
    stats = s.server.engine.tenants_status()
    assert stats["bob"]["l1"]["bytes"] <= 512 << 10
    assert stats["bob"]["l1"]["evicted"]["l1_max"] > 0
    assert stats["alice"]["l1"]["objects"] == 40
    assert any(e["event"] == "quota_breach" and e["tenant"] == "bob" for e in s.audit_lines())


@pytest.mark.parametrize("tier", ["l1", "disk"])
def test_the_shared_namespace_is_read_and_written_only_as_allowed(tmp_path, keys, setups, tier,
                                                                    no_internal_errors):  # noqa: F811
    disk = dict(l2_disk=str(tmp_path / "disk"), l2_disk_size="64MiB", l2_write="all") if tier == "disk" else {}
    s = setups(tmp_path, keys, extra={"alice": 'shared = "read"'}, **disk)
    with open(s.tenants, "a") as f:
        f.write(f'[tenants.writer]\ncurve_keys = ["{keys}/clients/w.key"]\nshared = "write"\n')
    assert s.server.engine.tenancy.reload()
    a, b, wr = s.client("client"), s.client("b"), s.client("w")
    kv_w, h_w, ref, hashes, ids = engine_of(wr, seed=9, chunks=2, model="m")
    assert wr.store(h_w, hashes, ids, shared=True).result().stored == 2
    if tier == "disk":  # the shared chunks are found, and loaded, from the disk tier
        wait_until(lambda: s.server.engine.status()["l2"]["idle"], 120, "the L2 writes")
        s.server.engine.l1.clear()
    kv_a, h_a, _, _, _ = engine_of(a, seed=1, chunks=2, model="m")
    assert a.lookup(hashes, model="m").hits == 2  # found in shared
    if tier == "disk":
        assert s.server.engine.status()["l1"]["objects"] == 0  # (a lookup without lock loads nothing)
        assert a.lookup(hashes, model="m", lock=True).hits == 2  # loaded into L1, leased
    w.fill_blocks(kv_a, "mha", ids, 0)
    assert a.retrieve(h_a, hashes, ids).result().loaded == 2
    assert np.array_equal(w.read_tokens(kv_a, "mha", ids), ref)
    _, h_b, _, _, _ = engine_of(b, seed=2, chunks=2, model="m")
    assert b.lookup(hashes, model="m").hits == 0  # bob does not read shared
    assert b.retrieve(h_b, hashes, ids).result().loaded == 0
    for who, h in ((a, h_a), (b, h_b)):
        with pytest.raises(RequestError, match="PERMISSION_DENIED"):
            who.store(h, hashes, ids, shared=True).result()


def test_tenants_stay_apart_across_a_warm_restart_and_on_disk(tmp_path, keys, setups):
    disk = tmp_path / "disk"
    s = setups(tmp_path, keys, l1_persist=str(tmp_path / "l1.arena"), l2_disk=str(disk), l2_disk_size="64MiB",
               l2_write="all")
    a = s.client("client")
    _, h_a, ref, hashes, ids = engine_of(a, seed=1, chunks=2)
    a.store(h_a, hashes, ids).result()
    wait_until(lambda: s.server.engine.status()["l2"]["idle"], 120, "the L2 writes")
    s.restart()
    a, b = s.client("client"), s.client("b")
    kv_b, h_b, _, _, _ = engine_of(b, seed=2, chunks=2)
    assert b.lookup(hashes, model="m").hits == 0
    assert b.retrieve(h_b, hashes, ids).result().loaded == 0
    kv_a, h_a, _, _, _ = engine_of(a, seed=3, chunks=2)
    assert a.lookup(hashes, model="m").hits == 2  # A's chunks came back for A
    wait_until(lambda: s.server.engine.status()["l2"]["idle"], 120, "the L2 writes")
    s.server.engine.l1.clear()  # only the disk tier holds them now
    assert s.server.engine.status()["l1"]["objects"] == 0
    assert a.lookup(hashes, model="m").hits == 2
    assert b.lookup(hashes, model="m").hits == 0 and b.lookup(hashes, model="m", lock=True).hits == 0
    w.fill_blocks(kv_a, "mha", ids, 0)
    assert a.retrieve(h_a, hashes, ids).result().loaded == 2
    assert np.array_equal(w.read_tokens(kv_a, "mha", ids), ref)


def test_lookups_of_another_tenants_hashes_take_the_time_of_random_ones(tmp_path, keys, setups):
    s = setups(tmp_path, keys)
    a, b = s.client("client"), s.client("b")
    _store_prompts(a, range(8))
    theirs = [chunk_hashes(w.prompt(seed, 8), CHUNK) for seed in range(8)]
    rng = np.random.default_rng(0)
    randoms = [[rng.bytes(16) for _ in range(8)] for _ in range(8)]
    times = {"theirs": [], "random": []}
    for i in range(1200):  # interleaved: the machine's load falls on both alike
        for kind, sets in (("theirs", theirs), ("random", randoms)) if i % 2 else (("random", randoms),
                                                                                 ("theirs", theirs)):
            t0 = time.perf_counter()
            assert b.lookup(sets[i % 8], model="m").hits == 0
            times[kind].append(time.perf_counter() - t0)
    t, r = np.array(times["theirs"][100:]), np.array(times["random"][100:])
    for q in (25, 50, 75):
        ratio = np.percentile(t, q) / np.percentile(r, q)
        assert 0.8 < ratio < 1.25, (q, ratio)


def test_a_local_peers_uid_names_its_tenant_before_its_gid(tmp_path):
    from lmcache_mp.server.tenancy.audit import NullAuditLog
    from lmcache_mp.server.tenancy.tenancy import Tenancy

    (tmp_path / "t.toml").write_text("[tenants.a]\nuids = [5]\n[tenants.b]\ngids = [7]\n")
    tenancy = Tenancy(str(tmp_path / "t.toml"), NullAuditLog())
    assert tenancy.state_of(tenancy.peer_credential(5, 7)).name == "a"
    assert tenancy.state_of(tenancy.peer_credential(6, 7)).name == "b"
    assert tenancy.state_of(tenancy.peer_credential(6, 8)) is None


def test_local_peers_are_tenants_by_their_kernel_credentials(tmp_path, socket_dir):
    if os.getuid() != 0:
        pytest.skip("needs root: a client process of another group")
    tenants = tmp_path / "tenants.toml"
    tenants.write_text("[tenants.root]\ngids = [0]\n[tenants.nobody]\ngids = [65534]\n")
    srv = Server(ServerConfig(url=f"ipc://{socket_dir}/srv.sock", device="cpu", l1_size="64MiB", chunk_size=CHUNK,
                              tenants=str(tenants), http_addr="off")).start()
    try:
        a = Client(srv.url)
        _, h_a, _, hashes, ids = engine_of(a, seed=1, chunks=2)
        a.store(h_a, hashes, ids).result()
        assert a.lookup(hashes, model="m").hits == 2
        code = ("import importlib.machinery, os, sys; sys.path.insert(0, 'tests')\n"
                "from lmcache_mp import Client, chunk_hashes\nimport cpu_workers as w\n"
                "import lmcache_mp.client.endpoint, zmq.utils.monitor\n"
                "os.setgroups([]); os.setgid(65534)\n"
                f"c = Client({srv.url!r}); hs = chunk_hashes(w.prompt(1, 2), {CHUNK})\n"
                "print('hits', c.lookup(hs, model='m').hits, 'lane', c.status().get('tenant')); c.close()")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             cwd=os.path.dirname(os.path.dirname(__file__)))
        assert out.returncode == 0, out.stderr
        assert "hits 0 lane nobody" in out.stdout
        tenants.write_text("[tenants.root]\ngids = [0]\n")
        assert srv.engine.tenancy.reload()
        out = subprocess.run([sys.executable, "-c", code.replace("Client(", "Client(connect_timeout=1, url=")],
                             capture_output=True, text=True, timeout=60, cwd=os.path.dirname(os.path.dirname(__file__)))
        assert out.returncode != 0 and "tenants file names neither this user" in out.stderr
        a.close()
    finally:
        srv.stop()


def test_a_bad_tenants_file_is_one_clear_line(tmp_path, keys):
    bad = tmp_path / "tenants.toml"
    bad.write_text(f'[tenants.alice]\ncurve_keys = ["{keys}/clients/client.key"]\nl1_min = "lots"\n')
    with pytest.raises(ValueError, match=r"tenants.toml:3: tenants.alice.l1_min"):  # (after the setting)
        Server(ServerConfig(url="tcp://127.0.0.1:0", device="cpu", l1_size="16MiB", tenants=str(bad),
                            curve_secret_key=f"{keys}/server.key_secret", http_addr="off")).start()
    run = subprocess.run([sys.executable, "-m", "lmcache_mp.server.cli", "--url", "tcp://127.0.0.1:0", "--device",
                          "cpu", "--l1-size", "16MiB", "--tenants", str(bad), "--curve-secret-key",
                          f"{keys}/server.key_secret", "--http-addr", "off"], capture_output=True, text=True, timeout=60)
    err = [line for line in run.stderr.splitlines() if " WARNING " in line or " ERROR " in line]
    assert run.returncode != 0 and len(err) == 1 and "tenants.toml:3: tenants.alice.l1_min" in err[0], run.stderr
    with pytest.raises(ValueError, match="tenants need credentials"):
        ServerConfig(url="tcp://127.0.0.1:0", tenants=str(bad))
    with pytest.raises(ValueError, match="curve_keys"):
        ServerConfig(url="tcp://127.0.0.1:0", tenants=str(bad), curve_secret_key=f"{keys}/server.key_secret",
                     curve_clients=f"{keys}/clients")


def test_l1_min_beyond_l1_stops_the_start_and_a_reload_in_one_line(tmp_path, keys, setups):
    big = tenants_file(tmp_path, keys, extra={"alice": 'l1_min = "12MiB"', "bob": 'l1_min = "12MiB"'})
    run = subprocess.run([sys.executable, "-m", "lmcache_mp.server.cli", "--url", "tcp://127.0.0.1:0", "--device",
                          "cpu", "--l1-size", "16MiB", "--tenants", big, "--curve-secret-key",
                          f"{keys}/server.key_secret", "--http-addr", "off"],
                         capture_output=True, text=True, timeout=120)
    err = [line for line in run.stderr.splitlines() if " WARNING " in line or " ERROR " in line]
    assert run.returncode != 0 and len(err) == 1, run.stderr
    assert "the l1_min of all tenants add up to 24.0 MiB" in err[0] and "(--l1-size 16.0 MiB)" in err[0], err[0]

    s = setups(tmp_path, keys, l1_size="16MiB", extra={"alice": 'l1_min = "8MiB"'})
    tenants_file(tmp_path, keys, extra={"alice": 'l1_min = "8MiB"', "bob": 'l1_min = "20MiB"'})
    assert not s.server.engine.tenancy.reload()  # one larger than L1: the running configuration stays
    failed = [e for e in s.audit_lines() if e["event"] == "tenants_reload_failed"]
    assert len(failed) == 1 and ":6: tenants.bob.l1_min: 20.0 MiB is more than L1" in failed[0]["error"]
    assert s.server.engine.tenants_status()["bob"]["limits"]["l1_min"] == 0


def test_a_reload_warns_of_a_rename_and_of_an_engine_window_it_cannot_resize(tmp_path, keys, setups, caplog):
    import logging

    small = 'engine_window = "16MiB"'
    s = setups(tmp_path, keys, url=f"ipc://{tmp_path}/srv.sock", extra={"alice": small, "bob": small})
    a, b = s.client("client"), s.client("b")
    h_a = a.register_kv_cache(w.make_kv("mha", 64, 8), model="m", transfer="engine")  # (maps alice's window)
    _, h_b, _, hashes, ids = engine_of(b, seed=2, chunks=2)
    assert b.store(h_b, hashes, ids).result().stored == 2
    caplog.set_level(logging.WARNING, logger="lmcache_mp.server.tenancy.tenancy")
    tenants_file(tmp_path, keys, body=f'[tenants.alice]\ncurve_keys = ["{keys}/clients/client.key"]\n'
                                        'engine_window = "32MiB"\n'
                                        f'[tenants.robert]\ncurve_keys = ["{keys}/clients/b.key"]\n'
                                        'engine_window = "32MiB"\n')
    assert s.server.engine.tenancy.reload()
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("tenant bob is now named robert" in m and "robert starts with an empty cache" in m for m in said)
    assert any("alice's engine_window stays 16.0 MiB, not 32.0 MiB" in m for m in said), said
    assert len(said) == 2, said  # (robert has no window yet: his is made at 32 MiB when first asked for)
    line = [e for e in s.audit_lines() if e["event"] == "tenants_reloaded"][-1]
    assert line["renamed"] == [["bob", "robert"]] and line["engine_window_kept"] == ["alice"]
    c = s.client("b")  # robert now: bob's chunks are not his
    assert c.status()["tenant"] == "robert" and c.lookup(hashes, model="m").hits == 0
    a.unregister_kv_cache(h_a)


def test_sighup_reloads_the_tenants_file_of_a_running_server(tmp_path, keys):
    tenants = tenants_file(tmp_path, keys)
    proc = subprocess.Popen([sys.executable, "-m", "lmcache_mp.server.cli", "--url", "tcp://127.0.0.1:0",
                             "--device", "cpu", "--l1-size", "16MiB", "--http-addr", "off", "--tenants", tenants,
                             "--curve-secret-key", f"{keys}/server.key_secret"],
                            stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for line in proc.stderr:
            if "ready: serving on" in line:
                url = line.rsplit(" ", 1)[-1].strip()
                break
        assert url, "the server did not start"
        kw = dict(curve_server_key=f"{keys}/server.key", heartbeat_interval=0.25)
        b = Client(url, curve_client_key=f"{keys}/client-secret/b.key_secret", **kw)
        assert b.ping() >= 0
        tenants_file(tmp_path, keys, body=f'[tenants.carol]\ncurve_keys = ["{keys}/clients/c.key"]\n')
        t0 = time.monotonic()
        proc.send_signal(signal.SIGHUP)
        assert refused_within(lambda: b.lookup([b"x" * 16], model="m"), t0 + 1.0), \
            "the removed key still worked a second after SIGHUP"
        b.close()
        c = Client(url, curve_client_key=f"{keys}/client-secret/c.key_secret", **kw)
        assert c.ping() >= 0
        c.close()
    finally:
        proc.terminate()
        proc.wait(30)


def test_l2_disk_max_keeps_a_tenant_within_its_share_of_the_disk(tmp_path, keys, setups):
    # A chunk's file is 8 KiB (4 KiB of KV and a 4 KiB header). Bob may hold 256 KiB (32 files).
    # However the writer batches his 400 chunks (one by one, or all in one write on a busy
    # machine), he gets files on disk and no more than his cap.
    s = setups(tmp_path, keys, l1_size="8MiB", l2_disk=str(tmp_path / "disk"), l2_disk_size="64MiB",
               l2_write="all", extra={"bob": 'l2_disk_max = "256KiB"'})
    a, b = s.client("client"), s.client("b")
    _store_prompts(a, range(5))
    _store_prompts(b, range(100, 150))
    wait_until(lambda: s.server.engine.status()["l2"]["idle"], 120, "the L2 writes")
    stats = s.server.engine.tenants_status()
    assert 0 < stats["bob"]["l2_disk_bytes"] <= 256 << 10
    assert stats["alice"]["l2_disk_bytes"] == 40 * (8 << 10)
    s.server.engine.l1.clear()
    assert all(a.lookup(chunk_hashes(w.prompt(seed, 8), CHUNK), model="m").hits == 8 for seed in range(5))


def test_l2_disk_max_refusals_are_audited_a_line_a_minute(tmp_path, keys, setups):
    # Bob's cap is smaller than one chunk's file (8 KiB): every write of his is refused, and the
    # audit log has one quota_breach line for them all (the next would come a minute later).
    s = setups(tmp_path, keys, l1_size="8MiB", l2_disk=str(tmp_path / "disk"), l2_disk_size="64MiB",
               l2_write="all", extra={"bob": 'l2_disk_max = "4KiB"'})
    b = s.client("b")
    _store_prompts(b, range(100, 104))
    wait_until(lambda: s.server.engine.status()["l2"]["idle"], 120, "the L2 writes")
    disk = next(t for t in s.server.engine.status()["l2"]["tiers"] if t["name"] == "disk")
    assert disk["over_tenant_cap"] == 32 and s.server.engine.tenants_status()["bob"]["l2_disk_bytes"] == 0
    breaches = [e for e in s.audit_lines() if e["event"] == "quota_breach"]
    assert len(breaches) == 1, breaches
    assert breaches[0]["tenant"] == "bob" and breaches[0]["quota"] == "l2_disk_max"
    assert breaches[0]["limit"] == 4096 and breaches[0]["chunks"] >= 1 and breaches[0]["suppressed"] == 0


def test_two_nodes_sharing_valkey_keep_tenants_apart(tmp_path, keys, setups):
    from test_l2_valkey import Valkey

    valkey = Valkey()
    try:
        one = setups(tmp_path, keys, l2_redis=valkey.url)  # (written through: the default)
        two = setups(tmp_path, keys, l2_redis=valkey.url)
        a1 = one.client("client")
        _, h, ref, hashes, ids = engine_of(a1, seed=1, chunks=2)
        a1.store(h, hashes, ids).result()
        wait_until(lambda: one.server.engine.status()["l2"]["idle"], 120, "the L2 writes")
        b2, a2 = two.client("b"), two.client("client")
        _, h_b, _, _, _ = engine_of(b2, seed=2, chunks=2)
        assert b2.lookup(hashes, model="m").hits == 0 and b2.lookup(hashes, model="m", lock=True).hits == 0
        assert b2.retrieve(h_b, hashes, ids).result().loaded == 0
        kv_a, h_a, _, _, _ = engine_of(a2, seed=3, chunks=2)
        w.fill_blocks(kv_a, "mha", ids, 0)
        assert a2.retrieve(h_a, hashes, ids).result().loaded == 2  # alice's, on the other node, through Valkey
        assert np.array_equal(w.read_tokens(kv_a, "mha", ids), ref)
    finally:
        valkey.stop()


def test_curve_tenants_get_the_local_lane_and_engine_side_copies_through_their_tickets(tmp_path, keys, setups):
    small = 'engine_window = "16MiB"'  # (the scan below copies all of bob's window, holding the GIL)
    s = setups(tmp_path, keys, url=f"ipc://{tmp_path}/srv.sock", extra={"alice": small, "bob": small})
    a, b = s.client("client"), s.client("b")
    assert a.server_info["lane_ticket"] and a.server_info["lane_ticket"] != b.server_info["lane_ticket"]
    kv_a = w.make_kv("mha", 64, 8)
    h_a = a.register_kv_cache(kv_a, model="m", transfer="engine")
    ref, ids = w.reference(1, "mha", 2 * CHUNK), list(range(2 * BPC))
    w.write_tokens(kv_a, "mha", ids, ref)
    hashes = chunk_hashes(w.prompt(1, 2), CHUNK)
    assert a.store(h_a, hashes, ids).result().stored == 2
    kv_b = w.make_kv("mha", 64, 8)
    h_b = b.register_kv_cache(kv_b, model="m", transfer="engine")
    assert b.lookup(hashes, model="m").hits == 0 and b.retrieve(h_b, hashes, ids).result().loaded == 0
    window = bytes(b._engine._use.arena._view)  # all bob's process has mapped of the server
    assert not any(window.find(ref[layer, seg, :CHUNK].tobytes()) >= 0 for layer in range(ref.shape[0])
                   for seg in range(2))
    w.fill_blocks(kv_a, "mha", ids, 0)
    assert a.retrieve(h_a, hashes, ids).result().loaded == 2
    assert np.array_equal(w.read_tokens(kv_a, "mha", ids), ref)
    lanes = [e for e in s.audit_lines() if e["event"] == "connection_accepted" and e["transport"] == "lane"]
    assert {e["tenant"] for e in lanes} == {"alice", "bob"} and all("ticket" in e["by"] for e in lanes)
    # a lane connection with a ticket nobody was given is closed, and its request never answered
    import socket as socket_

    from lmcache_mp import protocol as p

    sock = socket_.socket(socket_.AF_UNIX, socket_.SOCK_SEQPACKET)
    sock.connect(a.server_info["lane"])
    sock.settimeout(5)
    sock.send(p.pack_lane(0, p.encode(p.LaneClaim(ticket=b"x" * 32))))
    try:
        sock.send(p.pack_lane(1, p.encode(p.Lookup(client_id=b"c" * 16, model="m", world_size=1,
                                                    hashes=b"".join(hashes)))))
        assert sock.recv(4096) == b""  # closed, the lookup unanswered
    except (BrokenPipeError, ConnectionResetError):  # (closed already, or with the request unread)
        pass
    sock.close()
    assert any(e["event"] == "connection_refused" and e["transport"] == "lane" for e in s.audit_lines())
    a.unregister_kv_cache(h_a)
    b.unregister_kv_cache(h_b)


def _lane_lookup(sock, req_id: int, hashes) -> int:
    """A lookup sent on a raw lane connection: its hits (EOFError: the server closed the connection)."""
    from lmcache_mp import protocol as p

    try:
        sock.send(p.pack_lane(req_id, p.encode(p.Lookup(client_id=b"c" * 16, model="m", world_size=1,
                                                          hashes=b"".join(hashes)))))
        data = sock.recv(p.LANE_MAX_BYTES)
    except (BrokenPipeError, ConnectionResetError):  # (closed already, or with the request unread)
        raise EOFError from None
    if not data:
        raise EOFError
    return p.decode_reply(p.unpack_lane(data)[2]).hits


def test_a_lane_connection_claims_a_tenant_only_with_its_first_datagram(tmp_path, keys, setups):
    """A lane connection that spoke as one tenant never becomes another: a later claim, even with
    a valid ticket, closes it (unanswered) and is audited."""
    import socket as socket_

    from lmcache_mp import protocol as p

    s = setups(tmp_path, keys, url=f"ipc://{tmp_path}/srv.sock")
    a, b = s.client("client"), s.client("b")
    for who, seed in ((a, 1), (b, 2)):
        _, h, _, hashes, ids = engine_of(who, seed=seed, chunks=2)
        assert who.store(h, hashes, ids).result().stored == 2
    hashes_a, hashes_b = (chunk_hashes(w.prompt(seed, 2), CHUNK) for seed in (1, 2))
    sock = socket_.socket(socket_.AF_UNIX, socket_.SOCK_SEQPACKET)
    sock.connect(a.server_info["lane"])
    sock.settimeout(30)
    sock.send(p.pack_lane(0, p.encode(p.LaneClaim(ticket=a.server_info["lane_ticket"]))))  # first: taken
    assert _lane_lookup(sock, 1, hashes_a) == 2 and _lane_lookup(sock, 2, hashes_b) == 0  # alice's namespace
    sock.send(p.pack_lane(0, p.encode(p.LaneClaim(ticket=b.server_info["lane_ticket"]))))  # bob's, later
    with pytest.raises(EOFError):
        _lane_lookup(sock, 3, hashes_b)
    sock.close()
    refused = [e for e in s.audit_lines() if e["event"] == "connection_refused" and e["transport"] == "lane"]
    assert len(refused) == 1 and "first datagram" in refused[0]["reason"] and refused[0]["tenant"] == "alice"
    assert a.lookup(hashes_a, model="m").hits == 2 and b.lookup(hashes_b, model="m").hits == 2  # both served on


def test_a_server_without_tenants_lets_no_client_name_a_tenants_namespace(tmp_path):
    # (one that shares an L1 file or an L2 tier with a server with tenants must not open it to its clients)
    with Server(ServerConfig(url="tcp://127.0.0.1:0", device="cpu", l1_size="16MiB", chunk_size=CHUNK,
                             http_addr="off")) as srv, Client(srv.url) as c:
        for call in (lambda: c.lookup([b"x" * 16], model="alice\x1fm"),
                     lambda: c.register_kv_cache(w.make_kv("mha", 16, 8), model="alice\x1fm"),
                     lambda: c.events(models=["alice\x1fm"])):
            with pytest.raises(RequestError, match="INVALID_ARGUMENT"):
                call()
        assert c.lookup([b"x" * 16], model="alice/m").hits == 0
