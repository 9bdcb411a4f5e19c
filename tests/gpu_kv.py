"""CUDA KV caches for the GPU tests: layouts, byte views and the NumPy reference."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lmcache_mp.layout import LayoutSpec, infer_layout

LAYOUTS = {
    # name: (kind, shape builder, padded)
    "mha": "mha",
    "mha_padded": "mha",  # heads of a wider buffer: token rows not contiguous
    "block_major": "block_major",
    "mla": "mla",
    "mla_padded": "mla",
    "opaque": "opaque",
}


@dataclass
class CudaKV:
    spec: LayoutSpec
    tensors: list  # per-layer views
    storages: list  # the tensors owning the bytes (uint8 views of whole allocations)

    @property
    def ptrs(self) -> list[int]:
        return [t.data_ptr() for t in self.tensors]

    def layer_bytes(self) -> list[np.ndarray]:
        """Each layer's bytes from its base over its extent, copied to the host."""
        out = []
        for t in self.tensors:
            raw = _raw(t)
            off = t.storage_offset() * t.element_size()
            out.append(raw[off: off + self.spec.layer_extent].cpu().numpy().copy())
        return out

    def all_bytes(self) -> list[np.ndarray]:
        return [s.cpu().numpy().copy() for s in self.storages]


def _raw(t):
    import torch

    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def make_cuda_kv(name: str, dtype, layers: int = 3, blocks: int = 64, block_size: int = 16, heads: int = 2,
                 head_size: int = 64, device: str = "cuda", one_buffer: bool = False, seed: int = 0) -> CudaKV:
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    kind = LAYOUTS[name]
    pad = 1 if name.endswith("_padded") else 0

    def alloc():
        if kind == "mha":
            full = torch.empty((2, blocks, block_size, heads + pad, head_size), dtype=dtype, device=device)
            return full, full[:, :, :, :heads, :]
        if kind == "block_major":
            full = torch.empty((blocks, 2, block_size, heads, head_size), dtype=dtype, device=device)
            return full, full
        if kind == "mla":
            full = torch.empty((blocks, block_size, heads * head_size + pad * 16), dtype=dtype, device=device)
            return full, full[:, :, : heads * head_size]
        full = torch.empty((blocks, heads, block_size, 2 * head_size), dtype=dtype, device=device)
        return full, full

    tensors, storages = [], []
    if one_buffer:  # all layers as views into one allocation, like vLLM's allocator does
        first, _ = alloc()
        big = torch.empty((layers, first.numel()), dtype=dtype, device=device)
        for i in range(layers):
            full = big[i].view(first.shape)
            view = full if full.shape == _.shape else full[tuple(slice(0, s) for s in _.shape)]
            tensors.append(view)
        storages.append(_raw(big))
    else:
        for _i in range(layers):
            full, view = alloc()
            tensors.append(view)
            storages.append(_raw(full))
    for s in storages:
        s.copy_(torch.randint(0, 256, s.shape, dtype=torch.uint8, generator=g))
    t = tensors[0]
    spec = infer_layout(t.shape, t.stride(), t.element_size(), str(t.dtype), layers, kind)
    return CudaKV(spec=spec, tensors=tensors, storages=storages)
