"""Hints through a real vLLM (CPU build) and its connector (docs/hints.md).

Engine A runs a session's prompt S asking, in its kv_transfer_params, for a pin (and for actions
this server does not know, which change nothing), and a control prompt C without hints. A flood of
other prompts from engine B then evicts everything L1 does not protect. Engine C runs S and C again:
S is a whole hit with the outputs of a plain engine, C a miss.

A finished request's hints go out once its workers report its stores over, at a later step of the
engine: `vllm serve` keeps stepping for them (has_pending_push_work), an offline `LLM.generate`
only within its next call. Engine A therefore runs its prompts one call each (S first).
"""

from __future__ import annotations

import importlib.util
import random

import pytest

from test_vllm_e2e import CHUNK, Runner, ServerProcess, expected_hit, free_port, make_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

CHUNK_BYTES = 2 * 32 * 2 * 2 * 32 * 4 * 2  # one chunk of the tiny model: 2 blocks of 32 KiB
L1_CHUNKS = 32


def test_a_pinned_session_survives_a_flood_and_unknown_actions_change_nothing(tmp_path):
    model = make_model(tmp_path / "tiny-llama", "llama")
    run = Runner(tmp_path, model)
    rng = random.Random(4848)
    S, C = ([rng.randrange(3, 512) for _ in range(5 * CHUNK + 20)] for _ in range(2))
    flood = [[rng.randrange(3, 512) for _ in range(5 * CHUNK + 20)] for _ in range(2 * L1_CHUNKS // 5)]
    hints = {"lmcache_mp.hints": [{"action": "pin", "ttl": 600}, {"action": "share"}, {"action": "teleport", "x": 1}]}
    plain = run("hints_plain", [S, C])
    server = ServerProcess(free_port(), tmp_path / "server.log", "--l1-size", f"{L1_CHUNKS * CHUNK_BYTES}",
                           "--eviction-policy", "lru")
    try:
        a = run("hints_A", [{"tokens": S, "kv_transfer_params": hints}, C], server.url, "--sequential")
        assert a["outputs"] == plain["outputs"]
        assert server.present_chunks([S, C], model) == [5, 5]
        from lmcache_mp import Client

        with Client(server.url, timeout=10) as c:
            pins = c.status()["hints"]
        assert pins["requests"]["pin"] == 1 and pins["tenants"][""]["pinned_objects"] == 5
        assert pins["requests"]["ignored"] == 0  # the connector never sends what it does not know

        b = run("hints_flood", flood, server.url)
        assert b["connector"]["stored_chunks"] == 5 * len(flood)
        assert server.present_chunks([S, C], model) == [5, 0], "the flood evicted the pinned session"

        again = run("hints_C", [S, C], server.url)
        assert again["num_cached_tokens"] == [expected_hit(len(S), len(S)), 0]
        assert again["outputs"] == plain["outputs"]
        assert again["connector"]["failed_load_chunks"] == 0
    finally:
        server.stop()
