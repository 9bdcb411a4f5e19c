"""Storage tiers. L1: the pinned host arena (l1.py)."""

from lmcache_mp.storage.l1 import L1Object, L1Store, ObjectKey, StorePlan

__all__ = ["L1Object", "L1Store", "ObjectKey", "StorePlan"]
