"""`lmcache-mp-server doctor` on this machine: each check says OK, WARN or FAIL with a fix, and
the exit code is 0 only when a server with the given settings would work here."""

from __future__ import annotations

import re
import socket

import pytest

from lmcache_mp.native import build_info
from lmcache_mp.server.cli import main as cli_main


def doctor(capsys, *args) -> tuple[int, str]:
    rc = cli_main(["doctor", *args])
    return rc, capsys.readouterr().out


def test_the_cpu_device_works_here(capsys, tmp_path):
    rc, out = doctor(capsys, "--device", "cpu", "--url", f"ipc://{tmp_path}/s.sock", "--http-addr", "127.0.0.1:0",
                     "--l1-size", "64MiB", "--l2-disk", str(tmp_path / "new" / "l2"))
    assert rc == 0, out
    assert "[OK  ] build: lmcache-mp" in out and "/dev/shm" in out and "can be bound" in out
    assert "L2 disk" in out and "writable" in out and "would work" in out


@pytest.mark.skipif(build_info()["cuda_devices"] > 0, reason="this machine has a GPU")
def test_the_cuda_device_without_a_gpu_fails_and_says_why(capsys, tmp_path):
    rc, out = doctor(capsys, "--device", "cuda", "--url", f"ipc://{tmp_path}/s.sock", "--http-addr", "off")
    assert rc == 1
    assert "[FAIL]" in out and ("none visible" in out or "CPU only" in out) and "would not work" in out
    assert "->" in out  # with a fix


def test_problems_of_the_settings_are_failures_or_warnings(capsys, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        unwritable = tmp_path / "ro"
        unwritable.mkdir(mode=0o500)
        rc, out = doctor(capsys, "--device", "cpu", "--url", f"tcp://127.0.0.1:{port}", "--http-addr",
                         f"127.0.0.1:{port}", "--l1-size", "100TiB", "--l2-disk", str(unwritable / "l2"),
                         "--l2-redis", f"redis://:pw@127.0.0.1:{port}0"[:-1] + "1")
    assert rc == 1
    lines = out.splitlines()
    assert any(line.startswith("[FAIL] memory") for line in lines)
    assert any(line.startswith("[FAIL] endpoint") for line in lines)
    assert any(line.startswith("[FAIL] HTTP") for line in lines)  # named: the server would refuse it
    assert any(line.startswith("[WARN] L2 valkey") for line in lines) and "pw" not in out
    import os
    if os.geteuid() != 0:  # root writes anywhere
        assert any(line.startswith("[FAIL] L2 disk") for line in lines)


def test_bad_settings_exit_2_before_any_check(capsys):
    with pytest.raises(SystemExit) as e:  # argparse: an invalid choice
        cli_main(["doctor", "--device", "tpu"])
    assert e.value.code == 2
    assert cli_main(["doctor", "--device", "cpu", "--url", "tcp://127.0.0.1"]) == 2


@pytest.mark.parametrize("flag, value, setting", [("--url", "tcp://127.0.0.1:99999", "url"),
                                                   ("--http-addr", "127.0.0.1:99999", "http_addr")])
def test_a_port_out_of_range_is_refused_naming_the_setting(capsys, flag, value, setting):
    assert cli_main(["doctor", "--device", "cpu", flag, value]) == 2  # (ZeroMQ would bind 99999 - 65536)
    err = capsys.readouterr().err
    assert f"port 99999 of '{value}' is out of range" in err and f"({setting} from {flag})" in err, err


def test_a_disk_tier_larger_than_its_disk_is_a_warning(capsys, tmp_path):
    rc, out = doctor(capsys, "--device", "cpu", "--url", f"ipc://{tmp_path}/s.sock", "--http-addr", "off",
                     "--l1-size", "64MiB", "--l2-disk", str(tmp_path / "l2"), "--l2-disk-size", "100000TiB")
    assert rc == 0, out  # it would work: a full disk drops writes, it fails no request
    assert any(line.startswith("[WARN] L2 disk") and "100000.0 TiB" in line for line in out.splitlines()), out


def test_what_the_server_checks_at_start_doctor_fails_in_the_same_words(capsys, tmp_path):
    """doctor runs the server's own start-up checks (server/ops/resources.py): a setting the server
    refuses is a FAIL of doctor's, with the server's message."""
    import subprocess
    import sys

    regular = tmp_path / "a-file"
    regular.write_text("")
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("[tenants.a\n")
    big_min = tmp_path / "big-min.toml"  # (an l1_min larger than L1)
    big_min.write_text('[tenants.a]\nuids = [1]\nl1_min = "128MiB"\n')
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    ipc = ["--url", f"ipc://{tmp_path}/s.sock"]
    cases = [
        (["--url", f"ipc://{tmp_path}/no-such-folder/s.sock"], "its folder"),
        (["--url", f"ipc://{tmp_path}/s.sock", "--ipc-group", "no-such-group-lmc"], "no such group"),
        (["--l2-disk", "/proc/lmcache-l2"], "on a proc filesystem"),
        (["--l2-disk", str(regular)], "exists and is not a folder"),
        (["--l1-size", "100TiB"], "more than this machine's memory allows"),
        ([*ipc, "--curve-secret-key", f"{tmp_path}/keys/server.key_secret"], "--curve-secret-key "),
        ([*ipc, "--curve-secret-key", str(regular)], "not a CURVE key file"),
        ([*ipc, "--tenants", f"{tmp_path}/no-tenants.toml"], "cannot read the tenants file"),
        ([*ipc, "--tenants", str(bad_toml)], "not valid TOML"),
        ([*ipc, "--tenants", str(big_min)], "tenants.a.l1_min: 128.0 MiB is more than L1 (--l1-size 64.0 MiB)"),
        ([*ipc, "--audit-log", f"{tmp_path}/no-such-folder/audit.jsonl"], "does not exist: create it"),
        ([*ipc, "--http-addr", "127.0.0.1:%d" % busy.getsockname()[1]], "cannot serve HTTP on 127.0.0.1:"),
    ]
    for args, says in cases:
        base = ["--device", "cpu", "--http-addr", "off", "--l1-size", "64MiB"]
        rc, out = doctor(capsys, *base, *args)
        assert rc == 1 and any(line.startswith("[FAIL]") and says in line for line in out.splitlines()), (args, out)
        srv = subprocess.run([sys.executable, "-m", "lmcache_mp.server.cli", *base, *args], capture_output=True,
                             text=True, timeout=60)
        assert srv.returncode == 1 and "cannot start: " in srv.stderr and says in srv.stderr, (args, srv.stderr)
        fail = next(line for line in out.splitlines() if line.startswith("[FAIL]"))
        # the same words (but for memory figures, which move between the two looks at the machine)
        assert re.sub(r"[0-9.]+ GiB", "N GiB", fail.split(": ", 1)[1]) in re.sub(r"[0-9.]+ GiB", "N GiB", srv.stderr), \
            (fail, srv.stderr)
    busy.close()


def test_doctor_leaves_no_socket_file_and_names_a_missing_folder(capsys, tmp_path, caplog):
    sock = tmp_path / "s.sock"
    rc, out = doctor(capsys, "--device", "cpu", "--url", f"ipc://{sock}", "--http-addr", "off", "--l1-size", "64MiB")
    assert rc == 0 and "can be bound" in out, out
    assert not sock.exists()  # (a server started later took a file left here for a killed server's, and said so)
    rc, out = doctor(capsys, "--device", "cpu", "--url", f"ipc://{tmp_path}/gone/s.sock", "--http-addr", "off",
                     "--l1-size", "64MiB")
    assert rc == 1 and "does not exist" in out and "another server" not in out, out


def test_a_group_the_servers_user_is_not_in_is_refused_before_anything_is_made(tmp_path):
    """chown() to a group this user is not in fails (EPERM on the socket file, after the bind):
    refused up front, naming the setting and the fix."""
    import grp
    import os

    from lmcache_mp import ServerConfig
    from lmcache_mp.server.ops.resources import check_ipc_group

    mine = set(os.getgroups()) | {os.getegid()}
    other = next((g for g in grp.getgrall() if g.gr_gid not in mine), None)
    if other is None:
        pytest.skip("every group of this machine is this user's")
    config = ServerConfig(url=f"ipc://{tmp_path}/s.sock", device="cpu", ipc_group=other.gr_name)
    if os.geteuid() == 0:
        check_ipc_group(config)  # root may give its files to any group
        return
    with pytest.raises(ValueError, match=f"ipc_group '{other.gr_name}': this server's user .* is not in that group"):
        check_ipc_group(config)


@pytest.mark.parametrize("cuda_build", [False, True])
def test_a_machine_without_gpus_is_no_warning_for_device_auto(monkeypatch, cuda_build):
    """Device auto on a CPU-only machine runs on the CPU, as meant: an OK line, no WARN; device
    cuda there is a FAIL."""
    import io

    from lmcache_mp.server.ops import doctor as d

    monkeypatch.setattr(d, "_gpus", lambda: [])
    for device, status in (("auto", "OK"), ("cpu", "OK"), ("cuda", "FAIL" if cuda_build else None)):
        r = d.Report(io.StringIO())
        d.check_gpus(r, {"cuda": cuda_build, "cuda_architectures": ""}, device)
        out = r.out.getvalue()
        assert "[WARN]" not in out, (device, out)
        if status is not None and out:
            assert out.startswith(f"[{status:4s}]"), (device, out)
    r = d.Report(io.StringIO())
    d.check_gpus(r, {"cuda": cuda_build, "cuda_architectures": ""}, "auto")
    assert "[OK  ] GPUs" in r.out.getvalue() and "CPU" in r.out.getvalue()
