"""`lmcache-mp-bench` as a user runs it: the console script against a `lmcache-mp-server`
subprocess, in an environment without torch, and when the run ends badly (the server killed, a
Ctrl-C, a SIGTERM, a bad --url): an exit status, one line that says why, and nothing left behind
(no process of the bench's session, no echo folder, no shared-memory file of its workers)."""

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from test_cli import ServerProcess

SMALL = ["--workers", "2", "--layers", "2", "--heads", "2", "--head-size", "64", "--chunks", "4", "--requests", "2"]
EXIT_AFTER_S = 45  # a run whose server died waited out its requests' 300 s timeout before
WAIT_S = 120  # generous: how long a loaded machine may take to get a run to a phase


def bench_command() -> list[str]:
    script = Path(sys.executable).parent / "lmcache-mp-bench"
    if script.exists():
        return [str(script)]
    found = shutil.which("lmcache-mp-bench")
    return [found] if found else [sys.executable, "-m", "lmcache_mp.loadgen.cli"]


@pytest.fixture
def without_torch(tmp_path):
    """An environment in which `import torch` fails, as after `pip install .` (the bench's workers
    inherit it)."""
    blocked = tmp_path / "no-torch" / "torch"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    env = dict(os.environ, PYTHONPATH=str(blocked.parent))
    check = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True)
    assert check.returncode != 0 and "No module named 'torch'" in check.stderr
    return env


@pytest.fixture
def server(request):
    """A server subprocess; parametrized indirectly, extra flags."""
    srv = ServerProcess(["--url", "tcp://127.0.0.1:0", "--device", "cpu", "--l1-size", "256MiB", "--chunk-size", "64",
                         "--http-addr", "off", *getattr(request, "param", ())])
    try:
        srv.url = srv.wait_ready()
        yield srv
    finally:
        if srv.proc.poll() is None:
            srv.proc.terminate()
            srv.proc.wait(30)
        srv.kill()


class Bench:
    """The console script in a session of its own (so that its processes can be found, and a
    Ctrl-C sent to its process group as a terminal does); its output read line by line."""

    def __init__(self, args, env=None):
        self.proc = subprocess.Popen(bench_command() + list(args), env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.lines: list[str] = []
        self.err: list[str] = []
        self._cond = threading.Condition()
        self._readers = [threading.Thread(target=self._read, args=(stream, into), daemon=True)
                         for stream, into in ((self.proc.stdout, self.lines), (self.proc.stderr, self.err))]
        for reader in self._readers:
            reader.start()

    def _read(self, stream, into: list[str]):
        for line in stream:
            with self._cond:
                into.append(line.rstrip("\n"))
                self._cond.notify_all()

    def wait_for(self, text: str) -> None:
        deadline = time.monotonic() + WAIT_S
        with self._cond:
            while not any(text in line for line in self.lines):
                assert time.monotonic() < deadline and self.proc.poll() is None, (
                    f"no {text!r} from the bench:\n" + "\n".join(self.lines + self.err))
                self._cond.wait(0.2)

    def finish(self) -> tuple[int, str]:
        """Exit status and stderr (a helper left running may hold stderr open: not waited for)."""
        try:
            rc = self.proc.wait(WAIT_S)
            self.ended = time.monotonic()
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            pytest.fail(f"the bench did not end within {WAIT_S} s:\n" + "\n".join(self.lines + self.err))
        for reader in self._readers:
            reader.join(5)
        with self._cond:
            return rc, "\n".join(self.err)

    def kill(self) -> None:
        """What is left of the bench's session, when a test failed before it ended."""
        for pid in [self.proc.pid, *self.helpers()]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)

    def helpers(self) -> dict[int, str]:
        """pid -> command line of every live process of the bench's session but the bench."""
        found = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == self.proc.pid:
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...
            if int(fields[3]) == self.proc.pid and fields[0] != "Z":
                found[int(entry)] = cmdline
        return found


@pytest.fixture
def benches():
    """Starts Bench runs; whatever a failed test left of them is killed."""
    started: list[Bench] = []

    def start(args, env=None) -> Bench:
        started.append(Bench(args, env))
        return started[-1]

    yield start
    for bench in started:
        bench.kill()


def echo_folder(helpers: dict[int, str]) -> Path:
    urls = [arg for cmd in helpers.values() for arg in cmd.split() if arg.startswith("ipc:///")]
    assert len(urls) == 1, helpers  # the echo peer's socket
    return Path(urls[0][len("ipc://"):]).parent


def assert_nothing_left(bench: Bench, helpers: dict[int, str]) -> None:
    """No process of the bench's session (workers, echo peer) stays: none reparented to init."""
    folder = echo_folder(helpers)
    deadline = time.monotonic() + 30
    while bench.helpers() and time.monotonic() < deadline:  # (the resource tracker exits after the bench)
        time.sleep(0.2)
    assert not bench.helpers(), bench.helpers()
    assert not folder.exists(), f"{folder} was left behind"
    left = [f for f in os.listdir("/dev/shm") if any(f.startswith(f"lmcache_mp_{pid}_") for pid in helpers)]
    assert not left, f"shared-memory files of the workers were left behind: {left}"


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_run_in_an_environment_without_torch(server, without_torch, benches):
    bench = benches(["--url", server.url, *SMALL, "--lookups", "20"], env=without_torch)
    rc, err = bench.finish()
    out = "\n".join(bench.lines)
    assert rc == 0, out + err
    assert "verify: 16 chunks checked, 0 missing, 0 mismatching" in out
    assert "torch" not in err and "Traceback" not in err, err


# With the local lane, a lookup in flight fails once the lane closes; without, only the bench's
# watch on the server ends the run before the workers' requests time out.
@pytest.mark.parametrize("server", [(), ("--no-local-lane",)], ids=["lane", "zeromq-only"], indirect=True)
def test_a_server_killed_mid_run_ends_the_run_within_seconds_naming_the_worker_and_phase(server, benches):
    bench = benches(["--url", server.url, *SMALL, "--lookups", "100000000"])  # lookups until stopped
    bench.wait_for("store: ")  # every worker stored: on to the lookups
    helpers = bench.helpers()
    server.proc.kill()
    killed = time.monotonic()
    rc, err = bench.finish()
    took = bench.ended - killed
    assert rc == 1, err
    assert took < EXIT_AFTER_S, f"the bench took {took:.0f} s to end after the server was killed"
    line = one_line(err)
    # (worker 0 may still be between store and lookup: it asks the server which transfer mode each used;
    # the first worker to fail may be the only one: the others are cut short, and no cause of their own)
    assert re.match(r"lmcache-mp-bench: (workers 0, 1|worker [01]) of 2 failed in the (lookup phase|store phase|"
                    r"store \(worker 0\) and lookup \(worker 1\) phases): .*server", line), line
    assert_nothing_left(bench, helpers)


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_a_stopped_run_says_so_in_one_line_and_leaves_nothing(server, how, benches):
    bench = benches(["--url", server.url, *SMALL, "--lookups", "100000000"])
    bench.wait_for("store: ")
    helpers = bench.helpers()
    assert len(helpers) >= 3, helpers  # two workers and the echo peer (and multiprocessing's resource tracker)
    if how == "ctrl-c":
        os.killpg(bench.proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole process group
    else:
        bench.proc.terminate()  # the bench only, as `kill PID` does
    stopped = time.monotonic()
    rc, err = bench.finish()
    took = bench.ended - stopped
    signum = signal.SIGINT if how == "ctrl-c" else signal.SIGTERM
    assert rc == 128 + signum, err
    assert took < EXIT_AFTER_S, f"the bench took {took:.0f} s to stop"
    assert one_line(err) == f"lmcache-mp-bench: stopped by {signum.name}; its workers and helpers have ended"
    assert_nothing_left(bench, helpers)
    assert server.proc.poll() is None  # the server goes on


@pytest.mark.parametrize("url, message", [
    ("127.0.0.1:5555", "lmcache-mp-bench: --url: not a server URL: '127.0.0.1:5555' has no scheme"),
    ("tcp://127.0.0.1:99999", "lmcache-mp-bench: --url: port 99999 of 'tcp://127.0.0.1:99999' is out of range"),
], ids=["no-scheme", "port-out-of-range"])
def test_a_bad_url_is_one_line(url, message):
    out = subprocess.run(bench_command() + ["--url", url], capture_output=True, text=True, timeout=WAIT_S)
    assert out.returncode == 2
    assert one_line(out.stderr).startswith(message), out.stderr


@pytest.mark.parametrize("l1, requests, said", [("1472KiB", 2, ""), ("1088KiB", 2, "note:"),
                                                ("1088KiB", 3, "warning:")],
                         ids=["fits", "warm-up-chunks-evicted", "checked-chunks-evicted"])
def test_what_the_bench_says_of_l1_before_it_runs(l1, requests, said, benches):
    """The SMALL run checks 16 chunks of 64 KiB (24 with 3 requests) and stores 6 warm-up chunks
    first; 1088 KiB of L1 hold 17. Said only what will happen: a warning that chunks will be
    missing when the checked ones do not fit, a note when only warm-up chunks will be evicted (as
    in the quickstart's run against a default server)."""
    srv = ServerProcess(["--url", "tcp://127.0.0.1:0", "--device", "cpu", "--l1-size", l1, "--slab-size", "64KiB",
                         "--chunk-size", "64", "--http-addr", "off"])
    try:
        url = srv.wait_ready()
        rc, err = benches(["--url", url, *SMALL, "--lookups", "10", "--requests", str(requests)]).finish()
        said_lines = [line for line in err.splitlines() if "the server's L1" in line]
        if not said:
            assert not said_lines, err
        else:
            assert len(said_lines) == 1 and said_lines[0].startswith(said), err
        if said == "warning:":
            assert "holds (17)" in said_lines[0] and rc == 1, err  # missing chunks fail the run
        else:
            assert rc == 0, err  # nothing missing
    finally:
        srv.kill()
