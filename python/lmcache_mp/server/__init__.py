"""The cache server: engine, registrations, transport and entry points."""

from lmcache_mp.server.copies.contexts import CPUCacheContext, GPUCacheContext
from lmcache_mp.server.engine import MPCacheEngine
from lmcache_mp.server.server import Server, run_cache_server

__all__ = ["CPUCacheContext", "GPUCacheContext", "MPCacheEngine", "Server", "run_cache_server"]
