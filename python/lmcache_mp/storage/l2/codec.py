"""Codecs below L1: what an L2 tier stores of a chunk, and how it comes back (always decoded: L1
and the engines never see a codec).

`fp8`: 16-bit KV (bf16, fp16) as FP8 E4M3 with a bf16 scale per group of consecutive values
(the group's largest magnitude over 448). In token layouts a group never spans two tokens (the
largest of 128, 64, 32, 16 or 8 values that divides a token's row: one attention head for the
usual head sizes); whole blocks (opaque, packed layouts) are grouped by 64 values or fewer.
The C++ core encodes and decodes (`_C.fp8_encode`, AVX2 where the CPU has it) on the tier's
writer and reader threads. A chunk is stored in half its bytes plus two bytes per group (1.94x
fewer bytes with heads of 64); docs/compression.md has the quality measured on a real model. KV
that is not 16-bit (e.g. vLLM's fp8 KV cache) is stored as it is.

An encoded object's format (what the tier checks on every read) is the raw object's format with
a prefix that names the codec, its group, its dtype and the raw size: a tier never hands an
encoded object to a reader expecting raw bytes or the reverse (the format differs), an object of
an unknown codec is a miss, and the checksum the tier keeps is over the bytes it stores. Every
tier is wrapped, `none` included: a tier without a codec treats encoded objects as misses.
"""

from __future__ import annotations

import concurrent.futures
import struct
import threading
import time

import msgspec
import numpy as np

from lmcache_mp.storage.l2 import FORMAT_MISMATCH, L2Backend

CODECS = ("none", "fp8")
TAG = b"LMCz"  # an encoded object's format begins so (a raw object's format is msgpack: a tuple, never this)
_HEAD = struct.Struct("<4sBBHQ")  # tag, codec, dtype, group, raw bytes; then the raw object's format
_CODEC_IDS = {"fp8": 1}
_DTYPES = {"bfloat16": 0, "bf16": 0, "float16": 1, "fp16": 1, "half": 1}  # -> the C++ codec's dtype
GROUPS = (128, 64, 32, 16, 8)
PIECE_BYTES = 4 << 20  # raw bytes the codec works on while the tier moves the piece before (or after)


def _row_values(fmt: tuple) -> int | None:
    """Values a group must divide for an object of this format key: a token's row (one segment of
    one layer) of a token layout; 64 in the whole blocks of opaque and packed layouts, whose
    insides only their engine knows (a head of 64 values, or part of one). None where the object
    is not 16-bit KV."""
    if not fmt or len(fmt) < 5:
        return None
    dtype = fmt[5] if fmt[0] == "packed" and len(fmt) >= 6 else fmt[4]
    if _DTYPES.get(str(dtype).replace("torch.", "")) is None:
        return None
    if fmt[0] == "tokens" and len(fmt) == 5:
        return fmt[3] // 2 if isinstance(fmt[3], int) and fmt[3] % 2 == 0 else None
    return 64 if fmt[0] in ("opaque", "packed") else None


def plan(fmt_bytes: bytes, nbytes: int) -> tuple[int, int] | None:
    """(dtype id, group) of an object of this raw format and size, or None: stored as it is."""
    try:
        fmt = msgspec.msgpack.decode(fmt_bytes)
    except msgspec.DecodeError:
        return None
    row = _row_values(tuple(fmt)) if isinstance(fmt, (list, tuple)) else None
    if not row or nbytes % 2:
        return None
    n = nbytes // 2
    group = next((g for g in GROUPS if row % g == 0 and n % g == 0), 0)
    if not group:
        return None
    dtype = fmt[4] if fmt[0] in ("tokens", "opaque") else fmt[5]
    return _DTYPES[str(dtype).replace("torch.", "")], group


def stored_format(codec: str, dtype: int, group: int, nbytes: int, fmt: bytes) -> bytes:
    return _HEAD.pack(TAG, _CODEC_IDS[codec], dtype, group, nbytes) + fmt


def parse(stored: bytes) -> tuple[int, int, int, int, bytes] | None:
    """(codec id, dtype, group, raw bytes, raw format) of an encoded object's format, else None."""
    if not stored.startswith(TAG) or len(stored) < _HEAD.size:
        return None
    _, codec, dtype, group, nbytes = _HEAD.unpack_from(stored)
    return codec, dtype, group, nbytes, stored[_HEAD.size:]


class _Scratch(threading.local):
    buf: np.ndarray | None = None


class CodecTier(L2Backend):
    """A tier behind a codec (`none`: the tier as it is, encoded objects being misses)."""

    def __init__(self, inner: L2Backend, codec: str = "none"):
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}: one of {', '.join(CODECS)}")
        from lmcache_mp import native

        self._native = native
        self.inner, self.codec = inner, codec
        self.name, self.default_write = inner.name, inner.default_write
        self.local = getattr(inner, "local", True)
        self._id = _CODEC_IDS.get(codec, 0)
        self._scratch = _Scratch()
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix=f"lmcache-codec-{inner.name}")
        self._lock = threading.Lock()
        self._counts = {"raw_bytes_written": 0, "stored_bytes_written": 0, "encode_seconds": 0.0,
                        "raw_bytes_read": 0, "stored_bytes_read": 0, "decode_seconds": 0.0}

    def _buffer(self, nbytes: int) -> np.ndarray:
        """This thread's scratch memory (a tier's writer and its reader each have their own)."""
        buf = self._scratch.buf
        if buf is None or buf.nbytes < nbytes:
            buf = self._scratch.buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
            register = getattr(self.inner, "register_memory", None)
            if register is not None:  # a tier that moves only registered memory (Mooncake)
                register(buf.ctypes.data, buf.nbytes)
        return buf

    def _add(self, **counts) -> None:
        with self._lock:
            for k, v in counts.items():
                self._counts[k] += v

    def _pieces(self, items: list[int], sizes: list[int]) -> list[list[int]]:
        """Items in runs of about PIECE_BYTES: the codec works on one while the tier moves another."""
        out: list[list[int]] = []
        held = PIECE_BYTES
        for i in items:
            if held + sizes[i] > PIECE_BYTES:
                out.append([])
                held = 0
            out[-1].append(i)
            held += sizes[i]
        return out

    def _run(self, counter: str, fn, piece: list[int]) -> None:
        t0 = time.perf_counter()
        for i in piece:
            fn(i)
        self._add(**{counter: time.perf_counter() - t0})

    # ---- writes --------------------------------------------------------------------------------

    def put(self, keys, formats, ptrs, sizes):
        if self.codec == "none":
            return self.inner.put(keys, formats, ptrs, sizes)
        plans = [plan(f, n) for f, n in zip(formats, sizes)]
        stored = [self._native.fp8_encoded_bytes(n // 2, p[1]) if p else n for p, n in zip(plans, sizes)]
        buf = self._buffer(sum(n for n, p in zip(stored, plans) if p))
        out_fmts, out_ptrs, at = list(formats), list(ptrs), buf.ctypes.data
        for i, p in enumerate(plans):
            if p is not None:
                out_fmts[i] = stored_format(self.codec, p[0], p[1], sizes[i], formats[i])
                out_ptrs[i], at = at, at + stored[i]

        def encode(i: int) -> None:
            if plans[i] is not None:
                self._native.fp8_encode(ptrs[i], sizes[i] // 2, plans[i][1], plans[i][0], out_ptrs[i])

        # the next piece is encoded (without the GIL) while the tier writes this one
        ok = [False] * len(keys)
        pieces = self._pieces(list(range(len(keys))), list(sizes))
        pending = self._pool.submit(self._run, "encode_seconds", encode, pieces[0]) if pieces else None
        for k, piece in enumerate(pieces):
            pending.result()
            if k + 1 < len(pieces):
                pending = self._pool.submit(self._run, "encode_seconds", encode, pieces[k + 1])
            for i, good in zip(piece, self.inner.put([keys[i] for i in piece], [out_fmts[i] for i in piece],
                                                     [out_ptrs[i] for i in piece], [stored[i] for i in piece])):
                ok[i] = good
        done = [i for i, (p, good) in enumerate(zip(plans, ok)) if p is not None and good]
        self._add(raw_bytes_written=sum(sizes[i] for i in done), stored_bytes_written=sum(stored[i] for i in done))
        return ok

    # ---- reads -----------------------------------------------------------------------------------

    def get(self, keys, formats, ptrs, capacities):
        if self.codec == "none":
            return self.inner.get(keys, formats, ptrs, capacities)
        plans = [plan(f, n) for f, n in zip(formats, capacities)]
        coded = [i for i, p in enumerate(plans) if p is not None]
        out = [FORMAT_MISMATCH] * len(keys)
        if coded:
            stored = {i: self._native.fp8_encoded_bytes(capacities[i] // 2, plans[i][1]) for i in coded}
            buf = self._buffer(sum(stored.values()))
            src, at = {}, buf.ctypes.data
            for i in coded:
                src[i], at = at, at + stored[i]

            def decode(i: int) -> None:
                if out[i] == stored[i]:
                    self._native.fp8_decode(src[i], capacities[i] // 2, plans[i][1], plans[i][0], ptrs[i])
                    out[i] = capacities[i]

            # each piece is decoded (without the GIL) while the tier reads the next one
            decoding = []
            for piece in self._pieces(coded, capacities):
                got = self.inner.get([keys[i] for i in piece],
                                     [stored_format(self.codec, plans[i][0], plans[i][1], capacities[i], formats[i])
                                      for i in piece],
                                     [src[i] for i in piece], [stored[i] for i in piece])
                for i, r in zip(piece, got):
                    out[i] = r if r < 0 or r == stored[i] else FORMAT_MISMATCH
                decoding.append(self._pool.submit(self._run, "decode_seconds", decode, piece))
            for d in decoding:
                d.result()
            read = [i for i in coded if out[i] == capacities[i]]
            self._add(raw_bytes_read=sum(capacities[i] for i in read), stored_bytes_read=sum(stored[i] for i in read))
        # stored as they are: not 16-bit KV, or written before the codec was (its raw format)
        plain = [i for i in range(len(keys)) if out[i] == FORMAT_MISMATCH]
        if plain:
            for i, r in zip(plain, self.inner.get([keys[i] for i in plain], [formats[i] for i in plain],
                                                  [ptrs[i] for i in plain], [capacities[i] for i in plain])):
                out[i] = r
        return out

    def lookup(self, keys):
        out = []
        for got in self.inner.lookup(keys):
            head = parse(got[1]) if got is not None else None
            if head is not None:  # encoded: by this tier's codec, as the raw object it stands for
                got = (head[3], head[4]) if head[0] == self._id else None
            out.append(got)
        return out

    def remove(self, keys):
        return self.inner.remove(keys)

    def stats(self) -> dict:
        with self._lock:
            counts = dict(self._counts)
        st = dict(self.inner.stats())
        st["codec"] = {"name": self.codec, **counts}
        return st

    def close(self) -> None:
        self._pool.shutdown()
        self.inner.close()
