"""bench/bench_pins.py on a trace small enough to reason about: three sessions take turns, their contexts
together nearly twice L1, so that LRU evicts each one (nearly whole) before its next turn. A pin
for the think time, within a budget of three quarters of L1, keeps the first session, whose
context fits it; the others' pins are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pinning_a_session_for_its_think_time_serves_it_where_lru_serves_nothing(tmp_path):
    trace = tmp_path / "sessions.jsonl"
    with open(trace, "w") as f:
        for turn in range(6):
            for s in range(3):
                blocks = [1000 * (s + 1) + b for b in range(24 + turn)]  # ids local to the session, growing
                f.write(json.dumps({"timestamp": 1000.0 * (3 * turn + s), "input_length": 512 * len(blocks),
                                    "hash_ids": blocks}) + "\n")
    out = tmp_path / "pins.json"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_pins.py"), "--trace", str(trace),
                          "--sizes", "40", "--policy", "lru", "--pin-ttl", "think", "--budget", "0.75",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    none, pinned = json.loads(out.read_text())["rows"]
    assert none["pin_ttl"] == "-" and none["pins"] == 0 and none["served"] == 0
    assert pinned["pins"] == 5 and pinned["refused"] == 10  # the first session's (24-28 blocks of 30), no other
    assert pinned["served"] >= 24 + 25 + 26 + 27 + 28  # its whole context at every next turn
    assert pinned["vs_no_pins"] == 0.0  # (no ratio to a run that served nothing)
