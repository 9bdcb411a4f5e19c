"""The wire protocol: the only module that knows how requests and replies are framed and encoded.

Transport: ZeroMQ DEALER (client) to ROUTER (server).
  request frames:  [request_id (8 bytes, little-endian), body]
  reply frames:    [request_id, body]            (the ROUTER adds/strips the peer identity)
A request may add a third frame, TRACE_FRAME: its reply then has a third frame too, the server's
timestamps of the request's stages (see encode_trace), for `lmcache-mp-bench --trace`.

Local lane: a client on the server's machine may also send small requests as datagrams on a unix
SOCK_SEQPACKET socket (HelloReply.lane); see pack_lane. Same bodies, same replies, no ZeroMQ I/O
threads on the way.
Body: one msgpack-encoded msgspec Struct, tagged by its op code, encoded as an array. Every
request gets exactly one reply with the same request_id: the op's reply struct, or `Error`.
Op codes and error codes are append-only; fields are only ever appended, with defaults.
Chunk hashes travel packed (16 bytes each), block ids as packed little-endian int32.
docs/protocol.md describes the schema for other implementations.

One module over 450 lines: it is the wire format's one definition (every request and reply with
its op code, the framing, the codecs), the module the client shares with the server.
"""

from __future__ import annotations

import enum
import struct
from typing import Any, Union

import msgspec
import numpy as np

from lmcache_mp.errors import ErrorCode, RequestError  # noqa: F401 - ErrorCode: the codes of Error replies

# 2: named leases (LOOKUP returns a lease id; RETRIEVE and RELEASE name it), deadlines
# 3: STORE, RETRIEVE and UNREGISTER carry the client id; a registration serves only its own client
#    (ops 12-16, the engine's own copies, were appended within it)
PROTOCOL_VERSION = 3

# Per-request limits: what one request may name, so that its cost stays bounded. Larger requests
# are answered with LIMIT_EXCEEDED (frames over MAX_MESSAGE_BYTES are dropped by the transport).
CLIENT_ID_BYTES = 16
MAX_CHUNKS = 1 << 16  # hashes in one request
MAX_WORLD_SIZE = 256
MAX_LAYERS = 1024
MAX_LOOKUP_KEYS = 1 << 18  # hashes x world_size of one lookup
TP_SHARED_WORLD = 0  # the world size of tp-shared objects (keys, events): every TP size reads them
MAX_NAME_BYTES = 1024  # model names
MAX_SALT_BYTES = 256
MAX_CHUNK_TOKENS = 1 << 20  # tokens per chunk a registration may ask for
MAX_EVENT_MODELS = 64  # namespaces one EVENTS request may name
MAX_EVENTS = 4096  # events in one EVENTS reply
MAX_MESSAGE_BYTES = (4 << 20) + 4096
# CPU KV caches live in files SHM_DIR/SHM_PREFIX* that the server maps by name.
SHM_DIR = "/dev/shm"
SHM_PREFIX = "lmcache_mp_"


def shm_path(name: str) -> str:
    """The file of a CPU cache's shared-memory name; ValueError unless it is one of ours."""
    if not name.startswith(SHM_PREFIX) or "/" in name or name in (".", ".."):
        raise ValueError(f"not an lmcache-mp shared-memory name: {name!r}")
    return f"{SHM_DIR}/{name}"
BLOCK_ID_DTYPE = np.dtype("<i4")

_REQ_ID = struct.Struct("<Q")


class Op(enum.IntEnum):
    HELLO = 1
    REGISTER_KV_CACHE = 2
    UNREGISTER_KV_CACHE = 3
    STORE = 4
    RETRIEVE = 5
    LOOKUP = 6
    RELEASE = 7
    CLEAR = 8
    PING = 9
    STATUS = 10
    BYE = 11
    # The engine's own copies (a registration with transfer="engine"): the client maps L1 and
    # moves the bytes itself; the server allocates, indexes, leases and commits.
    MAP_ARENA = 12
    RESERVE = 13
    COMMIT = 14
    READ = 15
    READ_DONE = 16
    EVENTS = 17  # the chunk events feed (storage/events.py)
    LANE_CLAIM = 18  # a local-lane connection's tenant, from its client's HELLO (no reply)
    HINT = 19  # the application's hint about a prefix (server/hints.py): pin, retain, prefetch, demote, drop


class _Msg(msgspec.Struct, array_like=True, omit_defaults=False, forbid_unknown_fields=False):
    pass


# ---- pieces ----------------------------------------------------------------------------------


class MemoryRef(_Msg):
    """Where a layer tensor's bytes are. CPU: a shared-memory file name. CUDA: an IPC handle of
    the allocation. `offset` is the tensor's first byte inside it, `size` the bytes it holds."""

    kind: str  # "shm" | "cuda_ipc" | "private" (a CPU cache the client copies itself; never mapped)
    name: str = ""
    handle: bytes = b""
    offset: int = 0
    size: int = 0


class LayerRef(_Msg):
    shape: list[int]
    strides: list[int]  # in elements
    dtype: str
    element_size: int
    memory: MemoryRef


# ---- requests --------------------------------------------------------------------------------


class Hello(_Msg, tag=int(Op.HELLO)):
    version: int
    client_id: bytes
    client_name: str = ""
    pid: int = 0
    capabilities: list[str] = []
    # With pid, they name the client's process: the server watches it when it is in the server's
    # pid namespace (and forgets the client as soon as it exits).
    pid_namespace: int = 0  # the inode of /proc/self/ns/pid (0: unknown)
    start_time: int = 0  # the process's start, in clock ticks since boot (/proc/self/stat)


class RegisterKVCache(_Msg, tag=int(Op.REGISTER_KV_CACHE)):
    client_id: bytes
    model: str
    world_size: int
    rank: int
    device: str  # "cpu" | "cuda"
    device_uuid: bytes
    layout: str  # "auto" or a layout kind
    layers: list[LayerRef]
    block_size: int = 0  # only for opaque layouts whose block size the shape does not tell
    transfer: str = ""  # "engine": the client copies (RESERVE/COMMIT, READ/READ_DONE); else the server does
    # Tokens per chunk of this registration (0: the server's --chunk-size): models whose block
    # size does not divide the server's (hybrids: 288, 544, 784 tokens) choose their own.
    chunk_size: int = 0
    # One object per chunk with every KV head, each rank its heads' slice, shared by every TP
    # size (head_slices.py); num_kv_heads: the model's KV heads, which prove the split;
    # pipeline_size: the stages world_size counts (tp-shared chunks need one).
    tp_shared: bool = False
    num_kv_heads: int = 0
    pipeline_size: int = 1


class UnregisterKVCache(_Msg, tag=int(Op.UNREGISTER_KV_CACHE)):
    kv_id: int
    client_id: bytes = b""  # the registration's own client (no other may use it)


class Store(_Msg, tag=int(Op.STORE)):
    kv_id: int
    hashes: bytes
    block_ids: bytes
    salt: bytes = b""
    event: bytes = b""  # IPC event the worker recorded after producing the KV (CUDA)
    client_id: bytes = b""  # the registration's own client (no other may use it)
    deadline: float = 0.0  # CLOCK_MONOTONIC seconds: no copy starts after it, none that ends after it is kept
    # the digest of the prompt's chunk before the first one here (empty: they start the prompt),
    # so that L2 writes keep the prompt's prefix order across its stores
    parent: bytes = b""
    shared: bool = False  # into the shared namespace (a server with tenants; the tenant must write it)


class Retrieve(_Msg, tag=int(Op.RETRIEVE)):
    kv_id: int
    hashes: bytes
    block_ids: bytes
    salt: bytes = b""
    event: bytes = b""  # IPC event to wait for before writing the blocks (CUDA)
    reply_on_submit: bool = False  # reply once queued, with a completion event to wait on
    lease: int = 0  # the lookup lease this retrieve consumes (0: none)
    deadline: float = 0.0  # CLOCK_MONOTONIC seconds after which no copy may start (0: none)
    client_id: bytes = b""  # the registration's own client (no other may use it)
    # packed block ids that may appear more than once in block_ids: blocks whose bytes nobody
    # reads (a sliding-window group's blocks of tokens outside its window: vLLM's null block)
    scratch_blocks: bytes = b""


class Lookup(_Msg, tag=int(Op.LOOKUP)):
    client_id: bytes
    model: str
    world_size: int
    hashes: bytes
    lock: bool = False
    salt: bytes = b""
    tp_shared: bool = False  # the chunks of tp-shared registrations, whatever TP size stored them


class Release(_Msg, tag=int(Op.RELEASE)):
    """Drop what is left of a lease: on these chunks only, or on all of its chunks (no hashes)."""

    client_id: bytes
    lease: int
    hashes: bytes = b""


class Clear(_Msg, tag=int(Op.CLEAR)):
    pass


class Ping(_Msg, tag=int(Op.PING)):
    client_id: bytes = b""


class Status(_Msg, tag=int(Op.STATUS)):
    client_id: bytes = b""  # given: the reply's "mine" lists this client's registrations (kv_ids)


class Bye(_Msg, tag=int(Op.BYE)):
    """The client is closing: drop its leases and registrations now."""

    client_id: bytes


class Events(_Msg, tag=int(Op.EVENTS)):
    """The chunk events (committed, removed) with sequence numbers from `since` on, of these
    namespaces (models) only, or of all."""

    client_id: bytes = b""
    since: int = 0
    models: list[str] = []
    max_events: int = 1024


class MapArena(_Msg, tag=int(Op.MAP_ARENA)):
    """On a connection of the local lane of its own: the reply carries L1's file descriptor
    (SCM_RIGHTS), which the client maps to copy chunks itself."""

    client_id: bytes


class Reserve(_Msg, tag=int(Op.RESERVE)):
    """A store the client copies itself: slots for the chunks not stored yet, held for it until
    its COMMIT (or until its process is gone)."""

    kv_id: int
    hashes: bytes
    client_id: bytes
    salt: bytes = b""
    deadline: float = 0.0  # CLOCK_MONOTONIC seconds: reserved after it, nothing is (DEADLINE_EXCEEDED)
    parent: bytes = b""  # as Store's
    shared: bool = False  # as Store's


class Commit(_Msg, tag=int(Op.COMMIT)):
    """The reservation's bytes have landed (ok), or the copy failed (the slots go back)."""

    client_id: bytes
    reservation: int
    ok: bool = True


class Read(_Msg, tag=int(Op.READ)):
    """A retrieve the client copies itself: where the leading stored chunks are, held for it
    (not evicted, moved or reused) until its READ_DONE (or until its process is gone)."""

    kv_id: int
    hashes: bytes
    client_id: bytes
    salt: bytes = b""
    lease: int = 0  # the lookup lease this read consumes (0: none)


class ReadDone(_Msg, tag=int(Op.READ_DONE)):
    client_id: bytes
    read: int


class LaneClaim(_Msg, tag=int(Op.LANE_CLAIM)):
    """The first datagram of a local-lane connection to a server with tenants: the ticket its
    client's HELLO reply carried (over ZeroMQ, where CURVE proved its tenant). No reply: a bad
    ticket closes the connection."""

    ticket: bytes


class Hint(_Msg, tag=int(Op.HINT)):
    """A hint about the leading chunks of a prefix, in the client's tenant's namespace. `action`:
    pin (keep in L1 for `ttl` seconds, within the tenant's hint budget), unpin (end this tenant's
    pins on these chunks), retain (count as `priority` more uses in the eviction order), prefetch
    (load from the L2 tiers into L1), demote (write to L2, then drop from L1), drop (from L1). A
    server answers an action it does not know with HintReply(ignored=True): hints never change
    what a lookup or retrieve returns, only how long chunks stay."""

    client_id: bytes
    model: str
    world_size: int
    hashes: bytes
    action: str
    salt: bytes = b""
    ttl: float = 0.0  # pin: seconds
    priority: int = 0  # retain: uses to count
    tp_shared: bool = False  # of tp-shared chunks (as Lookup's)


Request = Union[Hello, RegisterKVCache, UnregisterKVCache, Store, Retrieve, Lookup, Release, Clear, Ping, Status, Bye,
                MapArena, Reserve, Commit, Read, ReadDone, Events, LaneClaim, Hint]

# ---- replies ---------------------------------------------------------------------------------


class Error(_Msg, tag=0):
    code: int
    message: str


class HelloReply(_Msg, tag=int(Op.HELLO)):
    protocol_version: int
    server_version: str
    session_id: bytes  # changes when the server restarts
    chunk_size: int
    device: str
    capabilities: list[str] = []
    lease_ttl: float = 0.0  # seconds a lookup lease lives unless retrieves or a release end it
    lane: str = ""  # the local lane's address ("@name": abstract unix socket), "" without one
    lane_ticket: bytes = b""  # with tenants: what this client's lane connections claim first (LaneClaim)


class RegisterReply(_Msg, tag=int(Op.REGISTER_KV_CACHE)):
    kv_id: int
    layout: str
    object_bytes: int
    transfer_mode: str
    shared: bool  # objects shared by all ranks (MLA)
    block_size: int
    num_blocks: int
    chunk_size: int = 0  # tokens per chunk of this registration (0 from servers before it was asked)
    tp_shared: bool = False  # its chunks are tp-shared objects (lookups should ask for those)


class UnregisterReply(_Msg, tag=int(Op.UNREGISTER_KV_CACHE)):
    kv_id: int


class StoreReply(_Msg, tag=int(Op.STORE)):
    stored: int  # chunks written now
    present: int  # chunks that were already there
    skipped: int  # chunks not stored: no memory (everything leased or in use)


class RetrieveReply(_Msg, tag=int(Op.RETRIEVE)):
    loaded: int  # leading chunks written into the blocks
    event: bytes = b""  # with reply_on_submit: IPC event recorded after the copy


class LookupReply(_Msg, tag=int(Op.LOOKUP)):
    hits: int
    lease: int = 0  # with lock and hits: the lease on the found prefix, for retrieves and release
    from_l2: int = 0  # of the hits, those found after L1's prefix, in the L2 tiers


class ReleaseReply(_Msg, tag=int(Op.RELEASE)):
    released: int  # objects the lease no longer holds


class ClearReply(_Msg, tag=int(Op.CLEAR)):
    removed: int


class PingReply(_Msg, tag=int(Op.PING)):
    session_id: bytes


class StatusReply(_Msg, tag=int(Op.STATUS)):
    status: dict[str, Any]


class ByeReply(_Msg, tag=int(Op.BYE)):
    leases: int
    registrations: int


class MapArenaReply(_Msg, tag=int(Op.MAP_ARENA)):
    capacity: int  # bytes of the file to map (offsets in RESERVE and READ replies are into it)
    slab_bytes: int  # objects never straddle a slab: the unit to page-lock
    session_id: bytes


class ReserveReply(_Msg, tag=int(Op.RESERVE)):
    reservation: int  # 0: nothing to write (then the counts are final)
    chunks: bytes  # packed int32: the request's chunks to write, in order
    offsets: bytes  # packed uint64: where each goes in the arena
    object_bytes: int
    present: int  # chunks that were already there (or being written by another request)
    skipped: int  # chunks not stored: no memory


class CommitReply(_Msg, tag=int(Op.COMMIT)):
    stored: int
    present: int
    skipped: int


class ReadReply(_Msg, tag=int(Op.READ)):
    read: int  # 0 when nothing was found
    offsets: bytes  # packed uint64: the leading chunks found, in order
    object_bytes: int


class ReadDoneReply(_Msg, tag=int(Op.READ_DONE)):
    released: int


class ChunkEvent(_Msg):
    seq: int
    kind: int  # 1: committed (visible to lookups), 2: removed (evicted, cleared, replaced)
    model: int  # index into EventsReply.models
    world_size: int  # 0: a tp-shared object, read by every rank of any TP size
    rank: int  # -1: shared by every rank (MLA, tp-shared objects)
    digest: bytes
    salt: bytes = b""


class EventsReply(_Msg, tag=int(Op.EVENTS)):
    session_id: bytes  # changes when the server restarts: sequence numbers start over
    first: int  # the oldest event the server still keeps; events in [since, first) were lost
    next: int  # where the next request should start (events scanned up to here)
    models: list[str]
    events: list[ChunkEvent]
    # indices into models that are the shared namespace's (a tenant that reads it: its chunks are
    # hits of this tenant's lookups too), named as the tenant names the model
    shared: list[int] = []


class HintReply(_Msg, tag=int(Op.HINT)):
    chunks: int  # chunks the action took effect on (pin: held; prefetch: loaded; demote: written and dropped)
    nbytes: int = 0  # their bytes in L1 (pin: what it added to the tenant's pinned bytes)
    pinned_bytes: int = 0  # the tenant's pinned bytes after it
    ignored: bool = False  # an action this server does not know: nothing was done


Reply = Union[
    Error,
    HelloReply,
    RegisterReply,
    UnregisterReply,
    StoreReply,
    RetrieveReply,
    LookupReply,
    ReleaseReply,
    ClearReply,
    PingReply,
    StatusReply,
    ByeReply,
    MapArenaReply,
    ReserveReply,
    CommitReply,
    ReadReply,
    ReadDoneReply,
    EventsReply,
    HintReply,
]

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


class FrameError(Exception):
    """A request that cannot be decoded; `code` is the ErrorCode to answer with."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def too_large(msg: msgspec.Struct, size: int) -> Exception:
    """What a client raises instead of sending a message the transport would drop."""
    return RequestError(int(ErrorCode.LIMIT_EXCEEDED), f"a {type(msg).__name__} of {size} bytes is over the "
                                                       f"{MAX_MESSAGE_BYTES}-byte message limit")


TRACE_FRAME = b"trace"
_trace_decoder = msgspec.msgpack.Decoder(list[tuple[str, int]])


def encode_trace(stamps: list[tuple[str, int]]) -> bytes:
    """[(stage, time.monotonic_ns()), ...]: one clock for every process of the machine."""
    return msgspec.msgpack.encode(stamps)


def decode_trace(frame: bytes) -> list[tuple[str, int]]:
    return _trace_decoder.decode(frame)


# Local lane datagrams: request id (8 bytes) | flags (1 byte) | body; with LANE_TRACED set, a
# request asks for a trace, and its reply is id | flags | body length (4 bytes, LE) | body | trace.
LANE_TRACED = 1
LANE_MAX_BYTES = 64 << 10  # larger requests take ZeroMQ; replies are always smaller (no STATUS)
_LANE_HEAD = struct.Struct("<QB")
_LANE_LEN = struct.Struct("<I")


def pack_lane(request_id: int, body: bytes, traced: bool = False, trace: bytes | None = None) -> bytes:
    head = _LANE_HEAD.pack(request_id, LANE_TRACED if traced or trace is not None else 0)
    if trace is None:
        return head + body
    return head + _LANE_LEN.pack(len(body)) + body + trace


def unpack_lane(datagram: bytes) -> tuple[int, bool, bytes]:
    """(request id, traced, body) of a request datagram; ValueError if it is not one."""
    if len(datagram) < _LANE_HEAD.size:
        raise ValueError(f"a lane datagram has at least {_LANE_HEAD.size} bytes, got {len(datagram)}")
    rid, flags = _LANE_HEAD.unpack_from(datagram)
    return rid, bool(flags & LANE_TRACED), datagram[_LANE_HEAD.size:]


def unpack_lane_reply(datagram: bytes) -> tuple[int, bytes, bytes | None]:
    """(request id, body, trace or None) of a reply datagram; ValueError if it is not one."""
    rid, traced, rest = unpack_lane(datagram)
    if not traced:
        return rid, rest, None
    if len(rest) < _LANE_LEN.size:
        raise ValueError("a traced lane reply without its body length")
    (n,) = _LANE_LEN.unpack_from(rest)
    return rid, rest[_LANE_LEN.size:_LANE_LEN.size + n], rest[_LANE_LEN.size + n:]


def pack_request_id(request_id: int) -> bytes:
    return _REQ_ID.pack(request_id)


def unpack_request_id(frame: bytes) -> int:
    return _REQ_ID.unpack(frame)[0]


# Largest body per op: decoding is the one cost the server pays before it can check a field, so
# ops that carry lists of structs get small frames (1,000 layers of a registration take ~1 ms).
_SMALL_FRAME = 1024
MAX_FRAME_BYTES = {
    Op.HELLO: 4096,
    Op.REGISTER_KV_CACHE: 128 << 10,
    Op.STORE: MAX_MESSAGE_BYTES,
    Op.RETRIEVE: MAX_MESSAGE_BYTES,
    Op.LOOKUP: MAX_CHUNKS * 16 + 2048,
    Op.RELEASE: MAX_CHUNKS * 16 + 1024,
    Op.RESERVE: MAX_CHUNKS * 16 + 2048,
    Op.READ: MAX_CHUNKS * 16 + 2048,
    Op.HINT: MAX_CHUNKS * 16 + 2048,
    Op.EVENTS: MAX_EVENT_MODELS * (MAX_NAME_BYTES + 8) + 1024,
}


def peek_op(body: bytes) -> int | None:
    """The tag of an encoded body without decoding it (None if it is not a tagged array)."""
    if not body:
        return None
    head = body[0]
    if 0x90 <= head <= 0x9F:
        at = 1
    elif head == 0xDC:
        at = 3
    elif head == 0xDD:
        at = 5
    else:
        return None
    return body[at] if len(body) > at and body[at] <= 0x7F else None


def decode_request(body: bytes) -> Request:
    """Decode a request body, or raise FrameError(BAD_REQUEST, UNKNOWN_OP or LIMIT_EXCEEDED)."""
    op = peek_op(body)
    limit = MAX_FRAME_BYTES.get(op, _SMALL_FRAME) if op is not None else MAX_MESSAGE_BYTES
    if len(body) > limit:
        name = Op(op).name if op in Op._value2member_map_ else f"op {op}"
        raise FrameError(ErrorCode.LIMIT_EXCEEDED, f"a {name} request may be at most {limit} bytes, got {len(body)}")
    try:
        return _request_decoder.decode(body)
    except msgspec.ValidationError as e:
        text = str(e)
        if "Invalid value" in text and "$[0]" in text:
            raise FrameError(ErrorCode.UNKNOWN_OP, f"unknown op code: {text}") from None
        raise FrameError(ErrorCode.BAD_REQUEST, f"malformed request: {text}") from None
    except msgspec.DecodeError as e:
        raise FrameError(ErrorCode.BAD_REQUEST, f"undecodable request: {e}") from None


def decode_reply(body: bytes) -> Reply:
    return _reply_decoder.decode(body)


_BLOCK_ID_MAX = int(np.iinfo(BLOCK_ID_DTYPE).max)


def pack_block_ids(block_ids) -> bytes:
    ids = np.asarray(block_ids)
    if ids.size == 0 and ids.dtype.kind == "f":  # np.asarray([]) is float64: no chunks, no ids
        return b""
    if ids.dtype.kind not in "iu":
        raise ValueError(f"block ids must be integers, got dtype {ids.dtype}")
    if ids.size and (ids.min() < 0 or ids.max() > _BLOCK_ID_MAX):
        raise ValueError("block ids must be in [0, 2**31)")
    return np.ascontiguousarray(ids, dtype=BLOCK_ID_DTYPE).tobytes()


OFFSET_DTYPE = np.dtype("<u8")


def pack_offsets(offsets) -> bytes:
    return np.ascontiguousarray(offsets, dtype=OFFSET_DTYPE).tobytes()


def unpack_offsets(data: bytes) -> np.ndarray:
    if len(data) % OFFSET_DTYPE.itemsize:
        raise ValueError(f"offsets must be packed uint64, got {len(data)} bytes")
    return np.frombuffer(data, dtype=OFFSET_DTYPE)


def unpack_block_ids(data: bytes) -> np.ndarray:
    if len(data) % BLOCK_ID_DTYPE.itemsize:
        raise ValueError(f"block ids must be packed int32, got {len(data)} bytes")
    return np.frombuffer(data, dtype=BLOCK_ID_DTYPE)
