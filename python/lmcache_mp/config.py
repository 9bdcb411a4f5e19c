"""Server configuration: one dataclass; CLI > LMCACHE_MP_* environment > --config TOML > defaults."""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import tomllib
from dataclasses import dataclass, field, fields
from typing import Any, Mapping
from urllib.parse import urlparse

from lmcache_mp.sizes import format_size, parse_size  # noqa: F401 (the config's sizes, also imported from here)
from lmcache_mp.storage.eviction import DEFAULT_POLICY, POLICIES

ENV_PREFIX = "LMCACHE_MP_"
# LMCACHE_MP_* variables that are no server setting (the server's are its fields, upper case).
OTHER_ENV_VARS = {
    "LMCACHE_MP_CUDA": "the build: ON, OFF or AUTO, whether to compile the CUDA data plane",
    "LMCACHE_MP_CURVE_SERVER_KEY": "clients: the server's CURVE public key file",
    "LMCACHE_MP_CURVE_CLIENT_KEY": "clients: their own CURVE secret key file",
    "LMCACHE_MP_COPY_PRIORITY": "clients copying their own chunks: low or high stream priority",
    "LMCACHE_MP_PACK_CTAS": "clients copying their own chunks: CTAs of the packing kernels (0: chosen)",
}
DEVICES = ("auto", "cpu", "cuda")
EVICTION_POLICIES = tuple(POLICIES)
TRANSFER_MODES = ("auto", "direct", "staged", "dma")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEFAULT_HTTP_ADDR = "127.0.0.1:9099"
L2_WRITE_POLICIES = ("evicted", "all", "none")
L2_WRITE_FIELDS = ("l2_write", "l2_disk_write", "l2_redis_write", "l2_mooncake_write")
L2_CODECS = ("none", "fp8")
L2_CODEC_FIELDS = ("l2_disk_codec", "l2_redis_codec", "l2_mooncake_codec")
_SIZE_FIELDS = ("l1_size", "staging_size", "slab_size", "l2_disk_size", "l2_queue_size",
                "l2_mooncake_segment", "hint_budget")  # int or a string with units

def _setting(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class ServerConfig:
    """Settings of one cache server. Sizes accept ints (bytes) or strings like '64GiB'."""

    url: str = _setting(
        "tcp://127.0.0.1:5555", "ZeroMQ endpoint to bind: tcp://HOST:PORT (port 0 picks a free one) or ipc:///path")
    l1_size: int | str = _setting("4GiB", "host memory for cached chunks; page-locked on the cuda device")
    chunk_size: int = _setting(256, "tokens per chunk: the unit of hashing, lookup and storage")
    tp_shared: bool = _setting(
        False, "every registration stores tensor-parallel-shared chunks (one object per chunk with every KV head, "
               "each rank writing and reading its heads' slice: engines of any TP size share them), and lookups "
               "find those; a registration whose head split the server cannot prove is refused. Without it a "
               "registration opts in itself (tp_shared=True; docs/tensor-parallel.md)")
    tp_shared_timeout: float = _setting(
        10.0, "seconds a tp-shared chunk waits for its other ranks' slices once none is being written (from the "
              "last one's start or landing); then it is dropped, never served half written")
    device: str = _setting(
        "auto", "cpu: KV caches in shared memory; cuda: GPU caches over CUDA IPC; auto: cuda when usable")
    transfer_mode: str = _setting(
        "auto", "GPU copy path: direct (zero-copy kernel), staged (device ring + DMA), dma (copy engines only); "
        "auto: dma for caches whose blocks are contiguous spans of 768 KiB or more, else staged")
    staging_size: int | str = _setting(
        "256MiB", "device staging ring per registration and direction (staged); deep enough to pack ahead")
    direct_ctas: int = _setting(
        4, "with --transfer-mode direct, how many thread blocks (CTAs) of the GPU its copy kernel takes: a few "
           "already reach PCIe line rate, and every one more is an SM the engine loses while a transfer runs")
    slab_size: int | str = _setting(
        "256MiB", "L1 is handed out in slabs of this size, each cut into slots of one chunk size; memory moves "
                  "between chunk sizes a whole slab at a time. One rank's chunk must fit in a slab, which is at "
                  "most l1_size/16; smaller slabs leave less memory idle when layouts of several sizes share L1. "
                  "The default suits chunks up to 256 MiB")
    eviction_policy: str = _setting(
        DEFAULT_POLICY, "which chunks L1 and the disk tier keep: switch (runs whichever of adaptive, arc, s3fifo and "
        "lru is winning on sampled miniature caches, about 2x one policy's CPU), adaptive (frequency, whole prompts and "
        "an admission share learned from the traffic), follow (evicts as whichever of adaptive, arc, s3fifo and lru is winning on "
        "miniature caches: more hits on agentic traffic for about 7x the policy's CPU; docs/eviction.md), lru, arc "
        "or s3fifo")
    l1_persist: str = _setting(
        "", "a file (on /dev/shm or hugetlbfs) that holds L1, with PATH.journal: a restarted server re-attaches the "
        "chunks in it (SIGTERM or SIGKILL) and serves them at once (empty: L1 ends with the process)")
    lease_ttl: float = _setting(30.0, "seconds a lookup lease lives unless a retrieve or release ends it")
    hint_budget: int | str = _setting(
        0, "L1 bytes one tenant's pins (the application's hints, docs/hints.md) may hold at once; a tenants file's "
           "hint_budget overrides it per tenant (0: a quarter of L1)")
    kv_events: int = _setting(
        65536, "chunk events (stored, removed) kept for readers of the event feed, e.g. the vLLM connector's KV "
               "events for routers (0: none)")
    max_registrations_per_client: int = _setting(
        64, "KV caches one client may have registered at once (more are refused: LIMIT_EXCEEDED)")
    max_queued_requests: int = _setting(
        1024, "stores and retrieves of one registration queued or running at once (more are refused: LIMIT_EXCEEDED)")
    drain_timeout: float = _setting(
        30.0, "seconds a stopping server (SIGTERM) gives the requests it took to finish")
    heartbeat_timeout: float = _setting(
        10.0, "seconds of client silence after which its leases and registrations are dropped")
    cpu_threads: int = _setting(0, "threads for CPU copies (0: one per core, at most 16)")
    local_lane: bool = _setting(
        True, "also take small requests of clients on this machine on a unix datagram socket (no ZeroMQ "
              "I/O threads on their way; clients that cannot reach it use ZeroMQ)")
    spin_us: int = _setting(
        -1, "microseconds the socket thread polls without sleeping after a request, so that the next one "
            "finds it awake (a sleeping thread takes tens of microseconds to wake; 0: always sleep; "
            "-1: 5000 on machines of at least 8 cores, else 0)")
    l2_disk: str = _setting("", "directory of the local-disk L2 tier, kept across restarts (empty: no disk tier)")
    l2_disk_size: int | str = _setting(
        "0", "bytes the disk tier may use (0: 90% of the free space of its filesystem at start)")
    l2_disk_write: str = _setting(
        "", "what goes to the disk tier: evicted (what L1 is about to evict, written ahead of the eviction), all "
            "(every chunk, soon after it is stored) or none (empty: --l2-write if given, else evicted)")
    l2_redis: str = _setting(
        "", "a Valkey/Redis server shared by every node, redis://[user:password@]host:port[/db]; several "
            "host:port separated by commas are seeds of a cluster; rediss:// is TLS, with ?ssl_ca_certs=FILE, "
            "ssl_certfile=, ssl_keyfile=, ssl_cert_reqs=none (empty: none)")
    l2_redis_cluster: bool = _setting(False, "the Valkey/Redis server is a cluster (also when only one seed is given)")
    l2_redis_prefix: str = _setting("lmcache", "prefix of this cache's keys on the Valkey/Redis server")
    l2_redis_ttl: float = _setting(0.0, "seconds a chunk lives on the Valkey/Redis server (0: until evicted there)")
    l2_redis_write: str = _setting(
        "", "what goes to Valkey/Redis: all, evicted or none (empty: --l2-write if given, else all: other nodes find "
            "a chunk soon after it is stored)")
    l2_mooncake: str = _setting("", "a Mooncake Store master, host:port (empty: none)")
    l2_mooncake_metadata: str = _setting(
        "", "the Mooncake metadata server (default: the master's, http://<master host>:8080/metadata)")
    l2_mooncake_segment: int | str = _setting("4GiB", "host memory this server contributes to the Mooncake pool")
    l2_disk_codec: str = _setting(
        "none", "what the disk tier stores of a chunk: none (its bytes) or fp8 (16-bit KV as FP8 E4M3 with a scale "
        "per head: half the bytes; docs/compression.md)")
    l2_redis_codec: str = _setting("none", "the same for Valkey/Redis")
    l2_mooncake_codec: str = _setting("none", "the same for Mooncake Store")
    l2_mooncake_write: str = _setting(
        "", "what goes to Mooncake Store: all, evicted or none (empty: --l2-write if given, else all)")
    l2_write: str = _setting(
        "", "what goes to every L2 tier not given a policy of its own (--l2-disk-write, --l2-redis-write, "
            "--l2-mooncake-write): evicted, all or none (empty: each tier's default, evicted for the disk, all for "
            "the shared tiers)")
    l2_admit: int = _setting(
        1, "a chunk goes to L2 only once stored or looked up this many times (keeps one-off chunks off the disk)")
    l2_queue_size: int | str = _setting(
        "0", "how far ahead of L1's eviction the L2 writers work: once less than this much of L1 is free they "
             "write the chunks L1 evicts next (nearest first), so that eviction finds them written; one write "
             "holds at most this much of L1. Larger absorbs longer bursts of stores before writes are dropped "
             "(0: a quarter of L1; at most half of L1)")
    l2_io_threads: int = _setting(4, "threads of each L2 tier's I/O")
    prefetch_timeout: float = _setting(
        0.5, "seconds a lookup with lock waits for chunks found in L2 to reach L1 before it answers")
    max_prefetches: int = _setting(64, "lookups whose L2 chunks load at once (more: answered from L1 alone)")
    numa_node: int = _setting(-1, "NUMA node of the arena (-1: the first GPU's node where known)")
    curve_secret_key: str = _setting(
        "", "the server's CURVE secret key file (lmcache-mp-server keygen DIR makes it): encrypted, authenticated "
        "ZeroMQ; required to bind TCP on an address other than loopback")
    curve_clients: str = _setting(
        "", "with CURVE: a folder of the public keys of the clients let in (empty: any client that knows the "
        "server's public key)")
    tenants: str = _setting(
        "", "a TOML file of tenants (docs/tenants.md): each connection's credential (CURVE key; uid/gid on ipc://) "
        "names its tenant, whose keys no other tenant can see; SIGHUP re-reads it")
    audit_log: str = _setting(
        "", "a file the server appends JSON lines to: connections accepted and refused, registrations, tenants "
        "file reloads, quota breaches")
    ipc_group: str = _setting(
        "", "ipc:// socket files are 0600 (this user only); with a group (name or id) 0660 of that group")
    http_addr: str = _setting(
        DEFAULT_HTTP_ADDR, "HOST:PORT of the HTTP listener for /metrics, /live, /health and /status (off: none; "
        "when the default is taken by another server, this one takes a free port of that host and says which)")
    log_level: str = _setting("INFO", "DEBUG, INFO, WARNING or ERROR")

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name))
        if self.log_level.upper() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        self.l1_size = parse_size(self.l1_size)
        self.staging_size = parse_size(self.staging_size)
        self.slab_size = parse_size(self.slab_size)
        self.l2_disk_size = parse_size(self.l2_disk_size)
        self.l2_queue_size = parse_size(self.l2_queue_size)
        self.l2_mooncake_segment = parse_size(self.l2_mooncake_segment)
        self.hint_budget = parse_size(self.hint_budget)
        for name in L2_WRITE_FIELDS:
            if getattr(self, name) not in ("", *L2_WRITE_POLICIES):
                raise ValueError(f"{name} must be one of {L2_WRITE_POLICIES}, got {getattr(self, name)!r}")
        if self.l2_admit < 1 or self.l2_io_threads < 1 or self.max_prefetches < 0:
            raise ValueError("l2_admit and l2_io_threads must be at least 1, max_prefetches not negative")
        if self.l2_redis:
            from lmcache_mp.storage.l2.valkey_nodes import parse_url

            parse_url(self.l2_redis)
        if self.l2_redis_ttl < 0:
            raise ValueError(f"l2_redis_ttl must not be negative, got {self.l2_redis_ttl}")
        if self.prefetch_timeout < 0:
            raise ValueError(f"prefetch_timeout must not be negative, got {self.prefetch_timeout}")
        if self.max_registrations_per_client < 1 or self.max_queued_requests < 1 or self.drain_timeout < 0:
            raise ValueError("max_registrations_per_client and max_queued_requests must be at least 1, "
                             "drain_timeout not negative")
        if self.http_addr.lower() in ("", "off", "none"):
            self.http_addr = "off"
        else:
            parse_addr(self.http_addr)
        if not re.match(r"^(tcp|ipc|inproc)://", self.url):
            raise ValueError(f"url must start with tcp://, ipc:// or inproc://, got {self.url!r}")
        if self.url.startswith("tcp://"):
            tcp_host_port(self.url)
        if not self.curve_secret_key and not is_loopback_url(self.url):
            raise ValueError(f"binding {self.url} lets other machines in: it needs authentication. Run "
                             "`lmcache-mp-server keygen DIR` and pass --curve-secret-key DIR/server.key_secret "
                             "(see docs/OPERATIONS.md), or bind a loopback address or ipc://")
        if self.curve_clients and not self.curve_secret_key:
            raise ValueError("curve_clients needs curve_secret_key")
        if self.tenants and self.curve_clients:
            raise ValueError("tenants and curve_clients both say which clients get in: with tenants, put the "
                             "clients' keys in the tenants file (curve_keys)")
        if self.tenants and not self.curve_secret_key and not self.url.startswith("ipc://"):
            raise ValueError("tenants need credentials the server can check: CURVE (curve_secret_key) or an ipc:// "
                             "endpoint (the kernel's uid/gid of each peer)")
        if self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {self.chunk_size}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.transfer_mode not in TRANSFER_MODES:
            raise ValueError(f"transfer_mode must be one of {TRANSFER_MODES}, got {self.transfer_mode!r}")
        for name in L2_CODEC_FIELDS:
            if getattr(self, name) not in L2_CODECS:
                raise ValueError(f"{name} must be one of {L2_CODECS}, got {getattr(self, name)!r}")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be one of {EVICTION_POLICIES}, got {self.eviction_policy!r}")
        if self.slab_size < 4096 or self.slab_size % 4096:
            raise ValueError(f"slab_size must be a multiple of 4 KiB, got {self.slab_size}")
        # A small L1 gets small slabs: memory moves between object sizes a slab at a time, and
        # each size may keep up to a slab of free slots, so a slab should be a small part of L1.
        # (The start-up line says so when it cuts the slab size: slab_cut_from.)
        asked, self.slab_size = self.slab_size, min(self.slab_size, max(4096, (self.l1_size // 16) // 4096 * 4096))
        self.slab_cut_from = asked if asked != self.slab_size else 0
        if self.l1_size < self.slab_size:
            raise ValueError(f"l1_size ({format_size(self.l1_size)}) must hold at least one slab")
        if self.spin_us < 0:
            from lmcache_mp.native import default_spin_us

            self.spin_us = default_spin_us()
        if self.spin_us > 1_000_000:
            raise ValueError(f"spin_us must be at most 1000000, got {self.spin_us}")
        if self.lease_ttl <= 0 or self.heartbeat_timeout <= 0:
            raise ValueError("lease_ttl and heartbeat_timeout must be positive")
        if self.tp_shared_timeout <= 0:
            raise ValueError(f"tp_shared_timeout must be positive, got {self.tp_shared_timeout}")
        if self.direct_ctas <= 0:
            raise ValueError("direct_ctas must be positive")
        self.given: frozenset[str] = frozenset()  # the settings a source named (from_sources), not defaults

    def l2_write_of(self, tier: str, default: str) -> str:
        """The write policy of one tier (disk, redis or mooncake): its own setting, else
        --l2-write, else the tier's default."""
        return getattr(self, f"l2_{tier}_write") or self.l2_write or default

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_sources(
        cls,
        cli: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        config_file: str | None = None,
    ) -> "ServerConfig":
        """Merge settings: CLI values (None = not given) > LMCACHE_MP_* env > TOML file > defaults."""
        names = set(cls.field_names())
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}  # where each value came from, for the messages
        if config_file:
            data = read_config_file(config_file)
            unknown = set(data) - names
            if unknown:
                raise ValueError(f"config file {config_file}: unknown settings {sorted(unknown)} "
                                 f"(known: the names of --help's flags with _ for -, e.g. l1_size)")
            values.update({k: _coerce(k, v, f"config file {config_file}") for k, v in data.items()})
            sources.update({k: f"config file {config_file}" for k in data})
        env = os.environ if env is None else env
        check_env_names(env, names)
        for name in names:
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is not None:
                values[name] = _coerce(name, raw, ENV_PREFIX + name.upper())
                sources[name] = ENV_PREFIX + name.upper()
        for name, v in (cli or {}).items():
            if v is not None and name in names:
                values[name] = _coerce(name, v, "--" + name.replace("_", "-"))
                sources[name] = "--" + name.replace("_", "-")
        try:
            config = cls(**values)
            config.given = frozenset(values)
            return config
        except ValueError as e:  # a check across settings (ranges, combinations): say where they came from
            found = {name: m.start() for name in sources if (m := re.search(rf"\b{name}\b", str(e)))}
            named = [f"{name} from {sources[name]}" for name in sorted(found, key=found.get)]
            raise ValueError(f"{e} ({'; '.join(named)})" if named else str(e)) from None


def check_env_names(env: Mapping[str, str], names: set[str]) -> None:
    """A LMCACHE_MP_* variable that is no setting is refused, as a config file's unknown key is:
    a typo would otherwise leave the default in force without a word."""
    import difflib

    known = {ENV_PREFIX + n.upper() for n in names} | set(OTHER_ENV_VARS)
    for var in sorted(v for v in env if v.startswith(ENV_PREFIX) and v not in known):
        close = difflib.get_close_matches(var, sorted(known), n=1)
        raise ValueError(f"environment variable {var}: no such setting" + (f" (did you mean {close[0]}?)" if close
                                                                            else " (see --help for the settings)"))


def read_config_file(path: str) -> dict[str, Any]:
    """The settings of a TOML file (top-level keys or a [server] table); errors name the file."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"config file {path}: no such file") from None
    except OSError as e:
        raise ValueError(f"config file {path}: cannot read it ({e.strerror or e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path}: not valid TOML: {e}") from None
    return data.get("server", data)


_DEFAULTS = {f.name: f.default for f in fields(ServerConfig)}


def parse_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"http_addr must be HOST:PORT (or off), got {addr!r}")
    if int(port) > 65535:
        raise ValueError(f"http_addr: port {port} of {addr!r} is out of range (0-65535; 0 picks a free one)")
    return host.strip("[]"), int(port)


def tcp_host_port(url: str) -> tuple[str, int]:
    """(host, port) of a tcp://HOST:PORT url (an IPv6 host in brackets: tcp://[::1]:5555); a
    ValueError that says what is missing, before ZeroMQ fails with a bare 'Invalid argument'."""
    rest = url[len("tcp://"):]
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or (":" in host and not (host.startswith("[") and host.endswith("]"))):
        raise ValueError(f"url {url!r} is not tcp://HOST:PORT (a port is needed; 0 picks a free one; an IPv6 "
                         "address goes in brackets: tcp://[::1]:5555)")
    if int(port) > 65535:  # ZeroMQ would wrap it round, to another port
        raise ValueError(f"url: port {port} of {url!r} is out of range (0-65535; 0 picks a free one)")
    return host.strip("[]"), int(port)


def is_ipv6_url(url: str) -> bool:
    """A tcp:// url of an IPv6 address: ZeroMQ sockets need their IPV6 option for it."""
    return url.startswith("tcp://[")


def is_loopback_url(url: str) -> bool:
    """tcp:// on a loopback address, or not tcp at all (ipc://, inproc:// stay on this machine)."""
    if not url.startswith("tcp://"):
        return True
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # an interface name or a host name: resolve what it binds
        try:
            return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
        except OSError:
            return False


def _kind(name: str) -> str:
    default = _DEFAULTS[name]
    if isinstance(default, bool):
        return "on or off (true/false, on/off, 1/0)"
    if isinstance(default, float):
        return "a number"
    if isinstance(default, int):
        return "an integer"
    return "a string"


def _check_type(name: str, value: Any) -> None:
    if name in _SIZE_FIELDS:
        return  # parse_size says what is wrong with a size
    kind = _kind(name)
    if isinstance(_DEFAULTS[name], bool):
        ok = isinstance(value, bool)
    elif kind == "a number":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind == "an integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, str)
    if not ok:
        raise ValueError(f"{name} must be {kind}, got {value!r}")


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")  # on/off settings as text


def _coerce(name: str, value: Any, source: str) -> Any:
    """Values from env and files arrive as strings or TOML types: give them the field's type.
    Errors name the source (the file or the environment variable) and the setting."""
    try:
        if name in _SIZE_FIELDS:
            try:
                return parse_size(value)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
        if isinstance(value, str):
            try:
                if isinstance(_DEFAULTS[name], bool):
                    if value.strip().lower() not in _TRUE + _FALSE:
                        raise ValueError(value)
                    return value.strip().lower() in _TRUE
                if _kind(name) == "an integer":
                    return int(value)
                if _kind(name) == "a number":
                    return float(value)
            except ValueError:
                raise ValueError(f"{name} must be {_kind(name)}, got {value!r}") from None
        _check_type(name, value)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    return value
