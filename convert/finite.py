"""NaN/Inf in raw stored weights, found from the exponent bits (no cast, no copy into torch).

A float is non-finite exactly when all its exponent bits are set, so one AND and one compare over
the bytes viewed as unsigned integers of the element size tell, for F64/F32/F16/BF16 alike. The
conversion runs this on bytes it reads anyway (the sha256 pass over safetensors sources, the block
buffer of tensors it assembles), so finding non-finite weights costs no extra read.
"""

from __future__ import annotations

import numpy as np

# dtype -> (unsigned view, exponent mask); little-endian, as safetensors stores them
_EXPONENT = {
    "F64": (np.dtype("<u8"), 0x7FF0000000000000),
    "F32": (np.dtype("<u4"), 0x7F800000),
    "F16": (np.dtype("<u2"), 0x7C00),
    "BF16": (np.dtype("<u2"), 0x7F80),
}


def checks(dtype: str) -> bool:
    """Whether ``dtype`` (a safetensors name) can hold NaN/Inf at all."""
    return dtype in _EXPONENT


def itemsize(dtype: str) -> int:
    return _EXPONENT[dtype][0].itemsize


def has_nonfinite(buf, dtype: str) -> bool:
    """True when the little-endian ``dtype`` elements in ``buf`` (whole elements) hold a NaN or Inf."""
    spec = _EXPONENT.get(dtype)
    if spec is None or not len(buf):
        return False
    view, mask = spec
    a = np.frombuffer(buf, dtype=view)
    return bool(np.any(np.bitwise_and(a, view.type(mask)) == view.type(mask)))


def describe(names: list[str], limit: int = 8) -> str:
    """'a, b, c (and 3 more)' for a warning line."""
    shown = ", ".join(names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")
