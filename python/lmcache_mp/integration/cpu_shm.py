"""Move an engine's existing CPU KV-cache tensors into named shared memory, in place.

An engine allocates its CPU KV cache in ordinary process memory and hands references to it to
many places (attention layers, the model runner, kernel-block views). The server can only reach
memory it can map by name, so the bytes must move into a file under /dev/shm *without* any of
those references changing. Swapping the data pointer of the tensors' common storage does that:
every tensor and view of the storage then addresses the shared mapping.

The file has no name in /dev/shm (O_TMPFILE) except while the client registers the cache with a
server (`shm.published`): engines get killed (vLLM's default stop kills its workers), and a
killed worker must not leave its whole KV cache behind in /dev/shm.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from dataclasses import dataclass
from typing import Sequence

from lmcache_mp import shm
from lmcache_mp.protocol import shm_path

logger = logging.getLogger(__name__)


@dataclass
class SharedBuffer:
    """One storage moved to shared memory: the file's name (while published), its size in bytes,
    and whether it is unnamed outside registrations (else a named file, removed at exit)."""

    name: str
    nbytes: int
    base: int
    unnamed: bool = True

    @property
    def path(self) -> str:
        return shm_path(self.name)


_lock = threading.Lock()
_named: dict[str, SharedBuffer] = {}  # files with a name for their whole life


def _unlink_all() -> None:
    with _lock:
        buffers = list(_named.values())
        _named.clear()
    for buf in buffers:
        try:
            os.unlink(buf.path)
        except FileNotFoundError:
            pass


atexit.register(_unlink_all)


def _new_file(nbytes: int) -> tuple[SharedBuffer, str]:
    """A file for the storage: (its buffer, the path to map). Unnamed where /dev/shm can make
    such files, else named (a killed process then leaves it behind)."""
    try:
        name, fd = shm.open_unnamed(nbytes)
        return SharedBuffer(name=name, nbytes=nbytes, base=0), f"/proc/self/fd/{fd}"
    except OSError as exc:
        logger.warning("cannot make an unnamed file in %s (%s): the CPU KV cache's file keeps its name, and a "
                       "killed worker leaves it behind", shm.SHM_DIR, exc)
    name, path = shm.new_shared_file(nbytes)
    buf = SharedBuffer(name=name, nbytes=nbytes, base=0, unnamed=False)
    with _lock:
        _named[name] = buf
    return buf, path


def _is_shared(storage) -> bool:
    try:
        shm.find_shared_region(storage.data_ptr(), max(storage.nbytes(), 1))
        return True
    except ValueError:
        return False


def _forget_region(buf: SharedBuffer) -> None:
    # so that a later allocation at the same address is not mistaken for this (removed) file
    shm.unregister_shared_region(buf.base, buf.name)


def move_to_shared_memory(tensors: Sequence) -> list[SharedBuffer]:
    """Put the storages behind `tensors` (CPU) into /dev/shm files, keeping every reference valid.

    Tensors already in registered shared memory are left alone. Returns the buffers created;
    `release_shared_memory` ends them.
    """
    import torch

    created: list[SharedBuffer] = []
    seen: set[int] = set()
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"move_to_shared_memory takes CPU tensors, got {t.device}")
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or _is_shared(storage):
            seen.add(key)
            continue
        seen.add(key)
        nbytes = storage.nbytes()
        buf, path = _new_file(nbytes)
        try:
            mapped = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
            mapped.copy_(storage)
            if hasattr(storage, "_swap_data_ptr_"):
                # The storage object every view shares now owns the mapping; `mapped` gets the
                # old heap memory and frees it when it goes out of scope.
                storage._swap_data_ptr_(mapped)
            else:  # older torch: re-point each given tensor (misses other views of the storage)
                logger.warning("torch lacks UntypedStorage._swap_data_ptr_; re-pointing the layer tensors only")
                for other in tensors:
                    if other.untyped_storage().data_ptr() == key:
                        other.set_(mapped, other.storage_offset(), other.size(), other.stride())
                storage = mapped
            del mapped
        except BaseException:
            release_shared_memory([buf])
            raise
        buf.base = storage.data_ptr()
        shm.register_shared_region(buf.base, nbytes, buf.name)
        created.append(buf)
        logger.info("moved a %.1f MiB CPU KV cache into shared memory%s", nbytes / 2**20,
                    "" if buf.unnamed else f" {buf.path}")
    return created


def release_shared_memory(buffers: Sequence[SharedBuffer]) -> None:
    """Close or remove the files (the mappings stay valid while the tensors live)."""
    for buf in buffers:
        _forget_region(buf)
        if buf.unnamed:
            shm.close_unnamed(buf.name)
            continue
        with _lock:
            _named.pop(buf.name, None)
        try:
            os.unlink(buf.path)
        except FileNotFoundError:
            pass
