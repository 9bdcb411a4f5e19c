"""What this machine has for the settings: memory for L1, the group and folder of the socket files,
the CURVE keys, the tenants file, the audit log's folder, the HTTP address, a disk for the disk
tier. Checked at start-up (run_cache_server, before anything is made) and by
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


def check_curve_secret_key(config: ServerConfig, setting: str = "curve_secret_key") -> None:
    """ValueError unless the CURVE secret key file exists and holds a secret key (pyzmq's own
    words, "Invalid certificate file", name neither the setting nor the fix)."""
    path = config.curve_secret_key
    if not path:
        return
    if not os.path.isfile(path):
        raise ValueError(f"{setting} {path}: no such file (`lmcache-mp-server keygen DIR` makes the server's key, "
                         "DIR/server.key_secret)")
    import zmq.auth

    try:
        _, secret = zmq.auth.load_certificate(path)
    except Exception as e:  # noqa: BLE001 - OSError, ValueError: pyzmq's parse
        raise ValueError(f"{setting} {path}: not a CURVE key file ({e})") from None
    if secret is None:
        raise ValueError(f"{setting} {path}: holds no secret key (a public key file? give the server "
                         "DIR/server.key_secret)")


def check_curve_clients(config: ServerConfig, setting: str = "curve_clients") -> None:
    if config.curve_clients and not os.path.isdir(config.curve_clients):
        raise ValueError(f"{setting} {config.curve_clients}: not a folder of client public keys")


def check_tenants_file(config: ServerConfig, setting: str = "tenants") -> None:
    """ValueError unless the tenants file reads and checks whole (what the server loads at start)."""
    if not config.tenants:
        return
    from lmcache_mp.server.tenancy.tenants_file import load_tenants

    try:
        load_tenants(config.tenants, config.l1_size)  # (the l1_min must fit L1, as at start)
    except ValueError as e:  # TenantsFileError: names the file (and the line)
        raise ValueError(f"{setting} {e}") from None  # ("--tenants FILE: ...")


def check_audit_log(config: ServerConfig, setting: str = "audit_log") -> None:
    """ValueError unless this process can append to the audit log (its folder is not made)."""
    path = config.audit_log
    if not path:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{setting} {path}: the folder {parent} does not exist: create it (mkdir -p {parent})")
    if os.path.exists(path) and not os.access(path, os.W_OK) or not os.path.exists(path) and not os.access(
            parent, os.W_OK | os.X_OK):
        raise ValueError(f"{setting} {path}: this server's user may not write it")


def check_http_addr(config: ServerConfig, setting: str = "http_addr") -> bool:
    """Whether the HTTP address is free (bound and released here); taken, a ValueError when the
    settings named it, and False for the default address, which the server then leaves to the
    other server on it and takes a free port of the same host instead (http_answerer says whose
    the default's answers are)."""
    if config.http_addr == "off":
        return True
    import socket

    from lmcache_mp.config import DEFAULT_HTTP_ADDR, parse_addr

    host, port = parse_addr(config.http_addr)
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as the HTTP server binds)
            s.bind((host, port))
    except OSError as e:
        if config.http_addr != DEFAULT_HTTP_ADDR or "http_addr" in config.given:
            raise ValueError(f"cannot serve HTTP on {config.http_addr} ({setting}): {e.strerror or e}") from None
        return False
    return True


def http_answerer(addr: str) -> str:
    """Who answers HTTP on addr: 'the lmcache-mp server at URL (pid N)', or 'another process'."""
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{addr}/health", timeout=2) as r:
            body = json.loads(r.read())
    except Exception as e:  # noqa: BLE001 - a 503 (starting, draining) still has the body
        try:
            body = json.loads(e.read()) if hasattr(e, "read") else {}
        except Exception:  # noqa: BLE001
            body = {}
    if isinstance(body, dict) and body.get("url"):
        pid = f" (pid {body['pid']})" if body.get("pid") else ""
        return f"the lmcache-mp server at {body['url']}{pid}"
    return "another process (not an lmcache-mp server)"


def check_start(config: ServerConfig, setting=lambda name: name) -> None:
    """Everything the machine must give these settings (ValueError, naming the setting as
    setting(name) does); warnings for what only may go wrong."""
    check_l1_fits(config, setting("l1_size"))
    check_ipc_group(config, setting("ipc_group"))
    check_socket_folder(config, setting("url"))
    check_curve_secret_key(config, setting("curve_secret_key"))
    check_curve_clients(config, setting("curve_clients"))
    check_tenants_file(config, setting("tenants"))
    check_audit_log(config, setting("audit_log"))
    check_http_addr(config, setting("http_addr"))
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
