"""The build backend: scikit-build-core, plus a CUDA compiler from the package registry when the
CUDA data plane is wanted and the machine has no nvcc.

Inference containers often carry the NVIDIA driver and CUDA runtime but no toolkit. There,
instead of building the CPU-only extension, the build asks for NVIDIA's toolkit packages
(`nvidia-cuda-nvcc`, `-runtime`, `-cccl`, `-crt`, `nvidia-nvvm`) of the CUDA version the driver
supports, as build requirements (pip installs them into the isolated build environment),
and points CMake at them.

  LMCACHE_MP_CUDA=OFF   CPU only
  LMCACHE_MP_CUDA=AUTO  (default) CUDA when nvcc is installed (CUDACXX, or on PATH)
                        or an NVIDIA driver is (then from the registry); else CPU only, said once
  LMCACHE_MP_CUDA=ON    CUDA, from the registry if there is no nvcc (the driver's CUDA version,
                        13.0 without a driver); a build that cannot have it fails
"""

from __future__ import annotations

import ctypes
import glob
import os
import shutil
import sys

from scikit_build_core import build as _skbuild
from scikit_build_core.build import build_sdist, get_requires_for_build_sdist  # noqa: F401

DEFAULT_VERSION = (13, 0)  # without a driver to ask (a build for other machines): the oldest 13.x driver
PACKAGES = {  # CUDA major -> the registry's toolkit pieces nvcc needs
    13: ["nvidia-cuda-nvcc", "nvidia-cuda-runtime", "nvidia-cuda-cccl", "nvidia-cuda-crt", "nvidia-nvvm"],
    12: ["nvidia-cuda-nvcc-cu12", "nvidia-cuda-runtime-cu12", "nvidia-cuda-cccl-cu12"],
}
MIN_MINOR = {12: 4}  # CUDA 12 before 12.4 lacks what the data plane uses


def _say(msg: str) -> None:
    print(f"lmcache-mp build: {msg}", file=sys.stderr, flush=True)


def _tell(msg: str) -> None:
    """Say msg where the person installing sees it. pip captures a backend's output and shows it
    only with -v or after a failure, so on the terminal itself when there is one (pip's spinner
    goes on below it); else on stderr (pip -v, python -m build, CI logs)."""
    try:
        fd = os.open("/dev/tty", os.O_WRONLY | os.O_NOCTTY)
    except OSError:  # no controlling terminal: CI, a service
        _say(msg)
        return
    try:
        os.write(fd, f"\nlmcache-mp build: {msg}\n".encode())
    except OSError:
        _say(msg)
    finally:
        os.close(fd)


def _announce() -> None:
    """What the build compiles and how long it may take, before the compiler starts."""
    nvcc = system_nvcc() if _setting() != "OFF" else None  # (the registry's, once pointed at)
    if nvcc:
        archs = (os.environ.get("CMAKE_CUDA_ARCHITECTURES") or os.environ.get("CUDAARCHS")
                 or "75;80;86;89;90;100;120")
        _tell(f"compiling the extension with its CUDA data plane for GPU architectures {archs} ({nvcc}); a first "
              "build takes one to a few minutes (CMAKE_CUDA_ARCHITECTURES=90 builds for one only). "
              "pip install -v shows each step.")
    else:
        _tell("compiling the extension without CUDA (LMCACHE_MP_CUDA=OFF, or no nvcc and no NVIDIA driver); "
              "under a minute for a first build. pip install -v shows each step.")


def _setting() -> str:
    return os.environ.get("LMCACHE_MP_CUDA", "AUTO").strip().upper()


def system_nvcc() -> str | None:
    """The nvcc CMake finds on its own: CUDACXX, else the first on PATH."""
    return os.environ.get("CUDACXX") or shutil.which("nvcc")


def driver_cuda_version() -> tuple[int, int] | None:
    """(major, minor) of the CUDA version the installed driver supports (cuDriverGetVersion)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value <= 0:
        return None
    return version.value // 1000, version.value % 1000 // 10


def registry_cuda_version() -> tuple[int, int] | None:
    """The CUDA version whose packages this build takes from the registry (None: it does not):
    the driver's, so that what is built runs on it (for a driver newer than every toolkit here,
    the newest: a newer driver runs what an older toolkit builds)."""
    setting = _setting()
    if setting == "OFF" or system_nvcc():
        return None
    version = driver_cuda_version()
    if setting == "ON":
        version = version or DEFAULT_VERSION
    if version is None or version[0] < min(PACKAGES) or version < (version[0], MIN_MINOR.get(version[0], 0)):
        return None  # no driver, or one too old for these toolkits: CPU only (ON then fails in CMake, loudly)
    if version[0] > max(PACKAGES):
        return max(PACKAGES), 99
    return version


def requirements(version: tuple[int, int]) -> list[str]:
    major, minor = version
    spec = f">={major}.0" if minor == 99 else f">={major}.{minor},<{major}.{minor + 1}"
    return [name + spec for name in PACKAGES[major]]


def registry_nvcc() -> str | None:
    """nvcc of the registry's packages, installed on this interpreter's path (the build env)."""
    for entry in sys.path:
        for pattern in ("nvidia/cu*/bin/nvcc", "nvidia/cuda_nvcc/bin/nvcc"):
            found = sorted(glob.glob(os.path.join(entry, pattern)))
            if found:
                return found[-1]
    return None


def _requires(base: list[str]) -> list[str]:
    version = registry_cuda_version()
    if version is not None:
        _tell(f"no nvcc here; the CUDA compiler and headers come from the package registry (pip downloads them "
              f"next): {' '.join(requirements(version))}")
        return base + requirements(version)
    if _setting() == "AUTO" and not system_nvcc():
        _say("no NVIDIA driver and no nvcc: building the CPU-only extension (LMCACHE_MP_CUDA=ON for CUDA)")
    return base


def _point_cmake_at_registry_cuda() -> None:
    version = registry_cuda_version()
    if version is None:
        return
    nvcc = registry_nvcc()
    if nvcc is None:
        if _setting() == "ON":
            raise RuntimeError("LMCACHE_MP_CUDA=ON: the registry's CUDA packages are not installed in the build "
                               "environment (build without --no-build-isolation, or pip install "
                               + " ".join(repr(r) for r in requirements(version)) + ")")
        return
    root = os.path.dirname(os.path.dirname(nvcc))
    os.environ["CUDACXX"] = nvcc
    os.environ["CUDAToolkit_ROOT"] = root
    # The packages ship libcudart.so.N without the unversioned name CMake's FindCUDAToolkit looks
    # for; the extension links the static cudart, so the shared one only has to be found.
    shared = sorted(glob.glob(os.path.join(root, "lib", "libcudart.so.*")))
    if shared:
        os.environ["CMAKE_ARGS"] = f"{os.environ.get('CMAKE_ARGS', '')} -DCUDA_CUDART={shared[-1]}".strip()
    # Some nvcc releases look for the libraries in lib64 only; the packages have lib.
    os.environ["NVCC_APPEND_FLAGS"] = f"{os.environ.get('NVCC_APPEND_FLAGS', '')} -L{root}/lib".strip()
    os.environ["LMCACHE_MP_CUDA"] = "ON"  # from here on a CUDA build that fails is an error
    _say(f"CUDA from the registry's packages: {root}")


def get_requires_for_build_wheel(config_settings=None):
    return _requires(_skbuild.get_requires_for_build_wheel(config_settings))


def get_requires_for_build_editable(config_settings=None):
    return _requires(_skbuild.get_requires_for_build_editable(config_settings))


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    return _skbuild.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    return _skbuild.prepare_metadata_for_build_editable(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _point_cmake_at_registry_cuda()
    _announce()
    return _skbuild.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _point_cmake_at_registry_cuda()
    _announce()
    return _skbuild.build_editable(wheel_directory, config_settings, metadata_directory)
