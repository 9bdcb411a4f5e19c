"""Fuzzing: the protocol decoder on random and mutated bodies, and a live server under a stream of
random and mutated frames of every op while a real client's round trips stay byte-exact.

CI-sized; the counts are printed (pytest -s)."""

from __future__ import annotations

import os
import random
import time

import numpy as np
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

import cpu_workers as w
from lmcache_mp import Client, chunk_hashes
from lmcache_mp import protocol as p
from test_cli import ServerProcess
from test_server_e2e import blocks_of, register_mha

CID = b"fuzzer-client-id"  # 16 bytes
BATCHES = 200  # of 50 frames each, a real round trip after each batch


def valid_requests(kv_id: int = 7, shm_name: str = "lmcache_mp_1_ab", shm_size: int = 1 << 20,
                   owner: bytes = b"o" * 16) -> list[bytes]:
    """One well-formed body of every op (values that get deep into the server's checks)."""
    layer = p.LayerRef(shape=[2, 64, 8, 2, 8], strides=[8192, 128, 16, 8, 1], dtype="float16", element_size=2,
                       memory=p.MemoryRef(kind="shm", name=shm_name, offset=0, size=shm_size))
    h = bytes(range(32))
    ids = p.pack_block_ids(range(8))
    msgs = [
        p.Hello(version=p.PROTOCOL_VERSION, client_id=CID, client_name="fuzz", pid=1, capabilities=["x"]),
        p.RegisterKVCache(client_id=CID, model="fz", world_size=1, rank=0, device="cpu", device_uuid=b"",
                          layout="auto", layers=[layer, layer]),
        p.UnregisterKVCache(kv_id=kv_id + 1, client_id=owner),
        p.Store(kv_id=kv_id, hashes=h, block_ids=ids, salt=b"s", client_id=owner),
        p.Retrieve(kv_id=kv_id, hashes=h, block_ids=p.pack_block_ids(range(8, 16)), lease=3, deadline=1e12,
                   client_id=owner),
        p.Lookup(client_id=CID, model="fz", world_size=1, hashes=h, lock=True),
        p.Release(client_id=CID, lease=3, hashes=h[:16]),
        p.Clear(),
        p.Ping(client_id=CID),
        p.Status(),
        p.Bye(client_id=os.urandom(16)),
        p.MapArena(client_id=CID),
        p.Reserve(kv_id=kv_id, hashes=h, client_id=owner, salt=b"s", deadline=1e12),
        p.Commit(client_id=owner, reservation=5),
        p.Read(kv_id=kv_id, hashes=h, client_id=owner, lease=3),
        p.ReadDone(client_id=owner, read=5),
        p.Events(client_id=CID, since=0, models=["fz"], max_events=16),
        p.LaneClaim(ticket=os.urandom(32)),
        p.Hint(client_id=CID, model="fz", world_size=1, hashes=h, action="pin", ttl=0.5),
    ]
    assert {p.peek_op(p.encode(m)) for m in msgs} == {int(op) for op in p.Op}
    return [p.encode(m) for m in msgs]


def mutate(body: bytes, rng: random.Random, pool: list[bytes]) -> bytes:
    """One of: flip bytes, overwrite with interesting values, cut, grow, splice with another body."""
    b = bytearray(body)
    kind = rng.randrange(6)
    if kind == 0 and b:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif kind == 1 and b:
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(len(b))] = rng.choice([0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xCC, 0xCF, 0xD3, 0xDC, 0xDD, 0xFF])
    elif kind == 2:
        b = b[: rng.randrange(len(b) + 1)]
    elif kind == 3:
        at = rng.randrange(len(b) + 1)
        b[at:at] = os.urandom(rng.randint(1, 40)) if rng.random() < 0.5 else rng.choice(pool)[:40]
    elif kind == 4:
        other = rng.choice(pool)
        b = b[: rng.randrange(len(b) + 1)] + other[rng.randrange(len(other) + 1):]
    else:
        b = bytearray(os.urandom(rng.randint(0, 64)))
    return bytes(b)


# ---- the decoder --------------------------------------------------------------------------------

_VALID = valid_requests()


@settings(max_examples=3000, deadline=None)
@given(data=st.one_of(st.binary(max_size=300),
                      st.tuples(st.sampled_from(_VALID), st.randoms(use_true_random=False)).map(
                          lambda t: mutate(t[0], t[1], _VALID))))
def test_the_decoder_raises_only_frame_errors(data):
    try:
        msg = p.decode_request(data)
    except p.FrameError as e:
        assert e.code in (p.ErrorCode.BAD_REQUEST, p.ErrorCode.UNKNOWN_OP, p.ErrorCode.LIMIT_EXCEEDED)
        return
    assert p.decode_request(p.encode(msg)) == msg  # whatever decodes re-encodes to itself


def test_each_op_has_its_frame_limit():
    for body in _VALID:
        op = p.peek_op(body)
        limit = p.MAX_FRAME_BYTES.get(op, 1024)
        padded = body + b"\0" * (limit - len(body) + 1)
        try:
            p.decode_request(padded)
            raise AssertionError("an oversized frame decoded")
        except p.FrameError as e:
            assert e.code == p.ErrorCode.LIMIT_EXCEEDED, (p.Op(op).name, e)


# ---- a live server ------------------------------------------------------------------------------


def _rss_anon_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


def test_a_live_server_answers_every_fuzzed_frame_and_keeps_serving(shm_files):
    srv = ServerProcess(["--url", "tcp://127.0.0.1:0", "--device", "cpu", "--l1-size", "16MiB", "--chunk-size", "32",
                         "--heartbeat-timeout", "2"])
    url = srv.wait_ready()
    real = Client(url, timeout=20, heartbeat_interval=0.25)
    target = Client(url, timeout=20, heartbeat_interval=0.25)  # owns the cache the fuzzed frames name
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    rng = random.Random(1234)
    counts = {"frames": 0, "replies": 0, "errors": 0, "round_trips": 0, "bytes_checked": 0}
    try:
        kv, h = register_mha(real, model="real", num_blocks=64)
        tkv, th = register_mha(target, model="fz", num_blocks=64)
        mem = th.described.layers[0].memory
        pool = valid_requests(th.kv_id, mem.name, mem.size, target.client_id)

        def round_trip(i: int) -> None:
            hashes = chunk_hashes(w.prompt(50_000 + i, 2), 32)
            ref = w.reference(50_000 + i, "mha", 64)
            w.write_tokens(kv, "mha", blocks_of(2), ref)
            assert real.store(h, hashes, blocks_of(2)).result(20).chunks == 2
            found = real.lookup(hashes, model="real", lock=True)
            loaded = real.retrieve(h, hashes, blocks_of(2, start=8), lease=found).result(20).loaded
            assert loaded == found  # a CLEAR may have come in between store and lookup
            got = w.read_tokens(kv, "mha", blocks_of(loaded, start=8))
            assert np.array_equal(got, ref[:, :, : loaded * 32]), "a real client's bytes differ"
            counts["round_trips"] += 1
            counts["bytes_checked"] += got.nbytes

        rss0 = None
        t0 = time.monotonic()
        for batch in range(BATCHES):
            rids = set()
            for _ in range(50):
                body = rng.choice(pool) if rng.random() < 0.1 else mutate(rng.choice(pool), rng, pool)
                counts["frames"] += 1
                rid = counts["frames"]
                rids.add(rid)
                sock.send_multipart([p.pack_request_id(rid), body])
            while rids:
                assert sock.poll(30_000), f"{len(rids)} fuzzed frames got no reply"
                rid, reply = sock.recv_multipart()
                rid = p.unpack_request_id(rid)
                assert rid in rids, "a reply to a request never sent, or a second reply"
                rids.discard(rid)
                reply = p.decode_reply(reply)
                counts["replies"] += 1
                if isinstance(reply, p.Error):
                    counts["errors"] += 1
                    assert reply.code != p.ErrorCode.INTERNAL, reply.message
            round_trip(batch)
            if batch == 9:
                rss0 = _rss_anon_kib(srv.proc.pid)  # after warm-up: L1 index and caches in use
        assert not sock.poll(200), "an extra reply"
        growth = _rss_anon_kib(srv.proc.pid) - rss0
        counts.update(seconds=round(time.monotonic() - t0, 1), heap_growth_kib=growth)
        print(counts)
        assert counts["replies"] == counts["frames"] and counts["round_trips"] == BATCHES
        assert growth < 16 << 10, f"the server's heap grew by {growth} KiB under fuzzing"
        assert real.ping() < 1.0
        log = "\n".join(srv.lines)
        assert "Traceback" not in log and "internal error" not in log, log[-3000:]
    finally:
        sock.close(0)
        ctx.term()
        real.close()
        target.close()
        srv.kill()


def test_the_local_lane_answers_every_fuzzed_datagram_and_keeps_serving(shm_files):
    """The same on the local lane: datagrams with a request header get one reply each (too short
    for a header: ignored), oversized ones are cut and rejected, an empty one ends that connection
    only, and a real client stays exact."""
    import socket

    srv = ServerProcess(["--url", "tcp://127.0.0.1:0", "--device", "cpu", "--l1-size", "16MiB", "--chunk-size", "32"])
    url = srv.wait_ready()
    real = Client(url, timeout=20)
    assert real._io.has_lane
    lane = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    lane.connect("\0" + real.server_info["lane"][1:])
    lane.settimeout(30)
    rng = random.Random(4321)
    sent = replies = 0
    try:
        kv, h = register_mha(real, model="real", num_blocks=64)
        pool = valid_requests(h.kv_id + 1)
        for batch in range(40):
            rids = set()
            for _ in range(50):
                body = rng.choice(pool) if rng.random() < 0.1 else mutate(rng.choice(pool), rng, pool)
                kind = rng.random()
                if kind < 0.05:
                    lane.send(os.urandom(rng.randrange(1, 9)))  # no header: nothing to answer
                    continue
                sent += 1
                rids.add(sent)
                if kind < 0.08:
                    body += b"\0" * p.LANE_MAX_BYTES  # cut by the server, then undecodable
                lane.send(p.pack_lane(sent, body, traced=rng.random() < 0.1))
            while rids:
                rid, body, _trace = p.unpack_lane_reply(lane.recv(p.LANE_MAX_BYTES))
                assert rid in rids, "a reply to a request never sent, or a second reply"
                rids.discard(rid)
                reply = p.decode_reply(body)
                replies += 1
                if isinstance(reply, p.Error):
                    assert reply.code != p.ErrorCode.INTERNAL, reply.message
            hashes = chunk_hashes(w.prompt(60_000 + batch, 2), 32)
            ref = w.reference(60_000 + batch, "mha", 64)
            w.write_tokens(kv, "mha", blocks_of(2), ref)
            assert real.store(h, hashes, blocks_of(2)).result(20).chunks == 2
            assert real.retrieve(h, hashes, blocks_of(2, start=8)).result(20).loaded == 2
            assert np.array_equal(w.read_tokens(kv, "mha", blocks_of(2, start=8)), ref)
        assert replies == sent
        lane.send(b"")  # reads as the end of the connection: the server closes it, and only it
        assert lane.recv(16) == b""
        assert real.lookup(hashes, model="real") == 2 and real._io.has_lane
        log = "\n".join(srv.lines)
        assert "Traceback" not in log and "internal error" not in log, log[-3000:]
    finally:
        lane.close()
        real.close()
        srv.kill()
