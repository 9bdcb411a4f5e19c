"""The wire format: every request and reply survives encode/decode, malformed bodies map to typed
error codes, and packed block ids / hashes are validated on both ends."""

import msgspec
import numpy as np
import pytest

from lmcache_mp import protocol as p
from lmcache_mp.keys import DIGEST_BYTES, pack_hashes, unpack_hashes

H = bytes(range(16)) + bytes(range(16, 32))  # two packed digests
IDS = p.pack_block_ids([3, 1, 4, 1, 5])

LAYER = p.LayerRef(shape=[2, 8, 4, 2, 16], strides=[1024, 128, 32, 16, 1], dtype="bfloat16", element_size=2,
                   memory=p.MemoryRef(kind="shm", name="lmcache_mp_1_ab", offset=64, size=1 << 20))
CUDA_LAYER = p.LayerRef(shape=[8, 4, 64], strides=[256, 64, 1], dtype="float16", element_size=2,
                        memory=p.MemoryRef(kind="cuda_ipc", handle=b"\x01" * 64, offset=512, size=4096))

# Every field set to a value other than its default, so a field dropped or swapped in the
# encoding cannot round-trip by accident.
REQUESTS = [
    p.Hello(version=p.PROTOCOL_VERSION, client_id=b"c" * 16, client_name="w0", pid=1234,
            capabilities=["reply_on_submit"]),
    p.RegisterKVCache(client_id=b"c" * 16, model="llama", world_size=4, rank=3, device="cpu", device_uuid=b"u" * 16,
                      layout="mha", layers=[LAYER, LAYER], block_size=16),
    p.RegisterKVCache(client_id=b"d" * 16, model="ds", world_size=2, rank=1, device="cuda", device_uuid=b"v" * 16,
                      layout="mla", layers=[CUDA_LAYER], transfer="engine"),
    p.UnregisterKVCache(kv_id=(1 << 63) - 1),
    p.Store(kv_id=7, hashes=H, block_ids=IDS, salt=b"tenant", event=b"e" * 64, deadline=5.5, parent=b"p" * 16),
    p.Retrieve(kv_id=8, hashes=H, block_ids=IDS, salt=b"s", event=b"f" * 64, reply_on_submit=True, lease=77,
               deadline=12345.5, scratch_blocks=IDS[:4]),
    p.Lookup(client_id=b"c" * 16, model="m", world_size=2, hashes=H, lock=True, salt=b"x"),
    p.Release(client_id=b"c" * 16, lease=(1 << 63) - 1, hashes=H),
    p.Clear(),
    p.Ping(client_id=b"c" * 16),
    p.Status(),
    p.Bye(client_id=b"c" * 16),
    p.MapArena(client_id=b"c" * 16),
    p.Reserve(kv_id=9, hashes=H, client_id=b"c" * 16, salt=b"t", deadline=99.5, parent=b"q" * 16),
    p.Commit(client_id=b"c" * 16, reservation=(1 << 62) + 1, ok=False),
    p.Read(kv_id=10, hashes=H, client_id=b"c" * 16, salt=b"u", lease=78),
    p.ReadDone(client_id=b"c" * 16, read=(1 << 62) + 2),
    p.Events(client_id=b"c" * 16, since=12, models=["m#group0:full", "m#group1:sliding_window=4096"], max_events=64),
    p.LaneClaim(ticket=b"t" * 32),
    p.Hint(client_id=b"c" * 16, model="m", world_size=2, hashes=b"h" * 32, action="pin", salt=b"s", ttl=12.5,
           priority=3),
]

REPLIES = [
    p.Error(code=int(p.ErrorCode.INVALID_ARGUMENT), message="block id 9 is out of range"),
    p.HelloReply(protocol_version=1, server_version="0.1.0", session_id=b"s" * 16, chunk_size=256, device="cpu",
                 capabilities=["lookup_lock"], lease_ttl=12.5),
    p.RegisterReply(kv_id=42, layout="mha", object_bytes=1 << 20, transfer_mode="cpu", shared=True, block_size=16,
                    num_blocks=1000),
    p.UnregisterReply(kv_id=42),
    p.StoreReply(stored=3, present=2, skipped=1),
    p.RetrieveReply(loaded=5, event=b"e" * 64),
    p.LookupReply(hits=9, lease=(1 << 62) + 3),
    p.ReleaseReply(released=4),
    p.ClearReply(removed=11),
    p.PingReply(session_id=b"s" * 16),
    p.StatusReply(status={"l1": {"objects": 3, "bytes": 1.5}, "registrations": [{"kv_id": 1}], "ok": True}),
    p.EventsReply(session_id=b"s" * 16, first=3, next=15, models=["m#group0:full"],
                  events=[p.ChunkEvent(seq=12, kind=1, model=0, world_size=2, rank=-1, digest=b"d" * 16),
                          p.ChunkEvent(seq=14, kind=2, model=0, world_size=2, rank=1, digest=b"e" * 16, salt=b"t")]),
    p.ByeReply(leases=2, registrations=1),
    p.MapArenaReply(capacity=1 << 40, slab_bytes=1 << 28, session_id=b"s" * 16),
    p.ReserveReply(reservation=3, chunks=IDS, offsets=p.pack_offsets([0, 1 << 35]), object_bytes=4096, present=1,
                   skipped=2),
    p.CommitReply(stored=2, present=1, skipped=3),
    p.ReadReply(read=4, offsets=p.pack_offsets([1 << 33]), object_bytes=4096),
    p.ReadDoneReply(released=6),
    p.HintReply(chunks=3, nbytes=12288, pinned_bytes=1 << 33, ignored=False),
]


def test_every_op_has_a_request_and_a_reply_under_test():
    assert {type(m).__struct_config__.tag for m in REQUESTS} == {int(op) for op in p.Op}
    unanswered = {int(p.Op.LANE_CLAIM)}  # (a claim that fails closes the lane connection)
    assert {type(m).__struct_config__.tag for m in REPLIES} == {int(op) for op in p.Op} - unanswered | {0}


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda m: type(m).__name__)
def test_request_round_trip(msg):
    body = p.encode(msg)
    back = p.decode_request(body)
    assert type(back) is type(msg)
    assert back == msg
    assert p.encode(back) == body


@pytest.mark.parametrize("msg", REPLIES, ids=lambda m: type(m).__name__)
def test_reply_round_trip(msg):
    back = p.decode_reply(p.encode(msg))
    assert type(back) is type(msg)
    assert back == msg


def test_encoding_is_a_tagged_array():
    """Other implementations rely on this shape (docs/protocol.md): [op, field, field, ...]."""
    raw = msgspec.msgpack.decode(p.encode(p.Lookup(client_id=b"c", model="m", world_size=2, hashes=H, lock=True)))
    assert raw == [int(p.Op.LOOKUP), b"c", "m", 2, H, True, b"", False]


def test_optional_fields_take_their_defaults_when_absent():
    """An older client that omits appended fields is still understood."""
    body = msgspec.msgpack.encode([int(p.Op.RETRIEVE), 5, H, IDS])
    msg = p.decode_request(body)
    assert msg == p.Retrieve(kv_id=5, hashes=H, block_ids=IDS)
    assert msg.salt == b"" and msg.event == b"" and msg.reply_on_submit is False


def test_unknown_trailing_fields_are_ignored():
    """A newer client may append fields; this server ignores what it does not know."""
    body = msgspec.msgpack.encode([int(p.Op.PING), b"id", "a field from the future", 123])
    assert p.decode_request(body) == p.Ping(client_id=b"id")


def _encode(obj) -> bytes:
    return msgspec.msgpack.encode(obj)


BAD_BODIES = {
    "empty": (b"", p.ErrorCode.BAD_REQUEST),
    "invalid msgpack byte": (b"\xc1", p.ErrorCode.BAD_REQUEST),
    "random bytes": (bytes(range(200, 256)), p.ErrorCode.BAD_REQUEST),
    "truncated": (p.encode(REQUESTS[1])[:-5], p.ErrorCode.BAD_REQUEST),
    "a map, not an array": (_encode({"op": 6}), p.ErrorCode.BAD_REQUEST),
    "a bare integer": (_encode(6), p.ErrorCode.BAD_REQUEST),
    "empty array": (_encode([]), p.ErrorCode.BAD_REQUEST),
    "string op code": (_encode(["lookup", b"c", "m", 1, b""]), p.ErrorCode.BAD_REQUEST),
    "missing required fields": (_encode([int(p.Op.LOOKUP), b"c"]), p.ErrorCode.BAD_REQUEST),
    "model is an int": (_encode([int(p.Op.LOOKUP), b"c", 123, 1, b""]), p.ErrorCode.BAD_REQUEST),
    "hashes is a list": (_encode([int(p.Op.STORE), 1, [b"x" * 16], IDS]), p.ErrorCode.BAD_REQUEST),
    "kv_id is a float": (_encode([int(p.Op.STORE), 1.5, H, IDS]), p.ErrorCode.BAD_REQUEST),
    "lock is a string": (_encode([int(p.Op.LOOKUP), b"c", "m", 1, H, "yes"]), p.ErrorCode.BAD_REQUEST),
    "layer is not a struct": (_encode([int(p.Op.REGISTER_KV_CACHE), b"c", "m", 1, 0, "cpu", b"", "auto", [7]]),
                              p.ErrorCode.BAD_REQUEST),
    "unknown op 99": (_encode([99, b"c"]), p.ErrorCode.UNKNOWN_OP),
    "unknown op 20 (next to be assigned)": (_encode([20]), p.ErrorCode.UNKNOWN_OP),
    "a reply's tag (Error) as a request": (p.encode(REPLIES[0]), p.ErrorCode.UNKNOWN_OP),
}


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_malformed_requests_map_to_typed_errors(name):
    body, code = BAD_BODIES[name]
    with pytest.raises(p.FrameError) as info:
        p.decode_request(body)
    assert info.value.code == code
    assert str(info.value)  # a message the client can show


def test_decode_reply_rejects_garbage():
    with pytest.raises(msgspec.DecodeError):
        p.decode_reply(b"\xc1")
    with pytest.raises(msgspec.ValidationError):
        p.decode_reply(_encode([99]))


def test_request_id_frame():
    for rid in (0, 1, (1 << 62) + 5, (1 << 64) - 1):
        frame = p.pack_request_id(rid)
        assert len(frame) == 8 and frame == rid.to_bytes(8, "little")
        assert p.unpack_request_id(frame) == rid


# ---- packed block ids -------------------------------------------------------------------------


@pytest.mark.parametrize("ids", [[], [0], [5, 0, 7, 7, 2**31 - 1], np.arange(100, dtype=np.int64),
                                 np.array([1, 2, 3], dtype=np.uint16), np.array([9, 8], dtype=np.int32)])
def test_block_ids_round_trip(ids):
    packed = p.pack_block_ids(ids)
    assert len(packed) == 4 * len(ids)
    assert packed == np.asarray(ids, dtype="<i4").tobytes()  # little-endian int32 on the wire
    back = p.unpack_block_ids(packed)
    assert back.dtype == np.dtype("<i4")
    assert back.tolist() == [int(i) for i in ids]


@pytest.mark.parametrize("ids, match", [
    ([1.0, 2.0], "integers"),
    (np.array([0.5]), "integers"),
    (np.array([True, False]), "integers"),
    (["1", "2"], "integers"),
    ([-1], r"\[0, 2\*\*31\)"),
    ([0, 2**31], r"\[0, 2\*\*31\)"),
    (np.array([2**40], dtype=np.int64), r"\[0, 2\*\*31\)"),
])
def test_bad_block_ids_are_rejected(ids, match):
    with pytest.raises(ValueError, match=match):
        p.pack_block_ids(ids)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7])
def test_unpack_block_ids_rejects_partial_ids(n):
    with pytest.raises(ValueError, match="packed int32"):
        p.unpack_block_ids(b"\0" * n)


# ---- packed hashes ----------------------------------------------------------------------------


def test_hashes_pack_and_unpack():
    digests = [bytes([i]) * DIGEST_BYTES for i in range(5)]
    packed = pack_hashes(digests)
    assert packed == b"".join(digests)
    assert unpack_hashes(packed) == digests
    assert pack_hashes(packed) == packed  # already packed bytes pass through
    assert pack_hashes(bytearray(packed)) == packed
    assert pack_hashes(memoryview(packed)) == packed
    assert pack_hashes([]) == b"" and unpack_hashes(b"") == []
    assert pack_hashes(iter(digests)) == packed  # any iterable


@pytest.mark.parametrize("digests", [[b"x" * 15], [b"x" * 16, b"y" * 17], [b""], [b"x" * 32]])
def test_pack_hashes_rejects_wrong_digest_lengths(digests):
    with pytest.raises(ValueError, match="16 bytes"):
        pack_hashes(digests)


@pytest.mark.parametrize("n", [1, 15, 17, 33])
def test_packed_hashes_must_be_whole_digests(n):
    with pytest.raises(ValueError, match="multiple of 16"):
        pack_hashes(b"\0" * n)
    with pytest.raises(ValueError, match="multiple of 16"):
        unpack_hashes(b"\0" * n)
