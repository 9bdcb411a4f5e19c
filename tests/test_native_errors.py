"""Errors raised in the C++ data plane surface as Python exceptions and never take the process
down. Each case runs in a fresh interpreter, so a crash fails its test instead of the session."""

import subprocess
import sys

import pytest

CASES = {
    "invalid_argument": ("from lmcache_mp import _C; _C._raise_for_test(0)", "ValueError: plain invalid_argument"),
    "formatted": ("from lmcache_mp import _C; _C._raise_for_test(1)", "ValueError: formatted 42"),
    "runtime_error": ("from lmcache_mp import _C; _C._raise_for_test(2)", "RuntimeError: runtime"),
    "enum in message": ("from lmcache_mp import _C; _C._raise_for_test(3)", "ValueError: code 201"),
    "arena bad free": ("from lmcache_mp import _C; _C.HostArena(1 << 22, 1 << 20).free(12345)",
                       "ValueError: offset 12345 is not an allocated object"),
}


@pytest.mark.parametrize("torch_first", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_cpp_errors_become_python_exceptions(case, torch_first):
    code, want = CASES[case]
    if torch_first:  # another extension's pybind11 translators must not see our exceptions
        pytest.importorskip("torch")
        code = "import torch; " + code
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, f"exit {r.returncode}: {r.stderr[-2000:]}"
    assert r.stderr.strip().splitlines()[-1] == want


def test_formatting_without_error():
    from lmcache_mp import _C

    assert _C._raise_for_test(4) == "no error 4"
