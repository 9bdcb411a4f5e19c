"""Tenants at run time (--tenants FILE): whose each request is, and the namespace it lives in.

The server decides, never the client. A connection's credential (its CURVE key, checked in the
handshake; the kernel's uid/gid of a local peer) names its tenant: ZeroMQ's ZAP handler
(gate.py) lets in only credentials of the tenants file and stamps each message with it;
the local lane reads the peer's credentials when it accepts. Every request is then *scoped*
before the engine sees it:

- model names become `TENANT<SEP>model`, so keys, registrations, events, L2 objects and the L1
  journal of two tenants never meet, whatever model and salt a client sends;
- client ids become `tag + keyed hash(client id)`: one tenant's client cannot speak for (release
  the leases of, say goodbye for, commit the reservations of) another's, even knowing its id;
- what only an operator may do (CLEAR) needs `admin`; engine-side copies map the tenant's own
  window, never L1 (windows.py).

The `shared` namespace (`shared<SEP>model`) is read by tenants with `shared = "read"` after their
own, and written by stores that ask for it from tenants with `shared = "write"`.

SIGHUP re-reads the file (reload): new credentials work at once; the clients seen with a removed
credential are forgotten (registrations, leases, reservations) and its later requests refused.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import struct
import threading
from typing import Callable

from lmcache_mp import protocol as p
from lmcache_mp.sizes import format_size
from lmcache_mp.server import validation as check
from lmcache_mp.server.tenancy.audit import NullAuditLog
from lmcache_mp.server.tenancy.tenants_file import (SHARED, SharedLimits, Tenant, TenantsFileError, TenantTable,
                                       credential_fingerprint, load_tenants)
from lmcache_mp.server.validation import RequestFailure
from lmcache_mp.storage.eviction.quotas import SEP

logger = logging.getLogger(__name__)

_NAMED_CLIENT = (p.Hello, p.RegisterKVCache, p.UnregisterKVCache, p.Store, p.Retrieve, p.Lookup, p.Release, p.Ping,
                 p.Status, p.Bye, p.Events, p.MapArena, p.Reserve, p.Commit, p.Read, p.ReadDone, p.Hint)


def denied(message: str) -> RequestFailure:
    return RequestFailure(p.ErrorCode.PERMISSION_DENIED, message)


def strip(model: str) -> str:
    """The client's own name of a scoped model."""
    return model.split(SEP, 1)[-1]


def shown(model: str) -> str:
    """A scoped model's name for logs: TENANT/model."""
    return model.replace(SEP, "/", 1)


class TenantState:
    """One tenant while the server runs: its current limits, requests in flight, counters."""

    __slots__ = ("name", "tag", "prefix", "tenant", "inflight", "counters", "_lock")

    def __init__(self, name: str, index: int, tenant: Tenant):
        self.name = name
        self.tag = struct.pack(">H", index)
        self.prefix = name + SEP
        self.tenant = tenant
        self.inflight = 0
        self.counters = {"requests": 0, "denied": 0, "lookup_chunks": 0, "hit_chunks": 0}
        self._lock = threading.Lock()

    def begin(self) -> int:
        """A request arrived (its reply calls done): the requests in flight now, this one included."""
        with self._lock:
            self.inflight += 1
            self.counters["requests"] += 1
            return self.inflight

    def done(self, reply: p._Msg) -> None:
        with self._lock:
            self.inflight -= 1
            if type(reply) is p.LookupReply:
                self.counters["hit_chunks"] += reply.hits
            elif type(reply) is p.Error and reply.code in (p.ErrorCode.PERMISSION_DENIED, p.ErrorCode.LIMIT_EXCEEDED):
                self.counters["denied"] += 1

    def shared_model(self, scoped: str) -> str:
        """The shared namespace's name of one of this tenant's models ("" when it may not read it)."""
        return SHARED + SEP + scoped[len(self.prefix):] if self.tenant.reads_shared else ""


class NoTenancy:
    """A server without a tenants file: one implicit tenant, whose requests keep their names (the
    null object of Tenancy: the engine's parts ask it the same questions)."""

    enabled = False
    audit = NullAuditLog()

    def admit(self, msg: p._Msg, tenant: TenantState | None, credential: str | None) -> None:
        """A tenant's namespace is `TENANT<SEP>model`: a server without tenants that shares an L1 file
        or an L2 tier with one must not let its clients name it."""
        if SEP in getattr(msg, "model", "") or type(msg) is p.Events and any(SEP in m for m in msg.models):
            raise RequestFailure(p.ErrorCode.INVALID_ARGUMENT, "model names must not contain \\x1f")

    def shared_of(self, scoped: str) -> str:
        return ""

    def ticket(self, credential: str | None, client: bytes) -> bytes:
        return b""

    def forget(self, client: bytes) -> None:
        pass

    def foreign_lease(self, owner: bytes, client: bytes) -> bool:
        return False


class Tenancy:
    enabled = True

    def __init__(self, path: str, audit, l1_bytes: int = 0):
        """l1_bytes: the server's L1, which the tenants' l1_min must fit (at start and at every reload)."""
        self.path = path
        self.audit = audit
        self.l1_bytes = l1_bytes
        self._key = secrets.token_bytes(32)  # of client ids' hashes: a client cannot aim at another's
        self._lock = threading.Lock()
        self._states: dict[str, TenantState] = {}
        self._by_credential: dict[str, TenantState] = {}
        self._clients: dict[bytes, str] = {}  # scoped client id -> the credential it was last seen with
        self._tickets: dict[bytes, str] = {}  # lane ticket -> the credential its client proved
        self._ticket_of: dict[bytes, bytes] = {}  # scoped client id -> its lane ticket
        self.table = load_tenants(path, l1_bytes)
        self._apply(self.table)
        self.on_limits: Callable[[TenantState], None] | None = None  # (state) limits changed: L1 quotas
        self.on_shared_limits: Callable[[SharedLimits], None] | None = None  # the [shared] table's, at each load
        self.on_revoked: Callable[[str, list[bytes]], None] | None = None  # (credential, clients) to forget
        # (tenant name) the size of its engine-copy window, 0 before one is made: a made one keeps its size
        self.window_of: Callable[[str], int] | None = None
        logger.info("tenants: %d from %s (%s)", len(self.table), path, ", ".join(self.table.tenants))

    def _apply(self, table: TenantTable) -> None:
        by_credential = {}
        for cred, name in table.credentials().items():
            state = self._states.get(name)
            if state is None:
                state = self._states[name] = TenantState(name, len(self._states) + 1, table.tenants[name])
            state.tenant = table.tenants[name]
            by_credential[cred] = state
        self._by_credential = by_credential  # one assignment: readers see the old table or the new

    def shared_of(self, scoped: str) -> str:
        """The shared namespace's name of a scoped model, if its tenant reads it now ("" if not)."""
        state = self._states.get(scoped.split(SEP, 1)[0])
        return state.shared_model(scoped) if state is not None and state.name in self.table.tenants else ""

    def states(self) -> list[TenantState]:
        return [s for s in self._states.values() if s.name in self.table.tenants]

    # ---- credentials -------------------------------------------------------------------------

    def state_of(self, credential: str) -> TenantState | None:
        """The tenant of a credential now (None: not, or no longer, in the tenants file)."""
        return self._by_credential.get(credential)

    def curve_credential(self, z85_key: bytes) -> str:
        return "curve:" + z85_key.decode("ascii", "replace")

    def peer_credential(self, uid: int, gid: int) -> str:
        """The credential a local peer is let in with: its uid's when a tenant names it, else its gid's."""
        cred = f"uid:{uid}"
        return cred if cred in self._by_credential else f"gid:{gid}"

    def ticket(self, credential: str, client: bytes) -> bytes:
        """A client's lane ticket (HELLO): its lane connections claim its credential with it."""
        with self._lock:
            ticket = self._ticket_of.get(client)
            if ticket is None or self._tickets.get(ticket) != credential:
                ticket = secrets.token_bytes(32)
                self._tickets.pop(self._ticket_of.get(client, b""), None)
                self._tickets[ticket], self._ticket_of[client] = credential, ticket
            return ticket

    def ticket_credential(self, ticket: bytes) -> str | None:
        return self._tickets.get(ticket)

    def forget(self, client: bytes) -> None:
        """A client went away: its lane ticket claims nothing any more."""
        with self._lock:
            self._tickets.pop(self._ticket_of.pop(client, b""), None)
            self._clients.pop(client, None)

    # ---- requests ----------------------------------------------------------------------------

    def admit(self, msg: p._Msg, tenant: TenantState | None, credential: str | None) -> None:
        """A request (its message, the tenant and credential of its connection), before its handler:
        within its tenant's limits, rewritten into its namespace."""
        if tenant is None:  # (the transport names every request's tenant; anything else is refused)
            raise denied("a request without a tenant")
        if tenant.inflight > tenant.tenant.max_inflight:
            self.audit.denied(tenant.name, type(msg).__name__, "max_inflight")
            raise RequestFailure(p.ErrorCode.LIMIT_EXCEEDED,
                                 f"tenant {tenant.name} has {tenant.inflight - 1} requests in flight, the most its "
                                 "tenants file entry allows (max_inflight)")
        try:
            self.scope(msg, tenant, credential)
        except RequestFailure as e:
            if e.code == p.ErrorCode.PERMISSION_DENIED:
                self.audit.denied(tenant.name, type(msg).__name__, str(e))
            raise
        if type(msg) is p.Lookup:
            tenant.counters["lookup_chunks"] += len(msg.hashes) // 16

    @staticmethod
    def foreign_lease(owner: bytes, client: bytes) -> bool:
        """Whether a lease is another tenant's (lease ids are secrets: one that leaked is unknown)."""
        return owner[:2] != client[:2]

    def scope(self, msg: p._Msg, state: TenantState, credential: str) -> None:
        """Rewrite a request into its tenant's namespace, in place; raise what it may not do."""
        if isinstance(msg, _NAMED_CLIENT) and msg.client_id:
            cid = check.client_id(msg.client_id)
            msg.client_id = state.tag + hashlib.blake2b(cid, digest_size=14, key=self._key).digest()
            self._clients[msg.client_id] = credential
        kind = type(msg)
        if kind is p.Lookup or kind is p.RegisterKVCache or kind is p.Hint:
            check.names(msg.model)
            msg.model = state.prefix + msg.model
        elif kind is p.Events:
            msg.models = [state.prefix + m for m in msg.models]
        elif kind is p.Clear and not state.tenant.admin:
            raise denied(f"tenant {state.name} may not clear the cache (admin = true in the tenants file)")
        elif (kind is p.Store or kind is p.Reserve) and msg.shared and not state.tenant.writes_shared:
            raise denied(f"tenant {state.name} may not write the shared namespace (shared = \"write\")")

    # ---- reloads -----------------------------------------------------------------------------

    def _not_applied(self, old: TenantTable, new: TenantTable, added: list[str], removed: list[str],
                     changed: list[str]) -> tuple[list[list[str]], list[str]]:
        """What a reload does not do as the file may suggest, each said in a WARNING: the tenants
        renamed ([old, new]: a removed name's credentials now a new name's) and those whose
        engine_window changed while their window is made (its size stays)."""
        was, now = old.credentials(), new.credentials()
        renamed = sorted({(was[c], now[c]) for c in was.keys() & now.keys() if was[c] in removed and now[c] in added})
        for before, after in renamed:
            logger.warning("tenants file reloaded: tenant %s is now named %s (the same credentials); a tenant's "
                           "namespace is its name, so %s starts with an empty cache and %s's chunks stay, unused, "
                           "until evicted (rename it back to use them)", before, after, after, before)
        sizes = {n: self.window_of(n) if self.window_of is not None else 0 for n in changed
                 if new.tenants[n].engine_window != old.tenants[n].engine_window}
        kept = [n for n, size in sizes.items() if size and size != new.tenants[n].engine_window]
        for name in kept:
            logger.warning("tenants file reloaded: tenant %s's engine_window stays %s, not %s: its window is shared "
                           "memory its processes have mapped; the new size applies once the server restarts", name,
                           format_size(sizes[name]), format_size(new.tenants[name].engine_window))
        return [list(r) for r in renamed], kept

    def reload(self) -> bool:
        """Re-read the tenants file (SIGHUP). A bad file keeps the running configuration."""
        try:
            table = load_tenants(self.path, self.l1_bytes)
        except TenantsFileError as e:
            logger.error("tenants file not reloaded, the running configuration stays: %s", e)
            self.audit.write("tenants_reload_failed", file=self.path, error=str(e))
            return False
        old, old_creds = self.table, set(self._by_credential)
        with self._lock:
            self._apply(table)
            self.table = table
            revoked = old_creds - set(self._by_credential)
            gone: dict[str, list[bytes]] = {c: [] for c in revoked}
            for client in [c for c, cred in self._clients.items() if cred in revoked]:
                gone[self._clients.pop(client)].append(client)
            self._tickets = {t: c for t, c in self._tickets.items() if c not in revoked}
        added = sorted(set(table.tenants) - set(old.tenants))
        removed = sorted(set(old.tenants) - set(table.tenants))
        changed = sorted(n for n in set(table.tenants) & set(old.tenants) if table.tenants[n] != old.tenants[n])
        logger.info("tenants file reloaded: %d tenants (added %s, removed %s, changed %s), %d credentials revoked",
                    len(table), added or "none", removed or "none", changed or "none", len(revoked))
        renamed, kept = self._not_applied(old, table, added, removed, changed)
        self.audit.write("tenants_reloaded", file=self.path, added=added, removed=removed, changed=changed,
                         renamed=renamed, engine_window_kept=kept)
        for state in self.states():
            if self.on_limits is not None:
                self.on_limits(state)
        if self.on_shared_limits is not None:
            self.on_shared_limits(table.shared)
        for cred, clients in gone.items():
            tenant = old.credentials().get(cred, "")
            self.audit.write("credential_revoked", tenant=tenant, fingerprint=credential_fingerprint(cred),
                             clients=len(clients))
            if self.on_revoked is not None:
                self.on_revoked(cred, clients)
        return True
