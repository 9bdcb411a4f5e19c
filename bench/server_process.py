"""A cache server in a process of its own, as the benchmarks run it: `python -m lmcache_mp.server.cli`
with their flags, its log (stdout and stderr) in a file, its endpoint once it serves.

Without `--url` among the flags the server binds a free TCP port and its endpoint is read from
its "ready: serving on" line (so the log level must let INFO through); with one, readiness is a
client that connects. `command` runs another starter than the server's CLI (a benchmark's
variant of the server: `[sys.executable, "-c", code]`), given the same flags.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time


class ServerProcess:
    def __init__(self, args: list[str], log_path: str | None = None, env: dict | None = None,
                 command: list[str] | None = None):
        args = list(args)
        if "--url" in args:
            self.url = args[args.index("--url") + 1]
        else:
            self.url = ""
            args = ["--url", "tcp://127.0.0.1:0", *args]
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="lmcache-bench-server-", suffix=".log")
            os.close(fd)
        self.log_path = log_path
        self._log = open(log_path, "w")
        command = command or [sys.executable, "-m", "lmcache_mp.server.cli"]
        self.proc = subprocess.Popen([*command, *args], env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_pinned(self, client, within: float = 300.0, progress=None) -> dict:
        """L1's pinning status once it is done (L1 pins in the background: measure only then);
        progress(pinning) is called about every 5 s meanwhile."""
        deadline = time.monotonic() + within
        last = time.monotonic()
        while True:
            pin = client.status()["l1"]["pinning"]
            if pin.get("done") or not pin.get("requested"):
                return pin
            if time.monotonic() > deadline:
                raise RuntimeError(f"L1 pinning not finished after {within:.0f} s: {pin}")
            if progress is not None and time.monotonic() - last > 5:
                last = time.monotonic()
                progress(pin)
            time.sleep(0.2)

    def wait_ready(self, timeout: float = 120.0) -> str:
        """The endpoint, once the server serves on it (RuntimeError with its log's tail if it exits
        or the timeout passes first)."""
        from lmcache_mp import Client

        deadline = time.monotonic() + timeout
        while True:
            if not self.url:
                for line in self.log().splitlines():
                    if "ready: serving on " in line:
                        self.url = line.split("serving on ")[1].strip()
                        return self.url
            else:
                try:
                    Client(self.url, connect_timeout=0.5).close()
                    return self.url
                except Exception:
                    pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start:\n{self.log_tail()}")
            time.sleep(0.1)

    def connect(self, within: float = 120.0, **client_args):
        """A client of the server, retried until it connects (the server may still be starting)."""
        from lmcache_mp import Client

        deadline = time.monotonic() + within
        while True:
            try:
                return Client(self.wait_ready(within), **{"connect_timeout": 1, **client_args})
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start:\n{self.log_tail()}") from None
                time.sleep(0.2)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path) as f:
            return f.read()

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM, then its exit status once it has drained and stopped (killed after timeout)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        with contextlib.suppress(Exception):
            self._log.close()
        return self.proc.returncode
