"""The tenants file (`--tenants FILE`): parsed values and defaults, lookups by credential, and
the `<file>:<line>: tenants.<name>.<field>` messages of every kind of mistake."""

from __future__ import annotations

import hashlib
import os
import textwrap
from pathlib import Path

import pytest
import zmq
import zmq.auth
from zmq.utils import z85

from lmcache_mp.server.tenancy.tenants_file import (
    SHARED,
    Tenant,
    TenantsFileError,
    TenantTable,
    credential_fingerprint,
    load_tenants,
)

GiB = 1 << 30
KEY_A = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
KEY_B = zmq.curve_keypair()[0].decode()


def write(tmp_path: Path, text: str, name: str = "tenants.toml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return str(path)


def public_key_file(folder: Path, name: str) -> tuple[str, str]:
    """A zmq key pair in `folder`: the public key file's path and its z85 key."""
    folder.mkdir(parents=True, exist_ok=True)
    public_file, _ = zmq.auth.create_certificates(str(folder), name)
    return public_file, zmq.auth.load_certificate(public_file)[0].decode()


def load_error(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(TenantsFileError) as e:
        load_tenants(path)
    return str(e.value)


def test_every_field_and_the_defaults(tmp_path):
    _, alice_file_key = public_key_file(tmp_path / "keys", "alice")
    path = write(tmp_path, f"""
        # tenants of the test server
        [tenants.alice]
        curve_keys = ["{KEY_A}", "keys/alice.key"]
        uids = [1001, 1002]
        gids = [2001]
        shared = "read"
        l1_min = "4GiB"
        l1_max = "16GiB"
        l2_disk_max = 1000
        max_registrations = 16
        max_inflight = 256
        admin = true

        [tenants.bob]
        uids = [1003]
    """)
    table = load_tenants(path)
    assert isinstance(table, TenantTable) and table.path == path and len(table) == 2
    assert list(table.tenants) == ["alice", "bob"]
    assert table.tenants["alice"] == Tenant(
        name="alice", curve_keys=frozenset({KEY_A, alice_file_key}), uids=frozenset({1001, 1002}),
        gids=frozenset({2001}), shared="read", l1_min=4 * GiB, l1_max=16 * GiB, l2_disk_max=1000,
        max_registrations=16, max_inflight=256, admin=True)
    assert table.tenants["bob"] == Tenant(
        name="bob", curve_keys=frozenset(), uids=frozenset({1003}), gids=frozenset(), shared="none", l1_min=0,
        l1_max=0, l2_disk_max=0, max_registrations=64, max_inflight=1024, admin=False)


def test_key_file_is_relative_to_the_tenants_file_not_the_cwd(tmp_path, monkeypatch):
    key_file, key = public_key_file(tmp_path / "conf" / "keys", "carol")
    path = write(tmp_path / "conf", '[tenants.carol]\ncurve_keys = ["keys/carol.key"]\n')
    monkeypatch.chdir(tmp_path)
    assert load_tenants(path).tenants["carol"].curve_keys == {key}
    abs_path = write(tmp_path, f'[tenants.carol]\ncurve_keys = ["{key_file}"]\n', "abs.toml")
    assert load_tenants(abs_path).tenants["carol"].curve_keys == {key}


@pytest.mark.parametrize("shared, reads, writes", [("none", False, False), ("read", True, False),
                                                   ("write", True, True)])
def test_shared_modes(tmp_path, shared, reads, writes):
    tenant = load_tenants(write(tmp_path, f'[tenants.a]\nuids = [1]\nshared = "{shared}"\n')).tenants["a"]
    assert (tenant.reads_shared, tenant.writes_shared) == (reads, writes)


def test_names_quoted_and_inline_tables(tmp_path):
    path = write(tmp_path, """
        [tenants]
        team-1 = { uids = [7] }
        "a.b" = { gids = [8], admin = true }
        c_2.uids = [9]
    """)
    table = load_tenants(path)
    assert list(table.tenants) == ["team-1", "a.b", "c_2"]
    assert table.tenants["a.b"].admin and table.tenants["c_2"].uids == {9}


def test_lookups(tmp_path):
    path = write(tmp_path, f"""
        [tenants.alice]
        curve_keys = ["{KEY_A}"]
        uids = [1001]
        [tenants.bob]
        curve_keys = ["{KEY_B}"]
        gids = [2001]
        [tenants.carol]
        uids = [1002]
    """)
    table = load_tenants(path)
    assert table.by_curve_key(KEY_A).name == "alice"
    assert table.by_curve_key(KEY_B.encode()).name == "bob"
    assert table.by_curve_key("x" * 40) is None
    assert table.by_peer(1001, 2001).name == "alice"  # the uid wins over the gid
    assert table.by_peer(5000, 2001).name == "bob"
    assert table.by_peer(1002, 0).name == "carol"
    assert table.by_peer(5000, 5000) is None
    assert table.credentials() == {f"curve:{KEY_A}": "alice", "uid:1001": "alice", f"curve:{KEY_B}": "bob",
                                   "gid:2001": "bob", "uid:1002": "carol"}


def test_credential_fingerprint():
    expected = hashlib.sha256(z85.decode(KEY_A.encode())).hexdigest()[:12]
    assert len(z85.decode(KEY_A.encode())) == 32
    assert credential_fingerprint(f"curve:{KEY_A}") == f"curve:{expected}"
    assert credential_fingerprint("uid:1001") == "uid:1001"
    assert credential_fingerprint("gid:5") == "gid:5"


def test_shared_is_reserved():
    assert SHARED == "shared"


# (file text, line of the error, text the message must hold)
ERRORS = [
    ('[tenants.a]\nuids = [1\n', 2, "not valid TOML"),
    ('[tenants.a]\nuids = [1]\n[server]\nport = 1\n', 3, "server: unknown top-level key"),
    ('top = 1\n[tenants.a]\nuids = [1]\n', 1, "top: unknown top-level key"),
    ('# nothing\n[tenants]\n', 2, "tenants: no tenants"),
    ('tenants = 3\n', 1, "tenants: must be a table"),
    ('[tenants.a]\nuids = [1]\n[tenants."bad name"]\nuids = [2]\n', 3, "tenants.bad name: bad tenant name"),
    (f'[tenants.{"x" * 65}]\nuids = [2]\n', 1, "bad tenant name"),
    ('[tenants.shared]\nuids = [2]\n', 1, "tenants.shared: 'shared' is the reserved name"),
    ('[tenants]\na = 3\n', 2, "tenants.a: must be a table"),
    ('[tenants.a]\nuids = [1]\nl1_size = 5\n', 3, "tenants.a.l1_size: unknown field; known fields: curve_keys"),
    ('[tenants.a]\nuids = [1]\n[tenants.a.extra]\nx = 1\n', 3, "tenants.a.extra: unknown field"),
    ('[tenants.a]\nuids = 1001\n', 2, "tenants.a.uids: got 1001; expected a list of non-negative integers"),
    ('[tenants.a]\nuids = [1, -2]\n', 2, "tenants.a.uids: got -2"),
    ('[tenants.a]\nuids = [1]\ngids = [true]\n', 3, "tenants.a.gids: got True"),
    ('[tenants.a]\nuids = [1]\ngids = ["5"]\n', 3, "tenants.a.gids: got '5'"),
    ('[tenants.a]\ncurve_keys = "k"\n', 2, "tenants.a.curve_keys: got 'k'; expected a list of strings"),
    ('[tenants.a]\ncurve_keys = [5]\n', 2, "tenants.a.curve_keys: got 5 in the list"),
    ('[tenants.a]\nuids = [1]\nshared = "all"\n', 3, "tenants.a.shared: got 'all'; expected one of"),
    ('[tenants.a]\nuids = [1]\nshared = true\n', 3, "tenants.a.shared: got True"),
    ('[tenants.a]\nuids = [1]\nl1_min = "4 parsecs"\n', 3, "tenants.a.l1_min: not a size"),
    ('[tenants.a]\nuids = [1]\nl1_max = -1\n', 3, "tenants.a.l1_max: size must not be negative"),
    ('[tenants.a]\nuids = [1]\nl2_disk_max = 1.5\n', 3, "tenants.a.l2_disk_max: got 1.5; expected bytes"),
    ('[tenants.a]\nuids = [1]\nl2_disk_max = false\n', 3, "tenants.a.l2_disk_max: not a size"),
    ('[tenants.a]\nuids = [1]\nl1_min = "8GiB"\n\nl1_max = "4GiB"\n', 5, "tenants.a.l1_max: '4GiB' is less than"),
    ('[tenants.a]\nuids = [1]\nmax_registrations = 0\n', 3, "tenants.a.max_registrations: got 0; expected an int"),
    ('[tenants.a]\nuids = [1]\nmax_inflight = "8"\n', 3, "tenants.a.max_inflight: got '8'"),
    ('[tenants.a]\nuids = [1]\nmax_inflight = true\n', 3, "tenants.a.max_inflight: got True"),
    ('[tenants.a]\nuids = [1]\nadmin = "yes"\n', 3, "tenants.a.admin: got 'yes'; expected true or false"),
    ('[tenants.a]\nuids = [1]\n\n[tenants.b]\nshared = "read"\n', 4, "tenants.b: no credentials"),
    ('[tenants.b]\ncurve_keys = []\nuids = []\n', 1, "tenants.b: no credentials"),
    ('[tenants.a]\ncurve_keys = ["short"]\n', 2, "tenants.a.curve_keys: 'short' is neither a z85 public key"),
    (f'[tenants.a]\ncurve_keys = ["{"~" * 40}"]\n', 2, "is neither a z85 public key"),
    ('[tenants.a]\ncurve_keys = ["keys/none.key"]\n', 2, "no file "),
    ('[tenants.a]\nuids = [1]\n[tenants.b]\nuids = [2, 1]\n', 4,
     "tenants.b.uids: uid:1 is also a credential of tenant 'a'"),
    ('[tenants.a]\ngids = [5]\n[tenants.b]\nuids = [5]\ngids = [5]\n', 5, "tenants.b.gids: gid:5 is also"),
    (f'[tenants.a]\ncurve_keys = ["{KEY_A}"]\n[tenants.b]\n\ncurve_keys = ["{KEY_A}"]\n', 5,
     f"tenants.b.curve_keys: {credential_fingerprint('curve:' + KEY_A)} is also a credential of tenant 'a'"),
    ('[tenants]\nx = { uids = [1], color = "red" }\n', 2, "tenants.x.color: unknown field"),
    ('[tenants]\nx.uids = [1]\nx.admin = 1\n', 3, "tenants.x.admin: got 1"),
    ('[tenants."q.r"]\nuids = [1]\n\nadmin = 0\n', 4, "tenants.q.r.admin: got 0"),
]


@pytest.mark.parametrize("text, line, message", ERRORS)
def test_errors_name_file_line_and_field(tmp_path, text, line, message):
    error = load_error(tmp_path, text)
    assert error.startswith(f"{tmp_path / 'tenants.toml'}:{line}: "), error
    assert message in error, error


def test_toml_error_keeps_the_column(tmp_path):
    error = load_error(tmp_path, '[tenants.a]\nuids = [1]\nadmin = tru\n')
    assert error.startswith(f"{tmp_path / 'tenants.toml'}:3: not valid TOML: ") and "(column 9)" in error
    assert "at line" not in error


def test_bad_key_files(tmp_path):
    (tmp_path / "garbage.key").write_text("not a certificate\n")
    error = load_error(tmp_path, '[tenants.a]\nuids = [1]\ncurve_keys = ["garbage.key"]\n')
    assert error.startswith(f"{tmp_path / 'tenants.toml'}:3: tenants.a.curve_keys: cannot read the public key")
    assert str(tmp_path / "garbage.key") in error
    (tmp_path / "bad.key").write_text('public-key = "abc"\n')
    error = load_error(tmp_path, '[tenants.a]\ncurve_keys = ["bad.key"]\n')
    assert f"{tmp_path / 'bad.key'}: public-key is not a 40-character z85 key" in error
    error = load_error(tmp_path, '[tenants.a]\ncurve_keys = ["missing/x.key"]\n')
    assert str(tmp_path / "missing" / "x.key") in error


def test_a_key_file_and_an_inline_key_for_two_tenants_clash(tmp_path):
    _, key = public_key_file(tmp_path / "keys", "alice")
    error = load_error(tmp_path, f'[tenants.a]\ncurve_keys = ["keys/alice.key"]\n[tenants.b]\ncurve_keys = ["{key}"]\n')
    assert ":4: tenants.b.curve_keys:" in error and "tenant 'a'" in error


@pytest.mark.parametrize("setup, message", [
    (lambda p: None, "cannot read the tenants file"),
    (lambda p: os.mkdir(p), "cannot read the tenants file"),
    (lambda p: Path(p).write_bytes(b"[tenants.a]\nuids = [1]\n# \xff\xfe\n"), "not UTF-8"),
    (lambda p: Path(p).write_text(""), "no tenants"),
    (lambda p: Path(p).write_text("[tenants.a]\nuids = [1]\nuids = [2]\n"), "not valid TOML"),
])
def test_file_level_errors_are_tenants_file_errors(tmp_path, setup, message):
    path = str(tmp_path / "tenants.toml")
    setup(path)
    with pytest.raises(TenantsFileError, match=message) as e:
        load_tenants(path)
    assert str(e.value).startswith(path)


def test_the_l1_min_of_all_tenants_fit_in_l1(tmp_path):
    # (issue 49 3.3: an l1_min larger than L1 was taken without a word; so was a sum larger than L1)
    text = """
        [tenants.a]
        uids = [1]
        l1_min = "{a}"
        [tenants.b]
        uids = [2]
        l1_min = "{b}"
        [shared]
        l1_min = "{s}"
    """
    path = write(tmp_path, text.format(a="3GiB", b="3GiB", s="2GiB"))
    assert load_tenants(path, l1_bytes=8 * GiB).tenants["a"].l1_min == 3 * GiB  # all of L1: allowed
    assert load_tenants(path).tenants["a"].l1_min == 3 * GiB  # (no L1 given: not checked)
    with pytest.raises(TenantsFileError) as e:
        load_tenants(path, l1_bytes=7 * GiB)
    assert str(e.value) == (f"{path}: the l1_min of all tenants add up to 8.0 GiB (a 3.0 GiB, b 3.0 GiB, shared "
                            "2.0 GiB), more than L1 (--l1-size 7.0 GiB); keep their sum within L1 (well below it: "
                            "others need room too)")
    path = write(tmp_path, text.format(a="1GiB", b="9GiB", s="0"))
    with pytest.raises(TenantsFileError) as e:
        load_tenants(path, l1_bytes=8 * GiB)
    assert str(e.value).startswith(f"{path}:6: tenants.b.l1_min: 9.0 GiB is more than L1 (--l1-size 8.0 GiB)")
