"""What L1 hands to the L2 writers and what it evicts (storage/l1_writeback.py), without threads:
writes go in prefix order, a chunk that leaves L1 unwritten takes the rest of its prompt with it
(no fragments), eviction takes a clean chunk before a dirty one near the eviction end, and
chunks being written are neither evicted nor lost."""

from __future__ import annotations

import collections
import random

import pytest

from lmcache_mp.native import HostArena
from lmcache_mp.storage.l1 import L1Store, ObjectKey

FMT = ("tokens", 2, 1, 16, "uint8")
DISK = 1  # the bit of tier 0
N = 4096


class Drops:
    def __init__(self):
        self.dropped = self.lost = 0

    def __call__(self, dropped: int, lost: int, n: int) -> None:
        self.dropped += n if dropped & DISK else 0
        self.lost += n if lost & DISK else 0


def l1_of(slots: int, admit: int = 1) -> tuple[L1Store, Drops]:
    """An L1 of `slots` chunks under LRU: a prompt's deepest chunk goes first."""
    l1 = L1Store(HostArena(slots * N, N), policy="lru")
    drops = Drops()
    l1.attach_l2(DISK, admit, None, drops, None)
    return l1, drops


def keys_of(prompt: str, chunks: int) -> list[ObjectKey]:
    return [ObjectKey("m", 1, 0, f"{prompt}{i}".encode().ljust(16, b"."), b"") for i in range(chunks)]


def store(l1: L1Store, keys, parent=None) -> int:
    plan = l1.begin_store(keys, N, FMT, parent)
    l1.commit(plan)
    return len(plan.objects) + plan.present


def names(objs) -> list[str]:
    return [o.key.digest.rstrip(b".").decode() for o in objs]


def write(l1: L1Store, objs, ok: bool = True) -> None:
    l1.l2_written(DISK, [(o, ok) for o in objs])


def test_writes_go_in_prefix_order_whatever_the_lru_order():
    l1, _ = l1_of(16)
    a = keys_of("a", 4)
    store(l1, a)
    assert l1.lookup("m", 1, [a[0].digest])[0] == 1  # a0 is now the newest: LRU order a1 a2 a3 a0
    # a batch of two chunks begins at a1: a0 goes first (its prefix), and the batch goes on to the
    # end of the prompt
    got = l1.l2_take(DISK, 1 << 30, 2 * N)
    assert names(got) == ["a0", "a1", "a2", "a3"]
    assert l1.l2_take(DISK, 1 << 30, 1 << 20) == []  # being written: not handed out twice
    write(l1, got)
    assert l1.l2_take(DISK, 1 << 30, 1 << 20) == []  # written: clean


def test_a_chunk_evicted_unwritten_drops_the_rest_of_its_prompt_and_nothing_else():
    l1, drops = l1_of(8)
    a, b, c = keys_of("a", 4), keys_of("b", 4), keys_of("c", 2)
    store(l1, a)
    store(l1, b)  # L1 is full, nothing written yet: a3 a2 a1 a0 b3 b2 b1 b0, the oldest first
    assert store(l1, a[1:], a[0]) == 3  # a1 to a3 used again: a0, a's first chunk, is the oldest
    assert store(l1, c[:1]) == 1  # evicts a0, dirty: a dropped write
    assert (drops.dropped, drops.lost) == (1, 0)
    got = l1.l2_take(DISK, 1 << 30, 1 << 20)
    assert names(got) == ["b0", "b1", "b2", "b3", "c0"]  # a1 to a3 are never written: lost
    assert (drops.dropped, drops.lost) == (1, 3)
    write(l1, got)
    assert store(l1, c) == 2  # b3 goes (written): a3, a2, a1 left unwritten are counted once already
    assert store(l1, keys_of("d", 6)) == 6  # b and a go, the lost ones without counting again
    assert not any(l1.contains(k) for k in a)
    assert (drops.dropped, drops.lost) == (1, 3)


def test_eviction_takes_a_clean_chunk_before_a_dirty_one_near_the_eviction_end():
    l1, drops = l1_of(8)
    a, b = keys_of("a", 4), keys_of("b", 4)
    store(l1, a)
    store(l1, b)
    listed = collections.deque(l1.begin_read(b, FMT))  # b's objects, as a write-through list names them
    l1.end_read(list(listed))
    got = l1.l2_take(DISK, 0, 1 << 20, fresh=listed)
    assert names(got) == ["b0", "b1", "b2", "b3"] and not listed
    write(l1, got)
    assert store(l1, keys_of("c", 2)) == 2  # a is older, but b is written: b3 and b2 make room
    assert all(l1.contains(k) for k in a) and not l1.contains(b[3]) and not l1.contains(b[2])
    assert drops.dropped == drops.lost == 0
    got = l1.l2_take(DISK, 1 << 30, 1 << 20)
    assert names(got) == ["a0", "a1", "a2", "a3", "c0", "c1"]


def test_chunks_being_written_stay_until_written_and_a_failed_write_is_not_tried_again():
    l1, drops = l1_of(8)
    a, b = keys_of("a", 4), keys_of("b", 4)
    store(l1, a)
    store(l1, b)
    got = l1.l2_take(DISK, 1 << 30, 4 * N)  # a batch of four: prompt a
    assert names(got) == ["a0", "a1", "a2", "a3"]
    assert store(l1, keys_of("c", 2)) == 2  # a is being written: b3 and b2 go instead, unwritten
    assert all(l1.contains(k) for k in a) and drops.dropped == 2 and drops.lost == 0
    write(l1, got[:2])
    write(l1, got[2:], ok=False)  # a2 and a3 failed
    assert names(l1.l2_take(DISK, 1 << 30, 1 << 20)) == ["b0", "b1", "c0", "c1"]  # not a2 or a3
    assert drops.lost == 0


def test_a_store_that_names_present_chunks_links_its_new_ones_to_them():
    l1, drops = l1_of(8)
    a = keys_of("a", 4)
    store(l1, a[:2])
    got = l1.l2_take(DISK, 1 << 30, 1 << 20)
    write(l1, got)
    store(l1, a)  # a0 and a1 present (written), a2 and a3 new: their prefix is a0 a1
    assert names(l1.l2_take(DISK, 1 << 30, 1 << 20)) == ["a2", "a3"]


def test_one_off_chunks_are_clean_and_admission_counts_uses():
    l1, drops = l1_of(4, admit=2)
    a, b = keys_of("a", 2), keys_of("b", 2)
    store(l1, a)
    assert l1.lookup("m", 1, [k.digest for k in a])[0] == 2  # a used twice: admitted
    store(l1, b)  # used once
    assert names(l1.l2_take(DISK, 1 << 30, 1 << 20)) == ["a0", "a1"]
    store(l1, keys_of("c", 2))  # a is being written; b, one-off, leaves without a dropped write
    assert not l1.contains(b[0]) and not l1.contains(b[1]) and drops.dropped == drops.lost == 0


def test_a_tier_that_keeps_up_with_the_stores_loses_nothing():
    """Prompts stream through an L1 of 16 chunks; after each store the writer takes a batch of a
    quarter of L1 from the eviction end once less than that is free, and writes it (a tier as fast
    as the stores): every chunk that leaves L1 has been written, in prompt order."""
    l1, drops = l1_of(16)
    written = []
    for p in range(40):
        assert store(l1, keys_of(f"p{p:02d}-", 4)) == 4
        got = l1.l2_take(DISK, 4 * N, 4 * N)
        written += names(got)
        write(l1, got)
    assert drops.dropped == drops.lost == 0
    assert written[:4 * 36] == [f"p{p:02d}-{i}" for p in range(36) for i in range(4)]


def test_a_prompt_stored_as_it_grows_is_written_in_prefix_order_across_its_stores():
    l1, drops = l1_of(16)
    a = keys_of("a", 6)
    store(l1, a[:2])
    store(l1, a[2:4], a[1])  # the engine stores each new piece naming the chunk before it
    store(l1, a[4:], a[3])
    assert l1.lookup("m", 1, [k.digest for k in a[:2]])[0] == 2  # a0 a1 the newest: LRU a2 .. a5 a0 a1
    # (without the parents: a2 a3 a4 a5 a0 a1, the order of the LRU list)
    assert names(l1.l2_take(DISK, 1 << 30, 1 << 20)) == ["a0", "a1", "a2", "a3", "a4", "a5"]
    assert (drops.dropped, drops.lost) == (0, 0)


def test_a_piece_whose_earlier_piece_was_dropped_is_never_written():
    l1, drops = l1_of(4)
    a, b = keys_of("a", 4), keys_of("b", 2)
    store(l1, a[:2])
    store(l1, a[2:], a[1])  # (just behind a1)
    store(l1, a[2:], a[1])  # a2 and a3 used again: the oldest are a1, a0, a3, a2
    store(l1, b)  # evicts a1 unwritten (a dropped write), then a3, lost with it (clean before dirty)
    assert (drops.dropped, drops.lost) == (1, 1)
    got = l1.l2_take(DISK, 1 << 30, 1 << 20)
    assert names(got) == ["a0", "b0", "b1"] and drops.lost == 2  # not a2: no fragments in L2
    # without the parent, the second piece started a prompt of its own and was written: a fragment
    l1, drops = l1_of(4)
    store(l1, a[:2])
    store(l1, a[2:])
    store(l1, b)
    assert names(l1.l2_take(DISK, 1 << 30, 1 << 20)) == ["a2", "a3", "b0", "b1"]


def test_an_evicted_chunk_lets_go_of_its_prefix():
    l1, _ = l1_of(4)
    a, b = keys_of("a", 2), keys_of("b", 3)
    store(l1, a)
    gone = l1._get(a[1])
    assert gone.prev is l1._get(a[0])
    store(l1, b)  # 4 slots: b2 evicts a0
    store(l1, keys_of("c", 2))  # and c0 a1
    assert l1._get(a[1]) is None and gone.prev is None


def test_a_store_that_names_a_chunk_twice_writes_each_chunk_once():
    l1, _ = l1_of(16)
    a = keys_of("a", 3)
    assert store(l1, [a[0], a[1], a[0]]) == 2  # a0 then comes after a1: a loop of prefixes
    store(l1, [a[2]])
    assert store(l1, [a[2]], a[2]) == 1  # a chunk named as its own parent
    assert l1._get(a[2]).prev is l1._get(a[2])
    got = l1.l2_take(DISK, 1 << 30, 1 << 20)
    assert sorted(names(got)) == ["a0", "a1", "a2"]
    write(l1, got)
    assert l1.l2_take(DISK, 1 << 30, 1 << 20) == []


def test_a_piece_stored_after_its_parent_left_l1_follows_what_became_of_it():
    l1, drops = l1_of(6)
    a, b, c = keys_of("a", 4), keys_of("b", 4), keys_of("c", 4)
    store(l1, a[:2])
    write(l1, l1.l2_take(DISK, 1 << 30, 1 << 20))  # a0 a1 reach the tier
    store(l1, b[:2])
    store(l1, keys_of("x", 6))  # the a and b chunks leave L1: a's written, b's dropped
    assert drops.dropped == 2 and not any(l1._get(k) for k in a + b)
    write(l1, l1.l2_take(DISK, 1 << 30, 1 << 20))  # the x chunks too: they go first now
    store(l1, a[2:], a[1])  # the next pieces come now (and the x chunks leave)
    store(l1, b[2:], b[1])
    store(l1, c[2:], c[1])  # c1 was never seen: these start a prompt of their own
    assert all(l1._get(k) for k in a[2:] + b[2:] + c[2:])
    # after a written prefix, written; after a dropped one, never (it would be a fragment)
    assert sorted(names(l1.l2_take(DISK, 1 << 30, 1 << 20))) == ["a2", "a3", "c2", "c3"]


@pytest.mark.parametrize("seed", range(200))
def test_random_pieces_lookups_and_evictions_leave_only_prefixes_in_the_tier(seed):
    """Prompts stored in random pieces (each naming its parent), some stored again from the
    start, random lookups, an L1 that evicts all the time and a writer taking random batches:
    each chunk goes to the tier after its predecessor (earlier in the batch, or there already
    with its whole prefix) and no batch names a chunk twice; where no write fails, what the tier
    holds of each prompt is always a prefix of it. (A batch is written in parallel: where a write
    fails, the chunks after it in the batch may land; nothing more of their prompt follows them.)"""
    rng = random.Random(seed)
    l1, _ = l1_of(rng.choice([6, 12, 24]), admit=rng.choice([1, 1, 2]))
    fail = rng.choice([0.0, 0.0, 0.2])
    prompts = [keys_of(f"p{j}-", 8) for j in range(6)]
    upto = [0] * len(prompts)
    pred = {k: keys[i - 1] if i else None for keys in prompts for i, k in enumerate(keys)}
    tier: set = set()
    whole: set = set()  # in the tier with every chunk before it
    for _ in range(200):
        j = rng.randrange(len(prompts))
        keys = prompts[j]
        op = rng.random()
        if op < 0.45:
            if upto[j] == len(keys) or rng.random() < 0.1:  # the prompt again, from its start
                upto[j] = 0
            start, end = upto[j], min(len(keys), upto[j] + rng.randint(1, 3))
            store(l1, keys[start:end], keys[start - 1] if start else None)
            upto[j] = end
        elif op < 0.7:
            l1.lookup("m", 1, [k.digest for k in keys[: rng.randint(1, 8)]])
        else:
            got = l1.l2_take(DISK, rng.choice([0, 1 << 30]), rng.randint(1, 8) * N)
            assert len({id(o) for o in got}) == len(got), "a chunk handed out twice"
            # each after its predecessor: before it in the batch, or in the tier with its whole prefix
            for i, o in enumerate(got):
                before = pred[o.key]
                assert before is None or before in whole or before in {x.key for x in got[:i]}, names(got)
            ok = [rng.random() > fail for _ in got]  # a tier writes a batch in parallel: any may fail
            l1.l2_written(DISK, list(zip(got, ok)))
            for o, good in zip(got, ok):
                if good:
                    tier.add(o.key)
                    if pred[o.key] is None or pred[o.key] in whole:
                        whole.add(o.key)
            if not fail:
                for keys in prompts:
                    held = [k in tier for k in keys]
                    assert held == sorted(held, reverse=True), f"a fragment in the tier: {held}"


def test_chunks_written_after_a_failed_write_are_fragments_and_lost():
    l1, _ = l1_of(8)
    a = keys_of("a", 5)
    store(l1, a[:4])
    got = l1.l2_take(DISK, 1 << 30, 1 << 20)
    assert names(got) == ["a0", "a1", "a2", "a3"]
    fragments = l1.l2_written(DISK, list(zip(got, [True, False, True, True])))  # written in parallel
    assert names(fragments) == ["a2", "a3"]
    assert [bool(l1._get(k).l2_copies) for k in a[:4]] == [True, False, False, False]
    store(l1, a[4:], a[3])
    assert l1.l2_take(DISK, 1 << 30, 1 << 20) == []  # nothing after them either
