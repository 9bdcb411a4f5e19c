"""The audit log: JSON lines, file mode, append, rate-limited breaches and denials, write errors,
thread safety, close, and the null log."""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
from pathlib import Path
from typing import Any

import pytest

from lmcache_mp.server.tenancy.audit import AuditLog, NullAuditLog, open_audit_log


class FakeClock:
    def __init__(self, t: float = 1_796_419_800.123) -> None:  # 2026-12-04T21:30:00.123Z
        self.t = t

    def __call__(self) -> float:
        return self.t


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_lines_are_json_with_ts_event_and_fields(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    log = AuditLog(str(path), clock=FakeClock())
    log.write("registration", tenant="a", model="m", kv_id=3, world_size=2, rank=1)
    # flushed at once: readable before close
    assert lines(path) == [{"ts": "2026-12-04T21:30:00.123Z", "event": "registration", "tenant": "a",
                            "model": "m", "kv_id": 3, "world_size": 2, "rank": 1}]
    log.close()


def test_bytes_as_hex_and_others_as_str(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    log = AuditLog(str(path))
    log.write("connection_refused", fingerprint=b"\x01\xab", peer=tmp_path, reason="bad", ok=None)
    log.write("odd", value=float("nan"))
    log.close()
    first, second = lines(path)
    assert first["fingerprint"] == "01ab" and first["peer"] == str(tmp_path) and first["ok"] is None
    assert second["event"] == "odd" and second["value"] == "nan"


def test_created_with_mode_0600(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    AuditLog(str(path)).close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_missing_folder_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nowhere" / "audit.log"
    with pytest.raises((ValueError, OSError), match=str(path)):
        AuditLog(str(path))


def test_appends_to_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    first = AuditLog(str(path))
    first.write("server_start", tenants_file="t.toml", tenants=2)
    first.close()
    second = AuditLog(str(path))
    second.write("tenants_reloaded", file="t.toml", added=["b"], removed=[], changed=[])
    second.close()
    assert [line["event"] for line in lines(path)] == ["server_start", "tenants_reloaded"]


def test_breach_rate_limited_with_suppressed_counts(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    clock = FakeClock()
    log = AuditLog(str(path), clock=clock, breach_interval=60.0)
    log.breach("a", "bytes", used=10, limit=5)  # written
    for _ in range(3):
        clock.t += 10
        log.breach("a", "bytes", used=11, limit=5)  # suppressed
    log.breach("a", "clients")  # another quota: its own limit
    log.breach("b", "bytes")  # another tenant: its own limit
    clock.t += 30  # 60 s after the first line
    log.breach("a", "bytes", used=12, limit=5)  # written, carrying the 3 suppressed
    clock.t += 1
    log.breach("a", "bytes")  # suppressed
    clock.t += 60
    log.breach("a", "bytes")  # written, carrying 1
    log.close()
    got = [(line["event"], line["tenant"], line["quota"], line["suppressed"]) for line in lines(path)]
    assert got == [("quota_breach", "a", "bytes", 0), ("quota_breach", "a", "clients", 0),
                   ("quota_breach", "b", "bytes", 0), ("quota_breach", "a", "bytes", 3),
                   ("quota_breach", "a", "bytes", 1)]
    assert lines(path)[3]["used"] == 12


def test_denied_rate_limited_per_tenant_and_op(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    clock = FakeClock()
    log = AuditLog(str(path), clock=clock, breach_interval=5.0)
    log.denied("a", "store", "read-only tenant")
    log.denied("a", "store", "read-only tenant")
    log.denied("a", "retrieve", "not registered")
    clock.t += 5
    log.denied("a", "store", "read-only tenant")
    log.close()
    got = [(line["event"], line["op"], line["reason"], line["suppressed"]) for line in lines(path)]
    assert got == [("request_denied", "store", "read-only tenant", 0),
                   ("request_denied", "retrieve", "not registered", 0),
                   ("request_denied", "store", "read-only tenant", 1)]


class FailingFile:
    def __init__(self) -> None:
        self.calls = 0

    def write(self, data: bytes) -> int:
        self.calls += 1
        raise OSError(28, "No space left on device")

    def close(self) -> None:
        pass


def test_write_error_never_raises_and_warns_once_a_minute(tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "audit.log"
    clock = FakeClock()
    log = AuditLog(str(path), clock=clock)
    real, failing = log._file, FailingFile()
    log._file = failing
    with caplog.at_level(logging.WARNING, logger="lmcache_mp.server.tenancy.audit"):
        log.write("registration", tenant="a")
        log.breach("a", "bytes")
        clock.t += 30
        log.write("unregistration", tenant="a")
        assert len(caplog.records) == 1 and str(path) in caplog.records[0].getMessage()
        clock.t += 30
        log.write("unregistration", tenant="a")
        assert len(caplog.records) == 2
    assert failing.calls == 4
    log._file = real  # the disk has room again: later lines are written, the dropped ones are not
    log.write("server_start")
    log.close()
    assert [line["event"] for line in lines(path)] == ["server_start"]


def test_short_write_then_error_starts_the_next_line_fresh(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    log = AuditLog(str(path))
    real = log._file

    class ShortThenFull:
        def __init__(self) -> None:
            self.calls = 0

        def write(self, data: bytes) -> int:
            self.calls += 1
            if self.calls == 1:
                return real.write(data[:5])
            raise OSError(28, "No space left on device")

    log._file = ShortThenFull()
    log.write("registration", tenant="a")
    log._file = real
    log.write("server_start")
    log.close()
    torn, whole = path.read_text().splitlines()
    assert torn == '{"ts"' and json.loads(whole)["event"] == "server_start"


def test_threads_write_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    log = AuditLog(str(path))
    threads_n, per_thread = 8, 1000

    def work(i: int) -> None:
        for j in range(per_thread):
            log.write("registration", tenant=f"t{i}", n=j, pad="x" * 200)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    got = lines(path)
    assert len(got) == threads_n * per_thread
    for i in range(threads_n):
        assert [line["n"] for line in got if line["tenant"] == f"t{i}"] == list(range(per_thread))


def test_close_is_idempotent_and_later_writes_are_ignored(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    log = AuditLog(str(path))
    log.write("server_start")
    log.close()
    log.close()
    log.write("registration", tenant="a")
    log.breach("a", "bytes")
    log.denied("a", "store", "no")
    assert [line["event"] for line in lines(path)] == ["server_start"]


def test_null_log_accepts_every_call() -> None:
    log = NullAuditLog()
    log.write("server_start", tenants=1, key=b"\x00")
    log.breach("a", "bytes", used=1)
    log.denied("a", "store", "no")
    log.close()
    log.close()


def test_open_audit_log(tmp_path: Path) -> None:
    assert isinstance(open_audit_log(""), NullAuditLog)
    log = open_audit_log(str(tmp_path / "audit.log"))
    assert isinstance(log, AuditLog)
    log.close()


@pytest.mark.parametrize("tenants", [False, True])
def test_failed_curve_handshakes_are_audited(tmp_path: Path, tenants: bool) -> None:
    """A client with another server's public key (or a key not let in) fails the handshake: the
    audit log has a connection_refused line for it, as for keys in no tenant."""
    import time

    from lmcache_mp import Client, Server, ServerConfig, ServerUnavailable
    from lmcache_mp.server.cli import main as cli_main

    for d in ("keys", "other"):
        assert cli_main(["keygen", str(tmp_path / d)]) == 0
    keys, other = tmp_path / "keys", tmp_path / "other"
    audit = tmp_path / "audit.jsonl"
    access = dict(curve_clients=str(keys / "clients"))
    if tenants:
        (tmp_path / "tenants.toml").write_text(f'[tenants.a]\ncurve_keys = ["{keys}/clients/client.key"]\n')
        access = dict(tenants=str(tmp_path / "tenants.toml"))
    srv = Server(ServerConfig(url="tcp://127.0.0.1:0", device="cpu", l1_size="16MiB", http_addr="off",
                              curve_secret_key=str(keys / "server.key_secret"), audit_log=str(audit), **access)).start()
    try:
        with pytest.raises(ServerUnavailable):  # another server's public key
            Client(srv.url, connect_timeout=5, curve_server_key=str(other / "server.key"),
                   curve_client_key=str(keys / "client-secret" / "client.key_secret"))
        with pytest.raises(ServerUnavailable):  # a key not let in
            Client(srv.url, connect_timeout=5, curve_server_key=str(keys / "server.key"),
                   curve_client_key=str(other / "client-secret" / "client.key_secret"))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            refused = [r for r in lines(audit) if r["event"] == "connection_refused"] if audit.exists() else []
            if len(refused) >= 2:
                break
            time.sleep(0.1)
    finally:
        srv.stop()
    assert any("handshake failed" in r.get("reason", "") and r["transport"] == "zmq" for r in refused), refused
    assert any(r.get("fingerprint", "").startswith("curve:") for r in refused), refused
