"""Byte sizes written by people (flow.yaml, the command line): '8GB', '6GiB', '512MB', '1048576'."""

from __future__ import annotations

import re

from titan_pipe.rules.limits import shown

_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
# decimal units as disks and Hugging Face count; the -iB units binary
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str | int) -> int:
    """'8GB' -> 8e9 bytes, '6GiB' -> 6 * 2**30, a bare number is bytes; ValueError otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise ValueError(f"size {text} must be positive")
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"{shown(text)} is not a size; write e.g. 8GB, 512MB or 6GiB")
    n = int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])
    if n <= 0:
        raise ValueError(f"size {shown(text)} must be positive")
    return n


def format_size(n: float) -> str:
    """Bytes as people read them: '1.84 GB', '512 MB', '3.1 kB'."""
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3g} {unit}"
    return f"{int(n)} B"
