"""Hints from the application (docs/hints.md): what Client.hint sends and returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from lmcache_mp import protocol as p
from lmcache_mp.keys import pack_hashes

# What the server does with each (server/hints.py); it ignores any other action.
HINT_ACTIONS = ("pin", "unpin", "retain", "prefetch", "demote", "drop")


@dataclass(frozen=True)
class HintResult:
    chunks: int  # chunks the action took effect on (pin: held; prefetch: loaded; demote: written to L2 and dropped)
    nbytes: int  # their bytes in L1 (pin: what it added to the tenant's pinned bytes)
    pinned_bytes: int  # the tenant's pinned bytes after it
    ignored: bool  # the server does not know the action: nothing was done


def hint_message(client_id: bytes, action: str, hashes: bytes | Iterable[bytes], model: str, world_size: int,
                 salt: bytes, ttl: float, priority: int, tp_shared: bool = False) -> p.Hint:
    if not isinstance(action, str) or not action:
        raise ValueError(f"a hint's action is a name such as {', '.join(HINT_ACTIONS)}; got {action!r}")
    return p.Hint(client_id=client_id, model=model, world_size=world_size, hashes=pack_hashes(hashes),
                  action=action, salt=salt, ttl=float(ttl), priority=int(priority), tp_shared=tp_shared)


def hint_result(reply: p.HintReply) -> HintResult:
    return HintResult(reply.chunks, reply.nbytes, reply.pinned_bytes, reply.ignored)
