"""Hints from the application (docs/hints.md): pin, unpin, retain, prefetch, demote, drop.

A 64 KiB L1 of 16 chunk slots (lru, so that which chunks a flood evicts is known); the CPU device.
Pins end at their TTL on the server's clock: tests wait for that with a generous deadline.
"""

from __future__ import annotations

import numpy as np
import pytest

import cpu_workers as w
from lmcache_mp import chunk_hashes
from lmcache_mp.errors import RequestError
from lmcache_mp.server.ops.metrics import StatusCollector
from test_server_e2e import CHUNK, blocks_of, clients, no_internal_errors, register_mha, servers, wait_until  # noqa: F401
from test_tenants import Setup, engine_of, keys, setups  # noqa: F401

SLOTS = 16  # chunks a 64 KiB L1 holds
SLOT = 4096


def small_server(servers, **kw):  # noqa: F811
    srv = servers(l1_size="64KiB", eviction_policy="lru", **kw)
    arena = srv.engine.arena
    assert arena.capacity // arena.slot_bytes(arena.size_class(2 * w.LAYERS * CHUNK * w.TOKEN_BYTES)) == SLOTS
    return srv


def stored(c, h, kv, seed: int, chunks: int, start: int = 0) -> tuple[list[bytes], np.ndarray]:
    hashes = chunk_hashes(w.prompt(seed, chunks), CHUNK)
    ref = w.reference(seed, "mha", chunks * CHUNK)
    w.write_tokens(kv, "mha", blocks_of(chunks, start=start), ref)
    assert c.store(h, hashes, blocks_of(chunks, start=start)).result(30).stored == chunks
    return hashes, ref


def flood(c, h, seed: int, chunks: int = 3 * SLOTS) -> None:
    """Store other prompts, a slot's worth at a time: everything evictable goes."""
    for i in range(0, chunks, 4):
        c.store(h, chunk_hashes(w.prompt(seed + i, 4), CHUNK), blocks_of(4, start=32)).result(30)


def test_a_pinned_prefix_survives_a_flood_and_an_expired_pin_is_gone(shm_files, servers, clients,  # noqa: F811
                                                                     no_internal_errors):  # noqa: F811
    srv = small_server(servers, hint_budget="32KiB")
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=96)
    pinned, ref = stored(c, h, kv, seed=1, chunks=4)
    brief, _ = stored(c, h, kv, seed=2, chunks=4, start=16)
    other, _ = stored(c, h, kv, seed=3, chunks=4, start=64)
    r = c.hint("pin", pinned, model="m", ttl=600)
    assert (r.chunks, r.nbytes, r.pinned_bytes, r.ignored) == (4, 4 * SLOT, 4 * SLOT, False)
    assert c.hint("pin", brief, model="m", ttl=0.5).pinned_bytes == 8 * SLOT
    # (however slow this machine: the brief pin is waited for, not raced)
    wait_until(lambda: c.status()["hints"]["tenants"][""]["pinned_bytes"] == 4 * SLOT and c.status()["l1"]["leases"] == 1,
               60, "the brief pin to expire")
    flood(c, h, seed=100)
    assert c.lookup(other, model="m") == 0, "the flood evicted every unpinned chunk"
    assert c.lookup(brief, model="m") == 0, "an expired pin still held its chunks"
    assert c.lookup(pinned, model="m") == 4, "a pinned chunk was evicted"
    status = c.status()
    assert status["hints"]["tenants"][""] == {"pinned_bytes": 4 * SLOT, "pinned_objects": 4, "pins": 1,
                                              "hint_budget": 32 * 1024}
    assert status["hints"]["ended"] == 1
    series = {(x.name, tuple(x.labels.items())): x.value for m in StatusCollector(srv.engine).collect() for x in m.samples}
    assert series[("lmcache_mp_hint_pinned_bytes", (("tenant", ""),))] == 4 * SLOT
    dst = blocks_of(4, start=64)
    assert c.retrieve(h, pinned, dst).result(30).loaded == 4  # a read does not end a pin
    assert np.array_equal(w.read_tokens(kv, "mha", dst), ref)
    assert c.hint("unpin", pinned, model="m").pinned_bytes == 0
    flood(c, h, seed=200)
    assert c.lookup(pinned, model="m") == 0, "an unpinned prefix stayed"


def test_a_pin_over_the_budget_is_refused_and_holds_nothing(shm_files, servers, clients,  # noqa: F811
                                                            no_internal_errors):  # noqa: F811
    srv = small_server(servers, hint_budget="8KiB")  # two chunks
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=96)
    hashes, _ = stored(c, h, kv, seed=1, chunks=4)
    with pytest.raises(RequestError, match=r"LIMIT_EXCEEDED.*hint budget of 8\.0 KiB"):
        c.hint("pin", hashes, model="m", ttl=600)
    assert c.status()["l1"]["leases"] == 0 and c.status()["hints"]["refused"] == 1
    lookups = c.status()["l1"]["lookups"]
    assert c.hint("pin", hashes[:2], model="m", ttl=600).pinned_bytes == 2 * SLOT
    assert c.status()["l1"]["lookups"] == lookups  # a pin is no lookup (only reads and stores count)
    again = c.hint("pin", hashes[:2], model="m", ttl=600)  # the same chunks count once
    assert (again.chunks, again.nbytes, again.pinned_bytes) == (2, 0, 2 * SLOT)
    with pytest.raises(RequestError, match="hint budget"):
        c.hint("pin", hashes[:3], model="m", ttl=600)
    assert c.hint("unpin", hashes, model="m").pinned_bytes == 0
    assert c.status()["l1"]["leases"] == 0
    flood(c, h, seed=100)
    assert c.lookup(hashes, model="m") == 0
    with pytest.raises(RequestError, match="INVALID_ARGUMENT.*ttl"):
        c.hint("pin", hashes, model="m", ttl=0)
    with pytest.raises(RequestError, match="INVALID_ARGUMENT.*priority"):
        c.hint("retain", hashes, model="m", priority=0)


def test_budgets_are_per_tenant(tmp_path, keys, setups, no_internal_errors):  # noqa: F811
    s = setups(tmp_path, keys, l1_size="256KiB", eviction_policy="lru",
               extra={"alice": 'hint_budget = "12KiB"', "bob": 'hint_budget = "128KiB"'})
    a, b = s.client("client"), s.client("b")
    _, h_a, _, hashes_a, ids = engine_of(a, seed=1, chunks=6)
    _, h_b, _, hashes_b, ids_b = engine_of(b, seed=1, chunks=6)  # the same prompt: each tenant its own copy
    assert a.store(h_a, hashes_a, ids).result(30).stored == 6
    assert b.store(h_b, hashes_b, ids_b).result(30).stored == 6
    slot = a.hint("pin", hashes_a[:1], model="m", ttl=600).nbytes
    assert slot == SLOT
    with pytest.raises(RequestError, match="tenant alice.*hint budget of 12.0 KiB"):
        a.hint("pin", hashes_a, model="m", ttl=600)
    assert b.hint("pin", hashes_b, model="m", ttl=600).pinned_bytes == 6 * slot  # bob's budget is his own
    assert a.hint("unpin", hashes_b, model="m").chunks == 1  # alice's names reach only her own pins
    assert b.status()["tenants"]["bob"]["pinned_bytes"] == 6 * slot  # a tenant sees its own
    full = s.server.engine.status()
    assert full["tenants"]["alice"]["pinned_bytes"] == 0 and full["tenants"]["bob"]["pinned_bytes"] == 6 * slot


def test_pins_leave_room_for_another_tenants_l1_min(tmp_path, keys, setups, no_internal_errors):  # noqa: F811
    s = setups(tmp_path, keys, l1_size="256KiB", eviction_policy="lru",
               extra={"alice": 'hint_budget = "256KiB"', "bob": 'l1_min = "240KiB"'})
    a = s.client("client")
    _, h_a, _, hashes_a, ids = engine_of(a, seed=1, chunks=6)
    assert a.store(h_a, hashes_a, ids).result(30).stored == 6
    one = a.hint("pin", hashes_a[:1], model="m", ttl=600).nbytes
    room = 256 * 1024 - 240 * 1024
    k = room // one  # chunks alice may pin with bob's l1_min reserved
    assert 1 <= k < 6
    assert a.hint("pin", hashes_a[:k], model="m", ttl=600).pinned_bytes == k * one
    with pytest.raises(RequestError, match="LIMIT_EXCEEDED.*l1_min"):
        a.hint("pin", hashes_a[:k + 1], model="m", ttl=600)
    assert s.server.engine.status()["tenants"]["alice"]["pinned_bytes"] == k * one


def test_unknown_actions_are_ignored_and_change_nothing(shm_files, servers, clients, no_internal_errors):  # noqa: F811
    srv = small_server(servers)
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=96)
    hashes, ref = stored(c, h, kv, seed=1, chunks=4)
    for action in ("share", "Pin", "evict-everything", "x" * 300):
        r = c.hint(action, hashes, model="m", ttl=5, priority=3)
        assert r.ignored and r.chunks == 0 and r.pinned_bytes == 0
    assert c.status()["hints"]["requests"]["ignored"] == 4 and c.status()["l1"]["leases"] == 0
    assert c.lookup(hashes, model="m") == 4
    dst = blocks_of(4, start=64)
    assert c.retrieve(h, hashes, dst).result(30).loaded == 4
    assert np.array_equal(w.read_tokens(kv, "mha", dst), ref)


def test_retain_moves_a_prefix_away_from_eviction(shm_files, servers, clients, no_internal_errors):  # noqa: F811
    srv = small_server(servers)
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=96)
    old, _ = stored(c, h, kv, seed=1, chunks=4)
    newer, _ = stored(c, h, kv, seed=2, chunks=12, start=16)  # L1 is full; `old` is the least recent
    assert c.hint("retain", old, model="m", priority=1).chunks == 4
    stored(c, h, kv, seed=3, chunks=4, start=64)  # room for 4: taken from `newer`, not `old`
    assert c.lookup(old, model="m") == 4
    assert c.lookup(newer, model="m") == 8  # (from its end)


def test_drop_frees_a_prefix_but_never_a_leased_one(shm_files, servers, clients, no_internal_errors):  # noqa: F811
    srv = small_server(servers)
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=96)
    hashes, _ = stored(c, h, kv, seed=1, chunks=4)
    held = c.lookup(hashes[:2], model="m", lock=True)
    r = c.hint("drop", hashes, model="m")
    assert (r.chunks, r.nbytes) == (2, 2 * SLOT)  # the two leased ones stay
    assert c.lookup(hashes, model="m") == 2
    c.release(lease=held)
    assert c.hint("drop", hashes, model="m").chunks == 2
    assert c.lookup(hashes, model="m") == 0 and srv.engine.l1.stats()["objects"] == 0


def test_demote_writes_to_the_disk_and_prefetch_brings_it_back(shm_files, servers, clients, tmp_path,  # noqa: F811
                                                              no_internal_errors):  # noqa: F811
    srv = small_server(servers, l2_disk=str(tmp_path / "disk"), l2_disk_size="16MiB")
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=96)
    hashes, ref = stored(c, h, kv, seed=1, chunks=4)
    r = c.hint("demote", hashes, model="m")
    assert (r.chunks, r.nbytes) == (4, 4 * SLOT)
    assert srv.engine.l1.prefix_objects("m", 1, hashes)[0] == 0  # none left in L1
    found = c.lookup(hashes, model="m")
    assert found == 4 and found.from_l2 == 4  # all on the disk

    got = c.hint("prefetch", hashes, model="m")
    assert got.chunks <= 4
    wait_until(lambda: srv.engine.l1.prefix_objects("m", 1, hashes)[0] == 4, 60, "the prefetch to load the chunks")
    assert c.lookup(hashes, model="m").from_l2 == 0
    dst = blocks_of(4, start=64)
    assert c.retrieve(h, hashes, dst).result(30).loaded == 4
    assert np.array_equal(w.read_tokens(kv, "mha", dst), ref)


def test_prefetch_and_demote_without_a_tier_say_so(shm_files, servers, clients):  # noqa: F811
    srv = small_server(servers)
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=96)
    hashes, _ = stored(c, h, kv, seed=1, chunks=2)
    for action in ("prefetch", "demote"):
        with pytest.raises(RequestError, match=f"UNSUPPORTED.*{action}: this server has no L2 tier"):
            c.hint(action, hashes, model="m")
    assert c.lookup(hashes, model="m") == 2


def test_a_clear_ends_every_pin_and_its_bytes_with_it(shm_files, servers, clients, no_internal_errors):  # noqa: F811
    srv = small_server(servers)
    c = clients(srv.url)
    kv, h = register_mha(c, num_blocks=96)
    hashes, _ = stored(c, h, kv, seed=1, chunks=4)
    assert c.hint("pin", hashes, model="m", ttl=600).pinned_bytes == 4 * SLOT
    assert c.clear() == 4  # (a pinned chunk goes too: CLEAR ends every lease)
    st = c.status()
    assert st["hints"]["tenants"] == {} and st["l1"]["leases"] == 0
    again, _ = stored(c, h, kv, seed=1, chunks=4)
    assert c.hint("pin", again, model="m", ttl=600).pinned_bytes == 4 * SLOT  # the budget is whole again
