"""The hints a request carries for the server (docs/hints.md), read from an engine's request.

Two places, both optional:
- `kv_transfer_params["lmcache_mp.hints"]`: a list of `{"action": "pin", "ttl": 60, "priority": 4,
  "tokens": 4096}` (or one such dict);
- `request.kv_hints` (vLLM 0.33's `KvHintsEnvelope`): `actions`, each with an `action_type` (Pin,
  Retain, Prefetch, Demote, ...; matched without case) and a `payload` dict. Read by attribute or
  key, so no vLLM import is needed.

An action this connector does not know (vLLM's `Share` among them), or one whose fields make no
sense (a pin without a positive finite TTL), is skipped: a hint never fails a request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lmcache_mp.client.hints import HINT_ACTIONS

PARAMS_KEY = "lmcache_mp.hints"
AT_ARRIVAL = frozenset({"prefetch"})  # sent when the request is first looked up; the others once it finished
MAX_PRIORITY = 16


@dataclass(frozen=True)
class RequestHint:
    action: str
    ttl: float = 0.0
    priority: int = 0
    tokens: int | None = None  # only the first so many tokens of the request (None: all it stored)


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _number(value: Any, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        n = kind(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return n if math.isfinite(n) else None


def parse(action: Any, fields: Any) -> RequestHint | None:
    """One hint, or None when it is not one this connector sends."""
    if not isinstance(action, str) or action.strip().lower() not in HINT_ACTIONS:
        return None
    action = action.strip().lower()
    fields = fields if fields is not None else {}
    tokens = _number(_get(fields, "tokens"), int)
    if tokens is not None and tokens <= 0:
        return None
    if action == "pin":
        ttl = _number(_get(fields, "ttl_s", _get(fields, "ttl")), float)
        return RequestHint(action, ttl=ttl, tokens=tokens) if ttl is not None and ttl > 0 else None
    if action == "retain":
        priority = _number(_get(fields, "priority", 1), int)
        if priority is None or priority < 1:
            return None
        return RequestHint(action, priority=min(priority, MAX_PRIORITY), tokens=tokens)
    return RequestHint(action, tokens=tokens)


def request_hints(request: Any) -> list[RequestHint]:
    """Every hint of one engine request, from its kv_transfer_params and its kv_hints."""
    out: list[RequestHint] = []
    params = getattr(request, "kv_transfer_params", None)
    listed = params.get(PARAMS_KEY) if isinstance(params, dict) else None
    if isinstance(listed, dict):
        listed = [listed]
    if isinstance(listed, (list, tuple)):
        out += [h for item in listed if isinstance(item, dict) and (h := parse(item.get("action"), item))]
    actions = _get(getattr(request, "kv_hints", None), "actions")
    if isinstance(actions, (list, tuple)):
        out += [h for a in actions if (h := parse(_get(a, "action_type"), _get(a, "payload")))]
    return out
