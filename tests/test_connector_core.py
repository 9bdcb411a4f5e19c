"""The engine-agnostic connector core against a real in-process server and shared-memory caches.

A small fake engine stands in for vLLM: it allocates blocks, "computes" KV (deterministic bytes
derived from the token prefix, so a wrong block shows), and drives the scheduler-side core and
one worker-side core per rank the way vLLM's connector hooks do.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import math
import os
import socket
import threading
import time

import pytest

torch = pytest.importorskip("torch")

from lmcache_mp import Client, Server, ServerConfig  # noqa: E402
from lmcache_mp.integration.connector_core import (  # noqa: E402
    ConnectorConfig,
    KVGroup,
    ScheduledRequest,
    SchedulerCore,
    StepPlan,
    Transfer,
    WorkerCore,
)
from lmcache_mp.integration.link import ClientLink  # noqa: E402
from lmcache_mp.keys import chunk_hashes  # noqa: E402

BS = 32  # engine block size
CS = 64  # server chunk size
BPC = CS // BS
LAYERS, HEADS, HEAD2 = 2, 2, 64  # vLLM CPU layout [NB, H, BS, 2*D]
NUM_BLOCKS = 96
SCRATCH = 0  # block 0 is never handed to a request, like vLLM's null block


@pytest.fixture
def server():
    srv = Server(ServerConfig(url="tcp://127.0.0.1:0", l1_size="64MiB", device="cpu", chunk_size=CS)).start()
    yield srv
    srv.stop()


@pytest.fixture
def engines():
    """Factory of engines; whatever a test leaves open is closed before the server stops."""
    made = []

    def make(url: str, **kw) -> "Engine":
        made.append(Engine(url, **kw))
        return made[-1]

    yield make
    for e in made:
        e.close()


# The caches the fake engine allocates, as vLLM hands them over: per kind, the per-layer shape
# in memory, the permutation that gives the logical view, the view's block dim, and how many of
# the tensor's blocks make one engine block (vLLM's kernel blocks).
LAYER_LAYOUTS = {
    "opaque": ((NUM_BLOCKS, HEADS, BS, HEAD2), (0, 1, 2, 3), 0, 1),  # vLLM's CPU cache
    "opaque_nhd": ((NUM_BLOCKS, BS, HEADS, HEAD2), (0, 2, 1, 3), 0, 1),  # vLLM 0.32 CUDA default
    "kernel_blocks": ((NUM_BLOCKS * 2, HEADS, BS // 2, HEAD2), (0, 1, 2, 3), 0, 2),
    "mha": ((2, NUM_BLOCKS, BS, HEADS, HEAD2 // 2), (0, 1, 2, 3, 4), 1, 1),  # flash-attention
    "mla": ((NUM_BLOCKS, BS, HEAD2), (0, 1, 2), 0, 1),
    "cross_layer": ((NUM_BLOCKS, HEADS, BS, HEAD2), (0, 1, 2, 3), 0, 1),  # vLLM's BLHNC, see make_cache
}


def make_cache(device: str = "cpu", kind: str = "opaque") -> list:
    """Per-layer views into one ordinary (not shared) buffer, as vLLM's workers allocate."""
    shape, perm, _, _ = LAYER_LAYOUTS[kind]
    if kind == "cross_layer":  # block-outermost: the layers of one block lie side by side
        whole = torch.zeros((shape[0], LAYERS, *shape[1:]), dtype=torch.bfloat16, device=device)
        return [whole[:, i] for i in range(LAYERS)]
    per_layer = math.prod(shape)
    buf = torch.zeros(LAYERS * per_layer * 2, dtype=torch.int8, device=device)
    flat = buf.view(torch.bfloat16)
    return [flat[i * per_layer : (i + 1) * per_layer].view(shape).permute(perm) for i in range(LAYERS)]


def block_view(layer_cache, block_id: int, kind: str = "opaque"):
    """The part of one layer's tensor that holds engine block `block_id`."""
    _, _, dim, split = LAYER_LAYOUTS[kind]
    if split > 1:
        return layer_cache.narrow(dim, block_id * split, split)
    return layer_cache.select(dim, block_id)


def block_bytes(tokens, block_index: int, layer: int, rank: int, kind: str = "opaque", group: int = 0):
    """The KV of one full block: a function of every token up to its end (like real KV).
    MLA KV is the same on every rank."""
    if kind == "mla":
        rank = 0
    h = hashlib.blake2b(repr((tokens[: (block_index + 1) * BS], layer, rank, group)).encode(), digest_size=8)
    g = torch.Generator().manual_seed(int.from_bytes(h.digest(), "little"))
    shape, perm, dim, split = LAYER_LAYOUTS[kind]
    view = [shape[p] for p in perm]
    view = view[:dim] + ([split] if split > 1 else []) + view[dim + 1 :]
    return torch.randn(view, generator=g).to(torch.bfloat16)


def matched(sched, *args, **kw):
    """num_new_matched_tokens as the engine sees it: asked again at later steps while None."""
    while True:
        n = sched.num_new_matched_tokens(*args, **kw)
        if n is not None:
            return n
        time.sleep(0.002)


class Engine:
    """One engine instance: a scheduler core and one worker core per rank."""

    def __init__(self, url: str, world_size: int = 1, device: str = "cpu", kind: str = "opaque", groups=None,
                 **cfg):
        cfg.setdefault("lookup_timeout", 2.0)
        cfg.setdefault("connect_timeout", 5.0)
        cfg.setdefault("model", "tiny")
        self.cfg = ConnectorConfig(url=url, block_size=BS, world_size=world_size, **cfg)
        self.groups = groups or [KVGroup(0, block_size=BS)]
        self.sched = SchedulerCore(self.cfg, groups=self.groups)
        self.sched.scratch_block_id = SCRATCH
        # The engine's reference counts of blocks the scheduler keeps from reuse (vLLM's touch).
        self.pinned = collections.Counter()
        self.sched.pin_blocks = self.pinned.update
        self.sched.unpin_blocks = self.pinned.subtract
        self.sched.start()
        self.kind = kind
        # Per rank, per group: the layers (one block pool for all groups, as in vLLM).
        self.group_caches = [[make_cache(device, kind) for _ in self.groups] for _ in range(world_size)]
        self.caches = [gc[0] for gc in self.group_caches]
        # As the vLLM adapter does: MLA bytes are the same on every rank, so only rank 0 stores.
        mla = kind == "mla"
        self.workers = [
            WorkerCore(self.cfg, rank=r, layout="mla" if mla else "auto", stores=not mla or r == 0,
                       groups=self.groups)
            for r in range(world_size)
        ]
        for w, gc in zip(self.workers, self.group_caches):
            # (with a server, this returns once the worker's client has its KV cache registered; a
            # request sent before the client's socket connects waits to be sent, it does not fail)
            w.register_kv_caches(gc if len(self.groups) > 1 else gc[0])
        self.free = list(range(1, NUM_BLOCKS))
        self.finished: set[str] = set()
        self.load_errors: set[int] = set()
        self.closed = False

    def alloc(self, n: int) -> list[int]:
        assert n <= len(self.free), "fake engine out of blocks"
        out, self.free = self.free[:n], self.free[n:]
        return out

    def compute(self, tokens, block_ids, start: int, end: int, group: int = 0) -> None:
        """Write the KV of full blocks covering tokens [start, end) of a group on every rank."""
        for i in range(start // BS, end // BS):
            for r, gc in enumerate(self.group_caches):
                for layer in range(LAYERS):
                    block = block_view(gc[group][layer], block_ids[i], self.kind)
                    block.copy_(block_bytes(tokens, i, layer, r, self.kind, group))

    def check(self, tokens, block_ids, upto_tokens: int, group: int = 0, start_block: int = 0) -> bool:
        ok = True
        for i in range(start_block, upto_tokens // BS):
            for r, gc in enumerate(self.group_caches):
                for layer in range(LAYERS):
                    block = block_view(gc[group][layer], block_ids[i], self.kind).cpu()
                    ok &= torch.equal(block, block_bytes(tokens, i, layer, r, self.kind, group))
        return ok

    def settle_pins(self, timeout: float = 10.0) -> None:
        """Hand the workers' settled stores to the scheduler (vLLM: worker metadata each step)
        until no store keeps blocks pinned."""
        deadline = time.monotonic() + timeout
        while self.sched.pinned_stores:
            assert time.monotonic() < deadline, "pinned stores never settled"
            for w in self.workers:
                self.sched.stores_settled(collections.Counter(w.take_settled_pins()))
            time.sleep(0.01)

    def execute(self, plan: StepPlan, compute=()) -> None:
        """One forward step on every rank: loads, compute, then stores."""
        for w in self.workers:
            w.handle_preemptions(plan)
            w.start_loads(plan)
            w.wait_loads()
            self.load_errors |= w.take_load_errors()
        for args in compute:
            self.compute(*args)
        for w in self.workers:
            w.start_stores(plan)

    def prefill(self, rid: str, tokens, local_hit: int = 0, local_blocks=(), **kw):
        """Admit a request (kw: num_new_matched_tokens's, its hints) and run its whole prompt in
        one step; returns (external tokens, blocks)."""
        ext = matched(self.sched, rid, tokens, local_hit, **kw)
        blocks = list(local_blocks) + self.alloc(-(-len(tokens) // BS) - len(local_blocks))
        self.sched.on_allocated(rid, blocks, ext)
        computed = local_hit + ext
        plan = self.sched.build_plan([ScheduledRequest(rid, computed, len(tokens) - computed, blocks)])
        self.execute(plan, compute=[(tokens, blocks, computed, len(tokens))])
        return ext, blocks, plan

    def finish(self, rid: str, timeout: float = 10.0) -> bool:
        """request_finished + poll the workers until they report the request (if delayed)."""
        delay = self.sched.request_finished(rid)
        if not delay:
            return False
        deadline = time.monotonic() + timeout
        reported = [set() for _ in self.workers]
        first = True
        while time.monotonic() < deadline:
            for i, w in enumerate(self.workers):
                reported[i] |= w.finished({rid} if first else set())
            first = False
            if all(rid in r for r in reported):
                return True
            time.sleep(0.01)
        raise AssertionError(f"{rid} never reported finished")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for w in self.workers:
            w.close()
        self.sched.close()


def leases(server) -> int:
    """Objects the server's leases hold."""
    with Client(server.url, timeout=5) as c:
        return c.status()["l1"]["leased_objects"]


def prompt(seed: int, n: int, prefix=()):
    g = torch.Generator().manual_seed(seed)
    return list(prefix) + torch.randint(3, 500, (n - len(prefix),), generator=g).tolist()


# ---- configuration ---------------------------------------------------------------------------


def test_config_from_extra_config():
    cfg = ConnectorConfig.from_extra_config(
        {
            "lmcache_mp.url": "tcp://10.0.0.1:6000",
            "lmcache_mp.lookup_timeout": "0.5",
            "lmcache_mp.store_decode": "true",
            "other.key": 1,
        },
        model="served",
        block_size=32,
        world_size=4,
    )
    assert (cfg.url, cfg.model, cfg.block_size, cfg.world_size) == ("tcp://10.0.0.1:6000", "served", 32, 4)
    assert cfg.lookup_timeout == 0.5 and cfg.store_decode is True
    assert ConnectorConfig.from_extra_config({"lmcache_mp.model": "m"}, block_size=16).model == "m"
    with pytest.raises(ValueError, match="unknown"):
        ConnectorConfig.from_extra_config({"lmcache_mp.nope": 1})


# ---- shared memory ---------------------------------------------------------------------------


def my_shm_files(pid: int | None = None) -> set[str]:
    from lmcache_mp import shm

    prefix = f"{shm.SHM_PREFIX}{os.getpid() if pid is None else pid}_"
    return {f for f in os.listdir(shm.SHM_DIR) if f.startswith(prefix)}


def test_a_registered_cpu_cache_has_no_file_in_dev_shm(server, engines):
    """The worker's CPU cache moves into shared memory in place (the store and load tests show
    that the server reads and writes the tensors' own bytes); once registered, that memory has
    no name in /dev/shm, so however the worker ends, nothing is left there."""
    from lmcache_mp import shm

    before = my_shm_files()
    eng = engines(server.url)
    try:
        cache = eng.caches[0]
        name = shm.find_shared_region(cache[0].data_ptr(), cache[0].numel() * 2).name
        with Client(server.url, timeout=5) as c:
            assert [r["model"] for r in c.status()["registrations"]] == ["tiny"]
        assert my_shm_files() == before and name not in before
    finally:
        eng.close()


def test_a_server_that_cannot_open_the_file_through_proc_gets_a_lasting_name(server, engines, monkeypatch, caplog):
    """A server of another user or pid namespace cannot open the worker's file through the
    symbolic link to /proc/PID/fd/FD: the file then gets its name for good (removed at close),
    and the registration goes through."""
    import contextlib

    from lmcache_mp import shm

    monkeypatch.setattr(shm, "published", lambda names: contextlib.nullcontext())  # as if the link led nowhere
    before = my_shm_files()
    eng = engines(server.url)
    try:
        name = shm.find_shared_region(eng.caches[0][0].data_ptr(), 1).name
        assert registered_models(server.url) == ["tiny"]
        assert my_shm_files() - before == {name}
        assert "gets a name in /dev/shm for good" in caplog.text
    finally:
        eng.close()
    assert my_shm_files() == before


KILLED_WORKER = """
import sys, time, torch
from lmcache_mp.integration.connector_core import ConnectorConfig, WorkerCore
worker = WorkerCore(ConnectorConfig(url=sys.argv[1], model="killed", block_size=32))
buf = torch.zeros(2 * 16 * 2 * 32 * 64, dtype=torch.bfloat16)  # vLLM's CPU layout, 2 layers
worker.register_kv_caches([buf.view(2, 16, 2, 32, 64)[i] for i in range(2)])
print("registered" if worker.link.get() is not None else "not registered", flush=True)
time.sleep(600)
"""


def test_a_killed_worker_leaves_nothing_in_dev_shm(server):
    """vLLM's default stop kills its workers (SIGKILL): their KV cache must not stay in /dev/shm."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", KILLED_WORKER, server.url], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "registered"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
        proc.stdout.close()
    assert not my_shm_files(proc.pid)


# ---- hits, caps and alignment ----------------------------------------------------------------


def test_store_then_load_in_another_engine(server, engines):
    a = engines(server.url)
    toks = prompt(1, 300)
    ext, blocks_a, plan = a.prefill("r1", toks)
    assert ext == 0 and not plan.loads
    assert [len(t.hashes) for t in plan.stores] == [300 // CS]
    assert plan.stores[0].block_ids == blocks_a[: (300 // CS) * BPC]
    assert a.finish("r1") is True  # stores were in flight: blocks held until reported
    a.close()

    b = engines(server.url)
    try:
        b.free = b.free[::-1]  # other block ids than engine A's
        ext, blocks_b, plan = b.prefill("r1", toks)
        assert ext == 4 * CS  # whole chunks, not the 300-token prompt
        assert len(plan.loads) == 1 and len(plan.loads[0].hashes) == 4
        assert not plan.stores  # nothing new to store: chunk 5 is partial
        assert b.load_errors == set()
        assert b.check(toks, blocks_b, 300)
        assert leases(server) == 0  # the retrieve consumed the lease
        assert b.finish("r1") is True  # it had a load: blocks held until the server answered it
    finally:
        b.close()


def test_hit_never_covers_the_whole_prompt(server, engines):
    a = engines(server.url)
    toks = prompt(2, 256)  # exactly 4 chunks
    a.prefill("r", toks)
    a.finish("r")
    ext, _, plan = a.prefill("again", toks)
    assert ext == 3 * CS  # (256 - 1) // 64 chunks: vLLM must compute at least one token
    # The last chunk was not looked up, so it is stored again; the server finds it present.
    assert [t.hashes for t in plan.stores] == [chunk_hashes(toks, CS)[3:4]]
    a.finish("again")
    a.close()


def test_shared_prefix_and_chunk_alignment(server, engines):
    a = engines(server.url)
    base = prompt(3, 400)
    a.prefill("base", base)
    a.finish("base")
    other = prompt(4, 500, prefix=base[:150])  # shares 2 full chunks and 22 more tokens
    ext, blocks, plan = a.prefill("other", other)
    assert ext == 2 * CS
    assert a.load_errors == set() and a.check(other, blocks, 500)
    # Chunks 2.. are new: stored, starting after the hit.
    assert [len(t.hashes) for t in plan.stores] == [500 // CS - 2]
    assert plan.stores[0].hashes == chunk_hashes(other, CS)[2 : 500 // CS]
    a.finish("other")
    a.close()


def test_local_prefix_hit_inside_a_chunk_uses_the_scratch_block(server, engines):
    a = engines(server.url)
    toks = prompt(5, 330)
    a.prefill("r", toks)
    a.finish("r")
    # The engine holds 3 blocks (96 tokens) itself; the server has 5 chunks (320 tokens).
    local = a.alloc(3)
    a.compute(toks, local, 0, 96)
    before = [c[layer][local].clone() for c in a.caches for layer in range(LAYERS)]
    ext, blocks, plan = a.prefill("r2", toks, local_hit=96, local_blocks=local)
    assert ext == 320 - 96
    (load,) = plan.loads
    assert load.hashes == chunk_hashes(toks, CS)[1:5]  # starts at the chunk holding token 96
    assert load.num_scratch_blocks == 1 and load.block_ids[0] == SCRATCH
    assert load.block_ids[1:] == blocks[3:10]
    assert a.load_errors == set() and a.check(toks, blocks, 330)
    after = [c[layer][local].clone() for c in a.caches for layer in range(LAYERS)]
    assert all(torch.equal(x, y) for x, y in zip(before, after))  # local blocks untouched
    a.sched.flush_releases(5)
    assert leases(server) == 0  # chunk 0 was released, chunks 1-4 consumed by the load
    a.finish("r2")
    a.close()


def test_local_hit_beyond_the_server_hit_loads_nothing(server, engines):
    a = engines(server.url)
    toks = prompt(6, 300)
    a.prefill("r", toks)
    a.finish("r")
    local = a.alloc(9)
    a.compute(toks, local, 0, 288)
    ext, _, plan = a.prefill("r2", toks, local_hit=288, local_blocks=local)
    assert ext == 0 and not plan.loads
    a.sched.flush_releases(5)
    assert leases(server) == 0
    a.finish("r2")
    a.close()


def test_repeated_query_reuses_the_lookup_and_finish_releases_the_lease(server, engines):
    a = engines(server.url)
    toks = prompt(7, 300)
    a.prefill("r", toks)
    a.finish("r")
    # Allocation "fails": vLLM asks again next step; the first lease is reused, not doubled.
    assert matched(a.sched, "w", toks, 0) == 4 * CS
    assert matched(a.sched, "w", toks, 0) == 4 * CS
    assert leases(server) == 4
    assert a.sched.request_finished("w") is False  # aborted while waiting
    a.sched.flush_releases(5)
    assert leases(server) == 0
    a.close()


# ---- decode, chunked prefill, preemption -----------------------------------------------------


@pytest.mark.parametrize("store_decode", [False, True])
def test_decode_chunks_are_stored_only_when_configured(server, store_decode, engines):
    a = engines(server.url, store_decode=store_decode)
    toks = prompt(8, 120)
    ext, blocks, plan = a.prefill("r", toks)
    assert [len(t.hashes) for t in plan.stores] == [1]
    stored = []
    for step in range(40):  # decode 40 tokens: positions 120..159 (chunk 1 completes at 128)
        toks.append(7 + step)
        if len(toks) > len(blocks) * BS:
            blocks += a.alloc(1)
        pos = len(toks) - 1
        plan = a.sched.build_plan([ScheduledRequest("r", pos, 1, blocks)])
        a.execute(plan, compute=[(toks, blocks, pos, pos + 1)])
        stored += [h for t in plan.stores for h in t.hashes]
    expected = chunk_hashes(toks, CS)[1:2] if store_decode else []
    assert stored == expected
    a.finish("r")
    a.close()


def test_chunked_prefill_stores_each_chunk_once(server, engines):
    a = engines(server.url)
    toks = prompt(9, 700)
    assert matched(a.sched, "r", toks, 0) == 0
    blocks = a.alloc(-(-700 // BS))
    a.sched.on_allocated("r", blocks, 0)
    stored, parents, done = [], [], 0
    for n in (100, 100, 300, 200):  # prefill in budget-limited pieces
        plan = a.sched.build_plan([ScheduledRequest("r", done, n, blocks if done == 0 else None)])
        a.execute(plan, compute=[(toks, blocks, done, done + n)])
        parents += [(t.parent, stored[-1] if stored else b"") for t in plan.stores]
        stored += [h for t in plan.stores for h in t.hashes]
        done += n
    assert stored == chunk_hashes(toks, CS)
    # each piece names the chunk before it: the server writes the prompt to L2 in prefix order
    assert len(parents) > 1 and all(got == want for got, want in parents), parents
    a.finish("r")
    a.close()


def test_preemption_waits_for_stores_and_readmission_looks_up_again(server, engines):
    a = engines(server.url)
    toks = prompt(10, 400)
    ext, blocks, plan = a.prefill("r", toks)
    assert plan.stores
    # Preempted in the next step: workers must finish reading its blocks first.
    plan = a.sched.build_plan([], preempted=["r"])
    assert plan.preempted == ["r"]
    a.execute(plan)
    for w in a.workers:
        assert "r" not in w._stores  # waited for and reaped
    a.free += blocks
    # Re-admitted (generation 1): a fresh lookup finds what it stored before.
    assert matched(a.sched, "r", toks, 0, generation=1) == 6 * CS
    new_blocks = a.alloc(len(blocks))
    a.sched.on_allocated("r", new_blocks, 6 * CS)
    plan = a.sched.build_plan([ScheduledRequest("r", 6 * CS, 400 - 6 * CS, None, new_block_ids=new_blocks, resumed=True)])
    a.execute(plan, compute=[(toks, new_blocks, 6 * CS, 400)])
    assert a.load_errors == set() and a.check(toks, new_blocks, 400)
    assert a.finish("r") is True  # it had stores: the workers report it
    a.close()


# ---- failures --------------------------------------------------------------------------------


def test_short_and_failed_loads_report_their_blocks(server, engines):
    a = engines(server.url)
    toks = prompt(11, 300)
    a.prefill("r", toks)
    a.finish("r")
    hashes = chunk_hashes(toks, CS)
    missing = chunk_hashes(prompt(12, 300), CS)
    blocks = a.alloc(8)
    plan = StepPlan(
        loads=[
            Transfer("short", hashes[:2] + missing[2:4], blocks[:8]),
            Transfer("none", [], [40, 41]),  # a load the scheduler could not plan
        ]
    )
    a.execute(plan)
    assert a.load_errors == set(blocks[4:8]) | {40, 41}
    a.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def registered_models(url: str) -> list[str]:
    with Client(url, timeout=5) as c:
        return [r["model"] for r in c.status()["registrations"]]


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_absent_server_means_no_hits_and_no_stalls_and_a_late_one_is_used_at_once(caplog, engines):
    """No server at start-up: the engine starts without waiting for one, and serves without the
    cache and without stalls. A server that comes up later is found by the connector itself
    (the worker registers with it while no request runs), and the next request stores."""
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    caplog.set_level(logging.WARNING, logger="lmcache_mp")
    t0 = time.monotonic()
    a = engines(url, connect_timeout=5, retry_interval=0.5)
    assert time.monotonic() - t0 < 1.5  # nobody listens: neither side waits its connect timeout
    toks = prompt(13, 300)
    t0 = time.monotonic()
    for i in range(20):
        assert matched(a.sched, f"r{i}", toks, 0) == 0
    assert time.monotonic() - t0 < 0.5  # no request waits for a connection
    ext, blocks, plan = a.prefill("p", toks)
    assert ext == 0 and not plan.stores
    assert a.sched.request_finished("p") is False
    # A load the workers cannot do is reported, so the engine recomputes.
    a.execute(StepPlan(loads=[Transfer("x", chunk_hashes(toks, CS)[:1], [5, 6])]))
    assert a.load_errors == {5, 6}
    warnings = [r for r in caplog.records if "cannot connect" in r.getMessage()]
    assert 1 <= len(warnings) <= 2  # once per client (scheduler, worker), not per attempt or request

    srv = Server(ServerConfig(url=url, l1_size="64MiB", device="cpu", chunk_size=CS)).start()
    try:
        wait_until(lambda: registered_models(url) == ["tiny"], 20, "the worker to register by itself")
        wait_until(lambda: a.sched.link.get() is not None, 20, "the scheduler to connect")
        a.free = list(range(1, NUM_BLOCKS))
        assert a.prefill("first", toks)[2].stores  # the first request after the server came stores
        a.finish("first")
        assert matched(a.sched, "probe", toks, 0) == 4 * CS
        a.sched.request_finished("probe")
    finally:
        a.close()
        srv.stop()


class SlowClient:
    """Answers lookups only after the caller gave up."""

    chunk_size = CS

    def __init__(self):
        self.lookups = 0

    def lookup_async(self, hashes, *, model, world_size=1, lock=False, salt=b"", timeout=None, tp_shared=False):
        from concurrent.futures import Future

        from lmcache_mp import ServerUnavailable

        self.lookups += 1
        fut = Future()
        threading.Timer(timeout, fut.set_exception, (ServerUnavailable("no reply within timeout"),)).start()
        return fut

    def release(self, *a, **k):
        return 0

    def close(self):
        pass


def test_slow_server_costs_one_timeout_per_retry_interval(caplog):
    slow = SlowClient()
    cfg = ConnectorConfig(model="tiny", block_size=BS, lookup_timeout=0.05, retry_interval=60)
    link = ClientLink(cfg.url, retry_interval=60, client_factory=lambda *a: slow)
    sched = SchedulerCore(cfg, link=link)
    caplog.set_level(logging.WARNING, logger="lmcache_mp")
    sched.start()
    toks = prompt(14, 300)
    t0 = time.monotonic()
    for i in range(50):
        assert matched(sched, f"r{i}", toks, 0) == 0
    assert slow.lookups == 1
    assert time.monotonic() - t0 < 50 * cfg.lookup_timeout / 2  # one timeout per request would take 50
    assert len([r for r in caplog.records if "treating the server as a cache miss" in r.getMessage()]) == 1
    sched.close()


# ---- tensor parallelism ----------------------------------------------------------------------


def test_tensor_parallel_two_ranks(server, engines):
    a = engines(server.url, world_size=2)
    toks = prompt(15, 333)
    # Rank 1 is not connected yet: only rank 0 stores, so nothing is a hit for the pair.
    link1 = a.workers[1].link
    a.workers[1]._handles, handle1 = None, a.workers[1]._handles
    ext, _, plan = a.prefill("r", toks)
    assert a.finish("r") is True  # both ranks report, even the one that could not store
    assert matched(a.sched, "probe", toks, 0) == 0
    a.sched.request_finished("probe")
    a.workers[1]._handles = handle1
    assert link1.get() is not None
    ext, _, plan = a.prefill("r2", toks)  # now both ranks store the chunks
    a.finish("r2")
    a.close()

    b = engines(server.url, world_size=2)
    try:
        b.free = b.free[::-1]
        ext, blocks, plan = b.prefill("r", toks)
        assert ext == 5 * CS
        assert b.load_errors == set()
        assert b.check(toks, blocks, 333)  # each rank got its own shard back
        assert leases(server) == 0
        b.finish("r")
    finally:
        b.close()


def store_in_one_engine_load_in_another(url: str, *, kind: str, world_size: int, device: str = "cpu",
                                        between=None, **more) -> None:
    """Engine A stores a prompt's full chunks from every rank; a fresh engine B, with other
    block ids, loads them and must see every rank's bytes exactly, with no lease left over.
    between(), when given, runs after A and returns the server URL B talks to."""
    # One namespace per layout: a server shared by several of these runs keeps them apart.
    cfg = dict(world_size=world_size, device=device, kind=kind, lookup_timeout=5.0, model=f"tiny-{kind}", **more)
    a = Engine(url, **cfg)
    toks = prompt(40 + world_size, 333)
    try:
        ext, _, plan = a.prefill("r1", toks)
        assert ext == 0 and [len(t.hashes) for t in plan.stores] == [333 // CS]
        assert a.finish("r1") is True  # stores in flight until the server has the bytes
        if kind == "mla":  # one copy for all ranks: only rank 0 sent stores
            assert [w.stats["stored_chunks"] for w in a.workers] == [333 // CS] + [0] * (world_size - 1)
    finally:
        a.close()
    if between is not None:
        url = between()
    b = Engine(url, **cfg)
    try:
        b.free = b.free[::-1]  # other blocks than engine A's
        ext, blocks, plan = b.prefill("r1", toks)
        assert ext == (333 // CS) * CS
        assert b.load_errors == set()
        assert [w.stats["loaded_chunks"] for w in b.workers] == [333 // CS] * world_size
        assert b.check(toks, blocks, 333)  # every rank got its own shard back, bit for bit
        with Client(url, timeout=10) as c:
            assert c.status()["l1"]["leases"] == 0
        b.finish("r1")
    finally:
        b.close()


def test_tensor_blocks_larger_than_the_engine_block_are_refused(server, caplog):
    cfg = ConnectorConfig(url=server.url, model="tiny", block_size=BS, connect_timeout=5.0)
    worker = WorkerCore(cfg)
    try:
        t0 = time.monotonic()
        with caplog.at_level(logging.ERROR, logger="lmcache_mp"):
            worker.register_kv_caches([torch.zeros(8, HEADS, 2 * BS, HEAD2, dtype=torch.bfloat16) for _ in range(2)])
        assert time.monotonic() - t0 < 2.5  # start-up waits for the failed attempt, not the connect timeout
        assert worker._client() is None  # the engine runs without the cache
        assert any("do not divide the engine's block size" in r.getMessage() for r in caplog.records)
        with Client(server.url, timeout=5) as c:
            assert c.status()["registrations"] == []  # the refused registration was dropped
    finally:
        worker.close()


def test_chunks_of_another_block_packing_are_load_errors_not_garbage(server, caplog):
    """Same model name, same logical shape, other order of the bytes in a block: the server
    refuses to copy the objects, the engine is told, and the blocks are recomputed; both sides
    say so in their logs, and the server counts it."""
    toks = prompt(50, 300)
    a = Engine(server.url, kind="opaque_nhd", lookup_timeout=5.0)
    try:
        a.prefill("r", toks)
        assert a.finish("r") is True
    finally:
        a.close()
    b = Engine(server.url, kind="opaque", lookup_timeout=5.0)
    try:
        with caplog.at_level(logging.WARNING, logger="lmcache_mp"):
            ext, blocks, plan = b.prefill("r", toks)
        assert ext == 4 * CS  # lookups know keys, not layouts
        assert b.load_errors == set(blocks[: 4 * BPC])
        assert b.workers[0].stats["loaded_chunks"] == 0
        logged = [r.getMessage() for r in caplog.records]
        assert any("loaded 0 of the 4 chunks its lookup found" in m for m in logged), logged
        assert sum("stopped at a chunk stored in format" in m for m in logged) == 1, logged
        assert server.engine.status()["l1"]["format_mismatches"] == 1
        assert all(not block_view(c[layer], blocks[0]).any() for c in b.caches for layer in range(LAYERS))
        b.finish("r")
    finally:
        b.close()


@pytest.mark.parametrize("kind", list(LAYER_LAYOUTS))
@pytest.mark.parametrize("world_size", [1, 2])
def test_every_cache_layout_round_trips(server, kind, world_size):
    store_in_one_engine_load_in_another(server.url, kind=kind, world_size=world_size)


@pytest.mark.parametrize("kind", ["opaque", "opaque_nhd", "mha", "mla", "cross_layer"])
def test_tp_shared_chunks_round_trip_through_the_connector(server, kind):
    """lmcache_mp.tp_shared: the workers register tp-shared caches (the model's heads are two
    ranks' worth) and the scheduler looks up tp-shared chunks; engines of other TP sizes sharing
    them: tests/test_tp_shared.py, and with vLLM tests/vllm_e2e."""
    hashes = chunk_hashes(prompt(42, 333), CS)

    def stored_as_tp_shared() -> str:
        with Client(server.url, timeout=10) as c:
            assert c.lookup(hashes, model=f"tiny-{kind}", world_size=1, tp_shared=True) == len(hashes)
            assert c.lookup(hashes, model=f"tiny-{kind}", world_size=2) == 0  # no per-rank objects
        return server.url

    store_in_one_engine_load_in_another(server.url, kind=kind, world_size=2, between=stored_as_tp_shared,
                                        tp_shared=True, num_kv_heads=2 * HEADS)


@pytest.mark.parametrize("kind", ["opaque", "opaque_nhd", "mha", "mla"])
def test_every_cache_layout_comes_back_from_the_disk_tier(kind, tmp_path):
    """A chunk's format goes to L2 with its bytes and comes back equal to its layout's (an opaque
    layout's is nested): engine A stores through one server, which writes its chunks to disk and
    stops; engine B loads them through a fresh server on that disk, every byte, no load error."""
    cfg = ServerConfig(url="tcp://127.0.0.1:0", l1_size="64MiB", device="cpu", chunk_size=CS,
                       l2_disk=str(tmp_path), l2_disk_size="64MiB", l2_write="all")
    servers = [Server(cfg).start()]

    def restart() -> str:
        servers[0].stop()  # drains the disk writes
        servers.append(Server(cfg).start())
        return servers[1].url

    try:
        store_in_one_engine_load_in_another(servers[0].url, kind=kind, world_size=2, between=restart)
        st = servers[1].engine.status()
        assert st["l2"]["loaded"] == (333 // CS) * (1 if kind == "mla" else 2)
        assert st["l1"]["format_mismatches"] == 0
    finally:
        for srv in servers:
            srv.stop()


@pytest.mark.parametrize("lane", [True, False], ids=["local_lane", "heartbeat_only"])
def test_server_restart_is_survived(engines, monkeypatch, lane):
    """The server stops: lookups are immediate misses (no request waits for its timeout or a
    reconnection). An empty server starts at the same address: the clients find it by themselves
    (the worker registers its cache again while no request runs), and the first request stores.
    Without the local lane the heartbeat notices the outage, within a few seconds."""
    if not lane:
        monkeypatch.setattr(ClientLink, "_make_client", lambda self, url, timeout, connect_timeout: Client(
            url, timeout=timeout, connect_timeout=connect_timeout, local_lane=False))
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"

    def start():
        return Server(ServerConfig(url=url, l1_size="64MiB", device="cpu", chunk_size=CS)).start()

    srv = start()
    a = engines(url, lookup_timeout=2.0)  # retry_interval: the default 5 s
    try:
        toks = prompt(16, 300)
        a.prefill("r1", toks)
        a.finish("r1")
        assert matched(a.sched, "probe1", toks, 0) == 4 * CS
        a.sched.request_finished("probe1")
        srv.stop()
        links = [a.sched.link, a.workers[0].link]
        wait_until(lambda: all(link.get() is None for link in links), 10, "the clients to find the server away")
        t0 = time.monotonic()
        for i in range(20):
            assert matched(a.sched, f"down{i}", toks, 0) == 0
            a.sched.request_finished(f"down{i}")
        # not one lookup timeout (2 s): they take a millisecond or so, but a loaded machine, or a
        # full collection of the suite's heap in this process, may hold them up over 0.1 s
        assert time.monotonic() - t0 < 1.0
        srv = start()  # empty, same address
        wait_until(lambda: registered_models(url) == ["tiny"], 20, "the worker to register again by itself")
        wait_until(lambda: all(link.get() is not None for link in links), 20, "the clients to find the server back")
        a.free = list(range(1, NUM_BLOCKS))  # every earlier request has finished
        assert a.prefill("again", toks)[2].stores
        a.finish("again")
        assert matched(a.sched, "probe2", toks, 0) == 4 * CS  # the first request after the restart stored
        a.sched.request_finished("probe2")
    finally:
        a.close()
        srv.stop()


# ---- hybrid models: several KV-cache groups --------------------------------------------------

WINDOW = 80  # tokens of the sliding-window group: its window at a chunk boundary spans 3 blocks
HYBRID = [KVGroup(0, "full", BS), KVGroup(1, "sliding_window", BS, window=WINDOW)]


def window_table(engine, n_tokens: int, computed: int) -> list[int]:
    """A sliding-window group's block table as vLLM keeps it once `computed` tokens are done:
    the null block for blocks entirely before the window, real blocks after."""
    skipped = max(0, computed - WINDOW + 1) // BS
    return [SCRATCH] * skipped + engine.alloc(-(-n_tokens // BS) - skipped)


def test_hybrid_groups_store_and_load_each_group_in_its_own_namespace(server):
    hybrid_round_trip(server.url)


def hybrid_round_trip(url: str, device: str = "cpu") -> None:
    """Engine A stores a prompt of a full-attention and a sliding-window group; engine B loads
    every chunk of the first and only the window's chunks of the second, byte for byte."""
    a = Engine(url, groups=HYBRID, device=device)
    toks = prompt(60, 330)
    try:
        assert matched(a.sched, "r", toks, 0) == 0
        tables = (a.alloc(11), a.alloc(11))
        a.sched.on_allocated("r", tables, 0)
        plan = a.sched.build_plan([ScheduledRequest("r", 0, 330, tables)])
        # One store per group; the window group's blocks are pinned until the store read them.
        assert [(t.group, len(t.hashes), bool(t.pin)) for t in plan.stores] == [(0, 5, False), (1, 5, True)]
        assert +a.pinned == collections.Counter(tables[1][:10])
        a.execute(plan, compute=[(toks, tables[0], 0, 330, 0), (toks, tables[1], 0, 330, 1)])
        a.settle_pins()
        assert not +a.pinned  # every pin given back
        assert a.finish("r") is True
        with Client(url, timeout=5) as c:
            models = sorted(r["model"] for r in c.status()["registrations"])
            assert models == ["tiny#group0:full", f"tiny#group1:sliding_window={WINDOW}"]
            # A model of one group never sees these chunks, nor one group the other's.
            assert c.lookup(chunk_hashes(toks, CS), model="tiny") == 0
    finally:
        a.close()

    b = Engine(url, groups=HYBRID, device=device)
    try:
        b.free = b.free[::-1]
        assert matched(b.sched, "r", toks, 0) == 5 * CS
        # vLLM keeps for the window group only the blocks of its last WINDOW - 1 tokens: 7 nulls.
        tables = (b.alloc(11), window_table(b, 330, 320))
        b.sched.on_allocated("r", tables, 5 * CS)
        plan = b.sched.build_plan([ScheduledRequest("r", 5 * CS, 10, tables)])
        full, window = plan.loads
        assert (full.group, full.hashes) == (0, chunk_hashes(toks, CS)[:5])
        # Chunks 0-2 hold nothing the window reads: not loaded; chunk 3's first block is the null one.
        assert (window.group, window.hashes) == (1, chunk_hashes(toks, CS)[3:5])
        assert window.block_ids == [SCRATCH] + tables[1][7:10] and window.num_scratch_blocks == 1
        b.execute(plan, compute=[(toks, tables[0], 320, 330, 0), (toks, tables[1], 320, 330, 1)])
        assert b.load_errors == set()
        assert b.check(toks, tables[0], 330, group=0)
        assert b.check(toks, tables[1], 330, group=1, start_block=7)
        b.sched.flush_releases(5)
        with Client(url, timeout=5) as c:
            assert c.status()["l1"]["leases"] == 0  # chunks 0-2 of the window group's lease were released
        b.finish("r")
    finally:
        b.close()


def test_a_chunk_one_group_lacks_is_no_hit(server, engines):
    """The stores of the first steps were put off (server away); by the time they are planned
    vLLM has freed blocks the window of the early chunks needs: those chunks are stored for the
    full-attention group only, and a later lookup counts no hit on them."""
    a = engines(server.url, groups=HYBRID)
    toks = prompt(61, 330)
    assert matched(a.sched, "r", toks, 0) == 0
    tables = (a.alloc(11), a.alloc(11))
    a.sched.on_allocated("r", tables, 0)
    link_get, a.sched.link.get = a.sched.link.get, lambda: None
    plan = a.sched.build_plan([ScheduledRequest("r", 0, 250, tables)])
    assert not plan.stores
    a.execute(plan, compute=[(toks, tables[0], 0, 250, 0), (toks, tables[1], 0, 250, 1)])
    a.sched.link.get = link_get
    a.free += tables[1][:5]
    tables = (tables[0], [SCRATCH] * 5 + tables[1][5:])  # blocks before token 250 - 79 freed
    plan = a.sched.build_plan([ScheduledRequest("r", 250, 80, tables)])
    a.execute(plan, compute=[(toks, tables[0], 250, 330, 0), (toks, tables[1], 250, 330, 1)])
    # Chunks 3 and 4 still have every block their windows read (from tokens 177 and 241 on).
    assert [(t.group, t.hashes) for t in plan.stores] == [(0, chunk_hashes(toks, CS)), (1, chunk_hashes(toks, CS)[3:5])]
    a.settle_pins()
    a.finish("r")
    assert matched(a.sched, "probe", toks, 0) == 0  # chunk 0 is missing for the window group
    a.sched.request_finished("probe")
    a.sched.flush_releases(5)
    assert leases(server) == 0
    a.close()


def test_scratch_blocks_may_repeat_in_a_retrieve(server):
    """Bytes nobody reads may all go to one block; every other block id stays distinct."""
    from lmcache_mp import LMCacheMPError, shared_cpu_tensor

    layers = [shared_cpu_tensor((8, HEADS, BS, HEAD2), torch.bfloat16) for _ in range(LAYERS)]
    for i, t in enumerate(layers):
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(i)))
    with Client(server.url, timeout=10) as c:
        kv = c.register_kv_cache(layers, model="scratch", world_size=1, rank=0)
        hashes = chunk_hashes(prompt(62, 2 * CS), CS)
        c.store(kv, hashes, [1, 2, 3, 4]).result()
        with pytest.raises(LMCacheMPError, match="appears twice"):
            c.retrieve(kv, hashes, [0, 0, 5, 6]).result()
        with pytest.raises(LMCacheMPError, match="appears twice"):
            c.retrieve(kv, hashes, [0, 5, 5, 6], scratch_blocks=[0]).result()
        assert c.retrieve(kv, hashes, [0, 0, 5, 6], scratch_blocks=[0]).result().loaded == 2
        for t in layers:
            assert torch.equal(t[5], t[3]) and torch.equal(t[6], t[4])
        c.unregister_kv_cache(kv)


# ---- KV events: the chunks an engine stored, as announcements ---------------------------------


def fill_l1(url: str, n_chunks: int) -> None:
    """Store n_chunks chunks of another model: L1 evicts the oldest chunks to make room."""
    from lmcache_mp import shared_cpu_tensor

    layers = [shared_cpu_tensor((NUM_BLOCKS, HEADS, BS, HEAD2), torch.bfloat16) for _ in range(LAYERS)]
    with Client(url, timeout=30) as c:
        kv = c.register_kv_cache(layers, model="filler", world_size=1, rank=0)
        for start in range(0, n_chunks, 32):
            hashes = chunk_hashes(prompt(1000 + start, 32 * CS), CS)
            c.store(kv, hashes, list(range(64))).result()
        c.unregister_kv_cache(kv)


def test_server_events_report_commits_and_removals_with_a_bounded_window():
    from lmcache_mp.storage.events import REMOVED, STORED

    srv = Server(ServerConfig(url="tcp://127.0.0.1:0", l1_size="64MiB", device="cpu", chunk_size=CS,
                              kv_events=8)).start()
    try:
        layers = [shared_cpu(8) for _ in range(LAYERS)]
        with Client(srv.url, timeout=10) as c:
            kv = c.register_kv_cache(layers, model="m", world_size=1, rank=0)
            hashes = chunk_hashes(prompt(70, 3 * CS), CS)
            c.store(kv, hashes, list(range(6))).result()
            r = c.events(0, ["m"])
            assert [(e.seq, e.kind, r.models[e.model], e.rank, e.digest) for e in r.events] == \
                [(i, STORED, "m", 0, h) for i, h in enumerate(hashes)]
            assert (r.first, r.next) == (0, 3)
            assert c.events(0, ["other"]).events == [] and c.events(0, ["other"]).next == 3  # filtered, scanned
            assert c.clear() == 3
            r = c.events(3, ["m"])
            assert [(e.kind, e.digest) for e in r.events] == [(REMOVED, h) for h in reversed(hashes)]  # deepest first
            c.store(kv, hashes, list(range(6))).result()
            assert c.clear() == 3  # 6 more events: the window of 8 has dropped the first ones
            r = c.events(0, ["m"])
            assert (r.first, r.next) == (4, 12) and r.events[0].seq == 4  # events 0-3 lost
            assert r.session_id == c.events(12).session_id
            c.unregister_kv_cache(kv)
    finally:
        srv.stop()


def shared_cpu(num_blocks: int):
    from lmcache_mp import shared_cpu_tensor

    return shared_cpu_tensor((num_blocks, HEADS, BS, HEAD2), torch.bfloat16)


def tracked(engine):
    """A ChunkEvents of an engine's scheduler: announces ("stored"/"removed", chunk index)."""
    from lmcache_mp.integration.chunk_events import ChunkEvents

    ev = ChunkEvents(engine.sched.link, engine.sched.models, engine.cfg.world_size, interval=3600)
    engine.sched.on_store_planned = lambda rid, g, c, h: ev.expect(g, h, ("stored", rid, c), ("removed", rid, c))
    return ev


def test_stores_reported_finished_are_announced_at_once_while_the_engine_steps(server, engines):
    """vLLM publishes the connector's events only while it steps: when stores finish, the events
    are read at once (not at the next interval) and the engine is asked to step until it took
    them; then it may go idle."""
    a = engines(server.url)
    ev = tracked(a)  # reads every hour unless asked
    try:
        a.prefill("r1", prompt(72, 200))
        a.finish("r1")  # its stores are on the server (vLLM: finished_sending)
        assert not ev.has_news()
        ev.sync_soon()
        taken, deadline = [], time.monotonic() + 10
        while ev.has_news():  # the engine's steps: has_pending_push_work, then take_events
            assert time.monotonic() < deadline, "the engine was asked to step for ever"
            taken += ev.take()
            time.sleep(0.001)
        assert taken == [("stored", "r1", c) for c in range(3)]
    finally:
        ev.close()


def test_engine_announces_its_stores_then_evictions_then_a_restart():
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"

    def start():
        return Server(ServerConfig(url=url, l1_size="16MiB", slab_size="1MiB", device="cpu", chunk_size=CS)).start()

    srv = start()
    a = Engine(url, retry_interval=0.3, lookup_timeout=0.5)
    ev = tracked(a)
    try:
        toks = prompt(71, 330)
        a.prefill("r1", toks)
        a.finish("r1")
        assert ev.sync() and ev.take() == [("stored", "r1", c) for c in range(5)]
        fill_l1(url, 640)  # 16 MiB of 32 KiB chunks hold 512: r1's, the oldest, are evicted
        assert ev.sync() and sorted(ev.take()) == [("removed", "r1", c) for c in range(5)]
        a.prefill("r2", toks)  # stored again
        a.finish("r2")
        assert ev.sync() and ev.take() == [("stored", "r2", c) for c in range(5)]
        srv.stop()
        srv = start()  # an empty server at the same address
        deadline = time.monotonic() + 20
        while not ev.sync():  # the scheduler's client notices the new server by itself
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert sorted(ev.take()) == [("removed", "r2", c) for c in range(5)]
        assert ev.announced == 0 and ev.stats["resyncs"] == 1
    finally:
        ev.close()
        a.close()
        srv.stop()


class ScriptedEvents:
    """A client whose events() answers from a script of (first, next, [(seq, kind, rank, digest)])."""

    def __init__(self, script, session=b"s1"):
        self.script, self.session = list(script), session

    def events(self, since, models, max_events):
        from lmcache_mp import protocol as p

        first, nxt, evs = self.script.pop(0) if self.script else (0, since, [])
        # (an event of model 1 is the shared namespace's copy, as a server with tenants names it)
        return p.EventsReply(session_id=self.session, first=first, next=nxt, models=["m", "m"], shared=[1],
                             events=[p.ChunkEvent(seq=e[0], kind=e[1], model=e[4] if len(e) > 4 else 0, world_size=2,
                                                  rank=e[2], digest=e[3]) for e in evs])


def test_a_chunk_is_announced_once_every_rank_has_it_and_lost_events_resync():
    from lmcache_mp.integration.chunk_events import REMOVED, STORED, ChunkEvents

    client = ScriptedEvents([
        (0, 3, [(0, STORED, 0, b"a"), (1, STORED, 0, b"b"), (2, STORED, 1, b"a")]),
        (0, 4, [(3, REMOVED, 1, b"a")]),
        (0, 6, [(4, STORED, 0, b"c"), (5, STORED, 1, b"c")]),
        (10, 12, [(10, STORED, 1, b"b")]),  # events 6-9 were lost
    ])
    link = types_link(client)
    ev = ChunkEvents(link, ["m"], world_size=2, interval=3600)
    try:
        for d in (b"a", b"b", b"c"):
            ev.expect(0, d, ("stored", d), ("removed", d))
        ev.sync()
        assert ev.take() == [("stored", b"a")]  # b: rank 1 has not stored it yet
        ev.sync()
        assert ev.take() == [("removed", b"a")]  # one rank's copy is gone: no longer a hit
        ev.sync()
        assert ev.take() == [("stored", b"c")]
        ev.sync()
        # Lost events: c may be gone; b's rank 0 event is forgotten with them (not announced).
        assert ev.take() == [("removed", b"c")] and ev.announced == 0 and ev.stats["resyncs"] == 1
    finally:
        ev.close()


@pytest.mark.parametrize("stores_shared", [False, True])
def test_an_engine_announces_only_the_namespace_it_stores_into(stores_shared):
    """On a server with tenants a reader gets the shared namespace's events beside its own, under
    the same model name: the copy it did not store is another's (its removal is no news here)."""
    from lmcache_mp.integration.chunk_events import REMOVED, STORED, ChunkEvents

    mine = 1 if stores_shared else 0
    client = ScriptedEvents([
        (0, 4, [(0, STORED, 0, b"a", 0), (1, STORED, 1, b"a", 0), (2, STORED, 0, b"a", 1), (3, STORED, 1, b"a", 1)]),
        (0, 5, [(4, REMOVED, 0, b"a", 1 - mine)]),
        (0, 6, [(5, REMOVED, 0, b"a", mine)]),
    ])
    ev = ChunkEvents(types_link(client), ["m"], world_size=2, interval=3600, shared=stores_shared)
    try:
        ev.expect(0, b"a", "stored", "removed")
        ev.sync()
        assert ev.take() == ["stored"]
        ev.sync()
        assert ev.take() == []  # the other namespace's copy went
        ev.sync()
        assert ev.take() == ["removed"]
    finally:
        ev.close()


def types_link(client):
    import types

    return types.SimpleNamespace(get=lambda: client)


# ---- roles and per-request policies ------------------------------------------------------------


@pytest.mark.parametrize("role", ["producer", "consumer"])
def test_a_producer_only_stores_and_a_consumer_only_loads(server, engines, role):
    toks = prompt(80, 330)
    a = engines(server.url)
    a.prefill("seed", prompt(81, 330))  # something on the server to find, for the producer
    a.finish("seed")
    eng = engines(server.url, loads=role == "consumer", stores=role == "producer")
    ext, _, plan = eng.prefill("r", prompt(81, 330) if role == "producer" else toks)
    if role == "producer":
        assert ext == 0 and eng.sched.stats["lookups"] == 0 and plan.stores  # found nothing: never asked
    else:
        assert not plan.stores and matched(a.sched, "probe", toks, 0) == 0  # stored nothing
        a.sched.request_finished("probe")
    eng.finish("r")


def test_skip_save_and_skip_load_per_request(server, engines):
    a = engines(server.url)
    toks = prompt(82, 330)
    assert matched(a.sched, "r", toks, 0, skip_save=True) == 0
    blocks = a.alloc(11)
    a.sched.on_allocated("r", blocks, 0)
    assert not a.sched.build_plan([ScheduledRequest("r", 0, 330, blocks)]).stores
    a.sched.request_finished("r")
    a.free += blocks
    a.prefill("s", toks)  # stored now
    a.finish("s")
    assert matched(a.sched, "t", toks, 0, skip_load=True) == 0
    a.sched.request_finished("t")
    assert matched(a.sched, "u", toks, 0) == 5 * CS
    a.sched.request_finished("u")
    assert a.sched.stats["lookups"] == 3  # "r", "s" and "u": skip_load asks nothing


def test_multimodal_spans_key_the_chunks_from_their_first_placeholder_on(server, engines):
    """Same token ids (placeholders) behind two images: chunks before the image are shared,
    the chunk holding its placeholders and every later one are not."""
    a = engines(server.url)
    toks = prompt(83, 330)
    cat, dog = [(150, 200, b"image:cat")], [(150, 200, b"image:dog")]
    assert matched(a.sched, "cat", toks, 0, spans=cat) == 0
    blocks = a.alloc(11)
    a.sched.on_allocated("cat", blocks, 0)
    plan = a.sched.build_plan([ScheduledRequest("cat", 0, 330, blocks)])
    a.execute(plan, compute=[(toks, blocks, 0, 330)])
    a.finish("cat")
    plain = chunk_hashes(toks, CS)
    stored = plan.stores[0].hashes
    assert stored[:2] == plain[:2] and not set(stored[2:]) & set(plain)  # tokens 150-199: chunks 2, 3
    assert matched(a.sched, "cat again", toks, 0, spans=cat) == 5 * CS
    assert matched(a.sched, "dog", toks, 0, spans=dog) == 2 * CS  # only the chunks before the image
    assert matched(a.sched, "text", toks, 0) == 2 * CS
    for rid in ("cat again", "dog", "text"):
        a.sched.request_finished(rid)


# ---- recurrent states (Mamba2 / Gated DeltaNet groups) ---------------------------------------------

STATES = [KVGroup(0, "state", BS, detail="GDN"), KVGroup(1, "state", BS, detail="GDN"), KVGroup(2, "full", BS)]


def test_a_hybrid_hit_ends_at_the_deepest_boundary_every_state_group_has(server, engines):
    """States are stored where the engine names a boundary state (chunks of one block), and a
    hit ends at the deepest boundary below the attention hit where every state group has one:
    there the attention chunks load in full and each state group loads that one block."""
    a = engines(server.url, groups=STATES)
    both, split = prompt(70, 8 * BS), prompt(71, 8 * BS)
    for rid, toks, named in (("both", both, [(0, 3), (0, 6), (1, 3), (1, 6)]), ("split", split, [(0, 6), (1, 3)])):
        assert matched(a.sched, rid, toks, 0) == 0
        tables = tuple(a.alloc(8) for _ in STATES)
        a.sched.on_allocated(rid, tables, 0)
        offers = [(g, tables[g][b - 1], b * BS) for g, b in named]
        plan = a.sched.build_plan([ScheduledRequest(rid, 0, 8 * BS, tables, boundary_states=offers)])
        assert plan.async_loads  # (a state must land before the step that reads it: vLLM waits)
        states = sorted((t.group, t.block_ids[0]) for t in plan.stores if t.group < 2)
        assert states == sorted((g, tables[g][b - 1]) for g, b in named)
        assert +a.pinned == collections.Counter(blk for _, blk in states)  # until stored
        a.execute(plan, compute=[(toks, tables[g], 0, 8 * BS, g) for g in range(3)])
        a.settle_pins()
        assert not +a.pinned
        a.finish(rid)

    b = engines(server.url, groups=STATES)
    # "both": the attention hit is 7 blocks (never the last token), the deepest state is at 6.
    assert matched(b.sched, "both", both, 0) == 6 * BS
    tables = tuple(b.alloc(8) for _ in STATES)
    b.sched.on_allocated("both", tables, 6 * BS)
    plan = b.sched.build_plan([ScheduledRequest("both", 6 * BS, 2 * BS, tables)])
    assert sorted((t.group, len(t.hashes), t.block_ids[-1]) for t in plan.loads) == [
        (0, 1, tables[0][5]), (1, 1, tables[1][5]), (2, 6, tables[2][5])]
    b.execute(plan)
    assert b.load_errors == set()
    assert b.check(both, tables[2], 6 * BS, group=2)
    assert all(b.check(both, tables[g], 6 * BS, group=g, start_block=5) for g in (0, 1))
    b.finish("both")
    # "split": no boundary where both state groups have a state: a miss, and no lease is left.
    assert matched(b.sched, "split", split, 0) == 0
    b.sched.request_finished("split")
    b.sched.flush_releases(5)
    assert leases(server) == 0
