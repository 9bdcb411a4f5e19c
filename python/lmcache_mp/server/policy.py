"""The `auto` transfer-mode policy (see docs/PERFORMANCE.md for the measurements behind it)."""

from __future__ import annotations

from lmcache_mp.layout import LayoutSpec


def choose_transfer_mode(spec: LayoutSpec, direction: str, num_chunks: int) -> str:
    """Copy engines only: they keep line rate without taking SMs from the engine's kernels."""
    return "dma"
