"""The engine's own copies (register_kv_cache(..., transfer="engine")), on the CPU device: the
client maps L1 and moves the bytes; the server reserves, commits, pins reads and never copies.
Byte-exact round trips (MHA, MLA shared by TP ranks, two engines, mixed with clients the server
copies for), nothing half-visible after a client is killed mid-copy (its slots come back), a
reservation held while its process lives, deadlines, leases and L2."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

import cpu_workers as w
from lmcache_mp import Client, RequestError, ServerUnavailable, chunk_hashes
from lmcache_mp import protocol as p
from lmcache_mp.shm import remove_shared_files
from test_cli import ServerProcess
from test_server_e2e import CHUNK, RawClient, blocks_of, clients, servers, stopped, wait_until  # noqa: F401

BS = 8


def _register(c, layout="mha", model="m", transfer="engine", **kw):
    kv = w.make_kv(layout, 64, BS)
    return kv, c.register_kv_cache(kv, model=model, layout=layout, transfer=transfer, **kw)


def _store(c, h, kv, layout, seed, chunks=2, start=0):
    src = blocks_of(chunks, start=start)
    w.write_tokens(kv, layout, src, w.reference(seed, layout, chunks * CHUNK))
    return c.store(h, chunk_hashes(w.prompt(seed, chunks), CHUNK), src).result(10)


def _exact(c, h, kv, layout, seed, chunks=2, start=32, lease=0) -> int:
    """Retrieve a prompt into other blocks; asserts the loaded tokens are its own."""
    dst = blocks_of(chunks, start=start)
    w.fill_blocks(kv, layout, dst, 0)
    got = c.retrieve(h, chunk_hashes(w.prompt(seed, chunks), CHUNK), dst, lease=lease).result(10).loaded
    n = got * CHUNK
    want = w.reference(seed, layout, chunks * CHUNK)[:, :, :n]
    assert np.array_equal(w.read_tokens(kv, layout, dst)[:, :, :n], want)
    return got


@pytest.mark.parametrize("layout", ["mha", "block_major", "mla"])
def test_round_trips_are_byte_exact_and_shared_with_the_servers_copies(shm_files, servers, clients, layout):  # noqa: F811
    srv = servers()
    a = clients(srv.url)
    kv, h = _register(a, layout)
    assert h.transfer_mode == "engine" and h.copier is not None
    assert _store(a, h, kv, layout, 1).stored == 2
    assert _store(a, h, kv, layout, 1).present == 2  # stored already: nothing copied
    assert a.lookup(chunk_hashes(w.prompt(1, 2), CHUNK), model="m") == 2
    assert _exact(a, h, kv, layout, 1) == 2
    b = clients(srv.url)  # the server copies for this one: it reads what the engine stored, and back
    kv_b, h_b = _register(b, layout, transfer="server")
    assert h_b.transfer_mode == "cpu"
    assert _exact(b, h_b, kv_b, layout, 1) == 2
    assert _store(b, h_b, kv_b, layout, 2).stored == 2
    assert _exact(a, h, kv, layout, 2) == 2
    # a read ends with the client's READ_DONE, sent as its copy ends but not waited for: the
    # retrieve's result may come before the server has it (a store's result waits for its commit)
    wait_until(lambda: a.status()["engine_copies"]["reads"] == 0, 10, "the engine's reads to end")
    st = a.status()
    assert st["engine_copies"]["reservations"] == 0 and st["l1"]["writing"] == 0


def test_tp_ranks_share_one_mla_chunk(shm_files, servers, clients):  # noqa: F811
    srv = servers()
    r0, r1 = clients(srv.url), clients(srv.url)
    kv0 = w.make_kv("mla", 64, BS)
    kv1 = w.make_kv("mla", 64, BS)
    h0 = r0.register_kv_cache(kv0, model="tp", world_size=2, rank=0, layout="mla", transfer="engine")
    h1 = r1.register_kv_cache(kv1, model="tp", world_size=2, rank=1, layout="mla", transfer="engine")
    assert h0.shared and h1.shared
    assert _store(r0, h0, kv0, "mla", 5).stored == 2  # rank 0 stores the latent once...
    assert r1.lookup(chunk_hashes(w.prompt(5, 2), CHUNK), model="tp", world_size=2) == 2
    assert _exact(r1, h1, kv1, "mla", 5) == 2  # ... rank 1 reads it
    assert r0.status()["l1"]["objects"] == 2


def test_two_engines_store_and_read_each_others_chunks(shm_files, servers, clients):  # noqa: F811
    srv = servers()
    a, b = clients(srv.url), clients(srv.url)
    kv_a, h_a = _register(a, model="shared")
    kv_b, h_b = _register(b, model="shared")
    assert _store(a, h_a, kv_a, "mha", 7).stored == 2
    assert _store(b, h_b, kv_b, "mha", 7).present == 2
    assert _exact(b, h_b, kv_b, "mha", 7) == 2
    assert _store(b, h_b, kv_b, "mha", 8).stored == 2
    assert _exact(a, h_a, kv_a, "mha", 8) == 2


def test_a_lease_is_consumed_by_the_engines_read(shm_files, servers, clients):  # noqa: F811
    srv = servers()
    c = clients(srv.url)
    kv, h = _register(c)
    _store(c, h, kv, "mha", 3)
    found = c.lookup(chunk_hashes(w.prompt(3, 2), CHUNK), model="m", lock=True)
    assert found == 2 and srv.engine.status()["l1"]["leased_objects"] == 2
    assert _exact(c, h, kv, "mha", 3, lease=found) == 2
    assert srv.engine.status()["l1"]["leased_objects"] == 0


def test_requests_of_the_other_path_are_refused_clearly(shm_files, servers, clients):  # noqa: F811
    srv = servers()
    c = clients(srv.url)
    kv, h = _register(c)
    raw = RawClient(srv.url)
    try:
        hashes = b"".join(chunk_hashes(w.prompt(1, 1), CHUNK))
        msg = raw.expect_error(p.encode(p.Store(kv_id=h.kv_id, hashes=hashes, block_ids=p.pack_block_ids(
            blocks_of(1)), client_id=c.client_id)), p.ErrorCode.INVALID_ARGUMENT)
        assert "engine's own copies" in msg
        raw.expect_error(p.encode(p.MapArena(client_id=c.client_id)), p.ErrorCode.UNSUPPORTED)  # not on ZeroMQ
        raw.expect_error(p.encode(p.Commit(client_id=c.client_id, reservation=12345)), p.ErrorCode.INVALID_ARGUMENT)
        raw.expect_error(p.encode(p.ReadDone(client_id=c.client_id, read=12345)), p.ErrorCode.INVALID_ARGUMENT)
        kv_s, h_s = _register(c, transfer="server", model="s")
        raw.expect_error(p.encode(p.Reserve(kv_id=h_s.kv_id, hashes=hashes, client_id=c.client_id)),
                         p.ErrorCode.INVALID_ARGUMENT)
        raw.expect_error(p.encode(p.Reserve(kv_id=h.kv_id, hashes=hashes, client_id=c.client_id, parent=b"p")),
                         p.ErrorCode.INVALID_ARGUMENT)
        _, reply = raw.request(p.encode(p.Reserve(kv_id=h.kv_id, hashes=hashes, client_id=c.client_id,
                                                  deadline=time.monotonic() - 1)))
        assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.DEADLINE_EXCEEDED
        assert srv.engine.status()["l1"]["writing"] == 0
    finally:
        raw.close()


def test_a_clients_reads_and_reservations_end_with_it(shm_files, servers, clients):  # noqa: F811
    """A client that closes with a read and a reservation open: its goodbye ends the read at once;
    the reservation is held while its process lives (a copy of it could still land), and nothing
    of it is visible."""
    srv = servers()
    c = clients(srv.url)
    kv, h = _register(c)
    _store(c, h, kv, "mha", 4)
    hashes = b"".join(chunk_hashes(w.prompt(9, 2), CHUNK))
    reserved = c._call(p.Reserve(kv_id=h.kv_id, hashes=hashes, client_id=c.client_id), p.ReserveReply)
    read = c._call(p.Read(kv_id=h.kv_id, hashes=b"".join(chunk_hashes(w.prompt(4, 2), CHUNK)),
                          client_id=c.client_id), p.ReadReply)
    assert reserved.reservation and read.read
    st = srv.engine.status()
    assert st["engine_copies"]["reservations"] == 1 and st["engine_copies"]["reads"] == 1
    assert st["l1"]["writing"] == 2
    c.close()
    st = srv.engine.status()
    assert st["engine_copies"]["reads"] == 0  # the goodbye ended the read
    assert st["engine_copies"]["held_for_gone_clients"] == 1  # this process may still be copying
    assert st["l1"]["objects"] == 2  # nothing of the reservation is visible
    probe = clients(srv.url)
    assert probe.lookup(chunk_hashes(w.prompt(9, 2), CHUNK), model="m") == 0


def _reserve_then_die(url: str, q) -> None:
    """A client process that reserves slots, writes half of a chunk into them, and is killed."""
    import cpu_workers as w

    from lmcache_mp import Client, chunk_hashes

    c = Client(url)
    kv = w.make_kv("mha", 64, 8)
    h = c.register_kv_cache(kv, model="m", transfer="engine")
    hashes = b"".join(chunk_hashes(w.prompt(11, 2), w.CHUNK))
    r = c._call(p.Reserve(kv_id=h.kv_id, hashes=hashes, client_id=c.client_id), p.ReserveReply)
    arena = c._engine.arena().arena
    for off in p.unpack_offsets(r.offsets):
        np.frombuffer(arena._map, dtype=np.uint8, count=r.object_bytes // 2, offset=int(off))[:] = 0xAB
    q.put(("reserved", r.reservation))
    time.sleep(60)  # killed meanwhile


def test_a_client_killed_mid_copy_leaves_nothing_half_visible_and_its_slots_come_back(shm_files):
    srv = ServerProcess(["--url", "tcp://127.0.0.1:0", "--device", "cpu", "--l1-size", "16MiB", "--chunk-size",
                         str(CHUNK), "--heartbeat-timeout", "60", "--http-addr", "off"])
    url = srv.wait_ready()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_reserve_then_die, args=(url, q), daemon=True)
    proc.start()
    c = Client(url)
    try:
        assert q.get(timeout=60)[0] == "reserved"
        st = c.status()
        assert st["engine_copies"]["reservations"] == 1 and st["l1"]["writing"] == 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        # its process is gone: the reservation is given back at the next housekeeping tick
        wait_until(lambda: c.status()["engine_copies"]["reservations"] == 0, 10, "the slots to come back")
        st = c.status()
        assert st["l1"]["writing"] == 0 and st["l1"]["objects"] == 0
        assert c.lookup(chunk_hashes(w.prompt(11, 2), CHUNK), model="m") == 0
        assert "Traceback" not in "\n".join(srv.lines)
    finally:
        c.close()
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        remove_shared_files(proc.pid)  # its KV cache: a killed process cannot remove it
        srv.kill()


def test_a_stalled_server_never_keeps_a_late_engine_store(shm_files):
    """The server is stopped while a store asks for its reservation; the store fails at its
    deadline without copying; the resumed server's late reservation is given back unused."""
    srv = ServerProcess(["--url", "tcp://127.0.0.1:0", "--device", "cpu", "--l1-size", "16MiB", "--chunk-size",
                         str(CHUNK), "--heartbeat-timeout", "60", "--http-addr", "off"])
    url = srv.wait_ready()
    c = Client(url)
    try:
        kv, h = _register(c)
        hashes = chunk_hashes(w.prompt(21, 2), CHUNK)
        w.write_tokens(kv, "mha", blocks_of(2), w.reference(21, "mha", 2 * CHUNK))
        os.kill(srv.proc.pid, signal.SIGSTOP)
        wait_until(lambda: stopped(srv.proc.pid), 5, "the server to stop")
        try:
            t0 = time.monotonic()
            with pytest.raises(ServerUnavailable):
                c.store(h, hashes, blocks_of(2), timeout=0.5).result(10)
            assert time.monotonic() - t0 < 5
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        wait_until(lambda: c.status()["l1"]["writing"] == 0 and c.status()["engine_copies"]["reservations"] == 0,
                   10, "the late reservation to be given back")
        assert c.lookup(hashes, model="m") == 0
        assert _store(c, h, kv, "mha", 21).stored == 2  # and the next store goes through
    finally:
        c.close()
        srv.kill()


def test_an_engine_read_of_chunks_only_the_disk_holds_loads_them_first(shm_files, servers, clients, tmp_path):  # noqa: F811
    srv = servers(l1_size="1MiB", l2_disk=str(tmp_path / "l2"), l2_disk_size="64MiB", l2_write="all")
    c = clients(srv.url)
    kv, h = _register(c)
    for seed in range(40, 44):
        _store(c, h, kv, "mha", seed)
    wait_until(lambda: srv.engine.status()["l2"]["idle"], 10, "the L2 writes")
    c.clear()  # L1 empty: the chunks are on disk only
    assert srv.engine.status()["l1"]["objects"] == 0
    assert _exact(c, h, kv, "mha", 41) == 2


def test_engine_copies_need_the_lane(shm_files, servers, clients):  # noqa: F811
    srv = servers(local_lane=False)  # no local lane: L1 cannot be mapped
    c = clients(srv.url)
    kv = w.make_kv("mha", 64, BS)
    assert c.register_kv_cache(kv, model="m").transfer_mode == "cpu"  # auto: the server copies
    with pytest.raises(RequestError):
        c.register_kv_cache(kv, model="m2", transfer="engine")


def test_bad_block_ids_are_refused_before_any_slot_is_reserved(shm_files, servers, clients):  # noqa: F811
    srv = servers()
    c = clients(srv.url)
    kv, h = _register(c)
    hashes = chunk_hashes(w.prompt(30, 1), CHUNK)
    with pytest.raises(ValueError, match="out of range"):
        c.store(h, hashes, [0, 1, 2, 999])
    with pytest.raises(ValueError, match="twice"):
        c.retrieve(h, hashes, [5, 5, 6, 7])
    st = srv.engine.status()
    assert st["l1"]["writing"] == 0 and st["engine_copies"]["reservations"] == 0


def test_a_retrieve_that_gives_up_at_its_deadline_writes_nothing_later(shm_files):
    """The server is stopped while a retrieve asks where its chunks are: the retrieve fails at its
    deadline and nothing is copied; the resumed server's read is let go at once."""
    srv = ServerProcess(["--url", "tcp://127.0.0.1:0", "--device", "cpu", "--l1-size", "16MiB", "--chunk-size",
                         str(CHUNK), "--heartbeat-timeout", "60", "--http-addr", "off"])
    url = srv.wait_ready()
    c = Client(url)
    try:
        kv, h = _register(c)
        _store(c, h, kv, "mha", 31)
        dst = blocks_of(2, start=32)
        w.fill_blocks(kv, "mha", dst, 7)
        os.kill(srv.proc.pid, signal.SIGSTOP)
        wait_until(lambda: stopped(srv.proc.pid), 5, "the server to stop")
        try:
            with pytest.raises(RequestError) as info:
                c.retrieve(h, chunk_hashes(w.prompt(31, 2), CHUNK), dst, deadline=time.monotonic() + 0.5).result(10)
            assert info.value.code == p.ErrorCode.DEADLINE_EXCEEDED
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        # A later retrieve on the same connection is answered after the late read was.
        assert _exact(c, h, kv, "mha", 31, start=48) == 2
        wait_until(lambda: c.status()["engine_copies"]["reads"] == 0, 10, "the late read to be let go")
        assert w.blocks_equal(kv, "mha", dst, 7)  # untouched
    finally:
        c.close()
        srv.kill()


def test_the_engines_page_locking_takes_each_slab_once_when_first_needed(shm_files, servers, clients, monkeypatch):  # noqa: F811
    """CUDA copies page-lock L1 in the engine's process: a slab the first time a request needs it
    (never in the background), each once, all of them with pin_l1(), and none left at close."""
    import types

    from lmcache_mp import native

    calls = []
    fake = types.SimpleNamespace(host_register=lambda ptr, n, dev: calls.append(("lock", ptr, n, dev)),
                                 host_unregister=lambda ptr, dev: calls.append(("unlock", ptr, dev)))
    monkeypatch.setattr(native, "cuda", fake)
    monkeypatch.setattr("lmcache_mp.native.cuda_built", lambda: True)
    srv = servers(l1_size="8MiB", slab_size="1MiB")
    c = clients(srv.url)
    kv, h = _register(c)
    arena = c._engine.arena().arena
    arena.use_device(3)  # as a CUDA cache's registration does
    slab = arena.slab_bytes
    arena.ensure_pinned(np.array([0, 10, slab + 5], dtype=np.uint64))
    arena.ensure_pinned(np.array([slab], dtype=np.uint64))  # locked already
    assert calls == [("lock", arena.base, slab, 3), ("lock", arena.base + slab, slab, 3)]
    c.pin_l1()
    locked = sorted(ptr for kind, ptr, *_ in calls if kind == "lock")
    assert locked == [arena.base + i * slab for i in range(arena.capacity // slab)]
    c.close()
    assert sorted(ptr for kind, ptr, _ in (x for x in calls if x[0] == "unlock")) == locked
