"""The one size grammar: bytes from `128Gi`, `32MiB`, `64G`, `512m`, `1.5Gi` or `1048576`.

Units are binary whatever the spelling (K, Ki, KiB, KB all mean 1024), case-insensitive, with an
optional trailing B. The topology schema accepts a subset (`<number>[Ki|Mi|Gi|Ti]`); host facts and
command-line options accept the rest.

>>> parse_size("32MiB"), parse_size("32Mi"), parse_size("8m")
(33554432, 33554432, 8388608)
>>> format_size(64 * 1024**3)
'64Gi'
"""

from __future__ import annotations

import re

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: str | int) -> int:
    """Bytes in a size; ValueError (`not a size: ...`) for anything else.

    >>> parse_size("128Gi")
    137438953472
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.fullmatch(value) if isinstance(value, str) else None
    if not match:
        raise ValueError(f"not a size: {value!r} (use e.g. 64Gi, 512Mi, 1048576)")
    unit = (match.group(2) or "")[:1].lower()
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(size: int) -> str:
    """Bytes as the largest exact binary unit (`137438953472` -> `128Gi`).

    >>> format_size(1536)
    '1536'
    """
    for unit, factor in (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if size >= factor and size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)
