"""The build backend says up front what it compiles: on the terminal when there is one (pip shows a
backend's own output only with -v), else on stderr."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "backend"))
import lmcache_mp_build as backend  # noqa: E402


@pytest.fixture
def no_terminal(monkeypatch):
    real_open = os.open

    def open_(path, *a, **k):
        if path == "/dev/tty":
            raise OSError(6, "No such device or address")
        return real_open(path, *a, **k)

    monkeypatch.setattr(os, "open", open_)


def test_a_cpu_build_says_so_on_stderr_without_a_terminal(monkeypatch, capsys, no_terminal):
    monkeypatch.setenv("LMCACHE_MP_CUDA", "OFF")
    backend._announce()
    err = capsys.readouterr().err
    assert err.startswith("lmcache-mp build: compiling the extension without CUDA") and "pip install -v" in err


def test_a_cuda_build_names_the_compiler_and_the_architectures(monkeypatch, capsys, no_terminal):
    monkeypatch.setenv("LMCACHE_MP_CUDA", "AUTO")
    monkeypatch.setenv("CUDACXX", "/opt/cuda/bin/nvcc")
    monkeypatch.setenv("CMAKE_CUDA_ARCHITECTURES", "90")
    backend._announce()
    err = capsys.readouterr().err
    assert "CUDA data plane for GPU architectures 90 (/opt/cuda/bin/nvcc)" in err and "minutes" in err


def test_on_a_terminal_the_message_goes_to_it(monkeypatch, capsys):
    r, w = os.pipe()
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: os.dup(w) if path == "/dev/tty" else real_open(path, *a, **k))
    try:
        backend._tell("hello")
        os.close(w)
        assert os.read(r, 1000) == b"\nlmcache-mp build: hello\n"
    finally:
        os.close(r)
    assert capsys.readouterr().err == ""  # not twice
