"""`lmcache-mp-server doctor`: would a server with these settings work on this machine?

Checks, each one line with OK, WARN or FAIL and, for a problem, what to do: the build (CUDA
compiled in, for which architectures), the GPUs (names, UUIDs, compute capability against the
build, NUMA node), CUDA IPC between two processes (a real export and open), page-locked memory
(`ulimit -l`, /proc/meminfo) against --l1-size, /dev/shm for the CPU device, the endpoint and the
HTTP address (bound and released, leaving no socket file), and each L2 target configured
(reachable or not). Everything the server itself checks before it starts (server/ops/resources.py:
L1 against the memory available, the socket files' group and folder, the CURVE keys, the tenants
file, the audit log's folder, a taken HTTP address, the disk tier's folder) is
checked with the same functions, and fails the same way. Exit code 0 only when nothing FAILs for
the configured device.

Run it before a server starts (a systemd ExecStartPre, a Kubernetes init container), not beside
a running one: that server's L1 has taken the memory the check looks for, and its endpoint is taken.
"""

from __future__ import annotations

import os
import resource
import shutil
import socket
import subprocess
import sys
from urllib.parse import urlparse

from lmcache_mp.config import ServerConfig, format_size, is_ipv6_url
from lmcache_mp.server.ops.resources import (check_audit_log, check_curve_clients, check_curve_secret_key,
                                         check_http_addr, check_ipc_group, check_l1_fits, check_l2_disk,
                                         check_socket_folder, check_tenants_file, free_space, http_answerer, l1_limit,
                                         meminfo)

OK, WARN, FAIL = "OK", "WARN", "FAIL"

IPC_CHILD = """
import sys
from lmcache_mp import native
ev = native.cuda.open_event(bytes.fromhex(sys.argv[1]), int(sys.argv[2]))
native.cuda.event_synchronize(ev)
print("opened")
"""


class Report:
    def __init__(self, out=None):
        self.out, self.failed = out or sys.stdout, 0

    def line(self, status: str, what: str, fix: str = "") -> None:
        self.failed += status == FAIL
        print(f"[{status:4s}] {what}" + (f"\n       -> {fix}" if fix else ""), file=self.out)


def _gpus() -> list[dict]:
    from lmcache_mp import native

    out = []
    for d in range(native.cuda.device_count()):
        bus = native.cuda.device_pci_bus_id(d).lower()
        numa = None
        try:
            with open(f"/sys/bus/pci/devices/{bus}/numa_node") as f:
                numa = int(f.read())
        except (OSError, ValueError):
            pass
        out.append({"device": d, "name": native.cuda.device_name(d), "uuid": native.cuda.device_uuid(d).hex(),
                    "bus": bus, "numa": numa, "cc": _compute_capability(d)})
    return out


def _compute_capability(device: int) -> str:
    try:
        out = subprocess.run(["nvidia-smi", "-i", str(device), "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        return out.replace(".", "")
    except (OSError, subprocess.SubprocessError):
        return ""


def check_build(r: Report, info: dict, device: str) -> None:
    if info["cuda"]:
        r.line(OK, f"build: lmcache-mp {info['version']}, CUDA data plane ({info['cuda_compiler']}, architectures "
               f"{info['cuda_architectures']})")
    else:
        r.line(FAIL if device == "cuda" else OK, f"build: lmcache-mp {info['version']}, CPU only (no CUDA data plane)",
               "reinstall with LMCACHE_MP_CUDA=ON (nvcc from PATH, or the registry's CUDA packages when there is "
               "none)" if device == "cuda" else "")


def check_gpus(r: Report, info: dict, device: str) -> list[dict]:
    if not info["cuda"]:  # (the build's line FAILs device cuda; auto runs on the CPU, as meant on such a machine)
        if device == "auto":
            r.line(OK, "GPUs: not used (a build without CUDA: device auto is the CPU)")
        return []
    gpus = _gpus()
    if not gpus:  # a CPU-only machine: device auto is the CPU (the device line of the server's start says so)
        r.line(FAIL if device == "cuda" else OK,
               "GPUs: none visible (no NVIDIA driver, no device, or CUDA_VISIBLE_DEVICES hides them)"
               + (": device auto is the CPU" if device == "auto" else ""),
               "give this process every GPU of the node (in a container: --gpus all, or the device plugin)"
               if device == "cuda" else "")
        return []
    archs = info["cuda_architectures"].split(",")
    machine_code = {a.split("-")[0] for a in archs}  # "90-real": sm_90 code; "120": code and PTX
    ptx = [int(a) for a in archs if a.isdigit()]
    for g in gpus:
        if not g["cc"] or g["cc"] in machine_code:
            status, fix = OK, ""
        elif any(p <= int(g["cc"]) for p in ptx):
            status, fix = WARN, "runs through the driver's PTX compiler (a slow first start): rebuild with " \
                                f"CMAKE_CUDA_ARCHITECTURES={g['cc']}"
        else:
            status, fix = FAIL, f"the build has no code for sm_{g['cc']}: rebuild with " \
                                f"CMAKE_CUDA_ARCHITECTURES={g['cc']}"
        numa = f", NUMA node {g['numa']}" if g["numa"] is not None and g["numa"] >= 0 else ""
        r.line(status, f"GPU {g['device']}: {g['name']}, GPU-{_uuid(g['uuid'])}, sm_{g['cc'] or '?'}, "
               f"PCI {g['bus']}{numa}", fix)
    return gpus


def _uuid(h: str) -> str:
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def check_ipc(r: Report, gpus: list[dict]) -> None:
    if not gpus:
        return
    from lmcache_mp import native

    ev = None
    try:
        ev = native.cuda.create_event(0, True)
        handle = native.cuda.event_ipc_handle(ev).hex()
        out = subprocess.run([sys.executable, "-c", IPC_CHILD, handle, "0"], capture_output=True, text=True, timeout=60)
        if out.returncode == 0 and "opened" in out.stdout:
            r.line(OK, "CUDA IPC: another process opened this one's interprocess event")
        else:
            r.line(FAIL, f"CUDA IPC between two processes failed: {(out.stderr or out.stdout).strip()[-300:]}",
                   "engines and the server must share the IPC namespace and see the same GPUs (Kubernetes: "
                   "hostIPC or one pod; Docker: --ipc=host); see docs/DEPLOYMENT.md")
    except Exception as e:  # noqa: BLE001 - reported
        r.line(FAIL, f"CUDA IPC: {e}", "see docs/DEPLOYMENT.md")
    finally:
        if ev is not None:
            native.cuda.destroy_event(ev)


def _start_check(r: Report, label: str, what: str, check, config: ServerConfig, ok: str = "") -> bool:
    """One of the server's own start-up checks (of the setting `what`): FAIL with its message, or
    OK (with `ok`)."""
    try:
        check(config, "--" + what.replace("_", "-"))
    except ValueError as e:
        r.line(FAIL, f"{label}: {e}")
        return False
    if ok:
        r.line(OK, ok)
    return True


def check_memory(r: Report, config: ServerConfig, gpus: list[dict]) -> None:
    l1 = int(config.l1_size)
    avail = meminfo().get("MemAvailable", 0)
    if avail:
        _start_check(r, "memory", "l1_size", check_l1_fits, config, f"memory: --l1-size {format_size(l1)}, at most "
                     f"{format_size(l1_limit())} ({format_size(avail)} available)")
    if gpus:  # L1 is page-locked on the cuda device
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        if os.geteuid() == 0 or soft == resource.RLIM_INFINITY or soft >= l1:
            r.line(OK, "page-locked memory: " + ("unlimited" if soft == resource.RLIM_INFINITY or os.geteuid() == 0
                                                else format_size(soft)) + " (ulimit -l)")
        else:
            r.line(WARN, f"page-locked memory limit (ulimit -l) {format_size(soft)} < --l1-size; CUDA pins with "
                   "cudaHostRegister, which most drivers allow beyond it, but some set-ups refuse",
                   "raise it: LimitMEMLOCK=infinity (systemd), or ulimit -l unlimited")


def check_l1_persist(r: Report, config: ServerConfig) -> None:
    if not config.l1_persist:
        return
    folder = os.path.dirname(os.path.abspath(config.l1_persist))
    if not os.access(folder, os.W_OK):
        r.line(FAIL, f"--l1-persist {config.l1_persist}: {folder} is not writable", "pick a file on /dev/shm")
        return
    have = os.path.getsize(config.l1_persist) if os.path.exists(config.l1_persist) else 0
    free = shutil.disk_usage(folder).free + have
    status = OK if free >= int(config.l1_size) else FAIL
    r.line(status, f"--l1-persist {config.l1_persist}: {format_size(free)} available for {format_size(config.l1_size)}"
           + (" (an arena file is there: a server re-attaches it)" if have else ""),
           "" if status == OK else "enlarge /dev/shm (or the hugetlbfs mount), or lower --l1-size")


def check_shm(r: Report, config: ServerConfig, gpus: list[dict]) -> None:
    if config.device == "cuda" or (config.device == "auto" and gpus):
        return
    try:
        total, _, free = shutil.disk_usage("/dev/shm")
    except OSError as e:
        r.line(FAIL, f"/dev/shm: {e}", "the CPU device shares KV caches through /dev/shm: mount it")
        return
    status = OK if free >= 1 << 30 else WARN
    r.line(status, f"/dev/shm: {format_size(free)} free of {format_size(total)} (the CPU device's KV caches live "
           "there)", "" if status == OK else "enlarge it (Docker: --shm-size=16g; Kubernetes: an emptyDir with "
           "medium Memory)")


def check_endpoint(r: Report, config: ServerConfig) -> None:
    import errno

    import zmq

    if not (_start_check(r, "socket files", "ipc_group", check_ipc_group, config)
            and _start_check(r, "endpoint", "url", check_socket_folder, config)):
        return
    ipc = config.url[len("ipc://"):] if config.url.startswith("ipc://") else ""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    if is_ipv6_url(config.url):
        sock.setsockopt(zmq.IPV6, 1)
    try:
        if ipc and os.path.lexists(ipc):
            from lmcache_mp.server.transport.socket_files import server_answers

            if server_answers(ipc, socket.SOCK_STREAM, "the endpoint"):
                r.line(FAIL, f"endpoint {config.url}: another server answers there", "stop it, or pick another --url")
            else:
                r.line(OK, f"endpoint {config.url}: a socket file nothing answers on (a killed server's): a new "
                       "server takes it over")
        else:
            sock.bind(config.url)
            r.line(OK, f"endpoint {config.url}: can be bound")
            if ipc:  # the file the bind made is no server's: a server started later would take it for a killed one's
                sock.close(0)
                os.unlink(ipc)
    except (zmq.ZMQError, OSError) as e:
        taken = getattr(e, "errno", None) == errno.EADDRINUSE
        r.line(FAIL, f"endpoint {config.url}: {e}",
               "another server may be running there; pick another --url" if taken else "pick another --url")
    finally:
        sock.close(0)
        ctx.term()
    if config.http_addr != "off" and _start_check(r, "HTTP", "http_addr", check_http_addr, config):
        if check_http_addr(config):
            r.line(OK, f"HTTP {config.http_addr}: can be bound")
        else:
            r.line(WARN, f"HTTP {config.http_addr}: taken ({http_answerer(config.http_addr)} answers there): the "
                   "server would serve /metrics and /health on a free port of that host instead, and log which",
                   "set --http-addr to an address of its own (probes and Prometheus find it there)")


def check_access(r: Report, config: ServerConfig) -> None:
    """Who gets in and what is recorded: the CURVE keys, the tenants file, the audit log."""
    if config.curve_secret_key and _start_check(r, "CURVE", "curve_secret_key", check_curve_secret_key, config):
        r.line(OK, f"CURVE: secret key {config.curve_secret_key}")
    if config.curve_clients:
        _start_check(r, "CURVE", "curve_clients", check_curve_clients, config,
                     f"CURVE: client keys in {config.curve_clients}")
    if config.tenants:
        _start_check(r, "tenants", "tenants", check_tenants_file, config, f"tenants file {config.tenants}: valid")
    if config.audit_log:
        _start_check(r, "audit log", "audit_log", check_audit_log, config, f"audit log {config.audit_log}: writable")


def _reachable(host: str, port: int) -> str:
    try:
        socket.create_connection((host, port), timeout=2).close()
        return ""
    except OSError as e:
        return e.strerror or str(e)


def check_l2(r: Report, config: ServerConfig) -> None:
    if config.l2_disk and _start_check(r, "L2 disk", "l2_disk", check_l2_disk, config):
        path = config.l2_disk
        free, parent = free_space(path)
        if config.l2_disk_size > free:
            r.line(WARN, f"L2 disk {path}: --l2-disk-size {format_size(config.l2_disk_size)} but {format_size(free)} "
                   "free (chunks already there aside): once the disk is full, writes are dropped",
                   "lower --l2-disk-size, or leave it 0 (90% of the free space)")
        else:
            r.line(OK, f"L2 disk {path}: writable, {format_size(free)} free")
    if config.l2_redis:
        from lmcache_mp.storage.l2.resp import Connection, RespError
        from lmcache_mp.storage.l2.valkey_nodes import parse_url, redacted

        where = parse_url(config.l2_redis)
        for host, port in where.pop("seeds"):
            try:
                Connection(host, port, timeout=2, **where).call("PING")
                r.line(OK, f"L2 valkey {host}:{port}: answers")
            except (OSError, RespError) as e:
                r.line(WARN, f"L2 valkey {host}:{port} ({redacted(config.l2_redis)}): {e}",
                       "the server still starts and serves from L1; check the address, password and TLS options")
    if config.l2_mooncake:
        host, _, port = config.l2_mooncake.rpartition(":")
        err = _reachable(host, int(port))
        meta = config.l2_mooncake_metadata
        m = urlparse(meta) if meta else None
        meta_err = _reachable(m.hostname, m.port or 80) if m and m.hostname else ""
        try:
            import mooncake.store  # noqa: F401
        except Exception as e:  # noqa: BLE001 - an ImportError, or libibverbs missing
            r.line(WARN, f"L2 mooncake: the client does not load ({e})",
                   "pip install '.[mooncake]' in lmcache-mp's clone (the mooncake-transfer-engine-non-cuda package); "
                   "apt-get install libibverbs1")
        if err or meta_err:
            r.line(WARN, f"L2 mooncake master {config.l2_mooncake}: {err or 'ok'}; metadata {meta or '-'}: "
                   f"{meta_err or 'ok'}", "the server still starts and serves from L1; start mooncake_master")
        else:
            r.line(OK, f"L2 mooncake master {config.l2_mooncake} and its metadata server: reachable")


def run(config: ServerConfig, out=None) -> int:
    from lmcache_mp.native import build_info

    r = Report(out)
    info = build_info()
    check_build(r, info, config.device)
    gpus = check_gpus(r, info, config.device)
    check_ipc(r, gpus)
    check_memory(r, config, gpus)
    check_shm(r, config, gpus)
    check_l1_persist(r, config)
    check_endpoint(r, config)
    check_access(r, config)
    check_l2(r, config)
    verdict = "would work" if not r.failed else f"would not work ({r.failed} problem(s) above)"
    print(f"lmcache-mp-server with these settings (device {config.device}) {verdict}", file=r.out)
    return 1 if r.failed else 0
