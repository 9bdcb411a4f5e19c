"""The engine's storage, opened at start: L1 over the host arena (re-attaching the chunks a
previous server left in an --l1-persist file) and the L2 tiers below it, nearest first."""

from __future__ import annotations

import logging

from lmcache_mp.config import ServerConfig, format_size
from lmcache_mp.native import HostArena
from lmcache_mp.server.ops.gc_pauses import made_long_lived
from lmcache_mp.storage.events import EventLog
from lmcache_mp.storage.eviction.quotas import Quotas
from lmcache_mp.storage.l1 import L1Store
from lmcache_mp.storage.l1_journal import L1Journal
from lmcache_mp.storage.l2.tiers import L2Tiers

logger = logging.getLogger(__name__)


def open_l1(config: ServerConfig, device: str, numa: int) -> tuple[HostArena, L1Store, EventLog]:
    """The arena (pinned on the cuda device), L1 over it and L1's chunk events."""
    pin = device == "cuda"
    journal = None
    if config.l1_persist:  # locked before the arena file is touched: one server per file
        journal = L1Journal(config.l1_persist + ".journal", config.l1_size // config.slab_size * config.slab_size,
                            config.slab_size)
    try:
        arena = HostArena(config.l1_size, config.slab_size, pin, numa, config.l1_persist)
    except Exception:
        if journal is not None:
            journal.close()
        raise
    # with tenants, quotas from the start: each chunk the journal re-attaches is counted to its tenant
    l1 = L1Store(arena, policy=config.eviction_policy, quotas=Quotas() if config.tenants else None)
    l1.slices.ttl = config.tp_shared_timeout
    l1.on_commit = made_long_lived  # (a no-op unless this process is only a server)
    events = EventLog(config.kv_events)
    l1.events = events if config.kv_events else None
    if journal is not None:
        _reattach(config, device, arena, l1, journal)
    return arena, l1, events


def open_l2(config: ServerConfig, arena: HostArena, l1: L1Store) -> L2Tiers | None:
    """The L2 tiers, nearest first: the local disk, then a shared Valkey/Redis server, then Mooncake."""
    tiers, writes = [], []
    if config.l2_disk:
        from lmcache_mp.storage.l2.disk import DiskTier

        try:
            tiers.append(DiskTier(config.l2_disk, config.l2_disk_size, config.l2_io_threads,
                                  config.eviction_policy))
            writes.append(config.l2_write_of("disk", DiskTier.default_write))
        except (OSError, RuntimeError, ValueError) as e:
            raise RuntimeError(f"cannot open the L2 disk {config.l2_disk}: {e}") from None
    if config.l2_redis:  # unreachable at start is fine: it is tried again later
        from lmcache_mp.storage.l2.valkey import ValkeyTier

        tiers.append(ValkeyTier(config.l2_redis, config.l2_redis_prefix, config.l2_redis_ttl,
                                connections=config.l2_io_threads, cluster=config.l2_redis_cluster))
        writes.append(config.l2_write_of("redis", ValkeyTier.default_write))
    if config.l2_mooncake:
        from lmcache_mp.storage.l2.mooncake import MooncakeTier

        metadata = config.l2_mooncake_metadata or f"http://{config.l2_mooncake.rsplit(':', 1)[0]}:8080/metadata"
        tiers.append(MooncakeTier(config.l2_mooncake, metadata, arena, config.l2_mooncake_segment,
                                  prefix=config.l2_redis_prefix))
        writes.append(config.l2_write_of("mooncake", MooncakeTier.default_write))
    if not tiers:
        return None
    from lmcache_mp.storage.l2.codec import CodecTier

    if config.tenants:  # per-tenant caps on the shared tiers (the tenants file's l2_valkey_max, l2_mooncake_max)
        from lmcache_mp.storage.l2.tenant_caps import TenantCapped

        tiers = [t if getattr(t, "local", True) else TenantCapped(t) for t in tiers]
    codecs = {"disk": config.l2_disk_codec, "valkey": config.l2_redis_codec, "mooncake": config.l2_mooncake_codec}
    tiers = [CodecTier(t, codecs.get(t.name, "none")) for t in tiers]
    return L2Tiers(tiers, l1, writes=writes, admit=config.l2_admit,
                   queue_bytes=config.l2_queue_size, max_prefetches=config.max_prefetches,
                   prefetch_timeout=config.prefetch_timeout)


def _reattach(config: ServerConfig, device: str, arena: HostArena, l1: L1Store, journal: L1Journal) -> None:
    """The chunks a previous server left in the arena file, at once (on the cuda device once
    L1 is page-locked: no copy may touch memory that is not)."""
    live = journal.read_live() if arena.reattached else {}
    if not arena.reattached and journal.bytes:
        logger.warning("L1 in %s: the arena file was not of %s (--l1-size or --slab-size changed, or the file "
                       "was damaged): L1 starts empty", config.l1_persist, format_size(arena.capacity))
    if live and device == "cuda":
        logger.info("L1: waiting for the arena to be page-locked before re-attaching %d chunks", len(live))
        arena.wait_pinned(3600.0)
    l1.attach_journal(journal)
    restored, dropped = l1.restore(live.values())
    what = f"re-attached {restored} chunks of the previous server" + (f", dropped {dropped}" if dropped else "")
    logger.info("L1 in %s: %s", config.l1_persist, what if arena.reattached else "a new arena file")
