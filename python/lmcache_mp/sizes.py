"""Sizes of memory as people write them ('64GiB', '512 MiB') and as logs show them: a leaf
module, imported by the configuration and by storage alike."""

from __future__ import annotations

import re

# Memory is sized in binary units, whatever the spelling: 4G, 4g, 4GB and 4GiB are all 4 GiB (a
# mixture, 4GB of 10^9 bytes beside 4g of 2^30, was a trap; the start-up line says the size in GiB).
_UNITS = {"": 1, "b": 1, **{u + suffix: 1 << (10 * (i + 1)) for i, u in enumerate("kmgt") for suffix in ("", "b", "ib")}}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as '64GiB', '512 MiB', '1.5G' (every unit is binary:
    64GB is 64 GiB)."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative, got {value}")
        return value
    m = re.fullmatch(r"\s*(-?)([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(3).lower() not in _UNITS:
        raise ValueError(f"not a size: {value!r} (use e.g. 512MiB, 64GiB)")
    if m.group(1):
        raise ValueError(f"size must not be negative, got {value!r}")
    return int(float(m.group(2)) * _UNITS[m.group(3).lower()])


def format_size(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
