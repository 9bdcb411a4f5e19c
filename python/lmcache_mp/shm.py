"""Named shared memory for CPU KV caches: tensors (or NumPy arrays) a worker makes and the server
maps by name.

A tensor made by `shared_cpu_tensor` (an array by `shared_cpu_array`) lives in a file under
/dev/shm; the server opens the same file and maps it, so both processes see the same bytes. The
file is removed when the returned tensor object is garbage collected or the process exits
(mappings already open stay valid, and views keep the memory; but a server that restarts can map
it again only while it exists, so keep the returned tensor alive as long as the cache is
registered).

An unnamed file (`open_unnamed`, O_TMPFILE) has a name in /dev/shm only while a registration
needs one (`published`: a symbolic link to this process's descriptor of it): a process killed at
any other time leaves nothing there, and the kernel frees the memory once the last process that
maps it is gone.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import uuid
import weakref
from dataclasses import dataclass
from typing import Iterable

from lmcache_mp.protocol import SHM_DIR, SHM_PREFIX, shm_path  # noqa: F401  (SHM_DIR: public)


_lock = threading.Lock()
_regions: dict[int, tuple[int, str]] = {}  # base address -> (bytes, name)
_unnamed: dict[str, "_Unnamed"] = {}  # by name


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


@dataclass
class _Unnamed:
    fd: int
    published: int = 0  # registrations that need its name now
    named: bool = False  # has its name for good (keep_name)


def open_unnamed(nbytes: int) -> tuple[str, int]:
    """A new file of `nbytes` bytes in /dev/shm without a name there: (the name it takes while
    `published`, its descriptor; map it through /proc/self/fd/FD). OSError where /dev/shm cannot
    make unnamed files. `close_unnamed` ends it."""
    fd = os.open(SHM_DIR, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    name = new_shared_name()
    with _lock:
        _unnamed[name] = _Unnamed(fd)
    return name, fd


@contextlib.contextmanager
def published(names: Iterable[str]):
    """While the block runs, give the unnamed files among `names` their names in /dev/shm: a
    symbolic link to this process's descriptor (/proc/PID/fd/FD), which a server in this pid
    namespace, of this user, opens like the file. Other names are left alone."""
    linked = []
    try:
        for name in set(names):
            with _lock:
                entry = _unnamed.get(name)
                if entry is None or entry.named:
                    continue
                if not entry.published:
                    os.symlink(f"/proc/{os.getpid()}/fd/{entry.fd}", shm_path(name))
                entry.published += 1
            linked.append(name)
        yield
    finally:
        for name in linked:
            with _lock:
                entry = _unnamed.get(name)
                if entry is not None and not entry.named:
                    entry.published -= 1
                    if not entry.published:
                        _remove_name(name)


def is_unnamed(name: str) -> bool:
    """An unnamed file that has no name for good."""
    with _lock:
        entry = _unnamed.get(name)
        return entry is not None and not entry.named


def keep_name(name: str) -> None:
    """Give an unnamed file its name for good, a hard link (for a server that cannot follow
    the symbolic link: another user, another pid namespace); it is removed by close_unnamed
    or at exit, but a killed process leaves it behind."""
    with _lock:
        entry = _unnamed.get(name)
        if entry is None or entry.named:
            return
        if entry.published:
            _remove_name(name)  # the symbolic link
        # linkat(AT_SYMLINK_FOLLOW) on /proc/self/fd/FD names an O_TMPFILE file (once); os.link
        # makes that call only when given a directory descriptor (else link(), which links the
        # symbolic link itself).
        folder = os.open(SHM_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.link(f"/proc/self/fd/{entry.fd}", name, dst_dir_fd=folder, follow_symlinks=True)
        finally:
            os.close(folder)
        entry.named = True


def close_unnamed(name: str) -> None:
    """Close an unnamed file (the mappings of it stay valid) and remove any name it has."""
    with _lock:
        entry = _unnamed.pop(name, None)
    if entry is not None:
        if entry.published or entry.named:
            _remove_name(name)
        os.close(entry.fd)


def _remove_name(name: str) -> None:
    try:
        os.unlink(shm_path(name))
    except FileNotFoundError:
        pass


@atexit.register
def _remove_names() -> None:
    # an exit in the middle of a registration, or files named for good
    with _lock:
        names = [name for name, entry in _unnamed.items() if entry.published or entry.named]
    for name in names:
        _remove_name(name)


def new_shared_file(nbytes: int) -> tuple[str, str]:
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
    name, path = new_shared_file(numel * itemsize)
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
    name, path = new_shared_file(nbytes)
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
