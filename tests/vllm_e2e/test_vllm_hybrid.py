"""Hybrid models end to end with a real vLLM (CPU build): recurrent states cached by prefix.

Tiny state-sensitive hybrids made at test time (make_hybrid_model.py): Qwen3-Next (Gated DeltaNet
linear attention beside full attention, bfloat16: vLLM's CPU kernel wants it) and NemotronH
(Mamba2 mixers beside attention; vLLM's CPU scan kernel needs a token budget within one block).
vLLM keeps their states at block boundaries with its own prefix cache on ("align" mode), raising
the block size (544 and 160 tokens here: pages of the states); the connector then stores
attention chunks of one block and, where vLLM names a boundary state, one state object per state
group, and a hit ends where every group can restore.

Each engine is a fresh process; vLLM's own prefix cache is cleared before each prompt, so every
hit comes from the server. The oracle is the same prompts run without a connector: greedy tokens
identical, logprobs within bfloat16 noise. Two negative controls show the test can fail: the
state's load skipped, or made synchronous (it then lands after vLLM copied the block into the
running state), each changes the output while the attention KV still loads.
"""

from __future__ import annotations

import importlib.util
import random
import subprocess
import sys

import pytest

from test_vllm_e2e import HERE, Runner, ServerProcess, free_port, make_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

COMMON = ["--max-model-len", "2048", "--prefix-caching", "--sequential", "--reset-prefix-cache", "--logprobs"]
HYBRIDS = {
    "qwen3_next": ["--dtype", "bfloat16"],
    "nemotron_h": ["--max-num-batched-tokens", "128"],
}
# How far a token's logprob may move when the same prompt is computed from a loaded prefix: in
# bfloat16 (8 bits of mantissa) a logprob near -6 is rounded in steps of 1/32, and the KV a load
# restores was computed in other steps than a cold run's (seen: 0.053); float32 stays close.
LOGPROB_NOISE = {"qwen3_next": 0.1, "nemotron_h": 0.005}


def make_hybrid(out, arch: str) -> str:
    subprocess.run([sys.executable, str(HERE / "make_hybrid_model.py"), str(out), "--arch", arch], check=True,
                   timeout=300, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return str(out)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm_hybrid")


@pytest.fixture(scope="module")
def prompts():
    """A: 1,000 tokens; B: A and 600 more (a longer prompt sharing A, as a conversation's next turn)."""
    rng = random.Random(20261206)
    a = [rng.randrange(3, 512) for _ in range(1000)]
    return [a, a + [rng.randrange(3, 512) for _ in range(600)]]


def replay_boundary(n: int, block_size: int) -> int:
    """Where vLLM keeps a prompt's state: the last block boundary before its last token."""
    return (n - 1) // block_size * block_size


def same_output(got: dict, want: dict) -> bool:
    return got["outputs"] == want["outputs"]


def assert_same(got: dict, want: dict, arch: str) -> None:
    assert got["outputs"] == want["outputs"]
    worst = max(abs(x - y) for a, b in zip(got["logprobs"], want["logprobs"]) for x, y in zip(a, b))
    assert worst <= LOGPROB_NOISE[arch], f"logprobs differ by {worst}"


@pytest.mark.parametrize("arch", sorted(HYBRIDS))
def test_a_hybrid_loads_attention_and_state_from_the_server(workdir, prompts, arch):
    model = make_hybrid(workdir / arch, arch)
    run = Runner(workdir, model)
    args = [*COMMON, *HYBRIDS[arch]]
    disk = workdir / f"{arch}-disk"
    server = ServerProcess(free_port(), workdir / f"{arch}-server.log", "--l2-disk", str(disk),
                           "--l2-disk-write", "all")
    a, b = prompts
    try:
        cold = run(f"{arch}_cold", prompts, None, *args)
        bs = cold["block_size"]
        assert bs % 32 == 0 and 256 % bs, bs  # raised for the state's page: the server's 256 is no multiple of it
        assert cold["num_cached_tokens"] == [0, 0]

        # Engine 1 stores A (its attention chunks, its state at A's boundary), then B finds A there.
        first = run(f"{arch}_first", prompts, server.url, *args)
        assert first["num_cached_tokens"] == [0, replay_boundary(len(a), bs)]
        assert_same(first, cold, arch)
        assert first["connector"]["stored_chunks"] > 0 and first["connector"]["store_errors"] == 0

        # Engine 2, a fresh process: both prompts up to their boundaries from the server.
        second = run(f"{arch}_second", prompts, server.url, *args)
        want = [replay_boundary(len(p), bs) for p in prompts]
        assert second["num_cached_tokens"] == want
        assert_same(second, cold, arch)
        assert second["connector"]["failed_load_chunks"] == 0 and second["connector"]["loaded_chunks"] > 0

        # Negative controls: the same hits with the state skipped, or loaded too late, give other tokens.
        for fault in ("skip", "late"):
            bad = run(f"{arch}_{fault}", prompts, server.url, *args, "--state-fault", fault)
            assert bad["num_cached_tokens"] == want
            assert not same_output(bad, cold), f"the output did not change with the state {fault}"

        # A restarted server serves them from its disk tier.
        server.stop()
        server = ServerProcess(free_port(), workdir / f"{arch}-server2.log", "--l2-disk", str(disk),
                               "--l2-disk-write", "all")
        again = run(f"{arch}_restarted", prompts, server.url, *args)
        assert again["num_cached_tokens"] == want
        assert_same(again, cold, arch)
    finally:
        server.stop()


def test_one_server_serves_a_dense_model_and_two_hybrids_of_other_block_sizes(workdir, prompts):
    """One server on its default chunk size: a dense model (blocks of 32 tokens, chunks of the
    server's 64) and both hybrids (544- and 160-token blocks, chunks of their blocks) store and
    hit side by side; no operator setting."""
    server = ServerProcess(free_port(), workdir / "mixed-server.log")
    try:
        models = {arch: make_hybrid(workdir / f"mixed-{arch}", arch) for arch in HYBRIDS}
        models["llama"] = make_model(workdir / "mixed-llama", "llama")
        blocks = {}
        for rnd in ("store", "hit"):
            for name, model in models.items():
                args = [*COMMON, *HYBRIDS.get(name, [])]
                got = Runner(workdir, model)(f"mixed-{name}-{rnd}", prompts[:1] if name == "llama" else prompts,
                                             server.url, *args)
                blocks[name] = got["block_size"]
                if rnd == "hit":
                    assert got["num_cached_tokens"][0] > 0, name
                    assert got["connector"]["failed_load_chunks"] == 0
        assert len({blocks["qwen3_next"], blocks["nemotron_h"], blocks["llama"]}) == 3, blocks
    finally:
        server.stop()


def test_two_tenants_hybrid_chunks_and_states_stay_apart(workdir, prompts):
    """On a server with tenants, bob's engine finds none of alice's attention chunks or states
    (his A misses as alice's did; his B finds only his own A), while alice's next engine loads
    both prompts."""
    from lmcache_mp.server.cli import main as cli_main

    arch = "nemotron_h"
    model = make_hybrid(workdir / f"tenants-{arch}", arch)
    keys = workdir / "hybrid-tenant-keys"
    assert cli_main(["keygen", str(keys)]) == 0
    for name in ("alice", "bob"):
        assert cli_main(["keygen", str(keys), "--client", name]) == 0
    tenants = workdir / "hybrid-tenants.toml"
    tenants.write_text(f'[tenants.alice]\ncurve_keys = ["{keys}/clients/alice.key"]\n'
                       f'[tenants.bob]\ncurve_keys = ["{keys}/clients/bob.key"]\n')
    server = ServerProcess(free_port(), workdir / "hybrid-tenants-server.log", "--tenants", str(tenants),
                           "--curve-secret-key", f"{keys}/server.key_secret", "--http-addr", "off",
                           client_kw=dict(curve_server_key=f"{keys}/server.key",
                                          curve_client_key=f"{keys}/client-secret/bob.key_secret"))

    def as_(name: str) -> list[str]:
        return ["--extra-config", f'{{"lmcache_mp.curve_server_key": "{keys}/server.key", '
                                  f'"lmcache_mp.curve_client_key": "{keys}/client-secret/{name}.key_secret"}}']

    run = Runner(workdir, model)
    args = [*COMMON, *HYBRIDS[arch]]
    try:
        alice = run("hybrid_alice", prompts, server.url, *args, *as_("alice"))
        bs = alice["block_size"]
        assert alice["num_cached_tokens"] == [0, replay_boundary(len(prompts[0]), bs)]
        bob = run("hybrid_bob", prompts, server.url, *args, *as_("bob"))
        assert bob["num_cached_tokens"] == alice["num_cached_tokens"]
        assert bob["outputs"] == alice["outputs"]
        again = run("hybrid_alice_again", prompts, server.url, *args, *as_("alice"))
        assert again["num_cached_tokens"] == [replay_boundary(len(p), bs) for p in prompts]
        assert again["outputs"] == alice["outputs"]
    finally:
        server.stop()
