"""The server end to end on the CPU device, with real processes and real sockets: worker processes
(TP ranks, separate engine instances) with KV caches in shared memory, leases under memory
pressure, clients that die or misbehave, server restarts and timeouts."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import subprocess
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

import cpu_workers as w
from lmcache_mp import Client, RequestError, Server, ServerConfig, ServerUnavailable, chunk_hashes
from lmcache_mp import protocol as p
from lmcache_mp.shm import remove_shared_files

CHUNK = w.CHUNK
OBJECT_BYTES = 2 * w.LAYERS * CHUNK * w.TOKEN_BYTES  # one MHA chunk of one rank: [2, L, T, W]


def new_server(**settings) -> Server:
    cfg = dict(url="tcp://127.0.0.1:0", device="cpu", l1_size="64MiB", chunk_size=CHUNK)
    cfg.update(settings)
    return Server(ServerConfig(**cfg)).start()


@pytest.fixture
def servers():
    """Start servers with new_server-style settings; every one is stopped at the end."""
    started: list[Server] = []

    def start(**settings) -> Server:
        srv = new_server(**settings)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


@pytest.fixture
def clients():
    made: list[Client] = []

    def connect(url, **kw) -> Client:
        kw.setdefault("heartbeat_interval", 0.25)
        c = Client(url, **kw)
        made.append(c)
        return c

    yield connect
    for c in made:
        c.close()


@pytest.fixture
def no_internal_errors(caplog):
    """Fails the test if the in-process server logged an exception (a bug, not a bad request)."""
    caplog.set_level(logging.WARNING, logger="lmcache_mp")
    yield
    bad = [r for r in caplog.records if r.name.startswith("lmcache_mp") and (r.exc_info or "internal" in r.getMessage())]
    assert not bad, [r.getMessage() for r in bad]


@pytest.fixture
def ipc_url(socket_dir):
    return f"ipc://{socket_dir}/srv.sock"


def run_workers(targets, timeout: float = 120) -> list:
    """Run (fn, args) in 'spawn' processes, each reporting on a queue; fail on any error."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(q,) + tuple(args), daemon=True) for fn, args in targets]
    for proc in procs:
        proc.start()
    results = []
    try:
        for _ in procs:
            status, info = q.get(timeout=timeout)
            assert status == "ok", info  # the first failure ends the test (its partners may wait on it)
            results.append(info)
    finally:
        for proc in procs:
            proc.join(30 if len(results) == len(procs) else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
    assert all(proc.exitcode == 0 for proc in procs), [proc.exitcode for proc in procs]
    leaked = [f.name for proc in procs for f in Path("/dev/shm").glob(f"lmcache_mp_{proc.pid}_*")]
    assert not leaked, f"worker processes left shared memory behind: {leaked}"
    return results


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def register_mha(client, model="m", num_blocks=64, block_size=8):
    kv = w.make_kv("mha", num_blocks, block_size)
    return kv, client.register_kv_cache(kv, model=model)


def blocks_of(chunks, bpc=CHUNK // 8, start=0):
    return list(range(start, start + chunks * bpc))


# ---- worker processes -----------------------------------------------------------------------------


def test_tensor_parallel_ranks_store_lookup_and_retrieve(shm_files, servers, no_internal_errors):
    srv = servers()
    barrier = mp.get_context("spawn").Barrier(2)
    infos = run_workers([(w.tp_rank, (srv.url, rank, barrier)) for rank in range(2)])
    assert sorted(i["rank"] for i in infos) == [0, 1]
    l1 = srv.engine.status()["l1"]
    assert l1["objects"] == 3 * 2 + 3  # MHA: one object per rank and chunk; MLA: one per chunk


def test_engine_instances_share_chunks_across_layouts(shm_files, servers, no_internal_errors):
    srv = servers()
    barrier = mp.get_context("spawn").Barrier(2)
    infos = run_workers([
        (w.engine_instance, (srv.url, "engine-a", "mha", 8, 1, 2, barrier)),
        (w.engine_instance, (srv.url, "engine-b", "block_major", 16, 2, 1, barrier)),
    ])
    assert {i["layout"] for i in infos} == {"mha", "block_major"}
    status = srv.engine.status()
    assert status["l1"]["objects"] == 2 * (4 + 8)
    assert status["registrations"] == []  # both closed their clients


# ---- retrieve, leases and memory pressure -----------------------------------------------------------


def test_retrieve_loads_the_usable_prefix_and_leaves_later_blocks_alone(shm_files, servers, clients):
    srv = servers()
    c = clients(srv.url)
    kv, h = register_mha(c)
    hashes = chunk_hashes(w.prompt(5, 6), CHUNK)
    ref = w.reference(5, "mha", 6 * CHUNK)
    src = blocks_of(6)
    w.write_tokens(kv, "mha", src, ref)
    assert c.store(h, hashes[:3], src[:12]).result(10).stored == 3
    assert c.store(h, hashes[4:5], src[16:20]).result(10).stored == 1  # chunk 4 without chunk 3
    assert c.lookup(hashes, model="m") == 3

    dst = blocks_of(6, start=32)
    w.fill_blocks(kv, "mha", dst, 0xAB)
    assert c.retrieve(h, hashes, dst).result(10).loaded == 3
    assert np.array_equal(w.read_tokens(kv, "mha", dst[:12]), ref[:, :, :3 * CHUNK])
    assert w.blocks_equal(kv, "mha", dst[12:], 0xAB), "blocks after the usable prefix were written"
    assert np.array_equal(w.read_tokens(kv, "mha", src), ref), "the source blocks changed"

    assert c.retrieve(h, hashes[3:], dst[12:]).result(10).loaded == 0  # chunk 3 is missing
    assert w.blocks_equal(kv, "mha", dst[12:], 0xAB)
    other = chunk_hashes(w.prompt(6, 2), CHUNK)
    assert c.retrieve(h, other, dst[:8]).result(10).loaded == 0


def test_lookup_lock_protects_the_prefix_under_memory_pressure(shm_files, servers, clients):
    srv = servers(l1_size="64KiB", eviction_policy="lru")  # 4 slabs of 16 KiB: a handful of chunks
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=96)
    capacity = srv.engine.arena.capacity // srv.engine.arena.slot_bytes(srv.engine.arena.size_class(OBJECT_BYTES))
    assert h.object_bytes == OBJECT_BYTES and capacity == 16

    leased = chunk_hashes(w.prompt(1, 4), CHUNK)
    ref = w.reference(1, "mha", 4 * CHUNK)
    w.write_tokens(kv, "mha", blocks_of(4), ref)
    assert c.store(h, leased, blocks_of(4)).result(10).stored == 4
    found = c.lookup(leased, model="m", lock=True)
    assert found == 4 and found.lease

    # fill the rest of memory, then store more: only unleased chunks can make room
    filler = chunk_hashes(w.prompt(2, capacity), CHUNK)
    r = c.store(h, filler, blocks_of(capacity, start=16)).result(10)
    assert (r.stored, r.skipped) == (capacity - 4, 4)
    more = chunk_hashes(w.prompt(3, 8), CHUNK)
    assert c.store(h, more, blocks_of(8, start=16)).result(10).stored == 8
    assert c.lookup(leased, model="m") == 4, "a leased chunk was evicted"
    # the filler prompt, the oldest unleased, went from its end: its first chunks still hit
    assert c.lookup(filler, model="m") == capacity - 12
    assert c.lookup(filler[capacity - 12:capacity - 4], model="m") == 0
    assert c.lookup(more, model="m") == 8
    l1 = c.status()["l1"]
    assert l1["evicted"] == 8 and l1["leases"] == 1 and l1["leased_objects"] == 4

    # the retrieve consumes the lease; the bytes are intact
    dst = blocks_of(4, start=64)
    assert c.retrieve(h, leased, dst, lease=found).result(10).loaded == 4
    assert np.array_equal(w.read_tokens(kv, "mha", dst), ref)
    assert c.status()["l1"]["leases"] == 0
    # unprotected now: once the other chunks are used more recently, pressure evicts these first
    assert c.lookup(filler, model="m") == 4
    assert c.lookup(more, model="m") == 8
    assert c.store(h, chunk_hashes(w.prompt(4, 4), CHUNK), blocks_of(4, start=16)).result(10).stored == 4
    assert c.lookup(leased, model="m") == 0
    assert c.lookup(filler, model="m") == 4 and c.lookup(more, model="m") == 8


def test_release_ends_a_lease(shm_files, servers, clients):
    srv = servers()
    c = clients(srv.url)
    kv, h = register_mha(c)
    hashes = chunk_hashes(w.prompt(1, 3), CHUNK)
    c.store(h, hashes, blocks_of(3)).result(10)
    found = c.lookup(hashes, model="m", lock=True)
    assert found == 3 and c.status()["l1"]["leased_objects"] == 3
    assert c.release(hashes[:2], model="m") == 2  # this client's leases on those chunks
    assert c.release(hashes[:2], model="m") == 0
    assert c.status()["l1"]["leased_objects"] == 1
    assert c.release(lease=found) == 1  # the rest, by id
    assert c.status()["l1"]["leases"] == 0


def test_close_drops_the_clients_leases(shm_files, servers, clients):
    srv = servers()
    a = Client(srv.url)
    kv, h = register_mha(a)
    hashes = chunk_hashes(w.prompt(1, 4), CHUNK)
    assert a.store(h, hashes, blocks_of(4)).result(10).stored == 4
    assert a.lookup(hashes, model="m", lock=True) == 4
    b = clients(srv.url)
    l1 = b.status()["l1"]
    assert (l1["leases"], l1["leased_objects"], l1["evictable"]) == (1, 4, 0)
    a.close()
    status = b.status()
    assert (status["l1"]["leased_objects"], status["l1"]["evictable"], status["l1"]["objects"]) == (0, 4, 4)
    assert status["registrations"] == []  # unregistered by the goodbye
    with pytest.raises(ServerUnavailable, match="closed"):
        a.lookup(hashes, model="m")
    a.close()  # twice is fine


# ---- clients that die -----------------------------------------------------------------------------


def test_a_killed_client_loses_its_leases_after_the_heartbeat_timeout(servers, clients, no_internal_errors):
    """A client whose process the server cannot see (another pid namespace, off the lane)."""
    # only the heartbeat can free these leases; its timeout leaves the look right after the kill
    # seconds to spare on a loaded machine (1 s did not always)
    srv = servers(heartbeat_timeout=3.0, lease_ttl=600)
    watcher = clients(srv.url, heartbeat_interval=0.2)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=w.lease_holder, args=(q, srv.url, False), daemon=True)
    proc.start()
    try:
        status, info = q.get(timeout=60)
        assert status == "ok", info
        time.sleep(0.2)  # stores in flight
        before = watcher.status()
        assert before["l1"]["leased_objects"] == 4
        assert len(before["registrations"]) == 1
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        proc.join(10)
        assert watcher.status()["l1"]["leased_objects"] == 4, "leases must outlive a silent client for a while"
        # the lease TTL is 600 s: only the heartbeat timeout (3 s) frees them within the 20 s waited
        wait_until(lambda: watcher.status()["l1"]["leased_objects"] == 0, 20, "the dead client's leases to go")
        gone = time.monotonic() - killed
        wait_until(lambda: not watcher.status()["registrations"], 20, "the dead client's registration to go")
        assert 1.0 <= gone, gone  # not at once (its last request: about 0.25 s at most before the kill)
        # its chunks are ordinary cached chunks now: present and evictable
        after = watcher.status()["l1"]
        assert after["objects"] >= 4 and after["evictable"] == after["objects"] and after["writing"] == 0
        assert watcher.lookup(chunk_hashes(w.prompt(1, 4), CHUNK), model="doomed") == 4
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        remove_shared_files(proc.pid)  # a killed process cannot clean up
    # the server is fine
    kv, h = register_mha(watcher)
    assert watcher.store(h, chunk_hashes(w.prompt(9, 2), CHUNK), blocks_of(2)).result(10).stored == 2


@pytest.mark.parametrize("how", ["hello", "lane"])
def test_a_killed_client_whose_process_the_server_sees_is_forgotten_at_once(servers, clients, no_internal_errors,
                                                                            how):
    """Its registrations (the server's mappings of its memory: on the GPU, its KV cache's memory
    stays allocated while they are open) and leases go as soon as its process exits, not after
    the heartbeat timeout. The server sees the process when the client's HELLO names the server's
    own pid namespace, or, from another namespace, through the local lane's peer credentials."""
    srv = servers(heartbeat_timeout=60.0, lease_ttl=600)  # neither would free them within the test
    watcher = clients(srv.url, heartbeat_interval=0.2)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    if how == "lane":  # a HELLO that names no namespace: only the lane's credentials tell the pid
        target, args = w.lane_only_lease_holder, (q, srv.url)
    else:
        target, args = w.lease_holder, (q, srv.url)
    proc = ctx.Process(target=target, args=args, daemon=True)
    proc.start()
    try:
        status, info = q.get(timeout=60)
        assert status == "ok", info
        assert watcher.status()["l1"]["leased_objects"] == 4
        assert len(watcher.status()["registrations"]) == 1
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: not watcher.status()["registrations"] and not watcher.status()["l1"]["leased_objects"],
                   30, "the dead client's registration and leases to go")
        gone = time.monotonic() - killed
        assert gone < 5, gone  # about the time its process takes to exit (the heartbeat timeout is 60 s)
        proc.join(10)
        assert watcher.lookup(chunk_hashes(w.prompt(1, 4), CHUNK), model="doomed") == 4  # its chunks stay
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        remove_shared_files(proc.pid)


# ---- clients that misbehave -----------------------------------------------------------------------


class RawClient:
    """A DEALER socket that sends whatever frames it is given."""

    def __init__(self, url: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(url)
        self.rid = 100

    def send(self, frames) -> None:
        self.sock.send_multipart(frames)

    def request(self, body: bytes) -> tuple[int, object]:
        self.rid += 1
        self.send([p.pack_request_id(self.rid), body])
        return self.rid, self.reply()

    def reply(self, timeout: float = 5.0) -> object:
        assert self.sock.poll(timeout * 1000), "no reply"
        frames = self.sock.recv_multipart()
        assert len(frames) == 2 and len(frames[0]) == 8
        self.last_rid = p.unpack_request_id(frames[0])
        return p.decode_reply(frames[1])

    def expect_error(self, body: bytes, code: p.ErrorCode) -> str:
        rid, reply = self.request(body)
        assert self.last_rid == rid
        assert isinstance(reply, p.Error), reply
        assert reply.code == code, (p.ErrorCode(reply.code).name, reply.message)
        assert reply.message
        return reply.message

    def close(self):
        self.sock.close(0)
        self.ctx.term()


def _enc(obj) -> bytes:
    return msgspec.msgpack.encode(obj)


@pytest.fixture
def steady_worker():
    """A worker process storing and retrieving byte-exact while the test misbehaves."""
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    procs = []

    def start(url):
        proc = ctx.Process(target=w.steady_client, args=(q, url, stop, 3), daemon=True)
        proc.start()
        procs.append(proc)

    def finish() -> dict:
        stop.set()
        status, info = q.get(timeout=60)
        assert status == "ok", info
        return info

    yield start, finish
    stop.set()
    for proc in procs:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def test_garbage_frames_get_typed_errors_while_another_client_works(shm_files, servers, clients, steady_worker,
                                                                    no_internal_errors):
    srv = servers()
    start, finish = steady_worker
    start(srv.url)
    good = clients(srv.url)
    kv, h = register_mha(good, num_blocks=16)
    hashes = chunk_hashes(w.prompt(1, 2), CHUNK)
    w.write_tokens(kv, "mha", range(8), w.reference(1, "mha", 2 * CHUNK))
    raw = RawClient(srv.url)
    E = p.ErrorCode
    try:
        # frames the transport cannot take apart
        raw.send([b"\x01"])
        assert isinstance(raw.reply(), p.Error) and raw.last_rid == 0
        raw.send([p.pack_request_id(7), p.encode(p.Ping()), b"extra"])
        r = raw.reply()
        assert isinstance(r, p.Error) and r.code == E.BAD_REQUEST and raw.last_rid == 7
        raw.send([b"short", p.encode(p.Ping())])
        r = raw.reply()
        assert r.code == E.BAD_REQUEST and raw.last_rid == 0
        # bodies the decoder rejects
        raw.expect_error(b"", E.BAD_REQUEST)
        raw.expect_error(b"\xc1\xc1\xc1", E.BAD_REQUEST)
        raw.expect_error(b"\x93\x06\xc1" + b"\xff" * 61, E.BAD_REQUEST)  # an array holding an invalid byte
        raw.expect_error(p.encode(p.Lookup(client_id=b"x", model="m", world_size=1, hashes=b"h" * 32))[:-7],
                         E.BAD_REQUEST)
        raw.expect_error(_enc([99, b"x"]), E.UNKNOWN_OP)
        raw.expect_error(_enc([int(p.Op.LOOKUP), b"x", 5, "one", b""]), E.BAD_REQUEST)
        raw.expect_error(_enc([int(p.Op.STORE), "kv", b"", b""]), E.BAD_REQUEST)
        raw.expect_error(_enc({"op": "store"}), E.BAD_REQUEST)
        raw.expect_error(p.encode(p.Hello(version=999, client_id=b"x")), E.PROTOCOL_MISMATCH)
        # decodable requests with bad values
        good_ids = p.pack_block_ids(range(8))
        kv_id = h.kv_id
        store = lambda **kw: p.encode(p.Store(**{"kv_id": kv_id, "hashes": b"".join(hashes), "block_ids": good_ids,
                                                 "client_id": good.client_id, **kw}))  # noqa: E731
        retrieve = lambda **kw: p.encode(p.Retrieve(**{"kv_id": kv_id, "hashes": b"".join(hashes),  # noqa: E731
                                                       "block_ids": good_ids, "client_id": good.client_id, **kw}))
        raw.expect_error(store(kv_id=12345), E.UNKNOWN_REGISTRATION)
        # another client's registration, its kv_id known: refused as unknown, for every use
        regs = srv.engine.status()["registrations"]
        msg = raw.expect_error(store(client_id=b"x" * 16), E.UNKNOWN_REGISTRATION)
        assert "of this client" in msg
        raw.expect_error(retrieve(client_id=b"x" * 16), E.UNKNOWN_REGISTRATION)
        raw.expect_error(p.encode(p.UnregisterKVCache(kv_id=kv_id, client_id=b"x" * 16)), E.UNKNOWN_REGISTRATION)
        assert srv.engine.status()["registrations"] == regs and "kv_id" not in regs[0]  # the id is the owner's secret
        msg = raw.expect_error(store(block_ids=p.pack_block_ids([0, 1, 2, 3, 4, 5, 6, 16])), E.INVALID_ARGUMENT)
        assert "out of range" in msg
        raw.expect_error(store(block_ids=np.array([0, 1, 2, -1, 4, 5, 6, 7], "<i4").tobytes()), E.INVALID_ARGUMENT)
        raw.expect_error(store(block_ids=good_ids[:-1]), E.INVALID_ARGUMENT)
        raw.expect_error(store(block_ids=good_ids[:-4]), E.INVALID_ARGUMENT)
        raw.expect_error(store(hashes=b"h" * 31), E.INVALID_ARGUMENT)
        raw.expect_error(store(salt=b"s" * 257), E.INVALID_ARGUMENT)
        assert "parent" in raw.expect_error(store(parent=b"p" * 15), E.INVALID_ARGUMENT)
        raw.expect_error(store(hashes=b"h" * 16 * 70_000, block_ids=b""), E.LIMIT_EXCEEDED)
        raw.expect_error(retrieve(block_ids=p.pack_block_ids([8, 9, 10, 11, 12, 13, 14, 2**20])),
                         E.INVALID_ARGUMENT)
        raw.expect_error(retrieve(block_ids=p.pack_block_ids([8, 9, 10, 11, 8, 9, 10, 11])), E.INVALID_ARGUMENT)
        raw.expect_error(p.encode(p.UnregisterKVCache(kv_id=1)), E.UNKNOWN_REGISTRATION)
        cid = b"c" * 16
        for ws, code in ((0, E.INVALID_ARGUMENT), (-1, E.INVALID_ARGUMENT), (5000, E.LIMIT_EXCEEDED)):
            raw.expect_error(p.encode(p.Lookup(client_id=cid, model="m", world_size=ws, hashes=b"")), code)
        for bad_id in (b"", b"x", b"c" * 17):  # client ids are 16 bytes: state must belong to someone
            raw.expect_error(p.encode(p.Lookup(client_id=bad_id, model="m", world_size=1, hashes=b"")),
                             E.INVALID_ARGUMENT)
            raw.expect_error(p.encode(p.Hello(version=p.PROTOCOL_VERSION, client_id=bad_id)), E.INVALID_ARGUMENT)
        raw.expect_error(p.encode(p.Release(client_id=cid, lease=1, hashes=b"abc")), E.INVALID_ARGUMENT)
        layer = h.described.layers[0]
        register = lambda **kw: p.encode(p.RegisterKVCache(**{  # noqa: E731
            "client_id": b"raw-client-id-16", "model": "m", "world_size": 1, "rank": 0, "device": "cpu",
            "device_uuid": b"",
            "layout": "auto", "layers": [layer], **kw}))
        mem = layer.memory
        bad_layers = {
            "escaping name": msgspec.structs.replace(mem, name="../../etc/passwd"),
            "missing file": msgspec.structs.replace(mem, name="lmcache_mp_0_missing"),
            "offset past the end": msgspec.structs.replace(mem, offset=mem.size),
            "negative offset": msgspec.structs.replace(mem, offset=-4096),
            "cuda handle on a cpu server": msgspec.structs.replace(mem, kind="cuda_ipc", handle=b"\0" * 64),
        }
        for bad in bad_layers.values():
            raw.expect_error(register(layers=[msgspec.structs.replace(layer, memory=bad)]), E.INVALID_ARGUMENT)
        too_big = msgspec.structs.replace(layer, shape=[2, 1 << 30, 8, 2, 8],
                                          strides=[(1 << 30) * 128, 128, 16, 8, 1])
        raw.expect_error(register(layers=[too_big]), E.INVALID_ARGUMENT)
        # 2**63 blocks that alias one block (zero strides) pass the extent check but do not fit the
        # data plane's int64: this once escaped the registration worker and left the request unanswered
        aliased = msgspec.structs.replace(layer, shape=[2, 2**63, 8, 2, 8], strides=[0, 0, 16, 8, 1])
        raw.expect_error(register(layers=[aliased]), E.INVALID_ARGUMENT)
        raw.expect_error(register(layers=[msgspec.structs.replace(layer, shape=[2, -3, 8, 2, 8])]),
                         E.INVALID_ARGUMENT)
        raw.expect_error(register(layers=[]), E.INVALID_ARGUMENT)
        raw.expect_error(register(layout="sideways"), E.INVALID_ARGUMENT)
        raw.expect_error(register(rank=2, world_size=2), E.INVALID_ARGUMENT)
        raw.expect_error(register(model=""), E.INVALID_ARGUMENT)
        raw.expect_error(register(client_id=b""), E.INVALID_ARGUMENT)
        raw.expect_error(register(layers=[layer] * (p.MAX_LAYERS + 1)), E.LIMIT_EXCEEDED)
        raw.expect_error(register(device="cuda"), E.UNSUPPORTED)

        # nothing was copied by any rejected request, and the good client still works
        assert good.lookup(hashes, model="m") == 0
        assert w.blocks_equal(kv, "mha", range(8, 16), 0)
        assert good.store(h, hashes, list(range(8))).result(10).stored == 2
        assert good.retrieve(h, hashes, list(range(8, 16))).result(10).loaded == 2
        with pytest.raises(RequestError) as info:  # the client library forwards the same typed error
            good.retrieve(h, hashes, [0, 1, 2, 3, 4, 5, 6, 99]).result(10)
        assert info.value.code == E.INVALID_ARGUMENT

        # a frame over the size limit: the server drops that connection and serves on
        raw.send([p.pack_request_id(1), b"\0" * (p.MAX_MESSAGE_BYTES + 1)])
        assert not raw.sock.poll(300)
        assert good.ping() < 1.0
    finally:
        raw.close()
    assert finish()["rounds"] >= 3
    assert srv.engine.status()["l1"]["leases"] == 0


_fields = st.one_of(st.integers(-2**63, 2**64 - 1), st.binary(max_size=40), st.text(max_size=10), st.booleans(),
                    st.none(), st.floats(allow_nan=False), st.lists(st.integers(0, 5), max_size=3),
                    st.dictionaries(st.text(max_size=3), st.integers(-5, 5), max_size=2))
# every op except CLEAR (a valid one would wipe the cache the other tests here rely on)
_ops = st.sampled_from([int(op) for op in p.Op if op != p.Op.CLEAR] + [0, 12, 255, -1])
_raw_bodies = st.one_of(
    st.binary(max_size=64),
    st.builds(lambda op, rest: _enc([op] + rest), _ops, st.lists(_fields, max_size=10)),
)
_int = st.one_of(st.integers(-3, 70), st.sampled_from([2**31, 2**32 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1,
                                                         -2**31, -2**63]))


def _typed_requests(target):
    """Well-typed requests with hostile values, aimed at the engine's validation (the raw bodies
    above rarely get past the decoder). `target` names a real registration and shm file."""
    kv_ids = st.one_of(st.just(target["kv_id"]), st.integers(0, 2**64 - 1))
    digests = st.one_of(st.binary(max_size=70), st.integers(0, 6).map(lambda n: b"d" * 16 * n))
    ids = st.one_of(st.binary(max_size=40),
                    st.lists(st.integers(-5, 70), max_size=12).map(lambda v: np.array(v, "<i4").tobytes()))
    names = st.sampled_from([target["shm_name"], "lmcache_mp_missing", "../../etc/passwd", "", "lmcache_mp_/x"])
    memory = st.builds(p.MemoryRef, kind=st.sampled_from(["shm", "cuda_ipc", "nvme"]), name=names,
                       handle=st.binary(max_size=70), offset=_int, size=_int)
    dims = st.lists(_int, max_size=6)
    layer = st.builds(p.LayerRef, shape=dims, strides=dims, dtype=st.sampled_from(["float16", "uint8", "?"]),
                      element_size=_int, memory=memory)
    def hostile(values):  # keep each value or swap it for a hostile one
        return st.tuples(*[st.one_of(st.just(v), st.just(v), _int) for v in values]).map(list)

    plausible = st.sampled_from([  # layouts that register, as (shape, strides) over the real file
        ([16, 8, 16], [128, 16, 1]), ([2, 16, 8, 2, 8], [2048, 128, 16, 8, 1]),
        ([16, 2, 8, 2, 8], [256, 128, 16, 8, 1]), ([16, 2, 8, 16], [256, 128, 16, 1]),
        ([2, 16, 8, 2, 8], [0, 0, 16, 8, 1]), ([16, 8, 16], [0, 0, 1])])
    deep_layer = plausible.flatmap(lambda ss: st.builds(
        lambda shape, strides, off, esize: p.LayerRef(
            shape=shape, strides=strides, dtype="float16", element_size=esize,
            memory=p.MemoryRef(kind="shm", name=target["shm_name"], offset=off, size=target["shm_size"])),
        hostile(ss[0]), hostile(ss[1]), st.one_of(st.just(0), _int), st.one_of(st.just(2), _int)))
    deep_register = st.builds(  # everything valid but the layer geometry: reaches the layout code
        p.RegisterKVCache, client_id=st.just(b"fuzz" * 4), model=st.just("fuzz"), world_size=st.just(1),
        rank=st.just(0), device=st.just("cpu"), device_uuid=st.just(b""),
        layout=st.sampled_from(["auto", "mha", "mla", "block_major", "opaque"]),
        layers=st.lists(deep_layer, min_size=1, max_size=2), block_size=st.one_of(st.just(0), _int))
    common = dict(salt=st.binary(max_size=300))
    return st.one_of(
        deep_register,
        st.builds(p.Hello, version=_int, client_id=st.binary(max_size=20)),
        st.builds(p.RegisterKVCache, client_id=st.binary(max_size=20), model=st.text(max_size=5), world_size=_int,
                  rank=_int, device=st.sampled_from(["cpu", "cuda", ""]), device_uuid=st.binary(max_size=20),
                  layout=st.sampled_from(["auto", "mha", "mla", "block_major", "opaque", "x"]),
                  layers=st.lists(layer, max_size=3), block_size=_int),
        st.builds(p.UnregisterKVCache, kv_id=st.integers(0, 2**64 - 1)),
        st.builds(p.Store, kv_id=kv_ids, hashes=digests, block_ids=ids, event=st.binary(max_size=70), **common),
        st.builds(p.Retrieve, kv_id=kv_ids, hashes=digests, block_ids=ids, reply_on_submit=st.booleans(),
                  lease=st.integers(0, 2**64 - 1), deadline=st.floats(allow_nan=False), **common),
        st.builds(p.Lookup, client_id=st.binary(max_size=20), model=st.text(max_size=5), world_size=_int,
                  hashes=digests, lock=st.booleans(), **common),
        st.builds(p.Release, client_id=st.binary(max_size=20), lease=st.integers(0, 2**64 - 1), hashes=digests),
        st.builds(p.Ping, client_id=st.binary(max_size=20)),
        st.builds(p.Status),
        st.builds(p.Bye, client_id=st.binary(max_size=20)),
        st.builds(p.Hint, client_id=st.one_of(st.just(b"fuzz" * 4), st.binary(max_size=20)), model=st.text(max_size=5),
                  world_size=_int, hashes=digests, action=st.sampled_from(
                      ["pin", "unpin", "retain", "prefetch", "demote", "drop", "share", ""]),
                  ttl=st.floats(), priority=_int, **common),
    ).map(p.encode)


@pytest.fixture(scope="module")
def fuzz_target():
    srv = new_server()
    owner = Client(srv.url)
    kv, h = register_mha(owner, num_blocks=16)
    region = h.described.layers[0].memory
    target = {"kv_id": h.kv_id, "shm_name": region.name, "shm_size": region.size}
    raw = RawClient(srv.url)
    yield srv, raw, target
    raw.close()
    owner.close()
    srv.stop()


def _exactly_one_reply_each(raw: RawClient, bodies) -> None:
    sent = []
    for body in bodies:
        raw.rid += 1
        raw.send([p.pack_request_id(raw.rid), body])
        sent.append(raw.rid)
    got = {}
    for _ in sent:
        reply = raw.reply()
        got[raw.last_rid] = reply
    assert sorted(got) == sent, "every request gets exactly one reply"
    assert not raw.sock.poll(0), "an extra reply"
    for reply in got.values():
        if isinstance(reply, p.Error):
            assert reply.code != p.ErrorCode.INTERNAL, reply.message
            assert reply.code in set(p.ErrorCode)


@settings(max_examples=200, deadline=None)
@given(bodies=st.lists(_raw_bodies, min_size=1, max_size=8))
def test_random_frames_get_exactly_one_reply_each(fuzz_target, bodies):
    _exactly_one_reply_each(fuzz_target[1], bodies)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_hostile_values_get_exactly_one_typed_reply_each(fuzz_target, data):
    srv, raw, target = fuzz_target
    _exactly_one_reply_each(raw, data.draw(st.lists(_typed_requests(target), min_size=1, max_size=6)))
    assert srv.engine.status()["l1"]["writing"] == 0  # no store left half-done


# ---- restarts and timeouts ------------------------------------------------------------------------


def test_client_survives_a_server_restart_and_registers_again(shm_files, ipc_url, clients, no_internal_errors):
    sock = Path(ipc_url[len("ipc://"):])
    first = new_server(url=ipc_url)
    try:
        c = clients(ipc_url, timeout=5)
        kv, h = register_mha(c)
        hashes = chunk_hashes(w.prompt(1, 4), CHUNK)
        ref = w.reference(1, "mha", 4 * CHUNK)
        w.write_tokens(kv, "mha", blocks_of(4), ref)
        assert c.store(h, hashes, blocks_of(4)).result(10).stored == 4
        session, kv_id = c.session_id, h.kv_id
    finally:
        first.stop()
    assert not sock.exists()
    with pytest.raises(ServerUnavailable):
        c.lookup(hashes, model="m", timeout=0.3)

    second = new_server(url=ipc_url)
    try:
        wait_until(lambda: c.session_id != session and h.kv_id != kv_id and not c.server_away, 10,
                   "the client to register again")
        regs = second.engine.status()["registrations"]
        assert [r["id"] for r in regs] == [f"{h.kv_id & 0xFFFF:04x}"] and regs[0]["model"] == "m"
        assert c.lookup(hashes, model="m") == 0  # a new server starts empty
        assert c.store(h, hashes, blocks_of(4)).result(10).stored == 4
        dst = blocks_of(4, start=32)
        assert c.retrieve(h, hashes, dst).result(10).loaded == 4
        assert np.array_equal(w.read_tokens(kv, "mha", dst), ref)
        c.close()
    finally:
        second.stop()


def test_requests_fail_fast_when_the_server_is_gone(shm_files, servers, clients):
    srv = servers()
    c = clients(srv.url, timeout=0.5)
    kv, h = register_mha(c)
    hashes = chunk_hashes(w.prompt(1, 2), CHUNK)
    url = srv.url
    srv.stop()
    for call in (lambda: c.lookup(hashes, model="m"), lambda: c.ping(), lambda: c.status(),
                 lambda: c.store(h, hashes, blocks_of(2)).result(5),
                 lambda: c.retrieve(h, hashes, blocks_of(2)).result(5)):
        t0 = time.monotonic()
        with pytest.raises(ServerUnavailable):
            call()
        assert time.monotonic() - t0 < 4  # the client's timeout (0.5 s), not the result's 5 s
    t0 = time.monotonic()
    with pytest.raises(ServerUnavailable):
        Client(url, connect_timeout=0.3)
    assert time.monotonic() - t0 < 4


def test_requests_time_out_when_the_server_hangs(shm_files, ipc_url):
    """A server that is there but does not answer (stopped): each request fails after its own
    timeout; once it answers again, late replies to the old requests are skipped."""
    from test_cli import server_command

    proc = subprocess.Popen(server_command() + ["--url", ipc_url, "--device", "cpu", "--l1-size", "16MiB",
                                                "--chunk-size", str(CHUNK)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    c = None
    try:
        c = wait_until(lambda: _try_connect(ipc_url), 30, "the server to start")
        kv, h = register_mha(c)
        hashes = chunk_hashes(w.prompt(1, 2), CHUNK)
        assert c.store(h, hashes, blocks_of(2)).result(10).stored == 2
        os.kill(proc.pid, signal.SIGSTOP)
        wait_until(lambda: stopped(proc.pid), 5, "the server to stop")  # SIGSTOP lands asynchronously
        t0 = time.monotonic()
        with pytest.raises(ServerUnavailable):
            c.lookup(hashes, model="m", timeout=0.4)
        with pytest.raises(ServerUnavailable):
            c.retrieve(h, hashes, blocks_of(2, start=16), timeout=0.4).result(5)
        elapsed = time.monotonic() - t0
        assert 0.7 <= elapsed < 4.5, elapsed  # two timeouts of 0.4 s; a request that waited for its result: 5 s
        os.kill(proc.pid, signal.SIGCONT)
        assert c.lookup(hashes, model="m", timeout=5) == 2  # not confused by the late lookup reply
        assert c.retrieve(h, hashes, blocks_of(2, start=16)).result(10).loaded == 2
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        if c is not None:
            c.close()
        proc.terminate()
        assert proc.wait(20) == 0


def stopped(pid: int) -> bool:
    """Every thread of pid is stopped (state T)."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
    return all(s == "T" for s in states)


def _try_connect(url):
    try:
        return Client(url, connect_timeout=0.5, timeout=5)
    except ServerUnavailable:
        return None


def test_a_client_dropped_without_close_is_collected_and_forgotten():
    """The I/O thread holds no strong reference to its client: dropping the last reference
    stops the heartbeats, so the server forgets the client's leases."""
    import gc
    import weakref

    from lmcache_mp import Client, Server, ServerConfig

    server = Server(ServerConfig(url="tcp://127.0.0.1:0", l1_size="64MiB", device="cpu",
                                 heartbeat_timeout=1.0)).start()
    try:
        client = Client(server.url)
        ref = weakref.ref(client)
        del client
        gc.collect()
        assert ref() is None
    finally:
        server.stop()


def test_a_forgotten_client_registers_its_caches_again(shm_files):
    """When the server dropped a silent client's registrations (same session, no restart), the
    next store finds UNKNOWN_REGISTRATION and the client registers again by itself."""
    import time

    import numpy as np
    import torch

    from lmcache_mp import Client, RequestError, Server, ServerConfig, chunk_hashes, shared_cpu_tensor

    server = Server(ServerConfig(url="tcp://127.0.0.1:0", l1_size="64MiB", device="cpu", chunk_size=16)).start()
    try:
        client = Client(server.url)
        kv = [shared_cpu_tensor((2, 8, 16, 1, 8), torch.float16)]
        handle = client.register_kv_cache(kv, model="m")
        old = handle.kv_id
        server.engine._forget_client(client.client_id)  # what a heartbeat timeout does
        hashes = chunk_hashes(np.arange(16), 16)
        with pytest.raises(RequestError):
            client.store(handle, hashes, [0]).result()
        deadline = time.time() + 10
        while handle.kv_id == old and time.time() < deadline:
            time.sleep(0.05)
        assert handle.kv_id != old
        assert client.store(handle, hashes, [0]).result().stored == 1
        client.close()
        del kv
    finally:
        server.stop()
