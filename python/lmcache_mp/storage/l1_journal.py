"""L1 that outlives the server (--l1-persist PATH): the arena is the file PATH (on /dev/shm or
hugetlbfs) and PATH.journal says which of its slots hold which chunks, so that a restarted server
re-attaches both and serves the old chunks at once.

The journal is a header (magic, arena size, slab size, their XXH3) and records, each
`u32 length | msgpack payload | u64 XXH3 of the payload`:

    ["c", offset, object_bytes, model, world_size, rank, digest, salt, format_key, checksum]  committed
    ["f", offset]                                                                               freed

`checksum` is the XXH3 of the chunk's object bytes, taken after they landed (in the background:
storage/l1_persist.py), and a restarted server re-attaches a chunk only if its slot still holds
bytes of that checksum. That is what makes a wrong byte impossible whatever is lost or damaged:
records after damage in the journal (a bit flip, a torn tail after a crash mid-write, a full
disk) are dropped, and with them the free records that said a slot was reused, so an older
commit record may describe a slot that now holds another chunk's bytes; and the arena file
itself may be damaged. Either way the bytes no longer match the checksum and the chunk is
dropped. Records are written (one `write` per L1 operation, to a file in memory: it survives the
process, SIGKILL included, as the arena does); a free record before L1 hands a freed slot to
anyone else, so an undamaged journal is also exact. Chunks being written or not yet summed at
a crash have no commit record and are dropped (l1_persist.py bounds how many answered ones);
the replay stops at the first torn or damaged record. Only one server may use a PATH at a time
(an exclusive lock on the journal). A journal grown to several times what it describes is
rewritten (to a temporary file, then renamed) from the live chunks, in the background: L1 holds
its lock for one part of its index at a time.
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

logger = logging.getLogger(__name__)

MAGIC = b"LMCMPJ2\0"  # 2: commit records carry the chunk's checksum
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
    checksum: int  # chunk_sum of the object bytes when they were committed


def _record(payload: bytes) -> bytes:
    return _LEN.pack(len(payload)) + payload + _SUM.pack(_sum(payload))


def chunk_sum(data) -> int:
    """The checksum of a chunk's object bytes (a buffer; the GIL is let go while it runs)."""
    return _sum(data)


def commit_record(offset: int, object_bytes: int, key, format_key: tuple, checksum: int) -> bytes:
    return _record(_encode(["c", offset, object_bytes, key.model, key.world_size, key.rank, key.digest, key.salt,
                            format_key, checksum]))


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


def _why_not_ours(head: bytes, arena_bytes: int, slab_bytes: int) -> str:
    if len(head) < _HEAD.size or _sum(head[:_HEAD.size - 8]) != _SUM.unpack_from(head, _HEAD.size - 8)[0]:
        return "its header is damaged"
    magic, arena, slab, _ = _HEAD.unpack_from(head)
    if magic != MAGIC:
        return f"it is of another format ({magic.rstrip(bytes(1))!r}, this server writes {MAGIC.rstrip(bytes(1))!r})"
    return (f"it describes an arena of {arena} bytes in slabs of {slab}, and this one has {arena_bytes} in slabs "
            f"of {slab_bytes} (--l1-size or --slab-size changed)")


def replay(data: bytes, arena_bytes: int, slab_bytes: int) -> tuple[dict[int, Entry], int, str]:
    """The live chunks by offset, how many bytes were good, and why the replay stopped ("" at the end)."""
    if data[:_HEAD.size] != _header(arena_bytes, slab_bytes):
        return {}, 0, "the journal is not this arena's: " + _why_not_ours(data[:_HEAD.size], arena_bytes, slab_bytes)
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
                _, offset, object_bytes, model, world_size, rank, digest, salt, fmt, checksum = rec
                live.pop(offset, None)  # (re-inserted: the dict keeps the order of the commits)
                key = (model, world_size, rank, digest, salt)
                live[offset] = Entry(offset, object_bytes, key, format_key_from(fmt), checksum)
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
        if why and not good:
            logger.warning("L1 journal %s: %s; L1 starts empty", self.path, why)
        elif why:
            logger.warning("L1 journal %s: %s; the %d chunks described before it are checked against their "
                           "checksums, the records after it are dropped", self.path, why, len(live))
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

