"""The client library for engine workers."""

from lmcache_mp.client.client import Client, KVCacheHandle, RetrieveResult, StoreResult
from lmcache_mp.client.leases import LookupResult

__all__ = ["Client", "KVCacheHandle", "LookupResult", "RetrieveResult", "StoreResult"]
