"""`lmcache-mp-server` as a real subprocess: start-up banner, serving a client, clean shutdown on
SIGTERM, and clear failures on bad settings."""

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lmcache_mp import Client, __version__, chunk_hashes

START_TIMEOUT = 30


def server_command() -> list[str]:
    """The installed console script (next to this interpreter, as in a venv), else the module."""
    script = Path(sys.executable).parent / "lmcache-mp-server"
    if script.exists():
        return [str(script)]
    found = shutil.which("lmcache-mp-server")
    return [found] if found else [sys.executable, "-m", "lmcache_mp.server.cli"]


class ServerProcess:
    """A server subprocess whose log (stderr) is collected line by line."""

    def __init__(self, args, env=None):
        self.proc = subprocess.Popen(server_command() + list(args), env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, text: str, timeout: float = START_TIMEOUT) -> str:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    if text in line:
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"no {text!r} in the server log:\n" + "\n".join(self.lines))
                self._cond.wait(min(left, 0.2))

    def wait_ready(self, timeout: float = START_TIMEOUT) -> str:
        """The URL the server serves on, once it says it is ready."""
        return self.wait_for("ready: serving on", timeout).split("serving on ")[1].strip()

    def log(self) -> str:
        self._reader.join(10)
        return "\n".join(self.lines)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def sock_path(socket_dir):
    return Path(socket_dir) / "srv.sock"


def test_serves_a_client_and_exits_cleanly_on_sigterm(sock_path, shm_files):
    import numpy as np
    import torch

    from lmcache_mp import shared_cpu_tensor

    url = f"ipc://{sock_path}"
    env = dict(os.environ, LMCACHE_MP_CHUNK_SIZE="64", LMCACHE_MP_L1_SIZE="32MiB", PYTHONUNBUFFERED="1")
    srv = ServerProcess(["--url", url, "--device", "cpu", "--chunk-size", "32", "--lease-ttl", "12"], env=env)
    try:
        ready = srv.wait_for("ready: serving on")
        assert url in ready
        banner = "\n".join(srv.lines)
        assert f"lmcache-mp {__version__}" in banner
        assert f"endpoint {url}, L1 32.0 MiB, chunk 32 tokens, device cpu" in banner  # CLI over env
        assert sock_path.exists()

        with Client(url, connect_timeout=5) as client:
            assert client.chunk_size == 32
            assert client.server_info["device"] == "cpu"
            status = client.status()
            assert status["pid"] == srv.proc.pid
            assert status["l1"]["capacity"] == 32 << 20  # from the environment
            assert status["gc"]["settled"] == 1  # start-up's objects, out of the collector
            kv = [shared_cpu_tensor((2, 16, 8, 2, 4), torch.float16)]
            kv[0].copy_(torch.arange(kv[0].numel(), dtype=torch.float32).reshape(kv[0].shape).half())
            handle = client.register_kv_cache(kv, model="cli")
            assert client.status()["gc"]["settled"] == 2  # and the registration's
            hashes = chunk_hashes(np.arange(64), client.chunk_size)
            assert client.store(handle, hashes, [0, 1, 2, 3, 4, 5, 6, 7]).result(10).stored == 2
            assert client.lookup(hashes, model="cli") == 2
            assert client.retrieve(handle, hashes, [8, 9, 10, 11, 12, 13, 14, 15]).result(10).loaded == 2
            assert torch.equal(kv[0][:, 8:16], kv[0][:, 0:8])
            del kv

        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(20) == 0
        log = srv.log()
        assert "received SIGTERM" in log and "stopped" in log
        assert log.index("gave L1's 32.0 MiB back to the machine") < log.index("INFO lmcache_mp.server.server: stopped")
        assert "Traceback" not in log, log
        assert not sock_path.exists(), "the ipc socket file was left behind"
    finally:
        srv.kill()


def test_the_start_up_lines_say_the_device_chosen_and_why_the_slabs_are_smaller(sock_path):
    from lmcache_mp.server.copies.devices import resolve_device

    srv = ServerProcess(["--url", f"ipc://{sock_path}", "--l1-size", "1GiB", "--slab-size", "3GiB", "--http-addr",
                         "off"])  # --device auto, the default
    try:
        srv.wait_ready()
        banner = "\n".join(srv.lines)
        assert f"chunk 256 tokens, device {resolve_device('auto')} (auto), transfer mode auto" in banner
        assert "slabs of 64.0 MiB, not the 3.0 GiB set: a slab is at most L1/16" in banner
    finally:
        srv.proc.terminate()
        srv.proc.wait(20)
        srv.kill()


def test_sigint_also_stops_it(sock_path):
    srv = ServerProcess(["--url", f"ipc://{sock_path}", "--device", "cpu", "--l1-size", "16MiB"])
    try:
        srv.wait_ready()
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(20) == 0
        assert not sock_path.exists()
    finally:
        srv.kill()


def test_config_file(sock_path, tmp_path):
    conf = tmp_path / "server.toml"
    conf.write_text(f'[server]\nurl = "ipc://{sock_path}"\ndevice = "cpu"\nl1_size = "16MiB"\nchunk_size = 48\n')
    srv = ServerProcess(["--config", str(conf)])
    try:
        srv.wait_ready()
        with Client(f"ipc://{sock_path}") as client:
            assert client.chunk_size == 48
        srv.proc.terminate()
        assert srv.proc.wait(20) == 0
    finally:
        srv.kill()


@pytest.mark.parametrize("args, env, message", [
    (["--bogus"], {}, "unrecognized arguments: --bogus"),
    (["--chunk-size", "many"], {}, "argument --chunk-size: invalid int value"),
    (["--l1-size", "lots"], {}, "not a size"),
    (["--device", "tpu"], {}, "argument --device: invalid choice: 'tpu' (choose from 'auto', 'cpu', 'cuda')"),
    (["--log-level", "verbose"], {}, "argument --log-level: invalid choice: 'VERBOSE'"),
    ([], {"LMCACHE_MP_DEVICE": "tpu"}, "device must be one of"),
    ([], {"LMCACHE_MP_L1_SIZ": "1GiB"}, "environment variable LMCACHE_MP_L1_SIZ: no such setting (did you mean "
                                        "LMCACHE_MP_L1_SIZE?)"),
    (["--url", "tcp://127.0.0.1"], {}, "url 'tcp://127.0.0.1' is not tcp://HOST:PORT (a port is needed"),
    (["--url", "tcp://::1:5555"], {}, "an IPv6 address goes in brackets: tcp://[::1]:5555"),
    (["--config", "/nonexistent/lmcache.toml"], {}, "config file /nonexistent/lmcache.toml: no such file"),
    ([], {"LMCACHE_MP_CHUNK_SIZE": "abc"}, "LMCACHE_MP_CHUNK_SIZE: chunk_size must be an integer"),
    ([], {"LMCACHE_MP_L1_SIZE": "lots"}, "LMCACHE_MP_L1_SIZE: l1_size: not a size: 'lots'"),
    (["--local-lane", "maybe"], {}, "unrecognized arguments: maybe"),  # a switch takes no value
    ([], {"LMCACHE_MP_LOCAL_LANE": "maybe"}, "LMCACHE_MP_LOCAL_LANE: local_lane must be on or off"),
    (["--l1-size", "-5GiB"], {}, "l1_size: size must not be negative, got '-5GiB'"),  # argparse took it for a flag
    (["--url", "tcp://127.0.0.1:99999"], {}, "port 99999 of 'tcp://127.0.0.1:99999' is out of range (0-65535; 0 "
                                             "picks a free one) (url from --url)"),
    (["--http-addr", "127.0.0.1:99999"], {}, "port 99999 of '127.0.0.1:99999' is out of range (0-65535; 0 picks a "
                                             "free one) (http_addr from --http-addr)"),
], ids=["unknown-flag", "bad-int", "bad-size", "bad-device", "bad-log-level", "bad-env-device", "env-typo",
        "url-without-port", "ipv6-without-brackets", "missing-config", "bad-env",
        "bad-env-size", "switch-with-a-value", "bad-env-switch", "negative-size", "url-port-out-of-range",
        "http-port-out-of-range"])
def test_bad_settings_exit_2_with_a_message(args, env, message):
    out = subprocess.run(server_command() + args, env=dict(os.environ, **env), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert message in out.stderr
    assert "Traceback" not in out.stderr
    assert "lmcache-mp-server" in out.stderr  # says who is complaining
    assert len(out.stderr.splitlines()) <= 2, out.stderr  # a short usage line at most, not every flag


def test_an_endpoint_in_use_fails_with_a_clear_message(sock_path):
    first = ServerProcess(["--url", "tcp://127.0.0.1:0", "--device", "cpu", "--l1-size", "16MiB"])
    try:
        url = first.wait_ready()
        out = subprocess.run(server_command() + ["--url", url, "--device", "cpu", "--l1-size", "16MiB"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 1
        assert "cannot start" in out.stderr and "Traceback" not in out.stderr
    finally:
        first.proc.terminate()
        first.proc.wait(20)
        first.kill()


def test_sighup_without_tenants_is_logged_and_the_server_serves_on(sock_path):
    """SIGHUP's default action ended the process (rc 129, no log line); a server without a tenants
    file has nothing to reload and says so."""
    srv = ServerProcess(["--url", f"ipc://{sock_path}", "--device", "cpu", "--l1-size", "16MiB", "--http-addr", "off"])
    try:
        url = srv.wait_ready()
        srv.proc.send_signal(signal.SIGHUP)
        assert "nothing to reload" in srv.wait_for("received SIGHUP")
        assert srv.proc.poll() is None
        with Client(url, connect_timeout=30) as c:
            assert c.chunk_size > 0
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0
    finally:
        srv.kill()


def test_version_and_help():
    out = subprocess.run(server_command() + ["--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and __version__ in out.stdout
    out = subprocess.run(server_command() + ["--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for flag in ("--l1-size", "--chunk-size", "--heartbeat-timeout", "--config", "LMCACHE_MP_"):
        assert flag in out.stdout


def test_help_groups_every_setting_and_explains_the_obscure_ones(capsys):
    """--help was one flat list of 50 flags: now in groups, each setting in exactly one; the settings
    a new user could not read (--slab-size, --l2-queue-size, --direct-ctas) say what they do."""
    import dataclasses
    import re

    from lmcache_mp import ServerConfig
    from lmcache_mp.server.cli import GROUPS, _parser

    grouped = [name for _, _, names in GROUPS for name in names]
    assert sorted(grouped) == sorted(f.name for f in dataclasses.fields(ServerConfig)), "a setting in no group"
    _parser().print_help()
    text = capsys.readouterr().out
    sections = re.split(r"\n(?=\S[^\n]*:\n)", text)  # "title:" lines start the groups
    titles = [sec.split(":\n", 1)[0] for sec in sections[1:]]
    assert titles[titles.index("options"):] == ["options"] + [t for t, _, _ in GROUPS], titles
    assert "other:" not in text
    for title, _, names in GROUPS:
        section = next(sec for sec in sections if sec.startswith(title + ":"))
        for name in names:
            assert "--" + name.replace("_", "-") in section, (title, name)
    flat = " ".join(text.split())
    assert "each cut into slots of one chunk size" in flat and "moves between chunk sizes a whole slab" in flat
    assert "so that eviction finds them written" in flat and "absorbs longer bursts" in flat
    assert "thread blocks (CTAs)" in flat and "an SM the engine loses" in flat


def test_switches_turn_on_and_off(capsys):
    from lmcache_mp.server.cli import _parser

    ap = _parser()
    assert vars(ap.parse_args(["--no-local-lane"]))["local_lane"] is False
    assert vars(ap.parse_args(["--local-lane", "--l2-redis-cluster"]))["l2_redis_cluster"] is True
    assert vars(ap.parse_args([]))["local_lane"] is None  # not given: the environment, file or default decide
    ap.print_help()
    text = capsys.readouterr().out
    assert "--local-lane, --no-local-lane" in text and "LOCAL_LANE" not in text


def test_doctor_help_is_the_doctors():
    out = subprocess.run(server_command() + ["doctor", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert out.stdout.startswith("usage: lmcache-mp-server doctor")
    assert "would work on this machine" in out.stdout and "--l1-size" in out.stdout


def test_an_l1_larger_than_the_machine_says_how_much_memory_there_is(sock_path):
    out = subprocess.run(server_command() + ["--url", f"ipc://{sock_path}", "--device", "cpu", "--http-addr", "off",
                                             "--l1-size", "100TiB"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    assert "cannot start: --l1-size 100.0 TiB is more than this machine's memory allows: this machine has" in out.stderr
    assert "GiB of memory" in out.stderr and "Traceback" not in out.stderr


def test_a_taken_http_address_names_the_flag(sock_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        addr = "127.0.0.1:%d" % s.getsockname()[1]
        out = subprocess.run(server_command() + ["--url", f"ipc://{sock_path}", "--device", "cpu", "--l1-size", "16MiB",
                                                 "--http-addr", addr], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert f"cannot serve HTTP on {addr} (--http-addr)" in out.stderr


def test_a_taken_default_http_address_named_explicitly_is_refused(sock_path):
    """Left to its default, a taken HTTP address is a warning (another server on this machine has
    it) and the server serves HTTP on a free port, which it names; named by a setting, the server
    would otherwise run on while the probes meant for it reach the other one."""
    import socket

    from lmcache_mp.config import DEFAULT_HTTP_ADDR, parse_addr

    with socket.socket() as s:
        try:
            s.bind(parse_addr(DEFAULT_HTTP_ADDR))
        except OSError:
            pytest.skip(f"{DEFAULT_HTTP_ADDR} is taken here")
        s.listen(1)
        base = ["--url", f"ipc://{sock_path}", "--device", "cpu", "--l1-size", "16MiB"]
        out = subprocess.run(server_command() + base + ["--http-addr", DEFAULT_HTTP_ADDR], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 1 and f"cannot serve HTTP on {DEFAULT_HTTP_ADDR} (--http-addr)" in out.stderr
        srv = ServerProcess(base)  # the default: a warning, and the server serves
        try:
            srv.wait_ready()
            line = next(line for line in srv.lines if f"HTTP: {DEFAULT_HTTP_ADDR} is taken" in line)
            assert "another process (not an lmcache-mp server) answers there" in line and "--http-addr" in line, line
        finally:
            srv.kill()


def test_the_start_up_line_says_a_slab_size_was_set_only_when_it_was(sock_path):
    for args, says in ((["--slab-size", "256MiB"], "slabs of 64.0 MiB, not the 256.0 MiB set: a slab is at most L1/16"),
                       ([], "slabs of 64.0 MiB: at most L1/16")):
        srv = ServerProcess(["--url", f"ipc://{sock_path}", "--device", "cpu", "--l1-size", "1GiB", "--http-addr",
                             "off", *args])
        try:
            assert says in srv.wait_for("L1: ")
        finally:
            srv.kill()


def test_keygen_adds_a_second_clients_key_pair(tmp_path, capsys):
    from lmcache_mp.server.cli import main as cli_main

    keys = tmp_path / "keys"
    assert cli_main(["keygen", str(keys)]) == 0
    assert cli_main(["keygen", str(keys)]) == 1 and "--client NAME" in capsys.readouterr().err
    assert cli_main(["keygen", str(keys), "--client", "engine-b"]) == 0
    assert (keys / "clients" / "engine-b.key").exists() and (keys / "client-secret" / "engine-b.key_secret").exists()
    out = capsys.readouterr().out
    assert "engine-b.key_secret" in out
    # with --tenants, --curve-clients is refused: the tenants file takes the key, and SIGHUP reloads it
    assert f"{keys}/clients/engine-b.key is in a tenant's curve_keys" in out and "SIGHUP" in out, out
    # public keys are for others to read, secret keys this user's only
    import stat

    modes = {p.relative_to(keys).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in keys.rglob("*")}
    assert modes["server.key"] == modes["clients/client.key"] == modes["clients/engine-b.key"] == 0o644, modes
    assert modes["server.key_secret"] == modes["client-secret/engine-b.key_secret"] == 0o600, modes
    assert modes["client-secret"] == 0o700, modes
    assert cli_main(["keygen", str(keys), "--client", "engine-b"]) == 1  # never overwritten
    assert cli_main(["keygen", str(tmp_path / "none"), "--client", "x"]) == 1  # no server keys there
