"""Tenants in the engine (its `TenantShares` part): the tenants' shares of L1 and the L2 tiers
kept up to date, a revoked credential's clients forgotten, and what /status and a tenant's STATUS
say of them. The rules themselves, and the scoping of each request, are tenancy.py's."""

from __future__ import annotations

from typing import Callable

from lmcache_mp.server.copies.workers import SerialWorker
from lmcache_mp.server.registry.registrations import Registrations
from lmcache_mp.server.tenancy.tenancy import NoTenancy, Tenancy, TenantState
from lmcache_mp.server.tenancy.tenants_file import SHARED, SHARED_FIELDS, SharedLimits, Tenant
from lmcache_mp.server.tenancy.windows import TenantWindows
from lmcache_mp.storage.l1 import L1Store
from lmcache_mp.storage.l2.tiers import L2Tiers
from lmcache_mp.storage.eviction.quotas import CAUSES


class TenantShares:
    def __init__(self, l1: L1Store, l2: L2Tiers | None, registrations: Registrations, windows: TenantWindows,
                 housekeeping: SerialWorker, forget_client: Callable[[bytes], object]):
        """windows: the engine copies' tenant windows; forget_client: the engine's (leases, registrations...)."""
        self.l1 = l1
        self.l2 = l2
        self.registrations = registrations
        self.windows = windows
        self._housekeeping = housekeeping
        self._forget_client = forget_client
        self.tenancy: Tenancy | NoTenancy = NoTenancy()

    def attach(self, tenancy: Tenancy, revoke_lane: Callable[[str], None]) -> None:
        """Tenants (tenancy.py): their L1 shares now and on every reload; a credential
        removed by a reload loses its lane connections and its clients' leases and registrations."""
        self.tenancy = tenancy

        def quotas(name: str, q: Tenant | SharedLimits) -> None:
            self.l1.set_quota(name, q.l1_min, q.l1_max)
            if self.l2 is not None:
                self.l2.set_disk_quota(name, q.l2_disk_max)
                self.l2.set_tier_quota("valkey", name, q.l2_valkey_max)
                self.l2.set_tier_quota("mooncake", name, q.l2_mooncake_max)

        def limits(state: TenantState) -> None:
            quotas(state.name, state.tenant)

        def revoked(credential: str, clients: list[bytes]) -> None:
            revoke_lane(credential)
            self._housekeeping.submit(lambda: [self._forget_client(c) for c in clients])

        tenancy.on_limits, tenancy.on_revoked = limits, revoked
        tenancy.window_of = self.windows.size_of  # (a reload says when an engine_window cannot change)
        # the shared namespace's chunks are owned by "shared" in L1 and the tiers: its quotas are a tenant's
        tenancy.on_shared_limits = lambda shared: quotas(SHARED, shared)
        self.l1.quotas.on_breach = lambda name, quota, used, limit: tenancy.audit.breach(
            name, quota, bytes=used, limit=limit)
        if self.l2 is not None:  # (rate-limited there, as l1_max's: a line a minute per tenant)
            self.l2.on_disk_over_cap(lambda name, chunks, used, limit: tenancy.audit.breach(
                name, "l2_disk_max", bytes=used, limit=limit, chunks=chunks))
        for state in tenancy.states():
            limits(state)
        quotas(SHARED, tenancy.table.shared)

    def status(self) -> dict[str, dict]:
        """Per tenant: its limits, L1 share, requests and registrations."""
        if not self.tenancy.enabled:
            return {}
        l1 = self.l1.quota_stats()
        disk = self.l2.disk_tenant_bytes() if self.l2 is not None else {}
        # the shared tiers' bytes this node wrote for capped tenants (storage/l2/tenant_caps.py)
        remote = {tier: got for tier in ("valkey", "mooncake")
                  if self.l2 is not None and (got := self.l2.tier_tenant_bytes(tier)) is not None}
        empty = {"bytes": 0, "objects": 0, "evicted": dict.fromkeys(CAUSES, 0), "skipped": 0}
        models = self.registrations.models()
        out = {}
        for state in self.tenancy.states():
            t = state.tenant
            out[state.name] = {
                "l1": l1.get(state.name, empty),
                "l2_disk_bytes": disk.get(state.name, 0),
                "l2_tiers": {tier: got.get(state.name, 0) for tier, got in remote.items()},
                "limits": {"l1_min": t.l1_min, "l1_max": t.l1_max, "l2_disk_max": t.l2_disk_max,
                           "l2_valkey_max": t.l2_valkey_max, "l2_mooncake_max": t.l2_mooncake_max,
                           "max_registrations": t.max_registrations, "max_inflight": t.max_inflight,
                           "shared": t.shared},
                "inflight": state.inflight, "registrations": sum(m.startswith(state.prefix) for m in models),
                **state.counters,
            }
        q = self.tenancy.table.shared  # the shared namespace: its chunks and its own quotas ([shared])
        out[SHARED] = {"l1": l1.get(SHARED, empty), "l2_disk_bytes": disk.get(SHARED, 0),
                       "l2_tiers": {tier: got.get(SHARED, 0) for tier, got in remote.items()},
                       "limits": {k: getattr(q, k) for k in SHARED_FIELDS}}
        return out

    @staticmethod
    def tenant_view(full: dict, tenant: TenantState) -> dict:
        """STATUS for a tenant's client, out of the full one: the server's settings, its own
        registrations and figures."""
        mine = tenant.name + "/"
        regs = [dict(r, model=r["model"][len(mine):]) for r in full["registrations"] if r["model"].startswith(mine)]
        keep = ("version", "device", "chunk_size", "url")
        return {**{k: full[k] for k in keep}, "tenant": tenant.name, "registrations": regs,
                "tenants": {tenant.name: full["tenants"][tenant.name]}}
