"""The compiled data plane (``lmcache_mp._C``): every use of it in the package goes through here,
named and, where Python adds checks or defaults, wrapped."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Sequence

import numpy as np

from lmcache_mp import _C

HostArena = _C.HostArena
request_block_ids = _C.request_block_ids  # (packed int32, chunks, per chunk, num_blocks, distinct) -> int64 ids
ARENA_SLOT_ALIGN = _C.ARENA_SLOT_ALIGN  # an arena slot is the object's size rounded up to this
spin_poll = _C.spin_poll  # (fds, spin_us, timeout_ms) -> indices of the readable fds ([] on timeout)
KVLayout = _C.KVLayout  # a KV cache's layout with its layers' addresses (layout.py's LayoutSpec.native)
DiskStore = _C.DiskStore  # the disk tier's store: files, its index, I/O threads without the GIL
parallel_memcpy = _C.parallel_memcpy  # (dst, src, nbytes) on the CPU copy threads
# The FP8 codec: (src, n, group, dtype, dst) of n 16-bit values; fp8_encoded_bytes(n, group)
fp8_encode, fp8_decode, fp8_encoded_bytes = _C.fp8_encode, _C.fp8_decode, _C.fp8_encoded_bytes
# CUDA IPC, events, streams and the GPU transfer engine; None where the extension was built without CUDA
cuda = getattr(_C, "cuda", None)


def default_spin_us() -> int:
    """How long a thread that expects an answer soon polls before it sleeps: only where cores are
    plentiful (on a small machine the spinning threads would take the cores the others need)."""
    return 5000 if (os.cpu_count() or 1) >= 8 else 0


@contextlib.contextmanager
def pinning_paused(arena: HostArena) -> Iterator[None]:
    """Hold the arena's background pinning between slabs for the duration (GPU registrations)."""
    arena.pause_pinning()
    try:
        yield
    finally:
        arena.resume_pinning()


def build_info() -> dict[str, Any]:
    """How the extension was built: version, CUDA on/off, architectures, compilers."""
    info = dict(_C.build_info())
    info["cuda_devices"] = cuda_device_count()
    return info


def cuda_built() -> bool:
    return bool(_C.build_info()["cuda"])


def cuda_device_count() -> int:
    """CUDA devices this process sees (0 when built without CUDA, or without driver or device)."""
    return _C.cuda.device_count() if cuda_built() else 0


def _ids(block_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    ids = np.asarray(block_ids)
    if ids.dtype.kind not in "iu":
        raise ValueError(f"block ids must be integers, got dtype {ids.dtype}")
    return np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)


def _ptrs(object_ptrs: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(object_ptrs, dtype=np.uint64)).reshape(-1)


def cpu_gather(layout, chunk_size: int, block_ids, object_ptrs, object_capacity: int) -> None:
    """Copy the blocks of len(object_ptrs) chunks from a host KV cache into host objects.

    Checks every block id, the id count and the object size before any byte moves.
    """
    _C.cpu_gather(layout, int(chunk_size), _ids(block_ids), _ptrs(object_ptrs), int(object_capacity))


def cpu_scatter(layout, chunk_size: int, block_ids, object_ptrs, object_capacity: int) -> None:
    """Copy host objects back into the blocks of a host KV cache (same checks as cpu_gather)."""
    _C.cpu_scatter(layout, int(chunk_size), _ids(block_ids), _ptrs(object_ptrs), int(object_capacity))


def set_cpu_threads(n: int) -> None:
    """Threads used by CPU copies (n <= 0: one per core, at most 16)."""
    _C.set_cpu_threads(int(n))
