"""The audit log (`--audit-log FILE`): one JSON object a line, about tenants, for an operator or a SIEM.

Every line is `{"ts": "2026-12-04T21:30:00.123Z", "event": EVENT, ...fields}`, ts in UTC with
milliseconds. The log records who connected and what they were allowed to do, never a line per chunk.
Its vocabulary:

- server_start: tenants file, tenant count
- connection_accepted: tenant, credential fingerprint, transport ("zmq" | "lane"), peer
- connection_refused: credential fingerprint or peer, transport, reason (a failed CURVE handshake:
  transport and reason only, ZeroMQ names no peer)
- registration: tenant, model, kv_id, world_size, rank
- unregistration: the same fields as registration
- tenants_reloaded: file, added, removed, changed (tenant names)
- tenants_reload_failed: file, error
- credential_revoked: tenant, fingerprint, clients dropped
- quota_breach: tenant, quota, suppressed, ... (at most one line per (tenant, quota) per breach_interval)
- request_denied: tenant, op, reason, suppressed (at most one line per (tenant, op) per breach_interval)

`suppressed` counts the breaches (or denials) of that key left unwritten since its previous line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

WARNING_INTERVAL = 60.0


def _timestamp(t: float) -> str:
    ms = round(t * 1000)  # round, not truncate: 0.123 may be stored as 0.12299...
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms // 1000)) + f".{ms % 1000:03d}Z"


def _jsonable(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    return str(value)


class AuditLog:
    """JSON lines appended to a file; thread-safe, and no call raises once it is open."""

    def __init__(self, path: str, clock: Callable[[], float] = time.time, breach_interval: float = 60.0) -> None:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise ValueError(f"audit log {path}: the folder {parent} does not exist")
        try:
            # 0o600 because the log names tenants and credential fingerprints; an existing file keeps its mode.
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError as e:
            raise OSError(e.errno, f"cannot open the audit log {path}: {e.strerror}") from e
        # Unbuffered, one write per line: a failed write leaves nothing in a buffer to resurface later.
        self._file: Any = open(fd, "ab", buffering=0)  # noqa: SIM115 (open for the log's life)
        self.path = path
        self._clock = clock
        self._interval = breach_interval
        self._lock = threading.Lock()
        self._last_warning = float("-inf")
        self._torn = False  # the previous line was cut short: start the next one on a fresh line
        self._limits: dict[tuple[str, str, str], list[float]] = {}  # key -> [time of last line, suppressed]

    def write(self, event: str, **fields: Any) -> None:
        with self._lock:
            self._write(event, fields)

    def breach(self, tenant: str, quota: str, **fields: Any) -> None:
        self._limited("quota_breach", (tenant, quota), {"tenant": tenant, "quota": quota, **fields})

    def denied(self, tenant: str, op: str, reason: str) -> None:
        self._limited("request_denied", (tenant, op), {"tenant": tenant, "op": op, "reason": reason})

    def refused(self, who: str, **fields: Any) -> None:
        """A refused connection, limited per credential fingerprint (or peer): a client that
        retries forever leaves a line a minute."""
        self._limited("connection_refused", (who,), fields)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                file, self._file = self._file, None
                with contextlib.suppress(OSError):  # nothing is lost: writes are unbuffered
                    file.close()

    def _limited(self, event: str, key: tuple, fields: dict[str, Any]) -> None:
        # A tenant hammering its quota must not flood the log: one line per key per interval, with a count.
        with self._lock:
            now = self._clock()
            state = self._limits.get((event, *key))
            if state is not None and now - state[0] < self._interval:
                state[1] += 1
                return
            suppressed = int(state[1]) if state is not None else 0
            self._limits[(event, *key)] = [now, 0]
            self._write(event, {**fields, "suppressed": suppressed})

    def _write(self, event: str, fields: dict[str, Any]) -> None:
        if self._file is None:
            return
        now = self._clock()
        # ts and event come first and cannot be overridden by a field of the same name
        record = {"ts": _timestamp(now), "event": event}
        record.update((k, v) for k, v in fields.items() if k not in record)
        try:
            line = json.dumps(record, default=_jsonable, allow_nan=False)
        except ValueError:  # NaN or a cycle: still leave a trace rather than nothing
            line = json.dumps({k: v if k in ("ts", "event") else str(v) for k, v in record.items()})
        data = (("\n" if self._torn else "") + line + "\n").encode()
        written = 0
        try:
            while written < len(data):  # a write to a full disk may be short
                written += self._file.write(data[written:])
            self._torn = False
        except OSError as e:
            self._torn = self._torn or written > 0
            if now - self._last_warning >= WARNING_INTERVAL:
                self._last_warning = now
                logger.warning("audit log %s: cannot write (%s); dropping lines", self.path, e)


class NullAuditLog:
    """The audit log when no --audit-log is given: accepts every call and writes nothing."""

    def write(self, event: str, **fields: Any) -> None:
        pass

    def breach(self, tenant: str, quota: str, **fields: Any) -> None:
        pass

    def denied(self, tenant: str, op: str, reason: str) -> None:
        pass

    def refused(self, who: str, **fields: Any) -> None:
        pass

    def close(self) -> None:
        pass


def open_audit_log(path: str) -> AuditLog | NullAuditLog:
    return AuditLog(path) if path else NullAuditLog()
