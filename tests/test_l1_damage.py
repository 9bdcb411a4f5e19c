"""--l1-persist after crashes and damage: whatever part of the journal or of the arena file is
damaged, and wherever a crash falls, a restarted server never serves a chunk with bytes that are
not its own, and keeps the intact chunks that the journal described before the damage."""

from __future__ import annotations

import os
import random
import shutil

import numpy as np
import pytest

from lmcache_mp import Client
from lmcache_mp.native import HostArena
from lmcache_mp.storage import l1_journal
from lmcache_mp.storage.l1 import L1Store, ObjectKey
from lmcache_mp.storage.l1_journal import L1Journal, replay
from test_cli import ServerProcess
from test_l1_persist import persist_path  # noqa: F401 (a fixture)
from test_l2_tier import retrieved_exact, store_prompts
from test_server_e2e import CHUNK, register_mha, wait_until


def test_a_damaged_journal_never_serves_a_reused_slots_bytes(tmp_path, persist_path):  # noqa: F811
    """The reproduction: prompts A fill L1, prompts B evict every A (reusing its slot), SIGKILL,
    three bytes flipped in the middle of the journal. The replay keeps commit records of A from
    before the damage but loses the free records after it; A's slots hold B's bytes, so those
    chunks must not come back under A's keys."""
    url = f"ipc://{tmp_path}/s.sock"
    args = ["--url", url, "--device", "cpu", "--chunk-size", str(CHUNK), "--l1-size", "1MiB", "--l1-persist",
            persist_path, "--http-addr", "off"]
    srv = ServerProcess(args)
    try:
        srv.wait_ready()
        c = Client(url)
        kv, h = register_mha(c, num_blocks=128)
        per_l1 = (1 << 20) // h.object_bytes
        a, b = list(range(1000, 1000 + per_l1)), list(range(5000, 5000 + per_l1))
        store_prompts(c, h, kv, a, chunks=1)
        store_prompts(c, h, kv, b, chunks=1)
        assert c.status()["l1"]["evicted"] >= per_l1 // 2
        wait_until(lambda: c.status()["l1"]["journal_backlog"] == 0, 10, "every commit to be recorded")
    finally:
        srv.kill()
    c.close()
    journal = persist_path + ".journal"
    with open(journal, "r+b") as f:
        data = bytearray(f.read())
        mid = len(data) // 2
        for i in range(3):
            data[mid + i] ^= 0x5A
        f.seek(0)
        f.write(data)
    srv = ServerProcess(args)
    try:
        srv.wait_ready()
        assert "damaged record" in srv.wait_for("L1 journal")
        c = Client(url)
        kv, h = register_mha(c, num_blocks=128)
        served = sum(retrieved_exact(c, h, kv, seed, chunks=1) for seed in a + b)  # asserts the bytes
        assert 0 < served <= per_l1  # the chunks before the damage that are still in their slots
        c.close()
    finally:
        srv.kill()


# ---- the fuzz test: random crash points, random damage ---------------------------------------------

SLAB = 64 << 10
SLABS = 8
SIZES = (5000, 12000)  # two object sizes: slabs change size, objects move


def _content(key: ObjectKey, size: int) -> np.ndarray:
    seed = int.from_bytes(key.digest[:8], "little") ^ size
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def _key(i: int) -> ObjectKey:
    return ObjectKey("m", 1, 0, i.to_bytes(16, "little"), b"")


def _open(path: str):
    journal = L1Journal(path + ".journal", SLABS * SLAB, SLAB)
    arena = HostArena(SLABS * SLAB, SLAB, False, -1, path)
    l1 = L1Store(arena)
    l1.attach_journal(journal)
    l1.restore(journal.read_live().values() if arena.reattached else [])
    return arena, l1


def _store(l1, arena, keys, size, rng, finish=True) -> None:
    plan = l1.begin_store(keys, size, ("t", size))
    for obj in plan.objects:
        data = _content(obj.key, size)
        view = np.frombuffer(arena.view(obj.offset, size), dtype=np.uint8)
        if finish:
            view[:] = data
        else:  # a copy in progress at the crash: part of the bytes are there
            cut = rng.randrange(size)
            view[:cut] = data[:cut]
    if finish:
        l1.commit(plan)


def _run_until_crash(l1, arena, rng) -> None:
    """Stores (new keys and keys seen before, two sizes), lookups with and without leases,
    reads, releases and clears, with the journal's summing thread running alongside."""
    leases = []
    for _ in range(rng.randrange(5, 160)):
        op = rng.random()
        if op < 0.7:
            keys = [_key(rng.randrange(300)) for _ in range(rng.randrange(1, 5))]
            _store(l1, arena, list(dict.fromkeys(keys)), rng.choice(SIZES), rng)
        elif op < 0.8:
            digests = [_key(rng.randrange(300)).digest for _ in range(3)]
            _, lease = l1.lookup("m", 1, digests, lock=rng.random() < 0.5, owner=b"o")
            if lease:
                leases.append(lease)
        elif op < 0.9 and leases:
            l1.release(leases.pop(rng.randrange(len(leases))))
        elif op < 0.97:
            objs = l1.begin_read([_key(rng.randrange(300))], ("t", rng.choice(SIZES)))
            l1.end_read(objs)
        else:
            l1.clear()
        if rng.random() < 0.2:
            l1.flush_journal()


def _damage(path: str, rng) -> tuple[int, list[tuple[int, int]], bool]:
    """Damage the journal and/or the arena file; returns (the first journal byte that may have
    changed, the arena byte ranges that may have changed, whether the arena was truncated)."""
    journal, first = path + ".journal", os.path.getsize(path + ".journal")
    ranges, truncated = [], False
    for _ in range(rng.randrange(0, 4)):
        kind = rng.choice(["flip", "truncate", "zero page", "arena flip", "arena zero page", "arena truncate"])
        target = path if kind.startswith("arena") else journal
        size = os.path.getsize(target)
        if size == 0:
            continue
        with open(target, "r+b") as f:
            if kind.endswith("truncate"):
                at = rng.randrange(size)
                f.truncate(at)
            elif kind.endswith("zero page"):
                at = rng.randrange(size) // 4096 * 4096
                f.seek(at)
                f.write(bytes(min(4096, size - at)))
            else:
                at = rng.randrange(size)
                f.seek(at)
                byte = f.read(1)[0]
                f.seek(at)
                f.write(bytes([byte ^ (1 << rng.randrange(8))]))
        if target == journal:
            first = min(first, at)
        elif kind == "arena truncate":
            truncated = True
        else:
            ranges.append((at, at + 4096))
    return first, ranges, truncated


@pytest.mark.parametrize("seed", range(40))
def test_crashes_and_damage_never_serve_wrong_bytes_and_keep_intact_chunks(persist_path, monkeypatch, seed):  # noqa: F811
    monkeypatch.setattr(l1_journal, "COMPACT_MIN_BYTES", 16 << 10)  # rewrites happen too
    rng = random.Random(seed)
    arena, l1 = _open(persist_path)
    _run_until_crash(l1, arena, rng)
    crash = persist_path + ".crash"
    with l1._lock:  # the crash: both files as they are at one instant (the summing thread runs on)
        if rng.random() < 0.5:  # with a store's copy under way
            l1._lock.release()
            try:
                _store(l1, arena, [_key(1000 + seed)], rng.choice(SIZES), rng, finish=False)
            finally:
                l1._lock.acquire()
        shutil.copyfile(persist_path, crash)
        shutil.copyfile(persist_path + ".journal", crash + ".journal")
        if rng.random() < 0.3:  # a torn tail: the crash fell inside a write
            os.truncate(crash + ".journal", max(0, os.path.getsize(crash + ".journal") - rng.randrange(1, 40)))
        live = {o.key: o.offset for o in l1._at.values() if o.committed and o.checksum is not None}
    l1.close_journal()
    del l1, arena

    first, ranges, truncated = _damage(crash, rng)
    with open(crash + ".journal", "rb") as f:  # what the journal said before the first damage
        before, _, _ = replay(f.read()[:first], SLABS * SLAB, SLAB)

    arena, l1 = _open(crash)
    try:
        restored = {o.key: o for o in l1._at.values() if o.committed}
        for key, obj in restored.items():  # never a wrong byte
            size = obj.format_key[1]
            assert np.array_equal(np.frombuffer(arena.view(obj.offset, size), dtype=np.uint8), _content(key, size)), \
                f"seed {seed}: {key} came back with bytes that are not its own"
        if truncated:
            return
        for off, e in before.items():  # the intact chunks described before the damage are kept
            key = ObjectKey(*e.key)
            intact = not any(lo < off + e.object_bytes and off < hi for lo, hi in ranges)
            if live.get(key) == off and intact:
                assert key in restored, f"seed {seed}: intact chunk {key} at {off} was dropped"
    finally:
        l1.close_journal()
