"""Describing a worker's KV-cache tensors for registration: shapes, strides and where the bytes
are (a shared-memory file for CPU tensors, a CUDA IPC handle for GPU tensors). A CPU cache that
this process copies itself (transfer="engine") may live in its private memory: the server never
maps it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from lmcache_mp import protocol as p
from lmcache_mp.shm import find_shared_region


@dataclass
class DescribedCache:
    device: str  # "cpu" | "cuda"
    device_index: int  # CUDA ordinal in this process (-1 on the CPU)
    device_uuid: bytes
    layers: list[p.LayerRef]


def _as_list(kv_caches: Sequence[Any] | Mapping[str, Any]) -> list:
    tensors = list(kv_caches.values()) if isinstance(kv_caches, Mapping) else list(kv_caches)
    if not tensors:
        raise ValueError("kv_caches is empty: pass one tensor per layer")
    return tensors


def _span_bytes(shape, strides, element_size: int) -> int:
    """Bytes from a tensor's first element to one past its last."""
    if any(size == 0 for size in shape):
        raise ValueError("KV-cache tensors must not be empty")
    last = sum((size - 1) * stride for size, stride in zip(shape, strides))
    return (last + 1) * element_size


def _describe_arrays(arrays: list) -> DescribedCache:
    """NumPy arrays in shared memory (shared_cpu_array): a CPU cache without torch."""
    layers = []
    for a in arrays:
        if any(stride < 0 or stride % a.itemsize for stride in a.strides):
            raise ValueError("KV-cache arrays must have non-negative strides of whole elements")
        strides = [stride // a.itemsize for stride in a.strides]
        ptr = a.__array_interface__["data"][0]
        region = find_shared_region(ptr, _span_bytes(a.shape, strides, a.itemsize))
        mem = p.MemoryRef(kind="shm", name=region.name, offset=region.offset, size=region.size)
        layers.append(p.LayerRef(shape=list(a.shape), strides=strides, dtype=str(a.dtype), element_size=a.itemsize,
                                 memory=mem))
    return DescribedCache("cpu", -1, b"", layers)


def describe_kv_caches(kv_caches, private_cpu: bool = False) -> DescribedCache:
    """private_cpu: CPU tensors outside shared memory are allowed (described as "private"); only
    for caches whose chunks this process copies itself."""
    import numpy as np

    tensors = _as_list(kv_caches)
    if all(isinstance(t, np.ndarray) for t in tensors):
        return _describe_arrays(tensors)
    import torch

    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"KV caches must be torch tensors or NumPy arrays, got {type(t).__name__}")
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError("all layers of one KV cache must be on the same device")
    layers = []
    if device.type == "cpu":
        for t in tensors:
            span = _span_bytes(t.shape, t.stride(), t.element_size())
            try:
                region = find_shared_region(t.data_ptr(), span)
            except ValueError:
                if not private_cpu:
                    raise
                mem = p.MemoryRef(kind="private", size=span)
            else:
                mem = p.MemoryRef(kind="shm", name=region.name, offset=region.offset, size=region.size)
            layers.append(_layer(t, mem))
        return DescribedCache("cpu", -1, b"", layers)
    if device.type != "cuda":
        raise ValueError(f"KV caches on {device.type} are not supported (cpu or cuda)")
    from lmcache_mp import native

    if not native.cuda_built():
        raise RuntimeError("lmcache-mp was built without CUDA: reinstall with nvcc available to use GPU caches")
    index = device.index if device.index is not None else torch.cuda.current_device()
    exports: dict[int, tuple[bytes, int]] = {}  # allocation base -> (handle, allocation bytes)
    with torch.cuda.device(index):
        for t in tensors:
            ptr = t.data_ptr()
            base, _ = native.cuda.address_range(ptr, index)
            if base not in exports:
                handle, _offset, alloc_bytes, _dev = native.cuda.export_memory(ptr)
                exports[base] = (handle, alloc_bytes)
            handle, alloc_bytes = exports[base]
            mem = p.MemoryRef(kind="cuda_ipc", handle=handle, offset=ptr - base, size=alloc_bytes)
            layers.append(_layer(t, mem))
    return DescribedCache("cuda", index, native.cuda.device_uuid(index), layers)


def _layer(t, mem: p.MemoryRef) -> p.LayerRef:
    return p.LayerRef(shape=list(t.shape), strides=list(t.stride()), dtype=str(t.dtype).removeprefix("torch."),
                      element_size=t.element_size(), memory=mem)
