"""The server's tenants file (`--tenants FILE`, TOML): who may connect, and with what limits.

Each `[tenants.NAME]` table names a tenant, its credentials (CURVE public keys, given inline in
z85 or as zmq public-key files relative to the tenants file's folder; Unix uids and gids of local
processes) and its limits; a `[shared]` table gives the shared namespace quotas of its own (it
has no credentials: tenants with `shared = "write"` store into it). `load_tenants` reads and
checks the whole file up front, so that a mistake stops the server at start with a
`<file>:<line>: tenants.<name>.<field>: ...` message rather than surfacing later as a refused
client.
"""

from __future__ import annotations

import os
import re
import struct
import tomllib
from dataclasses import dataclass
from typing import Any

import zmq.auth
from zmq.utils import z85

from lmcache_mp.sizes import format_size, parse_size
from lmcache_mp.server.transport.refusals import fingerprint

SHARED = "shared"
SHARED_MODES = ("none", "read", "write")
DEFAULTS: dict[str, Any] = {
    "curve_keys": [], "uids": [], "gids": [], "shared": "none", "l1_min": 0, "l1_max": 0, "l2_disk_max": 0,
    "l2_valkey_max": 0, "l2_mooncake_max": 0,
    "max_registrations": 64, "max_inflight": 1024, "admin": False, "engine_window": 256 << 20, "hint_budget": 0,
}
# What a [shared] table may set: the shared namespace's own quotas, enforced as a tenant's are.
SHARED_FIELDS = ("l1_min", "l1_max", "l2_disk_max", "l2_valkey_max", "l2_mooncake_max")
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_KEY_PART = re.compile(r"""\s*(?:([A-Za-z0-9_-]+)|"((?:[^"\\]|\\.)*)"|'([^']*)')\s*""")
_TOML_POSITION = re.compile(r"\s*\(at line (\d+), column (\d+)\)$")
_AT_END = " (at end of document)"


@dataclass(frozen=True)
class Tenant:
    name: str
    curve_keys: frozenset[str]
    uids: frozenset[int]
    gids: frozenset[int]
    shared: str
    l1_min: int
    l1_max: int
    l2_disk_max: int
    max_registrations: int
    max_inflight: int
    admin: bool
    engine_window: int = 256 << 20  # shared memory its processes map for engine-side copies (windows.py)
    l2_valkey_max: int = 0  # caps on the shared tiers' objects this node wrote for it (storage/l2/tenant_caps.py)
    l2_mooncake_max: int = 0
    hint_budget: int = 0  # L1 bytes its pins may hold (server/hints.py; 0: the server's --hint-budget)

    @property
    def reads_shared(self) -> bool:
        return self.shared in ("read", "write")

    @property
    def writes_shared(self) -> bool:
        return self.shared == "write"


@dataclass(frozen=True)
class SharedLimits:
    """The shared namespace's quotas (the file's [shared] table; 0: none), as a tenant's."""

    l1_min: int = 0
    l1_max: int = 0
    l2_disk_max: int = 0
    l2_valkey_max: int = 0
    l2_mooncake_max: int = 0


class TenantsFileError(ValueError):
    """A bad tenants file: '<file>:<line>: tenants.<name>.<field>: <what is wrong and what is expected>'."""


class TenantTable:
    def __init__(self, path: str, tenants: dict[str, Tenant], shared: SharedLimits = SharedLimits()):
        self.path = path
        self.tenants = tenants
        self.shared = shared
        self._by_key = {k: t for t in tenants.values() for k in t.curve_keys}
        self._by_uid = {u: t for t in tenants.values() for u in t.uids}
        self._by_gid = {g: t for t in tenants.values() for g in t.gids}

    def by_curve_key(self, z85_key: str | bytes) -> Tenant | None:
        if isinstance(z85_key, bytes):
            z85_key = z85_key.decode("ascii", "replace")
        return self._by_key.get(z85_key)

    def by_peer(self, uid: int, gid: int) -> Tenant | None:
        return self._by_uid.get(uid) or self._by_gid.get(gid)

    def credentials(self) -> dict[str, str]:
        return {cred: t.name for t in self.tenants.values() for cred in _credentials(t)}

    def __len__(self) -> int:
        return len(self.tenants)


def credential_fingerprint(credential: str) -> str:
    """A credential as logs show it: CURVE keys by a short hash (not the key itself); uids and gids as they are."""
    kind, _, value = credential.partition(":")
    return f"curve:{fingerprint(value)}" if kind == "curve" else credential


def load_tenants(path: str, l1_bytes: int = 0) -> TenantTable:
    """The tenants file, checked whole; l1_bytes: the server's L1 (--l1-size), which the l1_min of
    all tenants (and [shared]) together must fit (0: not checked)."""
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
    except OSError as e:
        raise TenantsFileError(f"{path}: cannot read the tenants file: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise TenantsFileError(f"{path}: not UTF-8 text: {e}") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        msg = str(e)
        if m := _TOML_POSITION.search(msg):
            where, msg = f"{path}:{m.group(1)}", f"{msg[:m.start()]} (column {m.group(2)})"
        elif msg.endswith(_AT_END):
            where, msg = f"{path}:{max(1, len(text.splitlines()))}", f"{msg[:-len(_AT_END)]} at the end of the file"
        else:
            where = path
        raise TenantsFileError(f"{where}: not valid TOML: {msg}") from None
    checker = _Checker(path, text)
    table = checker.table(doc)
    if l1_bytes:
        checker.fits_l1(table, l1_bytes)
    return table


def _credentials(t: Tenant) -> list[str]:
    return ([f"curve:{k}" for k in sorted(t.curve_keys)] + [f"uid:{u}" for u in sorted(t.uids)]
            + [f"gid:{g}" for g in sorted(t.gids)])


def _is_z85_key(s: str) -> bool:
    try:
        return len(s) == 40 and len(z85.decode(s.encode("ascii"))) == 32
    except (ValueError, KeyError, struct.error):  # z85.decode's ways of refusing bad input
        return False


def _dotted_key(text: str) -> tuple[tuple[str, ...], str] | None:
    """The dotted TOML key at the start of `text` (bare or quoted parts), and the rest of the text."""
    parts: list[str] = []
    while m := _KEY_PART.match(text):
        parts.append(next(g for g in m.groups() if g is not None))
        text = text[m.end():]
        if not text.startswith("."):
            return tuple(parts), text
        text = text[1:]
    return None


def _key_lines(text: str) -> dict[tuple[str, ...], int]:
    """Line of each table header and `key =` in the text, by full key path (tomllib gives no positions).

    A line-by-line scan, good enough for hand-written files: it does not follow multi-line strings."""
    lines: dict[tuple[str, ...], int] = {}
    table: tuple[str, ...] = ()
    for n, line in enumerate(text.splitlines(), 1):
        s = line.lstrip()
        if s.startswith("["):
            parsed = _dotted_key(s[2 if s.startswith("[[") else 1:])
            if parsed and parsed[1].startswith("]"):
                table = parsed[0]
                lines.setdefault(table, n)
        elif (parsed := _dotted_key(s)) and parsed[1].startswith("="):
            lines.setdefault(table + parsed[0], n)
    return lines


class _Checker:
    def __init__(self, path: str, text: str):
        self.path = path
        self.folder = os.path.dirname(os.path.abspath(path))
        self.lines = _key_lines(text)

    def error(self, keys: tuple[str, ...], what: str) -> TenantsFileError:
        # Inline tables and dotted keys leave no line of their own: use the nearest enclosing one.
        line = next((self.lines[keys[:k]] for k in range(len(keys), 0, -1) if keys[:k] in self.lines), None)
        where = f"{self.path}:{line}" if line else self.path
        return TenantsFileError(f"{where}: {'.'.join(keys)}: {what}" if keys else f"{where}: {what}")

    def table(self, doc: dict[str, Any]) -> TenantTable:
        for key in doc:
            if key not in ("tenants", SHARED):
                raise self.error((key,), "unknown top-level key; the file holds [tenants.NAME] tables and [shared]")
        tables = doc.get("tenants", {})
        if not isinstance(tables, dict):
            raise self.error(("tenants",), "must be a table of tenants ([tenants.NAME])")
        if not tables:
            raise self.error(("tenants",) if "tenants" in doc else (), "no tenants: add at least one [tenants.NAME]")
        tenants: dict[str, Tenant] = {}
        tenant_of: dict[str, str] = {}  # credential -> the tenant it names
        for name, fields in tables.items():
            tenant = tenants[name] = self.tenant(name, fields)
            for cred in _credentials(tenant):
                if cred in tenant_of:
                    kind = {"curve": "curve_keys", "uid": "uids", "gid": "gids"}[cred.partition(":")[0]]
                    raise self.error(("tenants", name, kind), f"{credential_fingerprint(cred)} is also a credential "
                                     f"of tenant '{tenant_of[cred]}'; a credential belongs to one tenant only")
                tenant_of[cred] = name
        return TenantTable(self.path, tenants, self.shared(doc.get(SHARED, {})))

    def shared(self, fields: Any) -> SharedLimits:
        at = (SHARED,)
        if not isinstance(fields, dict):
            raise self.error(at, "must be a table of the shared namespace's quotas ([shared])")
        for key in fields:
            if key not in SHARED_FIELDS:
                raise self.error(at + (key,), f"unknown field; known fields: {', '.join(SHARED_FIELDS)}")
        sizes = {key: self.size(at + (key,), fields.get(key, 0)) for key in SHARED_FIELDS}
        if sizes["l1_max"] and sizes["l1_max"] < sizes["l1_min"]:
            raise self.error(at + ("l1_max",), f"{fields['l1_max']!r} is less than l1_min ({fields['l1_min']!r}); "
                             "expected l1_max >= l1_min, or 0 for no cap")
        return SharedLimits(**sizes)

    def tenant(self, name: str, fields: Any) -> Tenant:
        at = ("tenants", name)
        if not _NAME.fullmatch(name):
            raise self.error(at, "bad tenant name: use 1-64 letters, digits, '-', '_' or '.'")
        if name == SHARED:
            raise self.error(at, f"'{SHARED}' is the reserved name of the shared namespace, not a tenant name")
        if not isinstance(fields, dict):
            raise self.error(at, "must be a table of the tenant's settings ([tenants.NAME])")
        for key in fields:
            if key not in DEFAULTS:
                raise self.error(at + (key,), f"unknown field; known fields: {', '.join(DEFAULTS)}")
        v = {**DEFAULTS, **fields}
        keys = [self.curve_key(at, s) for s in self.items(at, "curve_keys", v, str)]
        uids, gids = self.items(at, "uids", v, int), self.items(at, "gids", v, int)
        if not keys and not uids and not gids:
            raise self.error(at, "no credentials: give at least one of curve_keys, uids, gids")
        if v["shared"] not in SHARED_MODES:
            raise self.error(at + ("shared",), f"got {v['shared']!r}; expected one of \"none\", \"read\", \"write\"")
        for key in ("max_registrations", "max_inflight"):
            if type(v[key]) is not int or v[key] < 1:
                raise self.error(at + (key,), f"got {v[key]!r}; expected an integer >= 1")
        if not isinstance(v["admin"], bool):
            raise self.error(at + ("admin",), f"got {v['admin']!r}; expected true or false")
        sizes = {key: self.size(at + (key,), v[key]) for key in ("l1_min", "l1_max", "l2_disk_max", "l2_valkey_max",
                                                                 "l2_mooncake_max", "engine_window", "hint_budget")}
        if sizes["l1_max"] and sizes["l1_max"] < sizes["l1_min"]:
            raise self.error(at + ("l1_max",), f"{v['l1_max']!r} is less than l1_min ({v['l1_min']!r}); "
                             "expected l1_max >= l1_min, or 0 for no cap")
        return Tenant(
            name=name, curve_keys=frozenset(keys), uids=frozenset(uids), gids=frozenset(gids), shared=v["shared"],
            **sizes, max_registrations=v["max_registrations"], max_inflight=v["max_inflight"], admin=v["admin"])

    def items(self, at: tuple[str, ...], key: str, v: dict[str, Any], kind: type) -> list[Any]:
        what = "strings (z85 public keys or key file paths)" if kind is str else "non-negative integers"
        value = v[key]
        if not isinstance(value, list):
            raise self.error(at + (key,), f"got {value!r}; expected a list of {what}")
        for item in value:
            if type(item) is not kind or (kind is int and item < 0):
                raise self.error(at + (key,), f"got {item!r} in the list; expected a list of {what}")
        return value

    def size(self, keys: tuple[str, ...], value: Any) -> int:
        if not isinstance(value, (int, str)):
            raise self.error(keys, f"got {value!r}; expected bytes (an integer >= 0) or a size such as \"16GiB\"")
        try:
            return parse_size(value)
        except ValueError as e:
            raise self.error(keys, f"{e}; expected bytes (an integer >= 0) or a size such as \"16GiB\"") from None

    def curve_key(self, at: tuple[str, ...], s: str) -> str:
        if _is_z85_key(s):
            return s
        file = os.path.join(self.folder, os.path.expanduser(s))
        if not os.path.isfile(file):
            raise self.error(at + ("curve_keys",), f"{s!r} is neither a z85 public key (40 characters) nor a key "
                             f"file: no file {file}")
        try:
            public, _ = zmq.auth.load_certificate(file)
            key = public.decode("ascii")
        except (OSError, ValueError) as e:
            raise self.error(at + ("curve_keys",), f"cannot read the public key of key file {file}: {e}") from None
        if not _is_z85_key(key):
            raise self.error(at + ("curve_keys",), f"key file {file}: public-key is not a 40-character z85 key")
        return key

    def fits_l1(self, table: TenantTable, l1_bytes: int) -> None:
        """The l1_min of every tenant and of [shared] fit in L1, one by one and together: an l1_min
        is memory other tenants' stores leave alone, and L1 cannot leave alone more than it has."""
        mins = {(("tenants", n) if n != SHARED else (SHARED,)): q.l1_min
                for n, q in [*table.tenants.items(), (SHARED, table.shared)] if q.l1_min}
        l1 = f"L1 (--l1-size {format_size(l1_bytes)})"
        for at, n in mins.items():
            if n > l1_bytes:
                raise self.error(at + ("l1_min",), f"{format_size(n)} is more than {l1}; expected at most L1, "
                                 "and the l1_min of all tenants together within it")
        if sum(mins.values()) > l1_bytes:
            each = ", ".join(f"{at[-1]} {format_size(n)}" for at, n in mins.items())
            raise self.error((), f"the l1_min of all tenants add up to {format_size(sum(mins.values()))} ({each}), "
                             f"more than {l1}; keep their sum within L1 (well below it: others need room too)")
