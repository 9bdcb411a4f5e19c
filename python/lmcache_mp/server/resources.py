"""What this machine has for the settings: memory for L1, the group and folder of the socket files,
a disk for the disk tier. Checked at start-up (run_cache_server, before anything is made) and by
`lmcache-mp-server doctor`, with the same functions and the same words.

An L1 larger than the memory available cannot work: the server refuses to start and says how much
there is (L1 is faulted in or page-locked in the background after the start, so without this
check such a server starts and is killed later, or fails with a bare `Cannot allocate memory`). A
disk tier larger than its disk's free space only warns: the tier is lossy (a write the full disk
refuses is a dropped chunk, never a failed request), its own files from an earlier run are part of
its size and not of the free space, and the free space of a shared disk changes while the server
runs.
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
import shutil
import tempfile

from lmcache_mp.config import ServerConfig, format_size

logger = logging.getLogger(__name__)

L1_SHARE_OF_AVAILABLE = 0.9  # of the memory available at the start: the rest is the machine's
# Filesystems that hold no files of their own: a disk tier there cannot work.
PSEUDO_FILESYSTEMS = {"proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs",
                      "securityfs", "pstore", "bpf", "configfs", "fusectl", "mqueue", "efivarfs", "autofs",
                      "binfmt_misc", "rpc_pipefs", "nsfs"}


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


def l1_limit() -> int:
    """The largest L1 this machine takes now (0: unknown, no limit)."""
    return int(meminfo().get("MemAvailable", 0) * L1_SHARE_OF_AVAILABLE)


def check_l1_fits(config: ServerConfig, setting: str = "l1_size") -> None:
    """ValueError if L1 exceeds what the machine's memory allows now (l1_limit)."""
    most, l1 = l1_limit(), int(config.l1_size)
    if most and l1 > most:
        raise ValueError(f"{setting} {format_size(l1)} is more than this machine's memory allows: {memory_note()}; "
                         f"give L1 at most {format_size(most)} ({L1_SHARE_OF_AVAILABLE:.0%} of what is available)")


def _group_id(group: str) -> int:
    try:
        return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise ValueError(f"ipc_group {group!r}: no such group on this machine (groupadd it, or name another)") from None


def check_ipc_group(config: ServerConfig, setting: str = "ipc_group") -> None:
    """ValueError unless the group exists and this process may give its socket files to it (it is
    root or in the group)."""
    if not config.ipc_group:
        return
    gid = _group_id(config.ipc_group)
    if os.geteuid() == 0 or gid == os.getegid() or gid in os.getgroups():
        return
    try:
        user = pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        user = str(os.geteuid())
    raise ValueError(f"{setting} {config.ipc_group!r}: this server's user {user} is not in that group, so its socket "
                     f"files cannot be given to it: add the user to it (usermod -aG {config.ipc_group} {user}), or "
                     "name a group of the user's")


def check_socket_folder(config: ServerConfig, setting: str = "url") -> None:
    """ValueError unless the folder of an ipc:// endpoint exists and this process may make files in it."""
    if not config.url.startswith("ipc://"):
        return
    folder = os.path.dirname(os.path.abspath(config.url[len("ipc://"):]))
    if not os.path.isdir(folder):
        raise ValueError(f"{setting} {config.url}: its folder {folder} does not exist: create it (the systemd unit's "
                         "RuntimeDirectory= does), or pick another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{setting} {config.url}: this server's user may not make files in {folder}")


def _filesystem_type(path: str) -> str:
    """The type of the filesystem path is on (its mount point is the longest one above it)."""
    best, kind = "", ""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                    best, kind = mount, parts[2]
    except OSError:
        pass
    return kind


def check_l2_disk(config: ServerConfig, setting: str = "l2_disk") -> None:
    """ValueError unless the disk tier's path is (or can become) a folder of files on a real
    filesystem with free space, where this process can make files."""
    if not config.l2_disk:
        return
    path = os.path.abspath(config.l2_disk)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{setting} {config.l2_disk}: exists and is not a folder")
    free, parent = free_space(path)
    kind = _filesystem_type(parent)
    if kind in PSEUDO_FILESYSTEMS:
        raise ValueError(f"{setting} {config.l2_disk}: on a {kind} filesystem, which holds no files: pick a folder "
                         "on a disk")
    try:  # as root every folder looks writable: make a file to know
        fd, probe = tempfile.mkstemp(prefix=".lmcache-mp-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{setting} {config.l2_disk}: cannot make files in {parent} ({e.strerror or e})") from None
    if not free and not config.l2_disk_size:
        raise ValueError(f"{setting} {config.l2_disk}: its filesystem has no free space")


def check_start(config: ServerConfig, setting=lambda name: name) -> None:
    """Everything the machine must give these settings (ValueError, naming the setting as
    setting(name) does); warnings for what only may go wrong."""
    check_l1_fits(config, setting("l1_size"))
    check_ipc_group(config, setting("ipc_group"))
    check_socket_folder(config, setting("url"))
    check_l2_disk(config, setting("l2_disk"))
    check_l2_disk_fits(config, setting("l2_disk_size"))


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
