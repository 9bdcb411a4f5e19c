"""`lmcache-mp-server doctor` on this machine: each check says OK, WARN or FAIL with a fix, and
the exit code is 0 only when a server with the given settings would work here."""

from __future__ import annotations

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
    assert any(line.startswith("[WARN] HTTP") for line in lines)
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
