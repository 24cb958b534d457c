"""Sizes in bytes as people write them: ``"8GiB"``, ``"512MB"``, ``"1.5G"`` or a plain integer."""

from __future__ import annotations

import re

from kvtier.errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")


def parse_bytes(value, field: str) -> int:
    """Bytes in ``value`` (an int, or a number and a unit: B, KB/MB/GB/TB, KiB/MiB/GiB/TiB); ConfigError(field)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    m = _SIZE.fullmatch(value) if isinstance(value, str) else None
    if m is None or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(field, f"{value!r} is not a size; write e.g. 8GiB, 512MB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
