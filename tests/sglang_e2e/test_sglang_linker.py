"""The SGLang unified cache linker (lmcache_mp.integration.sglang_linker) against the real sglang
0.5.23 (pinned, CPU build), driven through SGLang's own tree.

SGLang's UnifiedRadixCache test kit builds the tree, the device pools (full attention, and Mamba2
state beside it) and the allocators on the CPU (sglang_kit.py); the linker is made by SGLang's
`dynamic` factory and attached as SGLang's registry attaches it. Offloads come from SGLang's own
write-through (an insert), lookups from its match_prefix, loads from its init_load_back and the
layer counter a forward waits on. Oracle: the source instance's bytes, compared exactly.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

# (the kit's modules import openai and partial_json_parser through SGLang's scheduler types)
_HAVE_KIT = all(importlib.util.find_spec(m) is not None for m in ("sglang", "openai", "partial_json_parser"))
pytestmark = pytest.mark.skipif(not _HAVE_KIT, reason="sglang (with its test kit's imports: openai, "
                                "partial_json_parser) is not installed")

if _HAVE_KIT:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import sglang_kit as kit  # noqa: E402
    import torch  # noqa: E402
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer  # noqa: E402
    from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

from lmcache_mp import Server, ServerConfig  # noqa: E402

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server():
    srv = Server(ServerConfig(url=f"tcp://127.0.0.1:{free_port()}", l1_size="64MiB", device="cpu", chunk_size=256,
                              heartbeat_timeout=5.0, http_addr="off"))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def instances():
    made = []

    def make(url, **kw):
        made.append(kit.Instance(url, **kw))
        return made[-1]

    yield make
    for inst in made:
        inst.close()


def same(xs, ys) -> bool:
    return len(xs) == len(ys) and all(torch.equal(x, y) for x, y in zip(xs, ys))


def page_keys(tokens: list[int]) -> list[str]:
    return get_storage_hash_str(tokens, None, page_size=kit.PAGE)


def test_the_factory_makes_the_linker_from_the_dynamic_config(server, instances):
    from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker
    from sglang.srt.server_args import ServerArgs

    from lmcache_mp.integration.sglang_linker import LMCacheMPLinker

    a = instances(server.url)
    assert type(a.linker) is LMCacheMPLinker
    assert set(a.linker.pools) == {PoolName.KV, PoolName.MAMBA}
    assert a.linker.num_layers == 6
    registrations = server.engine.status()["registrations"]
    assert len(registrations) == 1 + len(a.state_tensors())  # the KV pool, and each Mamba state tensor
    typo = kit.linker_config(server.url)
    typo["linker_extra_config"]["lmcache_mp.urll"] = server.url
    with pytest.raises(ValueError, match="lmcache_mp.urll"):
        create_unified_cache_linker(ServerArgs(model_path="dummy"), a.cache.cache_init_params, backend="dynamic",
                                    config=typo, components=set(a.cache.components))


@pytest.mark.parametrize("kind", ["full+mamba", "full", "full+swa", "full+swa+mamba"])
def test_offload_lookup_load_restore_kv_and_state_bit_exact(server, instances, kind):
    """Instance A inserts a finished request (SGLang's write-through offloads it); instance B,
    its own pools full of other bytes, matches the prompt, loads the hit and runs the batch: its
    private slots hold A's KV, its request's Mamba slot A's state, and its window layers' slots
    of the last page A's window KV, bit for bit."""
    hybrid, swa = "mamba" in kind, "swa" in kind
    a = instances(server.url, hybrid=hybrid, swa=swa, seed=1)
    b = instances(server.url, hybrid=hybrid, swa=swa, seed=2)
    tokens = kit.prompt(1, 3)
    slots, state = a.insert(tokens)
    assert a.settle_offloads() >= 1
    req, match = b.match(tokens + [9, 9])
    assert match.device_prefix_len == 0 and match.host_hit_length == 3 * kit.PAGE
    loaded, dst = b.load_back(req)
    assert loaded == 3 * kit.PAGE and len(dst) == loaded
    assert not same(b.kv_at(dst), a.kv_at(slots))  # (the two pools differ before the load)
    assert b.run_batch([req]) == []
    assert same(b.kv_at(dst), a.kv_at(slots))
    if hybrid:
        assert same(b.state_at(req.kv.mamba_pool_idx), a.state_at(state[0]))
    if swa:
        assert match.swa_host_hit_length == kit.PAGE  # the window: one page
        assert same(b.swa_at(dst[-kit.PAGE:]), a.swa_at(slots[-kit.PAGE:]))
        assert not same(b.swa_at(dst[:kit.PAGE]), a.swa_at(slots[:kit.PAGE]))  # outside the window: not loaded
    assert b.linker.stats["loads"] == 1 and b.linker.stats["failed_loads"] == 0


@pytest.mark.parametrize("kind", ["full+mamba", "full", "full+swa+mamba"])
def test_layer_groups_restore_kv_and_state_bit_exact(server, instances, kind):
    """With lmcache_mp.layer_groups the KV pool is registered as one part per group of layers
    (pages in namespaces of their own, not the HiCache layer_first ones); offload, lookup and load
    restore the same bytes as with one part."""
    hybrid, swa = "mamba" in kind, "swa" in kind
    config = kit.linker_config(server.url, **{"lmcache_mp.layer_groups": 2})
    a = instances(server.url, hybrid=hybrid, swa=swa, seed=41, config=config)
    b = instances(server.url, hybrid=hybrid, swa=swa, seed=42, config=config)
    one = instances(server.url, hybrid=hybrid, swa=swa, seed=43)  # one part: finds none of the groups' pages
    parts = b.linker.layout.parts["kv"]
    assert b.linker.layer_groups == 2 and len(parts) == 2
    assert b.linker.layout.group_ends[-1] == b.linker.num_layers
    whole = one.linker.layout.parts["kv"][0]
    assert len({b.linker._namespaces[id(p)] for p in parts} | {one.linker._namespaces[id(whole)]}) == 3
    tokens = kit.prompt(41, 3)
    slots, state = a.insert(tokens)
    assert a.settle_offloads() >= 1
    _, miss = one.match(tokens + [9])
    assert miss.host_hit_length == 0
    req, match = b.match(tokens + [9])
    assert match.host_hit_length == 3 * kit.PAGE
    _, dst = b.load_back(req)
    assert b.run_batch([req]) == []
    assert same(b.kv_at(dst), a.kv_at(slots))
    if hybrid:
        assert same(b.state_at(req.kv.mamba_pool_idx), a.state_at(state[0]))
    if swa:
        assert same(b.swa_at(dst[-kit.PAGE:]), a.swa_at(slots[-kit.PAGE:]))


def test_the_first_layers_complete_while_the_last_group_is_still_copied(server, instances):
    """Layer by layer: with three layer groups, the last group's retrieve is held back; the
    counter's first layers complete (their KV and the Mamba state are in the slots) while the last
    layer's is still pending, so a forward runs its first layers before the load has finished.
    Released, the rest lands and the batch finishes bit-exact."""
    import threading
    from concurrent.futures import Future

    config = kit.linker_config(server.url, **{"lmcache_mp.layer_groups": 3})
    a = instances(server.url, seed=44, config=config)
    b = instances(server.url, seed=45, config=config)
    layout = b.linker.layout
    assert layout.kv_layers == (1, 3, 5) and layout.group_ends == (3, 5, 6)  # attention on 1, 3, 5
    tokens = kit.prompt(44, 2)
    slots, state = a.insert(tokens)
    assert a.settle_offloads() == 1
    req, match = b.match(tokens + [1])
    _, dst = b.load_back(req)
    client, handles = b.linker._registered
    last = handles[id(layout.parts["kv"][-1])]
    release, held = threading.Event(), []
    real = client.retrieve

    def retrieve(handle, *args, **kw):
        if handle is not last:
            return real(handle, *args, **kw)
        out = Future()

        def later():
            release.wait(60)
            try:
                out.set_result(real(handle, *args, **kw).result(60))
            except BaseException as e:  # noqa: BLE001
                out.set_exception(e)

        held.append(threading.Thread(target=later, daemon=True))
        held[-1].start()
        return out

    client.retrieve = retrieve
    try:
        index = b.cache.ready_to_load_host_cache()
        counter = b.linker.layer_done_counter
        counter.set_consumer(index)
        futures = counter.futures[index]
        futures[0].result(30)  # the forward's wait_until(0) returns ...
        futures[4].result(30)
        assert held and not futures[5].done()  # ... while the last layer's copy is held
        first = [t[dst] for t in (b.attention_pool.k_buffer[0], b.attention_pool.v_buffer[0])]
        source = [t[slots] for t in (a.attention_pool.k_buffer[0], a.attention_pool.v_buffer[0])]
        assert same(first, source)  # layer 1's KV has landed
        assert same(b.state_at(req.kv.mamba_pool_idx), a.state_at(state[0]))
        assert not torch.equal(b.attention_pool.k_buffer[2][dst], a.attention_pool.k_buffer[2][slots])
        release.set()
        for layer in range(b.linker.num_layers):
            counter.wait_until(layer)
        assert b.cache.finish_external_linker_loads([req]) == []
    finally:
        release.set()
        del client.retrieve
    assert same(b.kv_at(dst), a.kv_at(slots))


def test_lookup_gives_every_restorable_boundary(server, instances):
    """A Mamba state exists only where a node ended: a prompt inserted page by page restores at
    every page; one inserted at once only at its end. KV pages alone are not a hit."""
    a = instances(server.url, seed=3)
    grown, whole = kit.prompt(2, 3), kit.prompt(3, 3)
    for pages in (1, 2, 3):
        a.insert(grown[:pages * kit.PAGE])
    a.insert(whole)
    assert a.settle_offloads() == 4

    def lookup(tokens, pages):
        keys = page_keys(tokens[:pages * kit.PAGE])
        return a.linker.lookup("q", [PoolTransfer(name=PoolName.KV, keys=keys),
                                     PoolTransfer(name=PoolName.MAMBA, keys=keys[-1:],
                                                  hit_policy=PoolHitPolicy.TRAILING_PAGES)])

    assert lookup(grown + kit.prompt(9, 1), 4) == [1, 2, 3]
    assert lookup(whole + kit.prompt(9, 1), 4) == [3]
    assert lookup(kit.prompt(4, 2), 2) == []
    kv_only = page_keys(whole)
    assert a.linker.lookup("q", [PoolTransfer(name=PoolName.KV, keys=kv_only)]) == [1, 2, 3]


def test_a_second_instance_in_another_process_loads_the_first_pages(server, instances):
    a = instances(server.url, seed=5)
    tokens = kit.prompt(5, 4)
    slots, state = a.insert(tokens)
    assert a.settle_offloads() == 1
    run = subprocess.run([sys.executable, str(HERE / "linker_instance.py"), "--url", server.url, "--source-seed", "5",
                          "--prompt-seed", "5", "--pages", "4", "--slots", json.dumps(slots.tolist()),
                          "--state-slot", str(int(state[0]))], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out == {"hit_tokens": 4 * kit.PAGE, "loaded": 4 * kit.PAGE, "failed": [], "kv_equal": True,
                   "state_equal": True}


def test_a_queued_load_is_cancelled(server, instances):
    """A request released before its batch starts: the load is cancelled, nothing is written
    into the slots, and the next batch has nothing to start."""
    a = instances(server.url, seed=6)
    b = instances(server.url, seed=7)
    tokens = kit.prompt(6, 2)
    a.insert(tokens)
    a.settle_offloads()
    req, _ = b.match(tokens + [1])
    loaded, dst = b.load_back(req)
    assert loaded == 2 * kit.PAGE
    before = b.kv_at(dst)
    b.cache.linker.release_request(req.rid)
    assert b.cache.linker.inflight_load_rids == [] and b.linker.pending_loads == {}
    assert b.cache.ready_to_load_host_cache() == -1
    assert same(b.kv_at(dst), before)
    assert b.linker.cancel_queued_load(req.rid) is False


def _server_process(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "lmcache_mp.server.cli", "--url", f"tcp://127.0.0.1:{port}",
                             "--device", "cpu", "--l1-size", "64MiB", "--http-addr", "off"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read().decode()[-2000:])
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the server did not come up")


def test_a_server_killed_mid_load_gives_a_failed_load_then_misses(instances):
    """The server dies with a load queued: the batch's load fails (SGLang aborts the request,
    whose slots were private) within the request timeout instead of hanging the forward; then
    lookups are misses at once and offloads are refused, without raising into SGLang."""
    port = free_port()
    proc = _server_process(port)
    url = f"tcp://127.0.0.1:{port}"
    try:
        config = kit.linker_config(url, **{"lmcache_mp.request_timeout": 5.0})
        a = instances(url, seed=8, config=config)
        b = instances(url, seed=9, config=config)
        tokens = kit.prompt(8, 3)
        a.insert(tokens)
        a.settle_offloads()
        req, match = b.match(tokens + [2])
        assert match.host_hit_length == 3 * kit.PAGE
        loaded, _ = b.load_back(req)
        assert loaded == 3 * kit.PAGE
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        start = time.monotonic()
        failed = b.run_batch([req])
        assert [r.rid for r in failed] == [req.rid] and time.monotonic() - start < 10
        assert b.linker.stats["failed_loads"] == 1
        start = time.monotonic()
        req2, match2 = b.match(tokens + [3])
        assert match2.host_hit_length == 0 and time.monotonic() - start < 2
        a.insert(kit.prompt(10, 2))  # write-through while the server is gone: refused, nothing pending
        assert a.cache.linker.pending_offloads == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_an_absent_server_is_a_miss_at_once(instances):
    url = f"tcp://127.0.0.1:{free_port()}"
    start = time.monotonic()
    a = instances(url, seed=11, config=kit.linker_config(url, **{"lmcache_mp.connect_timeout": 5.0}))
    tokens = kit.prompt(11, 2)
    a.insert(tokens)
    assert a.cache.linker.pending_offloads == []
    req, match = a.match(kit.prompt(12, 2))
    assert match.host_hit_length == 0
    assert time.monotonic() - start < 30
    assert a.linker.load(req.rid, [PoolTransfer(name=PoolName.KV, keys=page_keys(tokens),
                                                device_indices=torch.arange(32))]) is False


def test_a_hicache_instance_and_a_linker_instance_share_layer_first_pages(server, instances):
    """The KV pool's pages are the HiCache backend's `layer_first` pages, in its namespace: what
    an instance on HiCache stored, one on the linker finds and loads, and the other way round."""
    from sglang_pools import attach, fill_random, host_pool, page_bytes, page_indices, storage_config

    pool = host_pool("mha", "layer_first", layers=kit.dense_config().num_layers)
    fill_random(pool, 12)
    hicache = attach(pool, storage_config(server.url, layout="layer_first", model="tiny"))
    linker = instances(server.url, hybrid=False, seed=13)
    try:
        assert hicache.namespace == linker.linker._namespaces[id(linker.linker.layout.parts["kv"][0])]
        tokens = kit.prompt(12, 3)
        keys = page_keys(tokens)
        assert hicache.batch_set_v1(keys, page_indices([4, 9, 2])) == [True] * 3
        req, match = linker.match(tokens + [1])
        assert match.host_hit_length == 3 * kit.PAGE
        _, dst = linker.load_back(req)
        assert linker.run_batch([req]) == []

        def page_of(inst, slots):  # a page as the layer_first host layout lays it out: K of each layer, then V
            return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in inst.kv_at(slots))

        for i, host_page in enumerate([4, 9, 2]):
            assert page_of(linker, dst[i * kit.PAGE:(i + 1) * kit.PAGE]) == page_bytes(pool, host_page)
        back = kit.prompt(14, 2)
        slots, _ = linker.insert(back)
        assert linker.settle_offloads() == 1
        back_keys = page_keys(back)
        assert hicache.batch_exists(back_keys) == 2
        assert hicache.batch_get_v1(back_keys, page_indices([20, 21])) == [True, True]
        assert page_bytes(pool, 20) + page_bytes(pool, 21) == page_of(linker, slots[:kit.PAGE]) + page_of(
            linker, slots[kit.PAGE:])
    finally:
        hicache.close()


def test_what_a_lookup_found_stays_on_the_server_until_its_load(instances):
    """Between SGLang's match and the batch's load, other traffic fills the server's L1: the
    pages and state the lookup found are leased and still load bit-exact, while an unleased
    prompt stored at the same time is evicted."""
    from lmcache_mp import Client, chunk_hashes, shared_cpu_tensor

    srv = Server(ServerConfig(url=f"tcp://127.0.0.1:{free_port()}", l1_size="4MiB", device="cpu", chunk_size=256,
                              heartbeat_timeout=5.0, http_addr="off"))
    srv.start()
    try:
        a = instances(srv.url, seed=15)
        b = instances(srv.url, seed=16)
        tokens, other = kit.prompt(15, 3), kit.prompt(16, 3)
        slots, state = a.insert(tokens)
        a.insert(other)
        assert a.settle_offloads() == 2
        req, match = b.match(tokens + [1])
        assert match.host_hit_length == 3 * kit.PAGE
        loaded, dst = b.load_back(req)
        with Client(srv.url) as filler:  # 8 MiB of another engine's chunks through a 4 MiB L1
            kv = [shared_cpu_tensor((16, 256, 1024), torch.uint8, fill=1)]
            handle = filler.register_kv_cache(kv, model="filler")
            for i in range(8):
                hashes = chunk_hashes(kit.prompt(100 + i, 64), 256)
                filler.store(handle, hashes, [j % 16 for j in range(len(hashes))]).result(60)
            filler.unregister_kv_cache(handle)
        assert b.run_batch([req]) == []
        assert same(b.kv_at(dst), a.kv_at(slots))
        assert same(b.state_at(req.kv.mamba_pool_idx), a.state_at(state[0]))
        _, evicted = b.match(other + [1])
        assert evicted.host_hit_length == 0
    finally:
        srv.stop()


def test_reset_quiesces_and_the_linker_goes_on(server, instances):
    """SGLang's cache reset (a flush) resets the linker: queued loads dropped, offloads finished
    and their results dropped, the layer counter back at its start; afterwards it serves again."""
    a = instances(server.url, seed=17)
    b = instances(server.url, seed=18)
    tokens = kit.prompt(17, 2)
    a.insert(tokens)
    a.settle_offloads()
    req, _ = b.match(tokens + [1])
    assert b.load_back(req)[0] == 2 * kit.PAGE
    a.insert(kit.prompt(18, 2))  # an offload in flight or done, its result not yet taken
    b.cache.reset()
    a.cache.reset()
    assert b.linker.pending_loads == {} and b.cache.linker.inflight_load_rids == []
    assert a.linker.num_completed_offloads() == 0 and a.cache.linker.pending_offloads == []
    assert b.linker.layer_done_counter.producer_index == -1
    assert b.cache.ready_to_load_host_cache() == -1
    again = kit.prompt(19, 2)
    slots, state = a.insert(again)
    assert a.settle_offloads() == 1
    req, match = b.match(again + [1])
    _, dst = b.load_back(req)
    assert b.run_batch([req]) == [] and same(b.kv_at(dst), a.kv_at(slots))


def test_mla_pages_have_the_hicache_backends_layer_first_format():
    """An MLA pool (SGLang's MLATokenToKVPool) is described as one latent run per layer, in the
    namespace format of the HiCache backend's layer_first MLA host pool of the same geometry."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang_pools import host_pool

    from lmcache_mp.integration.sglang_linker_pools import describe_pools
    from lmcache_mp.integration.sglang_pages import plan_pages

    dev = MLATokenToKVPool(size=256, page_size=16, dtype=torch.bfloat16, kv_lora_rank=96, qk_rope_head_dim=32,
                           layer_num=3, device="cpu", enable_memory_saver=False)
    pools = describe_pools(dev, None, {"FULL"}, 16)
    (part,) = pools.parts["kv"]
    assert pools.attention == "mla" and len(part.runs) == 3 and pools.num_layers == 3
    host = host_pool("mla", "layer_first")
    plan = plan_pages(host.kv_buffer, kind="mla", layout="layer_first", page_size=16, chunk_size=256)
    assert part.tag == plan.format_tag and part.row_bytes == plan.run_bytes


def test_two_tenants_linkers_share_no_pages(instances, tmp_path):
    """A server with a tenants file: the CURVE keys in each instance's linker config decide its
    tenant; one tenant's pages and states are misses for the other, hits for its own instances."""
    from lmcache_mp.server.cli import main as cli_main

    keys = tmp_path / "keys"
    assert cli_main(["keygen", str(keys)]) == 0
    assert cli_main(["keygen", str(keys), "--client", "bob"]) == 0
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.alice]\ncurve_keys = ["{keys}/clients/client.key"]\n'
                       f'[tenants.bob]\ncurve_keys = ["{keys}/clients/bob.key"]\n')
    srv = Server(ServerConfig(url=f"ipc://{tmp_path}/srv.sock", l1_size="64MiB", device="cpu", chunk_size=256,
                              heartbeat_timeout=5.0, tenants=str(tenants), curve_secret_key=f"{keys}/server.key_secret",
                              http_addr="off"))
    srv.start()
    try:
        def config(secret: str) -> dict:
            return kit.linker_config(srv.url, **{"lmcache_mp.curve_server_key": f"{keys}/server.key",
                                                 "lmcache_mp.curve_client_key": f"{keys}/client-secret/{secret}"})

        alice = instances(srv.url, seed=20, config=config("client.key_secret"))
        alice2 = instances(srv.url, seed=21, config=config("client.key_secret"))
        bob = instances(srv.url, seed=22, config=config("bob.key_secret"))
        tokens = kit.prompt(20, 2)
        slots, state = alice.insert(tokens)
        assert alice.settle_offloads() == 1
        _, miss = bob.match(tokens + [1])
        assert miss.host_hit_length == 0
        req, hit = alice2.match(tokens + [1])
        assert hit.host_hit_length == 2 * kit.PAGE
        _, dst = alice2.load_back(req)
        assert alice2.run_batch([req]) == [] and same(alice2.kv_at(dst), alice.kv_at(slots))
        status = srv.engine.status()
        assert status["tenants"]["alice"]["l1"]["objects"] == 2 + len(alice.state_tensors())
        assert status["tenants"]["bob"]["l1"]["objects"] == 0
    finally:
        srv.stop()


def test_pages_and_states_come_back_from_the_disk_tier_after_a_restart(instances, tmp_path):
    """L2 below: what one instance offloaded is written through to the disk tier; after the
    server restarted with an empty L1, another instance's lookup finds it there (its leases bring
    it back into L1) and the load restores KV and state bit-exact."""
    port = free_port()
    disk = dict(l2_disk=str(tmp_path / "l2"), l2_disk_size="64MiB", l2_disk_write="all")

    def start():
        srv = Server(ServerConfig(url=f"tcp://127.0.0.1:{port}", l1_size="64MiB", device="cpu", chunk_size=256,
                                  heartbeat_timeout=5.0, http_addr="off", **disk))
        srv.start()
        return srv

    srv = start()
    try:
        a = instances(srv.url, seed=23)
        tokens = kit.prompt(23, 3)
        slots, state = a.insert(tokens)
        assert a.settle_offloads() == 1
        deadline = time.monotonic() + 60
        while not srv.engine.status()["l2"]["idle"]:
            assert time.monotonic() < deadline, "the disk writes did not finish"
            time.sleep(0.05)
        srv.stop()
        srv = start()
        assert srv.engine.status()["l1"]["objects"] == 0
        b = instances(srv.url, seed=24)
        req, match = b.match(tokens + [1])
        assert match.host_hit_length == 3 * kit.PAGE
        _, dst = b.load_back(req)
        assert b.run_batch([req]) == []
        assert same(b.kv_at(dst), a.kv_at(slots)) and same(b.state_at(req.kv.mamba_pool_idx), a.state_at(state[0]))
    finally:
        srv.stop()


def test_tensor_parallel_ranks_store_their_own_shards(server, instances, monkeypatch):
    """Two TP ranks (the rank the linker reads from torch.distributed, set here): each stores its
    own KV pages and Mamba state; a prompt is a hit only once every rank stored it, and each rank
    of another instance loads its own rank's bytes."""
    import lmcache_mp.integration.sglang_linker as linker_module

    def rank(r):
        monkeypatch.setattr(linker_module, "_tp", lambda params: (r, 2))

    made = {}
    for name, r, seed in (("a0", 0, 30), ("a1", 1, 31), ("b0", 0, 32), ("b1", 1, 33)):
        rank(r)
        made[name] = instances(server.url, seed=seed)
    tokens = kit.prompt(30, 2)
    slots0, state0 = made["a0"].insert(tokens)
    assert made["a0"].settle_offloads() == 1
    _, partial = made["b0"].match(tokens + [1])
    assert partial.host_hit_length == 0  # rank 1's shard is missing
    slots1, state1 = made["a1"].insert(tokens)
    assert made["a1"].settle_offloads() == 1
    for b, a, slots, state in (("b0", "a0", slots0, state0), ("b1", "a1", slots1, state1)):
        b, a = made[b], made[a]
        req, match = b.match(tokens + [1])
        assert match.host_hit_length == 2 * kit.PAGE
        _, dst = b.load_back(req)
        assert b.run_batch([req]) == []
        assert same(b.kv_at(dst), a.kv_at(slots)) and same(b.state_at(req.kv.mamba_pool_idx), a.state_at(state[0]))


def test_mla_pages_are_stored_once_for_every_tp_rank(server, monkeypatch):
    """An MLA pool (SGLang's MLATokenToKVPool on the CPU, the linker called as the tree calls it):
    rank 0 writes a page once, rank 1's offload of the same node stores nothing and succeeds, and
    rank 1 finds and loads rank 0's bytes."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_cache.linker_factory import create_unified_cache_linker
    from sglang.srt.server_args import ServerArgs

    import lmcache_mp.integration.sglang_linker as linker_module

    def linker(rank, seed):
        pool = MLATokenToKVPool(size=256, page_size=16, dtype=torch.bfloat16, kv_lora_rank=96, qk_rope_head_dim=32,
                                layer_num=3, device="cpu", enable_memory_saver=False)
        g = torch.Generator().manual_seed(seed)
        for b in pool.kv_buffer:
            b.copy_(torch.randn(b.shape, generator=g).to(b.dtype))
        params = SimpleNamespace(token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: pool),
                                 req_to_token_pool=None, page_size=16, pp_size=1, attn_cp_size=1)
        monkeypatch.setattr(linker_module, "_tp", lambda params: (rank, 2))
        return pool, create_unified_cache_linker(ServerArgs(model_path="dummy"), params, backend="dynamic",
                                                 config=kit.linker_config(server.url), components={ComponentType.FULL})

    (pool0, l0), (pool1, l1) = linker(0, 40), linker(1, 41)
    try:
        keys = page_keys(kit.prompt(40, 2))
        for lk in (l1, l0):  # rank 1 first: its offload stores nothing
            assert lk.offload([PoolTransfer(name=PoolName.KV, keys=keys, device_indices=torch.arange(32, 64))])
            deadline = time.monotonic() + 60
            while lk.num_completed_offloads() == 0:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert lk.pop_completed_offload() is True
            if lk is l1:
                assert server.engine.status()["l1"]["objects"] == 0
        assert server.engine.status()["l1"]["objects"] == 2
        assert l1.lookup("r", [PoolTransfer(name=PoolName.KV, keys=keys)]) == [1, 2]
        assert l1.load("r", [PoolTransfer(name=PoolName.KV, keys=keys, device_indices=torch.arange(96, 128))])
        index = l1.start_layer_wise_loading()
        assert l1.finish_layer_wise_loading(index) is True
        assert all(torch.equal(b1[96:128], b0[32:64]) for b0, b1 in zip(pool0.kv_buffer, pool1.kv_buffer))
    finally:
        l0.close()
        l1.close()


def test_large_nodes_move_in_several_requests(server, instances, monkeypatch):
    """A node of more pages than one request carries (page size 1 makes 100k-page nodes) is
    stored and loaded in several requests, all of which must land."""
    import lmcache_mp.integration.sglang_linker_loads as loads_module

    monkeypatch.setattr(loads_module, "BATCH", 2)
    a = instances(server.url, seed=50)
    b = instances(server.url, seed=51)
    tokens = kit.prompt(50, 5)
    slots, state = a.insert(tokens)
    assert a.settle_offloads() == 1
    req, match = b.match(tokens + [1])
    assert match.host_hit_length == 5 * kit.PAGE
    _, dst = b.load_back(req)
    assert b.run_batch([req]) == []
    assert same(b.kv_at(dst), a.kv_at(slots)) and same(b.state_at(req.kv.mamba_pool_idx), a.state_at(state[0]))


def test_engine_side_copies_restore_bit_exact_and_share_with_server_copies(server, instances):
    """`lmcache_mp.transfer: engine`: the instance maps the server's L1 and copies its pools
    itself (no shared memory); its pages and states are the same objects as a server-copying
    instance's, both ways."""
    engine = kit.linker_config(server.url, **{"lmcache_mp.transfer": "engine"})
    a = instances(server.url, seed=60, config=engine)
    b = instances(server.url, seed=61)
    c = instances(server.url, seed=62, config=engine)
    assert a.linker._shm == [] and b.linker._shm != []
    for src, dst, seed in ((a, b, 60), (b, c, 61)):
        tokens = kit.prompt(seed, 3)
        slots, state = src.insert(tokens)
        assert src.settle_offloads() == 1
        req, match = dst.match(tokens + [1])
        assert match.host_hit_length == 3 * kit.PAGE
        _, into = dst.load_back(req)
        assert dst.run_batch([req]) == []
        assert same(dst.kv_at(into), src.kv_at(slots))
        assert same(dst.state_at(req.kv.mamba_pool_idx), src.state_at(state[0]))
    with pytest.raises(ValueError, match="lmcache_mp.transfer"):
        instances(server.url, config=kit.linker_config(server.url, **{"lmcache_mp.transfer": "both"}))


def test_the_benchmark_runs_and_checks_its_loads(tmp_path):
    """bench/bench_sglang_linker.py, small: every load is checked byte for byte inside it; the
    bound is loose on purpose (a loaded 2-core machine): it catches a path that moves pages over
    the socket or per token, not noise."""
    out = tmp_path / "bench.json"
    bench = HERE.parents[1] / "bench" / "bench_sglang_linker.py"
    run = subprocess.run([sys.executable, str(bench), "--layers", "2", "--repeat", "3", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    print(run.stdout)
    r = json.loads(out.read_text())
    assert r["pages"] == 64 and r["bytes"] == 64 * r["page_bytes"]
    assert r["offload_x_memcpy"] > 0.1 and r["load_x_memcpy"] > 0.1, r


def test_a_server_restart_gives_misses_then_hits_again(instances):
    """The server restarts empty: lookups are misses and offloads refused while it is away; the
    linkers register their pools again by themselves, and what is offloaded afterwards is found
    and loaded bit-exact."""
    port = free_port()

    def start():
        srv = Server(ServerConfig(url=f"tcp://127.0.0.1:{port}", l1_size="64MiB", device="cpu", chunk_size=256,
                                  heartbeat_timeout=5.0, http_addr="off"))
        srv.start()
        return srv

    srv = start()
    try:
        a = instances(srv.url, seed=70)
        b = instances(srv.url, seed=71)
        first = kit.prompt(70, 2)
        a.insert(first)
        assert a.settle_offloads() == 1
        srv.stop()
        _, away = b.match(first + [1])
        assert away.host_hit_length == 0
        srv = start()
        second = kit.prompt(71, 2)
        deadline = time.monotonic() + 60
        while True:  # until the linker is connected and registered again, its offloads are refused
            slots, state = a.insert(second)
            if a.cache.linker.pending_offloads:
                break
            assert time.monotonic() < deadline, "the linker did not come back"
            time.sleep(0.2)
            second = kit.prompt(int(time.monotonic() * 1000) % 100000, 2)
        assert a.settle_offloads() == 1
        _, gone = b.match(first + [1])
        assert gone.host_hit_length == 0  # (the restarted server is empty)
        deadline = time.monotonic() + 60
        while True:
            req, match = b.match(second + [1])
            if match.host_hit_length:
                break
            b.cache.linker.release_request(req.rid)
            assert time.monotonic() < deadline, "the other linker did not come back"
            time.sleep(0.2)
        assert match.host_hit_length == 2 * kit.PAGE
        _, dst = b.load_back(req)
        assert b.run_batch([req]) == []
        assert same(b.kv_at(dst), a.kv_at(slots)) and same(b.state_at(req.kv.mamba_pool_idx), a.state_at(state[0]))
    finally:
        srv.stop()


def test_unsupported_pools_are_refused_at_start_with_the_reason():
    from types import SimpleNamespace

    from lmcache_mp.integration.sglang_linker_pools import describe_pools
    from lmcache_mp.integration.sglang_pages import UnsupportedPool

    cache, allocator, req_pool = kit.build(kit.dense_config())
    kv = allocator.get_kvcache()
    with pytest.raises(UnsupportedPool, match="C128"):
        describe_pools(kv, req_pool, {"FULL", "C128"}, kit.PAGE)
    with pytest.raises(UnsupportedPool, match="neither MHA"):
        describe_pools(SimpleNamespace(layer_num=2), req_pool, {"FULL"}, kit.PAGE)
    with pytest.raises(UnsupportedPool, match="KV scales"):
        describe_pools(SimpleNamespace(k_buffer=kv.k_buffer, v_buffer=kv.v_buffer, k_scale_buffer=[1]), req_pool,
                       {"FULL"}, kit.PAGE)
    with pytest.raises(UnsupportedPool, match="not whole pages of 40"):
        describe_pools(kv, req_pool, {"FULL"}, 40)
    with pytest.raises(UnsupportedPool, match="without a Mamba pool"):
        describe_pools(kv, req_pool, {"FULL", "MAMBA"}, kit.PAGE)
