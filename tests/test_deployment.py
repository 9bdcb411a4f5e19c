"""The systemd unit of deploy/ is valid (systemd-analyze verify where it exists) and keeps what the
server needs: the doctor before the start, no locked-memory limit, more stop time than the drain."""

from __future__ import annotations

import configparser
import grp
import os
import pwd
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from lmcache_mp import ServerConfig

UNIT = Path(__file__).parent.parent / "deploy" / "lmcache-mp.service"


def parsed() -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str
    cp.read_string(UNIT.read_text())
    return cp


def test_the_unit_keeps_what_the_server_needs():
    unit = parsed()
    service = unit["Service"]
    assert service["ExecStart"].split()[0].endswith("/lmcache-mp-server")
    assert service["ExecStartPre"].split()[1] == "doctor"
    assert service["LimitMEMLOCK"] == "infinity"
    assert service["KillSignal"] == "SIGTERM"
    assert float(service["TimeoutStopSec"]) > ServerConfig.__dataclass_fields__["drain_timeout"].default
    assert unit["Install"]["WantedBy"] == "multi-user.target"


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="no systemd-analyze here (the parse test runs)")
def test_systemd_analyze_verifies_the_unit(tmp_path):
    script = Path(sys.executable).parent / "lmcache-mp-server"
    text = UNIT.read_text().replace("/opt/lmcache-mp/bin/lmcache-mp-server", str(script))
    text = text.replace("User=lmcache", "User=root").replace("Group=lmcache", "Group=root")
    good, bad = tmp_path / "lmcache-mp.service", tmp_path / "broken.service"
    good.write_text(text)
    bad.write_text(text.replace(str(script), "/nonexistent/lmcache-mp-server"))
    out = subprocess.run(["systemd-analyze", "verify", str(good)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "ignoring" not in out.stderr, out.stderr
    assert subprocess.run(["systemd-analyze", "verify", str(bad)], capture_output=True, timeout=60).returncode != 0


def _recipe() -> tuple[list[str], str]:
    """The systemd recipe of docs/DEPLOYMENT.md: its user and group lines, and its server.toml."""
    text = (UNIT.parent.parent / "docs" / "DEPLOYMENT.md").read_text()
    block = text.split("## systemd", 1)[1].split("```", 2)[1]
    lines = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    accounts = [line for line in lines if line.split(" ", 1)[0] in ("groupadd", "useradd", "usermod")]
    toml = block.split("<<'TOML'\n", 1)[1].split("\nTOML", 1)[0]
    return accounts, toml


def _as_user(user: str) -> list[str]:
    return ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", "--"]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("setpriv"),
                    reason="needs root, useradd and setpriv (CI runs as root)")
def test_the_recipe_and_the_unit_start_a_server_an_engine_of_another_user_reaches(tmp_path):
    """docs/DEPLOYMENT.md's systemd lines run as written (names of the test's own: the user and
    group made and removed here), then the unit's commands as systemd runs them: as User=, with
    the user's groups, RuntimeDirectory made with its mode, EnvironmentFile. The doctor passes,
    the server starts, and a process of another user in the engines' group connects. The
    interpreter is this machine's own (/usr/bin): this one may sit in a folder only root reads."""
    system_python = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    if not os.path.exists(system_python):
        pytest.skip(f"no {system_python} for the server's user to run")
    tag = f"{os.getpid() % 100000}"
    user, group, engine = f"lmcsrv{tag}", f"lmcinf{tag}", f"lmceng{tag}"
    accounts, toml = _recipe()
    assert any(line.startswith("groupadd") for line in accounts), accounts  # the group is made
    root = Path(tempfile.mkdtemp(prefix="lmc-deploy-", dir="/tmp"))  # every user may traverse it
    made: list[tuple[str, str]] = []
    try:
        os.chmod(root, 0o755)
        site = root / "site"  # what the server imports, where its user can read it
        import lmcache_mp
        import msgspec
        import numpy
        import prometheus_client
        import xxhash
        import zmq

        for mod in (lmcache_mp, msgspec, numpy, prometheus_client, xxhash, zmq):
            src = Path(mod.__file__).parent
            shutil.copytree(src, site / src.name, symlinks=True)
        for libs in Path(numpy.__file__).parent.parent.glob("*.libs"):  # vendored shared libraries
            shutil.copytree(libs, site / libs.name, symlinks=True)
        from lmcache_mp import _C

        if not (site / "lmcache_mp" / Path(_C.__file__).name).exists():  # an editable install keeps it apart
            shutil.copy(_C.__file__, site / "lmcache_mp")
        subprocess.run(["useradd", "--system", engine], check=True)
        made.append(("userdel", engine))
        for line in accounts:
            line = re.sub(r"\binference\b", group, line)
            line = re.sub(r"\blmcache\b(?![-.])", user, line).replace('"$ENGINE_USER"', engine)
            subprocess.run(line, shell=True, check=True)
            if line.startswith("groupadd"):
                made.insert(0, ("groupdel", group))
            if line.startswith("useradd"):
                made.insert(0, ("userdel", user))
        run_dir, etc = root / "run" / "lmcache-mp", root / "etc" / "lmcache-mp"
        etc.mkdir(parents=True)
        toml = re.sub(r"\binference\b", group, toml).replace("/run/lmcache-mp", str(run_dir))
        toml = re.sub(r'l1_size = "[^"]*"', 'l1_size = "64MiB"', toml) + '\ndevice = "cpu"\nhttp_addr = "off"\n'
        (etc / "server.toml").write_text(toml)
        service = parsed()["Service"]
        run_dir.mkdir(parents=True, mode=0o700)  # RuntimeDirectory=, owned by User=/Group=, its mode
        assert service["RuntimeDirectory"] == "lmcache-mp"
        os.chown(run_dir, pwd.getpwnam(user).pw_uid, grp.getgrnam(user).gr_gid)
        os.chmod(run_dir, int(service["RuntimeDirectoryMode"], 8))
        env = {"PATH": "/usr/bin:/bin", "HOME": str(root), "PYTHONPATH": str(site), "PYTHONUNBUFFERED": "1"}

        def command(line: str) -> list[str]:
            words = line.replace("/etc/lmcache-mp", str(etc)).split()
            assert words[0] == "/opt/lmcache-mp/bin/lmcache-mp-server"
            return _as_user(user) + [system_python, "-m", "lmcache_mp.server.cli"] + words[1:]

        doctor = subprocess.run(command(service["ExecStartPre"]), env=env, capture_output=True, text=True,
                                timeout=120)
        assert doctor.returncode == 0 and "would work" in doctor.stdout, doctor.stdout + doctor.stderr
        srv = subprocess.Popen(command(service["ExecStart"]), env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
        try:
            lines = []
            for line in srv.stdout:
                lines.append(line)
                if "ready: serving on" in line or "cannot start" in line:
                    break
            assert "ready: serving on" in lines[-1], "".join(lines)
            sock = run_dir / "server.sock"
            st = os.stat(sock)
            assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == grp.getgrnam(group).gr_gid
            probe = ("from lmcache_mp import Client, chunk_hashes; c = Client('ipc://%s', connect_timeout=10); "
                     "print('hits', int(c.lookup(chunk_hashes(list(range(512)), c.chunk_size), model='m'))); c.close()"
                     % sock)
            out = subprocess.run(_as_user(engine) + [system_python, "-c", probe], env=env, capture_output=True,
                                 text=True, timeout=60)
            assert out.returncode == 0 and "hits 0" in out.stdout, out.stdout + out.stderr
        finally:
            srv.send_signal(signal.SIGTERM)  # KillSignal=
            assert srv.wait(float(service["TimeoutStopSec"])) == 0
    finally:
        for cmd, name in made:
            subprocess.run([cmd, name], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
