"""The client library for engine workers."""

from lmcache_mp.client.client import Client, KVCacheHandle, RetrieveResult, StoreResult

__all__ = ["Client", "KVCacheHandle", "RetrieveResult", "StoreResult"]
