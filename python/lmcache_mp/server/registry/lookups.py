"""Lookups, leases and releases: the engine's `Lookups` part. A lookup counts the leading chunks
present for every rank (continuing into L2 after L1); with lock it leases them, and when L2
holds some of them its reply waits while they are loaded into L1 (at most the prefetch timeout).
Large lookups and releases run on the housekeeping thread, a slice of the index at a time."""

from __future__ import annotations

import logging

from lmcache_mp import protocol as p
from lmcache_mp.config import ServerConfig
from lmcache_mp.server import validation as check
from lmcache_mp.server.copies.workers import SerialWorker
from lmcache_mp.server.registry.clients import Clients
from lmcache_mp.server.request import Reply, Request
from lmcache_mp.server.tenancy.tenancy import NoTenancy, Tenancy
from lmcache_mp.server.validation import over_limit
from lmcache_mp.storage.l1 import L1Store
from lmcache_mp.storage.l2.tiers import L2Tiers
from lmcache_mp.storage.leases import TooManyLeases

logger = logging.getLogger(__name__)

INLINE_LOOKUP_KEYS = 2048  # lookups of at most this many keys (hashes x ranks) run on the socket thread


class Lookups:
    def __init__(self, config: ServerConfig, l1: L1Store, l2: L2Tiers | None, clients: Clients,
                 housekeeping: SerialWorker):
        self.config = config
        self.l1 = l1
        self.l2 = l2
        self.clients = clients
        self.tenancy: Tenancy | NoTenancy = NoTenancy()  # (MPCacheEngine.attach_tenancy)
        self._housekeeping = housekeeping

    def lookup(self, request: Request) -> None:
        msg: p.Lookup = request.msg
        reply = request.reply
        cost = check.lookup_cost(msg)
        self.clients.touch(msg.client_id)

        def run() -> None:
            digests = check.digests(msg.hashes)
            try:
                hits, lease = self.l1.lookup(msg.model, msg.world_size, digests, msg.salt,
                                             lock=msg.lock, owner=msg.client_id, ttl=self.config.lease_ttl,
                                             fallback_model=self._shared_of(msg.model), tp_shared=self._tp(msg))
            except TooManyLeases as e:
                raise over_limit(str(e)) from None
            if self.l2 is not None and hits < len(digests):
                if self.l2.remote:  # network round trips: off the socket thread, within the deadline
                    self._lookup_remote(msg, digests, hits, lease, reply)
                else:
                    self._lookup_l2(msg, digests, hits, lease, reply)
            else:
                reply(p.LookupReply(hits=hits, lease=lease))

        if cost <= INLINE_LOOKUP_KEYS:
            run()
        else:
            self._housekeeping.submit(request.job(run))

    def _lookup_remote(self, msg: p.Lookup, digests: list[bytes], hits: int, lease: int, reply: Reply) -> None:
        def found_in_l2(n: int | None) -> None:  # None: not known by the deadline
            if msg.lock:
                self._answer_leased(msg, digests, hits, lease, reply)
            else:
                reply(p.LookupReply(hits=hits + (n or 0), lease=0, from_l2=n or 0))

        self.l2.lookup_remote(lambda: self.l2.find(msg.model, msg.world_size, digests[hits:], msg.salt,
                                                   self._shared_of(msg.model), self._tp(msg)), msg.lock, found_in_l2)

    def _answer_leased(self, msg: p.Lookup, digests: list[bytes], hits: int, lease: int, reply: Reply) -> None:
        """The reply of a lookup with lock once its L2 chunks were brought in (or its deadline
        passed): the leading chunks in L1 now, leased."""
        try:
            if lease:
                more, still = self.l1.lookup(msg.model, msg.world_size, digests[hits:], msg.salt, extend=lease,
                                             fallback_model=self._shared_of(msg.model), tp_shared=self._tp(msg))
                reply(p.LookupReply(hits=hits + more if still else 0, lease=still, from_l2=more if still else 0))
            else:
                got, new = self.l1.lookup(msg.model, msg.world_size, digests, msg.salt, lock=True,
                                          owner=msg.client_id, ttl=self.config.lease_ttl,
                                          fallback_model=self._shared_of(msg.model), tp_shared=self._tp(msg))
                reply(p.LookupReply(hits=got, lease=new, from_l2=max(0, got - hits)))
        except TooManyLeases as e:
            reply(p.Error(code=int(p.ErrorCode.LIMIT_EXCEEDED), message=str(e)))
        except Exception as e:
            logger.exception("internal error answering a lookup after its prefetch")
            reply(p.Error(code=int(p.ErrorCode.INTERNAL), message=f"internal error: {e}"))

    def _lookup_l2(self, msg: p.Lookup, digests: list[bytes], hits: int, lease: int, reply: Reply) -> None:
        """The lookup goes on into L2 after the L1 prefix. Without lock it counts what L2 holds
        (a retrieve loads it); with lock the L2 chunks are loaded into L1 and the reply, which
        leases what is resident, waits until they are in or the prefetch deadline passed."""
        found = self.l2.find(msg.model, msg.world_size, digests[hits:], msg.salt, self._shared_of(msg.model),
                             self._tp(msg))
        if not found:
            reply(p.LookupReply(hits=hits, lease=lease))
            return
        if not msg.lock:
            reply(p.LookupReply(hits=hits + len(found), lease=0, from_l2=len(found)))
            return

        def answer() -> None:
            self._answer_leased(msg, digests, hits, lease, reply)

        if not self.l2.prefetch(found, answer):
            reply(p.LookupReply(hits=hits, lease=lease))

    def release(self, request: Request) -> None:
        msg: p.Release = request.msg
        self.clients.touch(check.client_id(msg.client_id))
        check.count_digests(msg.hashes)

        def run() -> None:
            digests = check.digests(msg.hashes) if msg.hashes else None
            held = self.l1.lease(msg.lease)
            if held is not None and self.tenancy.foreign_lease(held.owner, msg.client_id):
                request.reply(p.ReleaseReply(released=0))  # another tenant's lease is unknown
                return
            request.reply(p.ReleaseReply(released=self.l1.release(msg.lease, digests)))

        self._housekeeping.submit(request.job(run))

    def _tp(self, msg: p.Lookup) -> bool:
        """Whether the lookup is of tp-shared chunks: it says so, or every registration's are."""
        return msg.tp_shared or self.config.tp_shared

    def _shared_of(self, model: str) -> str:
        """Where a lookup of this model continues: the shared namespace, for a tenant that reads it."""
        return self.tenancy.shared_of(model)
