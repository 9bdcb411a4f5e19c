"""Which device the server runs on, and the NUMA node nearest its GPU."""

from __future__ import annotations

from lmcache_mp.native import cuda_device_count


def resolve_device(requested: str) -> str:
    if requested == "cpu":
        return "cpu"
    n = cuda_device_count()
    if requested == "cuda" and n == 0:
        raise RuntimeError("device=cuda but no CUDA device is usable (or lmcache-mp was built without CUDA)")
    return "cuda" if n > 0 else "cpu"


def gpu_numa_node() -> int:
    from lmcache_mp import native

    try:
        bus = native.cuda.device_pci_bus_id(0).lower()
        with open(f"/sys/bus/pci/devices/{bus}/numa_node") as f:
            return int(f.read().strip())
    except (OSError, ValueError, RuntimeError):
        return -1
