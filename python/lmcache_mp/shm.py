"""Named shared memory for CPU KV caches: tensors (or NumPy arrays) a worker makes and the server
maps by name.

A tensor made by `shared_cpu_tensor` (an array by `shared_cpu_array`) lives in a file under
/dev/shm; the server opens the same file and maps it, so both processes see the same bytes. The
file is removed when the returned tensor object is garbage collected or the process exits
(mappings already open stay valid, and views keep the memory; but a server that restarts can map
it again only while it exists, so keep the returned tensor alive as long as the cache is
registered).
"""

from __future__ import annotations

import atexit
import os
import threading
import uuid
import weakref
from dataclasses import dataclass

from lmcache_mp.protocol import SHM_DIR, SHM_PREFIX, shm_path  # noqa: F401  (SHM_DIR: public)


_lock = threading.Lock()
_regions: dict[int, tuple[int, str]] = {}  # base address -> (bytes, name)


@dataclass(frozen=True)
class SharedRegion:
    """Where a CPU tensor's bytes live: a shared-memory file and the offset into it."""

    name: str
    offset: int
    size: int  # bytes of the whole file


def _unlink(name: str, base: int) -> None:
    with _lock:
        _regions.pop(base, None)
    try:
        os.unlink(shm_path(name))
    except FileNotFoundError:
        pass


def new_shared_name() -> str:
    return f"{SHM_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:16]}"



def _new_shared_file(nbytes: int) -> tuple[str, str]:
    """A fresh shared-memory file of nbytes (at least 1): (name, path)."""
    name = new_shared_name()
    path = shm_path(name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, max(nbytes, 1))
    finally:
        os.close(fd)
    return name, path


def _remember(obj, base: int, nbytes: int, name: str) -> None:
    """The file goes when obj is collected or the process exits."""
    with _lock:
        _regions[base] = (max(nbytes, 1), name)
    weakref.finalize(obj, _unlink, name, base)
    atexit.register(_unlink, name, base)


def shared_cpu_tensor(shape, dtype, *, fill: float | None = 0):
    """A torch CPU tensor in named shared memory that another process can open by name.

    >>> kv = shared_cpu_tensor((2, 1024, 16, 8, 128), torch.bfloat16)
    """
    import torch

    shape = tuple(int(s) for s in shape)
    numel = 1
    for s in shape:
        numel *= s
    itemsize = torch.empty((), dtype=dtype).element_size()
    name, path = _new_shared_file(numel * itemsize)
    flat = torch.from_file(path, shared=True, size=numel, dtype=dtype)
    tensor = flat.view(shape)
    if fill is not None:
        tensor.fill_(fill)
    _remember(tensor, flat.data_ptr(), numel * itemsize, name)
    return tensor


def shared_cpu_array(shape, dtype, *, fill: float | None = 0):
    """shared_cpu_tensor for NumPy: an array in named shared memory, which `Client` registers
    like a tensor (a CPU cache needs no torch).

    >>> kv = shared_cpu_array((2, 1024, 16, 8, 128), np.float16)
    """
    import mmap

    import numpy as np

    shape = tuple(int(s) for s in shape)
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    name, path = _new_shared_file(nbytes)
    fd = os.open(path, os.O_RDWR)
    try:
        buf = mmap.mmap(fd, max(nbytes, 1))
    finally:
        os.close(fd)
    array = np.frombuffer(buf, dtype=dtype, count=nbytes // dtype.itemsize).reshape(shape)
    if fill is not None:
        array.fill(fill)
    _remember(array, array.__array_interface__["data"][0], nbytes, name)
    return array


def register_shared_region(base: int, nbytes: int, name: str) -> None:
    """Declare that [base, base+nbytes) is the mapping of the shared-memory file `name`."""
    shm_path(name)  # reject names the server would refuse
    with _lock:
        _regions[int(base)] = (int(nbytes), name)


def unregister_shared_region(base: int, name: str) -> None:
    """Forget a region declared by register_shared_region (its file is gone or reused)."""
    with _lock:
        entry = _regions.get(int(base))
        if entry is not None and entry[1] == name:
            del _regions[int(base)]


def find_shared_region(ptr: int, nbytes: int) -> SharedRegion:
    """The shared-memory file holding [ptr, ptr+nbytes), or ValueError if it is ordinary memory."""
    with _lock:
        for base, (size, name) in _regions.items():
            if base <= ptr and ptr + nbytes <= base + size:
                return SharedRegion(name=name, offset=ptr - base, size=size)
    raise ValueError(
        "CPU KV-cache tensors must live in shared memory: make them with "
        "lmcache_mp.shared_cpu_tensor(shape, dtype) (NumPy arrays: lmcache_mp.shared_cpu_array)"
    )


def remove_shared_files(pid: int) -> None:
    """Remove the shared-memory files that the process `pid` made (their names carry it): for
    whoever kills such a process, which cannot remove them itself."""
    prefix = f"{SHM_PREFIX}{int(pid)}_"
    for name in os.listdir(SHM_DIR):
        if name.startswith(prefix):
            try:
                os.unlink(shm_path(name))
            except FileNotFoundError:
                pass
