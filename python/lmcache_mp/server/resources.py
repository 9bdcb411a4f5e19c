"""What this machine has for the settings: memory for L1, disk space for the disk tier. Checked
at start-up (run_cache_server) and by `lmcache-mp-server doctor`.

An L1 larger than the machine's memory cannot work: the server refuses to start and says how much
memory there is (the arena is mapped lazily, so without this check such a server starts and is
killed later, or fails with a bare `Cannot allocate memory`). A disk tier larger than its disk's
free space only warns: the tier is lossy (a write the full disk refuses is a dropped chunk, never
a failed request), its own files from an earlier run are part of its size and not of the free
space, and the free space of a shared disk changes while the server runs.
"""

from __future__ import annotations

import logging
import os
import shutil

from lmcache_mp.config import ServerConfig, format_size

logger = logging.getLogger(__name__)


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes ({} where there is none)."""
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def memory_note() -> str:
    """'N GiB of memory in all, M GiB available', for messages about L1's size."""
    mem = meminfo()
    if "MemTotal" not in mem:
        return "this machine's memory is unknown"
    return (f"this machine has {format_size(mem['MemTotal'])} of memory, "
            f"{format_size(mem.get('MemAvailable', 0))} available now")


def check_l1_fits(config: ServerConfig, setting: str = "l1_size") -> None:
    """ValueError if L1 exceeds the machine's memory; a warning if it exceeds what is available."""
    mem = meminfo()
    total, avail = mem.get("MemTotal", 0), mem.get("MemAvailable", 0)
    l1 = int(config.l1_size)
    if total and l1 > total:
        raise ValueError(f"{setting} {format_size(l1)} is more than this machine's memory: {memory_note()}; "
                         f"give L1 at most {format_size(avail * 8 // 10)}")
    if avail and l1 > avail:
        logger.warning("%s %s is more than the %s of memory available now (of %s): as L1 fills, the machine "
                       "will swap or the kernel will end a process", setting, format_size(l1), format_size(avail),
                       format_size(total))


def free_space(path: str) -> tuple[int, str]:
    """Free bytes of the filesystem `path` is (or will be created) on, and the folder measured."""
    parent = os.path.abspath(path)
    while not os.path.isdir(parent):  # the server makes what is missing below the first that exists
        parent = os.path.dirname(parent)
    return shutil.disk_usage(parent).free, parent


def _bytes_in(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def check_l2_disk_fits(config: ServerConfig, setting: str = "l2_disk_size") -> None:
    """A warning if the disk tier may grow beyond the free space of its disk."""
    if not config.l2_disk or not config.l2_disk_size:  # 0: sized from the free space itself
        return
    free, _ = free_space(config.l2_disk)
    if config.l2_disk_size <= free:
        return
    own = _bytes_in(config.l2_disk) if os.path.isdir(config.l2_disk) else 0  # (walked only when it matters)
    if config.l2_disk_size > free + own:
        logger.warning("L2 disk %s: %s %s is more than its disk can hold (%s free%s): once the disk is full, "
                       "writes to it fail and are dropped (counted in lmcache_mp_l2_write_errors_total); lower "
                       "%s or leave it 0 (90%% of the free space)", config.l2_disk, setting,
                       format_size(config.l2_disk_size), format_size(free),
                       f", plus {format_size(own)} of chunks already there" if own else "", setting)
