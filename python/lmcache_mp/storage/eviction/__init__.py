"""Eviction and admission: which chunks a store keeps when it needs room (base.py says how a store
uses a policy). `--eviction-policy` picks one for L1 and the disk tier."""

from __future__ import annotations

from lmcache_mp.storage.eviction.adaptive import AdaptivePolicy
from lmcache_mp.storage.eviction.arc import ArcPolicy
from lmcache_mp.storage.eviction.base import EvictionPolicy
from lmcache_mp.storage.eviction.follow import FollowPolicy
from lmcache_mp.storage.eviction.lru import LruPolicy
from lmcache_mp.storage.eviction.s3fifo import S3FifoPolicy
from lmcache_mp.storage.eviction.sessions import SessionsPolicy
from lmcache_mp.storage.eviction.switch import SwitchPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {p.name: p for p in (SwitchPolicy, FollowPolicy, AdaptivePolicy, LruPolicy, ArcPolicy, S3FifoPolicy, SessionsPolicy)}
DEFAULT_POLICY = "switch"


def make_policy(name: str = DEFAULT_POLICY) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}: one of {', '.join(POLICIES)}") from None


__all__ = ["DEFAULT_POLICY", "POLICIES", "EvictionPolicy", "make_policy"]
