"""A CI-sized soak (bench/soak.py): client processes doing random requests with every byte read
checked, some SIGKILLed mid-flight; afterwards nothing is left behind on the server."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import soak  # noqa: E402


def test_soak_with_clients_killed_mid_flight():
    server = soak.start_server("8MiB", heartbeat_timeout=1.0)
    try:
        report = soak.run_soak(server.url, server.pid, clients=4, seconds=20, kill_every=2.0, heartbeat_timeout=1.0)
    finally:
        rc = server.stop(30)
    print({k: v for k, v in report.items() if k != "errors"})
    assert soak.problems(report, heap_bound_kib=32 << 10) == []
    assert report["clients_killed"] >= 5 and report["retrieves"] > 100 and report["bytes_checked"] > 1 << 20
    assert rc == 0
