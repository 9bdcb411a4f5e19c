"""lmcache-mp-server: run a cache server until SIGINT or SIGTERM.

Settings: command line > LMCACHE_MP_* environment > --config FILE (TOML) > defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import re
import sys

from lmcache_mp._version import __version__
from lmcache_mp.config import (DEVICES, EVICTION_POLICIES, L2_CODEC_FIELDS, L2_CODECS, L2_WRITE_FIELDS,
                               L2_WRITE_POLICIES, LOG_LEVELS, TRANSFER_MODES, ServerConfig, format_size)
from lmcache_mp.server.ops.gc_pauses import settle_after_setup

logger = logging.getLogger("lmcache_mp")


SERVER_HELP = ("Standalone multiprocess KV-cache server for LLM inference engines. Commands: "
               "`lmcache-mp-server [settings]` runs a server until SIGINT or SIGTERM; "
               "`lmcache-mp-server doctor [settings]` checks whether a server with those settings would work here "
               "(`doctor --help`); `lmcache-mp-server keygen DIR [--client NAME]` makes CURVE keys (see "
               "--curve-secret-key).")
DOCTOR_HELP = ("Check whether a server with these settings would work on this machine, without starting one: "
               "the build, GPUs (compute capability, NUMA node), CUDA IPC between two processes, memory and the "
               "locked-memory limit, /dev/shm, the endpoint and HTTP address, the CURVE keys, tenants file and audit "
               "log, each L2 target: everything the server checks at start, with its words. Prints one line per "
               "check (OK, WARN or FAIL, with a fix); exit code 0 only when that server would work here. Takes the "
               "server's settings, from the same sources.")


# The settings whose values are one of a few: --help lists them, argparse refuses others.
CHOICES = {"device": DEVICES, "transfer_mode": TRANSFER_MODES, "log_level": LOG_LEVELS,
           "eviction_policy": EVICTION_POLICIES, **{name: L2_CODECS for name in L2_CODEC_FIELDS},
           **{name: L2_WRITE_POLICIES for name in L2_WRITE_FIELDS}}
# --help in groups, in this order (every setting in one: test_cli checks)
GROUPS = (
    ("endpoint and access", "where clients connect, who gets in, what is recorded",
     ("url", "local_lane", "ipc_group", "curve_secret_key", "curve_clients", "tenants", "audit_log", "http_addr")),
    ("L1: host memory", "the chunks kept in this machine's memory, and which go first",
     ("l1_size", "chunk_size", "tp_shared", "tp_shared_timeout", "eviction_policy", "l1_persist", "slab_size",
      "numa_node")),
    ("device and transfers", "how chunks move between engines' KV caches and L1",
     ("device", "transfer_mode", "staging_size", "direct_ctas", "cpu_threads")),
    ("L2: tiers below L1", "local disk, Valkey/Redis, Mooncake Store; what goes there and when it is read back",
     ("l2_disk", "l2_disk_size", "l2_disk_write", "l2_disk_codec", "l2_redis", "l2_redis_cluster", "l2_redis_prefix",
      "l2_redis_ttl", "l2_redis_write", "l2_redis_codec", "l2_mooncake", "l2_mooncake_metadata",
      "l2_mooncake_segment", "l2_mooncake_write", "l2_mooncake_codec", "l2_write", "l2_admit", "l2_queue_size",
      "l2_io_threads", "prefetch_timeout", "max_prefetches")),
    ("clients and limits", "leases, heartbeats, per-client limits, events, stopping",
     ("lease_ttl", "hint_budget", "heartbeat_timeout", "max_registrations_per_client", "max_queued_requests", "kv_events",
      "drain_timeout")),
    ("process", "", ("spin_us", "log_level")),
)
USAGE = {"lmcache-mp-server": "lmcache-mp-server [--SETTING VALUE ...] | doctor [--SETTING VALUE ...] | keygen DIR"
                              "  (--help: the settings)",
         "lmcache-mp-server doctor": "lmcache-mp-server doctor [--SETTING VALUE ...]  (--help: the settings)"}


def _parser(prog: str = "lmcache-mp-server", description: str = SERVER_HELP) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog,
        usage=USAGE[prog],  # (not argparse's: 30 lines of flags before any error)
        description=description,
        epilog="Every setting can also come from the environment (LMCACHE_MP_<NAME>, e.g. "
        "LMCACHE_MP_L1_SIZE=64GiB; on/off ones take true/false, on/off or 1/0) or a TOML file (--config). "
        "Sizes accept units, all binary: 512MiB, 64GiB (64G and 64GB are the same).",
    )
    ap.add_argument("--config", metavar="FILE", help="TOML file with settings (keys as below, e.g. l1_size)")
    ap.add_argument("--version", action="version", version=f"lmcache-mp {__version__}")
    groups = {}
    for title, about, names in GROUPS:
        group = ap.add_argument_group(title, about or None)
        groups.update((name, group) for name in names)
    for f in dataclasses.fields(ServerConfig):
        doc = (f.metadata or {}).get("help", "")
        kind = type(f.default)
        flag = "--" + f.name.replace("_", "-")
        group = groups.get(f.name) or ap.add_argument_group("other")
        if kind is bool:  # a switch: --local-lane / --no-local-lane
            group.add_argument(flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction,
                               help=f"{doc} (default: {'on' if f.default else 'off'})".replace("%", "%%"))
            continue
        choices = CHOICES.get(f.name)
        if choices is not None and f.default == "":  # (empty: a default of its own, which the help says)
            choices = ("", *choices)
        group.add_argument(
            flag,
            dest=f.name,
            default=None,
            type=kind if kind in (int, float) else (str.upper if f.name == "log_level" else str),
            choices=choices,
            metavar="{" + ",".join(c for c in choices if c) + "}" if choices else None,
            help=(doc + (f" (default: {f.default})" if f.default != "" else "")).replace("%", "%%"),
        )
    return ap


def tune_process() -> None:
    """Latency settings for a process that is only a cache server.

    The socket thread must get the interpreter within a millisecond of a request arriving, even
    while a worker thread runs Python: hand the GIL over every 1 ms instead of 5. Full garbage
    collections walk every tracked object (the L1 index holds one per chunk: 130 ms for 262,144
    chunks here), so they never run on their own; young generations are still collected, and
    the index's objects are freed by reference counting (its only cycles are the LRU list's
    links, which an object leaves before it is freed). What start-up and each registration make,
    and L1's chunk objects every few thousand, are frozen out of the collector (gc_pauses)."""
    sys.setswitchinterval(0.001)
    gc.freeze()  # what imports made stays out of every collection
    gen0, gen1, _ = gc.get_threshold()
    gc.set_threshold(gen0, gen1, 1 << 30)
    settle_after_setup(True)


def _keygen_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lmcache-mp-server keygen",
                                 description="Make CURVE keys: the server's pair and one client's, in DIR; with "
                                             "--client NAME, another client's pair beside them.")
    ap.add_argument("dir")
    ap.add_argument("--client", default="", help="the name of another client's key pair (DIR/clients/NAME.key)")
    return ap


def _negative_values_attached(argv: list[str]) -> list[str]:
    """argparse takes a value such as -5GiB for a flag of its own ("expected one argument"):
    attached to its flag (--l1-size=-5GiB) it reaches the setting's check, which says what is
    wrong with it."""
    out: list[str] = []
    for arg in argv:
        if out and re.match(r"-[0-9.]", arg) and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def parse_command(argv: list[str]) -> tuple[str, object]:
    """What a command line asks for, checked but not done: ("keygen", DIR), ("doctor", config)
    or ("serve", config). Bad flags exit like argparse (status 2); bad settings raise ValueError
    (or OSError) with the command's name in front."""
    if argv[:1] == ["keygen"]:
        args = _keygen_parser().parse_args(argv[1:])
        return "keygen", (args.dir, args.client)
    doctor = argv[:1] == ["doctor"]
    parser = _parser("lmcache-mp-server doctor", DOCTOR_HELP) if doctor else _parser()
    args = vars(parser.parse_args(_negative_values_attached(argv[1:] if doctor else argv)))
    config_file = args.pop("config")
    try:
        config = ServerConfig.from_sources(cli=args, config_file=config_file)
    except (ValueError, OSError) as e:
        raise ValueError(f"{parser.prog}: {e}") from None
    return ("doctor" if doctor else "serve"), config


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        command, what = parse_command(argv)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if command == "keygen":
        from lmcache_mp.server.transport.curve import keygen

        try:
            print(keygen(*what))
        except (OSError, ValueError) as e:
            print(f"lmcache-mp-server keygen: {e}", file=sys.stderr)
            return 1
        return 0
    config = what
    if command == "doctor":
        from lmcache_mp.server.ops.doctor import run as run_doctor

        return run_doctor(config)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from lmcache_mp.native import build_info
    from lmcache_mp.server.copies.devices import resolve_device
    from lmcache_mp.server.server import run_cache_server

    info = build_info()
    cuda = f"CUDA {info['cuda_compiler']} sm {info['cuda_architectures']}" if info["cuda"] else "no CUDA"
    logger.info("lmcache-mp %s (%s, %d GPU(s) visible)", __version__, cuda, info["cuda_devices"])
    tune_process()
    try:
        device = resolve_device(config.device)
        logger.info("endpoint %s, L1 %s, chunk %d tokens, device %s, transfer mode %s", config.url,
                    format_size(config.l1_size), config.chunk_size,
                    f"{device} (auto)" if config.device == "auto" else device, config.transfer_mode)
        run_cache_server(config)
    except Exception as e:
        logger.error("cannot start: %s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
