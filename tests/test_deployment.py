"""The systemd unit of deploy/ is valid (systemd-analyze verify where it exists) and keeps what the
server needs: the doctor before the start, no locked-memory limit, more stop time than the drain."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
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
