"""Settings of the SGLang storage backend, from `--hicache-storage-backend-extra-config`.

The same JSON object names the backend for SGLang's `dynamic` factory (`backend_name`,
`module_path`, `class_name`) and says `interface_v1: 1` (SGLang then hands the backend host
indices, not copies of pages); lmcache-mp's own keys are `lmcache_mp.<field>`, as the vLLM
connector's are.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping

from lmcache_mp.integration.connector_types import CONFIG_PREFIX, DEFAULT_URL, _as_bool, check_curve_keys
from lmcache_mp.integration.link import ClientLink

LAUNCH_EXAMPLE = ('{"backend_name": "lmcache_mp", "module_path": "lmcache_mp.integration.sglang", '
                  '"class_name": "LMCacheMPStorage", "interface_v1": 1, "lmcache_mp.url": "' + DEFAULT_URL + '"}')


@dataclass
class SGLangStorageSettings:
    url: str = DEFAULT_URL
    model: str = ""  # the pages' namespace (default: SGLang's model name)
    request_timeout: float = 5.0  # longest one lookup, store or load waits for the server
    connect_timeout: float = 5.0  # how long start-up waits for the first connection
    retry_interval: float = 5.0  # least time between connection attempts / after a failure
    # CURVE key files: the server's public key and this instance's secret key (its tenant on a
    # server with tenants). Empty: LMCACHE_MP_CURVE_SERVER_KEY / LMCACHE_MP_CURVE_CLIENT_KEY, if set.
    curve_server_key: str = ""
    curve_client_key: str = ""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> "SGLangStorageSettings":
        extra = dict(extra or {})
        if not _as_bool(extra.get("interface_v1", 0)):
            raise ValueError("the lmcache-mp storage backend copies pages in place and needs SGLang's "
                             f"zero-copy interface: add \"interface_v1\": 1 to the extra config, e.g. {LAUNCH_EXAMPLE}")
        return cls._parse(extra)

    @classmethod
    def from_linker_config(cls, extra: Mapping[str, Any] | None) -> "SGLangStorageSettings":
        """The unified cache linker's settings: the `linker_extra_config` object of
        `--unified-cache-external-linker-config`, with the same `lmcache_mp.<field>` keys."""
        return cls._parse(dict(extra or {}))

    @classmethod
    def _parse(cls, extra: dict) -> "SGLangStorageSettings":
        cfg = cls()
        types = {f.name: type(getattr(cfg, f.name)) for f in fields(cls)}
        for key, value in extra.items():
            if not key.startswith(CONFIG_PREFIX):
                continue
            name = key[len(CONFIG_PREFIX):]
            if name not in types:
                raise ValueError(f"unknown lmcache-mp storage setting {key!r}; known: "
                                 f"{sorted(CONFIG_PREFIX + n for n in types)}")
            setattr(cfg, name, types[name](value))
        for name in ("request_timeout", "connect_timeout", "retry_interval"):
            if getattr(cfg, name) <= 0:
                raise ValueError(f"{CONFIG_PREFIX}{name} must be positive")
        check_curve_keys(cfg.curve_server_key, cfg.curve_client_key)
        return cfg

    def make_link(self, name: str, on_connect: Callable[[Any], None] | None = None) -> ClientLink:
        """The backend's connection to the server, with these settings."""
        return ClientLink(self.url, name=name, request_timeout=self.request_timeout,
                          connect_timeout=self.connect_timeout, retry_interval=self.retry_interval,
                          on_connect=on_connect, curve_server_key=self.curve_server_key,
                          curve_client_key=self.curve_client_key)
