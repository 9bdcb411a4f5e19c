"""L2: storage tiers below L1 (the host arena).

A tier (`L2Backend`) moves batches of objects straight between arena memory and its storage: it
is handed raw pointers, never Python copies of the bytes. Every stored object carries its key
and layout format, and a checksum its tier checks on every read, so a stale, foreign or damaged
object is a miss, never garbage in GPU blocks.

L2 is lossy: a miss, a full queue or a backend error is never a request error, only a chunk that
is not there (counted, and logged once per incident). `tiers.L2Tiers` does the rest: what is
written (policy and admission), the bounded write queue, lookups that continue into L2, and
loading L2 chunks back into L1 for a lookup with lock (the prefetch) or a retrieve.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import struct
import threading
from typing import NamedTuple

import xxhash

# The network tiers' payload checksum: XXH3-64 runs at about 27 GiB/s on one core (XXH64: 11),
# and without the GIL. The disk tier's files keep XXH64, checked in C++.
checksum = xxhash.xxh3_64_intdigest
_summers: list[concurrent.futures.ThreadPoolExecutor] = []
_summers_lock = threading.Lock()


def checksum_async(payload: memoryview) -> concurrent.futures.Future:
    """checksum(payload) on one of two helper threads, so that it overlaps the caller's I/O."""
    with _summers_lock:
        if not _summers:
            _summers.append(concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="lmcache-l2-sum"))
    return _summers[0].submit(checksum, payload)

def memory_view(ptr: int, n: int) -> memoryview:
    """The n bytes at address ptr (arena memory, or a codec's scratch memory)."""
    return memoryview((ctypes.c_char * n).from_address(ptr)).cast("B")


# get() results other than a byte count
MISS, FORMAT_MISMATCH, TOO_LARGE, CORRUPT, IO_ERROR = -1, -2, -3, -4, -5


_HEAD = struct.Struct("<8sIIQQ")  # magic, key length, format length, payload length, checksum of the payload
HEADER_BYTES = _HEAD.size  # before the key and the format


class Header(NamedTuple):
    key: bytes
    fmt: bytes
    payload_bytes: int
    checksum: int
    size: int  # of the header itself: fixed part, key and format


def pack_header(magic: bytes, key: bytes, fmt: bytes, payload_bytes: int, checksum: int) -> bytes:
    """The header a network tier stores with a chunk, so that a read can tell a foreign, stale or
    damaged value from the chunk it asked for."""
    return _HEAD.pack(magic, len(key), len(fmt), payload_bytes, checksum) + key + fmt


def unpack_header(magic: bytes, head: bytes | bytearray) -> Header | None:
    """The header at the start of head, or None if it is not one (key and format are cut short
    where head is)."""
    if len(head) < HEADER_BYTES:
        return None
    got, klen, flen, plen, checksum = _HEAD.unpack_from(head)
    if got != magic:
        return None
    end = HEADER_BYTES + klen
    return Header(bytes(head[HEADER_BYTES:end]), bytes(head[end:end + flen]), plen, checksum, end + flen)


class L2Backend:
    """One tier. Every method takes parallel lists (one entry per object) and may block: the
    tiers call them from their own threads, never from the socket thread (except `lookup`,
    which must answer from memory)."""

    name = "l2"
    default_write = "evicted"  # what is written to it unless configured (writers.py): a shared tier says "all"

    def put(self, keys: list[bytes], formats: list[bytes], ptrs: list[int], sizes: list[int]) -> list[bool]:
        """Store each object's bytes; False where it could not (full, I/O error)."""
        raise NotImplementedError

    def get(self, keys: list[bytes], formats: list[bytes], ptrs: list[int], capacities: list[int]) -> list[int]:
        """Read each object into its pointer: the byte count, or MISS, FORMAT_MISMATCH, TOO_LARGE,
        CORRUPT or IO_ERROR."""
        raise NotImplementedError

    def lookup(self, keys: list[bytes]) -> list[tuple[int, bytes] | None]:
        """(payload bytes, format) of each object present, else None; from memory, no I/O."""
        raise NotImplementedError

    def remove(self, keys: list[bytes]) -> int:
        raise NotImplementedError

    def stats(self) -> dict:
        raise NotImplementedError

    def close(self) -> None:
        pass
