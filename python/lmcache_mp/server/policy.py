"""The `auto` transfer-mode policy (see docs/PERFORMANCE.md for the measurements behind it)."""

from __future__ import annotations

from lmcache_mp.layout import LayoutSpec


def choose_transfer_mode(spec: LayoutSpec, direction: str, num_chunks: int) -> str:
    """Staged: a short packing kernel per chunk, then one DMA of the packed chunk."""
    return "staged"
