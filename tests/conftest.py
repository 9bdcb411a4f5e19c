import contextlib
import glob
import os
import shutil
import tempfile

import pytest

# Socket files need short paths (at most ~107 bytes; pytest's tmp_path can be longer): tests make
# them in folders of this prefix, each removed with everything a killed server left in it (its
# local lane's socket file beside the endpoint's).
SOCKET_DIR_PREFIX = f"lmc-test-{os.getpid()}-"


def _gpu_available() -> tuple[bool, str]:
    try:
        from lmcache_mp.native import cuda_built, cuda_device_count
    except ImportError as e:
        return False, f"lmcache_mp is not importable: {e}"
    if not cuda_built():
        return False, "lmcache-mp was built without CUDA"
    if cuda_device_count() == 0:
        return False, "no CUDA device"
    try:
        import torch

        if not torch.cuda.is_available():
            return False, "torch sees no CUDA device"
    except ImportError:
        return False, "torch is not installed"
    return True, ""


def pytest_collection_modifyitems(config, items):
    ok, why = _gpu_available()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {why}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _owner_gone(name: str) -> bool:
    """Whether the process that made this shared-memory file (lmcache_mp_PID_...) has exited."""
    pid = name[len("lmcache_mp_"):].split("_", 1)[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


_CALL_EXCINFO = pytest.StashKey()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Keeps a failed test's exception for its fixtures' teardown (shm_files)."""
    report = yield
    if report.when == "call" and report.failed and call.excinfo is not None:
        item.stash[_CALL_EXCINFO] = call.excinfo
    return report


@pytest.fixture
def shm_files(request):
    """Fails a test that leaves lmcache-mp shared-memory files behind: its own process's, or
    those of a process that exited meanwhile (one the test killed cannot remove its own).

    A test that failed already has its one line: its traceback, which holds its locals (the
    tensors whose collection removes their files), is cleared, and whatever is still left is
    removed rather than reported as a second failure."""
    before = {f for f in os.listdir("/dev/shm") if f.startswith("lmcache_mp_")}
    yield
    import gc
    import traceback

    excinfo = request.node.stash.get(_CALL_EXCINFO, None)
    if excinfo is not None:
        traceback.clear_frames(excinfo.tb)
    gc.collect()
    after = {f for f in os.listdir("/dev/shm")
             if f.startswith(f"lmcache_mp_{os.getpid()}_") or (f.startswith("lmcache_mp_") and _owner_gone(f))}
    leaked = sorted(after - before)
    if excinfo is not None:
        for f in leaked:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join("/dev/shm", f))
        return
    assert not leaked, f"leaked shared-memory files: {leaked}"


@pytest.fixture
def socket_dir():
    """A short folder in /tmp for socket files, removed with whatever is left in it."""
    path = tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX, dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def pytest_sessionfinish(session, exitstatus):
    """A run that leaves socket folders of this process in /tmp fails."""
    left = glob.glob(f"/tmp/{SOCKET_DIR_PREFIX}*")
    if left:
        for path in left:
            shutil.rmtree(path, ignore_errors=True)
        print(f"\nleft behind in /tmp: {left}")
        if exitstatus == 0:
            session.exitstatus = 1
