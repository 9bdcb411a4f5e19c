"""The application's hints (HINT requests): the engine's `Hints` part.

A hint names a prefix (chunk hashes of one model, world size and salt) in the client's tenant's
namespace and one action on the leading chunks of it that are present:

- `pin`: keep them in L1 for `ttl` seconds (at most MAX_PIN_TTL), within the tenant's hint budget
  (storage/hints.py: refused with LIMIT_EXCEEDED when over it, or when pins would take memory
  another tenant's l1_min promises);
- `unpin`: end this tenant's pins on them;
- `retain`: count them `priority` (1 to MAX_PRIORITY) more uses with the eviction policy, as reads
  would; nothing is held, so nothing is budgeted;
- `prefetch`: load the chunks after L1's prefix from the L2 tiers into L1 (answered when they are
  in, or at --prefetch-timeout with those loaded so far);
- `demote`: write them to the L2 tiers that take writes, then drop from L1 those a tier holds;
- `drop`: free them from L1 (the L2 tiers keep their copies).

Chunks that are read, leased, being stored or written are never dropped. A hint changes how long
chunks stay, never what a lookup or retrieve returns; an action this server does not know is
answered with `ignored` and does nothing. Hints run on the housekeeping thread, in order.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Callable

from lmcache_mp import protocol as p
from lmcache_mp.config import ServerConfig
from lmcache_mp.server import validation as check
from lmcache_mp.server.copies.workers import SerialWorker
from lmcache_mp.server.registry.clients import Clients
from lmcache_mp.server.request import Request
from lmcache_mp.server.tenancy.tenancy import NoTenancy, Tenancy
from lmcache_mp.server.validation import RequestFailure
from lmcache_mp.storage.hints import MAX_PIN_TTL, OverBudget, PinTable
from lmcache_mp.storage.l1 import L1Store
from lmcache_mp.storage.l2.tiers import L2Tiers
from lmcache_mp.storage.leases import TooManyLeases

logger = logging.getLogger(__name__)

ACTIONS = ("pin", "unpin", "retain", "prefetch", "demote", "drop")
MAX_PRIORITY = 16


def default_budget(config: ServerConfig, l1_bytes: int) -> int:
    """--hint-budget, or a quarter of L1 when it is 0."""
    return config.hint_budget or l1_bytes // 4


class Hints:
    def __init__(self, config: ServerConfig, l1: L1Store, l2: L2Tiers | None, clients: Clients,
                 housekeeping: SerialWorker):
        self.config = config
        self.l1 = l1
        self.l2 = l2
        self.clients = clients
        self.tenancy: Tenancy | NoTenancy = NoTenancy()  # (MPCacheEngine.attach_tenancy)
        self._housekeeping = housekeeping
        self._budget = default_budget(config, l1.arena.capacity)
        self.pins = PinTable(l1, l1.arena.capacity, self.budget_of, self._floors)
        self.counters = dict.fromkeys((*ACTIONS, "ignored"), 0)

    def budget_of(self, tenant: str) -> int:
        """A tenant's hint budget: its tenants-file hint_budget, else the server's."""
        if self.tenancy.enabled:
            entry = self.tenancy.table.tenants.get(tenant)
            if entry is not None and entry.hint_budget:
                return entry.hint_budget
        return self._budget

    def _floors(self) -> dict[str, int]:
        return {("" if name == "(none)" else name): q["l1_min"] for name, q in self.l1.quota_stats().items()}

    def hint(self, request: Request) -> None:
        msg: p.Hint = request.msg
        check.lookup_cost(msg)  # (the same fields as a lookup's: client id, world size, names, hashes)
        self.clients.touch(msg.client_id)
        action = msg.action
        if action not in ACTIONS:
            self.counters["ignored"] += 1
            request.reply(p.HintReply(chunks=0, ignored=True))
            return
        if action == "pin" and not (math.isfinite(msg.ttl) and 0 < msg.ttl <= MAX_PIN_TTL):
            raise check.invalid(f"a pin's ttl must be in (0, {MAX_PIN_TTL:.0f}] seconds, got {msg.ttl}")
        if action == "retain" and not 1 <= msg.priority <= MAX_PRIORITY:
            raise check.invalid(f"a retain's priority must be in [1, {MAX_PRIORITY}], got {msg.priority}")
        if action in ("prefetch", "demote") and (self.l2 is None or action == "demote" and not self.l2.writers):
            raise RequestFailure(p.ErrorCode.UNSUPPORTED, f"{action}: this server has no L2 tier"
                                 + (" that takes writes" if self.l2 is not None else ""))
        tenant = request.tenant.name if request.tenant is not None else ""
        run: Callable[[Request, str, list[bytes]], None] = getattr(self, "_" + action)
        self.counters[action] += 1
        self._housekeeping.submit(request.job(lambda: run(request, tenant, check.digests(msg.hashes))))

    def _tp(self, msg: p.Hint) -> bool:
        """Whether the hint is of tp-shared chunks: it says so, or every registration's are."""
        return msg.tp_shared or self.config.tp_shared

    def _prefix(self, msg: p.Hint, digests: list[bytes]):
        return self.l1.prefix_objects(msg.model, msg.world_size, digests, msg.salt, self._tp(msg))

    # ---- actions (housekeeping thread) ---------------------------------------------------------

    def _pin(self, request: Request, tenant: str, digests: list[bytes]) -> None:
        msg: p.Hint = request.msg
        try:
            chunks, added = self.pins.pin(tenant, msg.model, msg.world_size, digests, msg.salt, msg.ttl, self._tp(msg))
        except (OverBudget, TooManyLeases) as e:
            raise check.over_limit(str(e)) from None
        request.reply(p.HintReply(chunks=chunks, nbytes=added, pinned_bytes=self.pins.pinned_bytes(tenant)))

    def _unpin(self, request: Request, tenant: str, digests: list[bytes]) -> None:
        msg: p.Hint = request.msg
        n = self.pins.unpin(tenant, msg.model, msg.world_size, digests, msg.salt, self._tp(msg))
        request.reply(p.HintReply(chunks=n, pinned_bytes=self.pins.pinned_bytes(tenant)))

    def _retain(self, request: Request, tenant: str, digests: list[bytes]) -> None:
        msg: p.Hint = request.msg
        chunks, objs = self._prefix(msg, digests)
        self.l1.retain(objs, msg.priority)
        request.reply(p.HintReply(chunks=chunks, nbytes=sum(o.nbytes for o in objs),
                                  pinned_bytes=self.pins.pinned_bytes(tenant)))

    def _drop(self, request: Request, tenant: str, digests: list[bytes]) -> None:
        _, objs = self._prefix(request.msg, digests)
        freed, nbytes = self.l1.drop_objects(objs)
        request.reply(p.HintReply(chunks=freed, nbytes=nbytes, pinned_bytes=self.pins.pinned_bytes(tenant)))

    def _prefetch(self, request: Request, tenant: str, digests: list[bytes]) -> None:
        msg: p.Hint = request.msg

        def answer(before: int) -> None:
            now, objs = self._prefix(msg, digests)
            request.reply(p.HintReply(chunks=max(0, now - before), nbytes=sum(o.nbytes for o in objs[before:]),
                                      pinned_bytes=self.pins.pinned_bytes(tenant)))

        def find() -> None:  # (on the L2 reader thread: a remote tier's index is a round trip away)
            before, _ = self._prefix(msg, digests)
            found = self.l2.find(msg.model, msg.world_size, digests[before:], msg.salt, "", self._tp(msg))
            if not found or not self.l2.prefetch(found, request.job(lambda: answer(before))):
                request.reply(p.HintReply(chunks=0, pinned_bytes=self.pins.pinned_bytes(tenant)))

        self.l2.run_read(request.job(find))

    def _demote(self, request: Request, tenant: str, digests: list[bytes]) -> None:
        _, objs = self._prefix(request.msg, digests)
        writers = self.l2.writers
        left = [len(writers)]
        lock = threading.Lock()

        def written() -> None:  # on each writer's thread: the last one drops what a tier holds
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            freed, nbytes = self.l1.drop_objects(objs, written_only=True)
            request.reply(p.HintReply(chunks=freed, nbytes=nbytes, pinned_bytes=self.pins.pinned_bytes(tenant)))

        for w in writers:
            w.demote(objs, request.job(written))

    def stats(self) -> dict:
        return {"requests": dict(self.counters), "budget": self._budget, **self.pins.counters,
                "tenants": self.pins.stats()}
