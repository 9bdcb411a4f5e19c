"""The connector's hints (docs/hints.md): read from an engine's request, sent once its stores are on the server.

The fake engine of test_connector_core.py against an in-process server (CPU device); the real
vLLM end to end is tests/vllm_e2e/test_vllm_hints.py.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from lmcache_mp import Client
from lmcache_mp.integration.request_hints import RequestHint, request_hints
from lmcache_mp.integration.connector_core import ScheduledRequest
from test_connector_core import CS, engines, matched, server  # noqa: F401
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
