"""The connector's hints (docs/hints.md): read from an engine's request, sent once its stores are on the server.

The fake engine of test_connector_core.py against an in-process server (CPU device); the real
vLLM end to end is tests/vllm_e2e/test_vllm_hints.py.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from lmcache_mp import Client, Server, ServerConfig, chunk_hashes
from lmcache_mp.integration.request_hints import RequestHint, request_hints
from lmcache_mp.integration.connector_core import ScheduledRequest
from test_connector_core import CS, engines, matched, prompt, server  # noqa: F401
from test_server_e2e import wait_until

torch = pytest.importorskip("torch")


class Action:  # the shape of vLLM 0.33's KvHintAction (a msgspec Struct): attributes, a payload dict
    def __init__(self, action_type, payload):
        self.action_id, self.action_type, self.action_version, self.payload = "a1", action_type, "1", payload


def test_hints_come_from_kv_transfer_params_and_kv_hints_and_the_unknown_are_skipped():
    request = SimpleNamespace(
        kv_transfer_params={"lmcache_mp.hints": [{"action": "pin", "ttl": 30}, {"action": "teleport"},
                                                 {"action": "retain", "priority": 99, "tokens": 128},
                                                 {"action": "pin", "ttl": -1}, {"action": "pin", "ttl": math.inf},
                                                 "pin", {"action": 7}]},
        kv_hints=SimpleNamespace(protocol_version="1", message_id="m", actions=[
            Action("Pin", {"ttl_s": 12.5, "tokens": 256}), Action("Share", {"with": "everyone"}),
            Action("Prefetch", {}), Action("Demote", None), Action("Retain", {"priority": "x"}),
            Action(None, {}), {"action_type": "RETAIN", "payload": {"priority": 3}}]))
    assert request_hints(request) == [
        RequestHint("pin", ttl=30.0), RequestHint("retain", priority=16, tokens=128),
        RequestHint("pin", ttl=12.5, tokens=256), RequestHint("prefetch"), RequestHint("demote"),
        RequestHint("retain", priority=3)]
    assert request_hints(SimpleNamespace()) == []
    assert request_hints(SimpleNamespace(kv_transfer_params={"lmcache_mp.hints": {"action": "drop"}},
                                         kv_hints=SimpleNamespace(actions="nonsense"))) == [RequestHint("drop")]


def status(server):  # noqa: F811
    with Client(server.url, timeout=5) as c:
        return c.status()


def test_a_finished_requests_pin_is_sent_once_its_stores_are_answered(server, engines):  # noqa: F811
    a = engines(server.url)
    tokens = list(range(5 * CS + 10))
    hints = [RequestHint("pin", ttl=600), RequestHint("share"), RequestHint("retain", priority=2, tokens=2 * CS)]
    assert matched(a.sched, "r", tokens, 0, hints=hints) == 0
    blocks = a.alloc(-(-len(tokens) // 32))
    a.sched.on_allocated("r", blocks, 0)
    plan = a.sched.build_plan([ScheduledRequest("r", 0, len(tokens), blocks)])
    a.execute(plan, compute=[(tokens, blocks, 0, len(tokens))])
    assert a.finish("r")  # stores were planned: the workers report it once the server answered them
    assert status(server)["hints"]["requests"]["pin"] == 0, "a pin went out before the engine said the stores were over"
    a.sched.stores_finished({"r"})  # what vLLM hands the connector (finished_sending)
    st = wait_until(lambda: (s := status(server))["hints"]["requests"]["retain"] == 1 and s, 30, "the hints")
    assert st["hints"]["requests"] == {"pin": 1, "unpin": 0, "retain": 1, "prefetch": 0, "demote": 0, "drop": 0,
                                       "ignored": 1}
    pinned = st["hints"]["tenants"][""]
    assert pinned["pinned_objects"] == 5 and pinned["pinned_bytes"] >= 5 * 32768  # the 5 whole chunks stored
    assert a.sched.stats["hints"] == 3 and a.sched.stats["hint_errors"] == 0
    a.sched.stores_finished({"r"})  # (told twice: sent once)
    assert a.sched.stats["hints"] == 3


def test_a_tp_shared_engines_hints_reach_its_chunks(server, engines):  # noqa: F811
    """lmcache_mp.tp_shared: the chunks are stored once for every TP size, and a finished
    request's hints must name those objects, not per-rank ones the engine never stored."""
    a = engines(server.url, world_size=2, tp_shared=True, num_kv_heads=4)
    tokens = list(range(3 * CS + 10))
    assert a.prefill("r", tokens, hints=[RequestHint("pin", ttl=600), RequestHint("retain", priority=2)])[0] == 0
    assert a.finish("r")
    a.sched.stores_finished({"r"})
    st = wait_until(lambda: (s := status(server))["hints"]["requests"]["retain"] == 1 and s, 30, "the hints")
    assert st["hints"]["tenants"][""]["pinned_objects"] == 3  # the 3 whole chunks, one object each
    assert a.sched.stats["hint_errors"] == 0


def test_a_prefetch_at_arrival_brings_a_demoted_prompt_back_for_its_load(tmp_path, engines):  # noqa: F811
    """A prefetch hint goes to the server when the request arrives, on its prompt's chunks: a
    prompt demoted to the disk comes back into L1 and the engine loads it, every byte."""
    srv = Server(ServerConfig(url="tcp://127.0.0.1:0", l1_size="64MiB", device="cpu", chunk_size=CS,
                              l2_disk=str(tmp_path), l2_disk_size="64MiB")).start()
    try:
        tokens = prompt(5, 3 * CS + 10)
        hashes = chunk_hashes(tokens, CS)[:3]
        a = engines(srv.url)
        a.prefill("r", tokens)
        assert a.finish("r")
        with Client(srv.url, timeout=10) as c:
            assert c.hint("demote", hashes, model="tiny").chunks == 3
            assert srv.engine.l1.prefix_objects("tiny", 1, hashes)[0] == 0

        b = engines(srv.url)
        b.free = b.free[::-1]  # other blocks than engine A's
        ext = matched(b.sched, "q", tokens, 0, hints=[RequestHint("prefetch"), RequestHint("pin", ttl=60)])
        assert ext == 3 * CS
        st = wait_until(lambda: (s := srv.engine.status())["hints"]["requests"]["prefetch"] == 1 and s, 30,
                        "the prefetch")
        assert st["hints"]["requests"]["pin"] == 0  # (a pin goes once the request finished)
        wait_until(lambda: srv.engine.l1.prefix_objects("tiny", 1, hashes)[0] == 3, 30,
                   "the prefetch to load the chunks")
        blocks = b.alloc(-(-len(tokens) // 32))
        b.sched.on_allocated("q", blocks, ext)
        plan = b.sched.build_plan([ScheduledRequest("q", ext, len(tokens) - ext, blocks)])
        b.execute(plan, compute=[(tokens, blocks, ext, len(tokens))])
        assert b.load_errors == set() and b.workers[0].stats["loaded_chunks"] == 3
        assert b.check(tokens, blocks, 3 * CS)
        assert b.sched.stats["hints"] == 1 and b.sched.stats["hint_errors"] == 0
        b.finish("q")
    finally:
        srv.stop()
