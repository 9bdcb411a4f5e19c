"""How `auto` chooses a transfer mode (docs/PERFORMANCE.md has the measurements behind it).

A server's kernels run in its own CUDA context, so beside a busy engine they wait for the
engine's time slice and then take the whole GPU (the engine keeps 0.84x of a GEMM loop with
`staged`); the copy engines are not time-sliced that way (0.985x). Copy engines alone reach
0.9x memcpy only with large contiguous copies: one per block of a block-outermost cache
(1-2 MiB) is enough, one per layer's block (32-64 KiB) is not (0.5-0.65x). So a cache whose copies
are at least DMA_MIN_SEGMENT bytes moves by copy engines only; any other is packed by kernels.
"""

from __future__ import annotations

from lmcache_mp.sizes import format_size
from lmcache_mp.layout import LayoutSpec

# Copy engines alone by contiguous copy, 64-chunk requests of random blocks, store / retrieve /
# each way with both at once, x memcpy (NVIDIA H200, PCIe Gen5, 2026-12-03; docs/PERFORMANCE.md):
# 256 KiB 0.87 / 0.90 / 0.82, 512 KiB 0.93 / 0.92 / 0.87, 768 KiB 0.95 / 0.95 / 0.92,
# 1 MiB 0.96 / 0.96 / 0.94, 2 MiB 0.98 / 0.99 / 0.94.
DMA_MIN_SEGMENT = 768 << 10


def choose_transfer_mode(spec: LayoutSpec) -> tuple[str, str]:
    """(mode, why) for a CUDA cache of this layout."""
    seg = spec.segment_bytes
    if seg >= DMA_MIN_SEGMENT:
        return "dma", (f"copies of {format_size(seg)} (at least {format_size(DMA_MIN_SEGMENT)}): copy engines "
                       "only, no kernel")
    return "staged", (f"copies of {format_size(seg)}, under {format_size(DMA_MIN_SEGMENT)}, would leave copy "
                      "engines below 0.9x memcpy: packing kernels first")
