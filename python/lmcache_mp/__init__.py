"""lmcache-mp: a standalone multiprocess KV-cache server for LLM inference engines.

    from lmcache_mp import Server, ServerConfig, Client, chunk_hashes, shared_cpu_tensor
"""

from lmcache_mp._version import __version__
from lmcache_mp.client import Client, KVCacheHandle, LookupResult, RetrieveResult, StoreResult
from lmcache_mp.config import ServerConfig
from lmcache_mp.errors import CredentialRevoked, LMCacheMPError, ProtocolMismatch, RequestError, ServerUnavailable
from lmcache_mp.keys import chunk_hashes
from lmcache_mp.native import build_info
from lmcache_mp.server import Server
from lmcache_mp.shm import shared_cpu_array, shared_cpu_tensor

__all__ = [
    "Client",
    "CredentialRevoked",
    "KVCacheHandle",
    "LMCacheMPError",
    "LookupResult",
    "ProtocolMismatch",
    "RequestError",
    "RetrieveResult",
    "Server",
    "ServerConfig",
    "ServerUnavailable",
    "StoreResult",
    "__version__",
    "build_info",
    "chunk_hashes",
    "shared_cpu_array",
    "shared_cpu_tensor",
]
