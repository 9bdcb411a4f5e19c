"""L1 that outlives the server (--l1-persist PATH): the arena is the file PATH (on /dev/shm or
hugetlbfs) and PATH.journal says which of its slots hold which chunks, so that a restarted server
re-attaches both and serves the old chunks at once.

The journal is a header (magic, arena size, slab size, their XXH3) and records, each
`u32 length | msgpack payload | u64 XXH3 of the payload`:

    ["c", offset, object_bytes, model, world_size, rank, digest, salt, format_key]   committed
    ["f", offset]                                                                     freed

Records are written (one `write` per L1 operation, to a file in memory: it survives the process,
SIGKILL included, as the arena does) *before* L1 hands a freed slot to anyone else, and after a
chunk's bytes landed. So the last record of a slot tells the truth: a committed chunk whose slot
has not been freed since holds exactly its bytes. Chunks being written at a crash have no commit
record and are dropped; a torn or damaged record ends the replay there. Only one server may use
a PATH at a time (an exclusive lock on the journal). A journal grown to several times what it
describes is rewritten (to a temporary file, then renamed) from the live chunks, in the
background: L1 holds its lock for one part of its index at a time (L1Store._compact_journal).
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import threading
from typing import NamedTuple

import msgspec
import xxhash

from lmcache_mp.config import format_size

logger = logging.getLogger(__name__)

MAGIC = b"LMCMPJ1\0"
_HEAD = struct.Struct("<8sQQQ")  # magic, arena bytes, slab bytes, XXH3 of the three
_LEN = struct.Struct("<I")
_SUM = struct.Struct("<Q")
COMPACT_MIN_BYTES = 64 << 20  # rewrite only past this size...
COMPACT_FACTOR = 4  # ...and when this many times the live chunks' records

_encode = msgspec.msgpack.encode
_decode = msgspec.msgpack.decode
_sum = xxhash.xxh3_64_intdigest


class Entry(NamedTuple):
    offset: int
    object_bytes: int
    key: tuple  # ObjectKey fields
    format_key: tuple


def _record(payload: bytes) -> bytes:
    return _LEN.pack(len(payload)) + payload + _SUM.pack(_sum(payload))


def commit_record(offset: int, object_bytes: int, key, format_key: tuple) -> bytes:
    return _record(_encode(["c", offset, object_bytes, key.model, key.world_size, key.rank, key.digest, key.salt,
                            format_key]))


def free_record(offset: int) -> bytes:
    return _record(_encode(["f", offset]))


def _write_all(fd: int, data: bytes, at: int) -> int:
    """Write data at offset at; returns the offset after it."""
    view = memoryview(data)
    while view:
        view = view[os.pwrite(fd, view, at + len(data) - len(view)):]
    return at + len(data)


def _header(arena_bytes: int, slab_bytes: int) -> bytes:
    fields = _HEAD.pack(MAGIC, arena_bytes, slab_bytes, 0)[:-8]
    return fields + _SUM.pack(_sum(fields))


def format_key_from(value) -> tuple:
    """A format key read back from msgpack, which gives lists: tuples again at every depth, so
    that it compares equal to the layout's own (an opaque layout's block order is nested)."""
    return tuple(format_key_from(x) if isinstance(x, list) else x for x in value)


def _other_arena(data: bytes, arena_bytes: int, slab_bytes: int) -> str:
    """Why a journal's header is not this arena's: the sizes it was made for, or damage."""
    if len(data) >= _HEAD.size:
        magic, old_arena, old_slab, check = _HEAD.unpack_from(data)
        if magic == MAGIC and check == _sum(data[:_HEAD.size - _SUM.size]):
            return (f"it describes an L1 of {format_size(old_arena)} in slabs of {format_size(old_slab)}, this server "
                    f"has {format_size(arena_bytes)} in slabs of {format_size(slab_bytes)} (another --l1-size or "
                    "--slab-size); start with the earlier sizes to re-attach its chunks")
    return "its header is damaged or of another program"


def replay(data: bytes, arena_bytes: int, slab_bytes: int) -> tuple[dict[int, Entry], int, str]:
    """The live chunks by offset, how many bytes were good, and why the replay stopped ("" at the end)."""
    if data[:_HEAD.size] != _header(arena_bytes, slab_bytes):
        return {}, 0, _other_arena(data, arena_bytes, slab_bytes)
    live: dict[int, Entry] = {}
    pos = _HEAD.size
    while pos < len(data):
        if pos + _LEN.size > len(data):
            return live, pos, "a torn record at the end"
        (n,) = _LEN.unpack_from(data, pos)
        end = pos + _LEN.size + n + _SUM.size
        if end > len(data):
            return live, pos, "a torn record at the end"
        payload = data[pos + _LEN.size:pos + _LEN.size + n]
        if _SUM.unpack_from(data, end - _SUM.size)[0] != _sum(payload):
            return live, pos, f"a damaged record at byte {pos}"
        try:
            rec = _decode(payload)
            if rec[0] == "c":
                _, offset, object_bytes, model, world_size, rank, digest, salt, fmt = rec
                live.pop(offset, None)  # (re-inserted: the dict keeps the order of the commits)
                key = (model, world_size, rank, digest, salt)
                live[offset] = Entry(offset, object_bytes, key, format_key_from(fmt))
            elif rec[0] == "f":
                live.pop(rec[1], None)
            else:
                raise ValueError(rec[0])
        except (msgspec.DecodeError, ValueError, TypeError, IndexError) as e:
            return live, pos, f"an unreadable record at byte {pos} ({e})"
        pos = end
    return live, pos, ""


class L1Journal:
    """The journal file of one arena; its writes are called with L1's lock held (rewrites: below)."""

    def __init__(self, path: str, arena_bytes: int, slab_bytes: int):
        self.path = path
        self._head = _header(arena_bytes, slab_bytes)
        self._arena_bytes, self._slab_bytes = arena_bytes, slab_bytes
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise RuntimeError(f"{path} is in use by another server (l1_persist needs a path of its own)") from None
        self.bytes = os.fstat(self._fd).st_size
        self.closed = False
        self._state = threading.Lock()  # the file in use vs close(): a rewrite may end at shutdown
        self._since: list[bytes] | None = None  # records written since start_rewrite
        self._tmp_fd, self._tmp_bytes = -1, 0

    def read_live(self) -> dict[int, Entry]:
        """The chunks the journal describes (empty for a new or foreign journal; logged)."""
        data = os.pread(self._fd, self.bytes, 0) if self.bytes else b""
        if not data:
            return {}
        live, good, why = replay(data, self._arena_bytes, self._slab_bytes)
        if why:
            logger.warning("L1 journal %s: %s; %s", self.path, why,
                           f"{len(live)} chunks before it are kept, the rest is dropped" if good else "L1 starts empty")
        return live

    def rewrite(self, records: list[bytes]) -> None:
        """Replace the journal by the header and these records at once (at start-up)."""
        self.start_rewrite()
        self.write_rewrite([records])
        self.close_old(self.finish_rewrite())

    # A rewrite while L1 serves takes three steps, so that L1's lock is held only for the first and
    # the last: start_rewrite (lock held) keeps a copy of every record written from then on;
    # write_rewrite (lock not held) writes the live chunks' records, read from L1 a part at a time,
    # to a temporary file; finish_rewrite (lock held) appends the records kept meanwhile and renames
    # the file over the journal. Every record sets its slot's state outright, so replaying what
    # happened since the start on top of a snapshot taken at any later moment gives the state now.

    def start_rewrite(self) -> None:
        self._since = []

    def write_rewrite(self, batches) -> int:
        """The header and the records, given as an iterable of lists of records (one list in
        memory at a time), to the temporary file; returns how many records."""
        tmp = self.path + ".tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        n = 0
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            at = _write_all(fd, self._head, 0)
            for records in batches:
                at = _write_all(fd, b"".join(records), at)
                n += len(records)
            self._tmp_bytes = at
        except BaseException:
            os.close(fd)
            raise
        self._tmp_fd = fd
        return n

    def finish_rewrite(self) -> int:
        """Put the new file in place; returns the old file's descriptor, for close_old once L1's
        lock is let go (closing it frees the old file: a while, for hundreds of MiB), or -1 if
        the journal was closed meanwhile (it then stays as it was)."""
        since, self._since = self._since, None
        fd, self._tmp_fd = self._tmp_fd, -1
        with self._state:
            if self.closed or fd < 0:
                if fd >= 0:
                    os.close(fd)
                return -1
            try:
                size = _write_all(fd, b"".join(since), self._tmp_bytes)
                os.replace(self.path + ".tmp", self.path)
            except BaseException:
                os.close(fd)
                raise
            old, self._fd = self._fd, fd
            self.bytes = size
        return old

    @staticmethod
    def close_old(fd: int) -> None:
        if fd >= 0:
            os.close(fd)

    def abandon_rewrite(self) -> None:
        self._since = None
        fd, self._tmp_fd = self._tmp_fd, -1
        if fd >= 0:
            os.close(fd)

    @property
    def rewriting(self) -> bool:
        return self._since is not None

    def write(self, records: list[bytes]) -> None:
        if not records or self.closed:
            return
        data = b"".join(records)
        self.bytes = _write_all(self._fd, data, self.bytes)
        if self._since is not None:
            self._since.append(data)

    def wants_rewrite(self, live_bytes_estimate: int) -> bool:
        return self.bytes > max(COMPACT_MIN_BYTES, COMPACT_FACTOR * live_bytes_estimate)

    def close(self) -> None:
        with self._state:
            if not self.closed:
                self.closed = True
                os.close(self._fd)

