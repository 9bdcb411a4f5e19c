"""Server side of CPU KV caches: mapping a worker's shared-memory file by name."""

from __future__ import annotations

import ctypes
import mmap
import os

from lmcache_mp.protocol import shm_path



class SharedMapping:
    """Server side: a read-write mapping of a worker's shared-memory file."""

    def __init__(self, name: str, min_size: int):
        path = shm_path(name)
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < min_size:
                raise ValueError(f"shared memory {name!r} has {size} bytes, fewer than the {min_size} described")
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.name = name
        self.size = size
        self._anchor = (ctypes.c_char * size).from_buffer(self._mmap)
        self.address = ctypes.addressof(self._anchor)

    def close(self) -> None:
        if self._mmap is not None:
            del self._anchor
            self._mmap.close()
            self._mmap = None
