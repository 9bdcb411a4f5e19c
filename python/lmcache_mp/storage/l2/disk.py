"""The local-disk tier: one file per object under a directory, kept across restarts.

The I/O runs in the C++ core (`_C.DiskStore`) on its own threads without the GIL: `O_DIRECT`
between the file and arena memory when the slot is page-aligned, buffered otherwise. A file is
a 4 KiB header (key, format, length, checksums) and the payload; it is written under a temporary
name and renamed, so a crash mid-write leaves a temporary file that the next start removes. At
start the directory is scanned (headers only) and the index rebuilt; the payload checksum is
checked on every read, and a file that fails it is deleted and counted. LRU by bytes within the
size limit.
"""

from __future__ import annotations

import logging
import os
import shutil

from lmcache_mp.config import format_size
from lmcache_mp.storage.l2 import L2Backend

logger = logging.getLogger(__name__)

FREE_SPACE_SHARE = 0.9  # of the filesystem's free space, when no size is given


def _bytes_in(path: str) -> int:
    total = 0
    for sub in os.scandir(path):
        if sub.is_dir(follow_symlinks=False):
            total += sum(e.stat(follow_symlinks=False).st_size for e in os.scandir(sub.path)
                         if e.is_file(follow_symlinks=False))
    return total


class DiskTier(L2Backend):
    name = "disk"

    def __init__(self, path: str, size: int = 0, io_threads: int = 4):
        from lmcache_mp import _C

        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"L2 disk path {path} exists and is not a directory")
        os.makedirs(path, exist_ok=True)
        if size <= 0:  # what is there already, and most of what is free
            size = int(_bytes_in(path) + FREE_SPACE_SHARE * shutil.disk_usage(path).free)
        self.path = path
        self._store = _C.DiskStore(path, size, io_threads)
        st = self._store.stats()
        logger.info("L2 disk %s: %s, %d objects (%s) found in %.2f s%s", path, format_size(size), st["objects"],
                    format_size(st["bytes_used"]), st["scan_seconds"],
                    f", {st['dropped_at_scan']} damaged or unfinished files removed" if st["dropped_at_scan"] else "")

    def put(self, keys, formats, ptrs, sizes):
        return self._store.put(keys, formats, ptrs, sizes)

    def get(self, keys, formats, ptrs, capacities):
        return self._store.get(keys, formats, ptrs, capacities)

    def lookup(self, keys):
        return self._store.lookup(keys)

    def remove(self, keys):
        return self._store.remove(keys)

    def stats(self) -> dict:
        return {"path": self.path, **self._store.stats()}

    def close(self) -> None:
        self._store = None
