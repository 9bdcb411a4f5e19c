"""Probe of C++ error paths: each case in its own process (one crash must not hide the others),
with and without torch imported first. Prints one line per case."""

import subprocess
import sys

CASES = {
    "plain invalid_argument": "from lmcache_mp import _C; _C._raise_for_test(0)",
    "formatted InvalidArgument": "from lmcache_mp import _C; _C._raise_for_test(1)",
    "runtime_error": "from lmcache_mp import _C; _C._raise_for_test(2)",
    "no error, ostringstream": "from lmcache_mp import _C; print(_C._raise_for_test(3))",
    "arena bad free": "from lmcache_mp import _C; _C.HostArena(1 << 22, 1 << 20).free(12345)",
}

for name, code in CASES.items():
    for pre in ("", "import torch; "):
        r = subprocess.run([sys.executable, "-c", pre + code], capture_output=True, text=True, timeout=120)
        last = (r.stderr.strip().splitlines() or [""])[-1]
        print(f"{name:28s} torch-first={bool(pre)!s:5s} rc={r.returncode:4d} {r.stdout.strip()} | {last}", flush=True)
