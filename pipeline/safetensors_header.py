"""The header of a safetensors file, read and checked without reading tensor data or importing torch.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (dtype, shape,
data_offsets per tensor), then raw row-major bytes. ``read_header`` validates every entry against
the file's size (a truncated or forged header is one line naming the file), so every reader —
convert's stores, the unified model dir, export's weight plan — starts from the same checked facts.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from titan_pipe.dtypes import DTYPE_SIZES
from titan_pipe.errors import UserError

MAX_HEADER = 100 * 2**20  # the safetensors library's own limit


@dataclass(frozen=True)
class StoredTensor:
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the data in the file
    nbytes: int


def read_header(path: Path) -> tuple[dict[str, StoredTensor], dict]:
    """The tensors of a safetensors file (validated against its size) and its __metadata__."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise UserError(
                    f"{path}: truncated ({size} bytes); not a complete safetensors file. "
                    "Copy the file again from where it was written"
                )
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise UserError(
                    f"{path}: header length {n} does not fit in the file ({size} bytes); "
                    "the file is truncated or not safetensors. Copy it again"
                )
            raw = f.read(n)
    except FileNotFoundError:
        raise UserError(
            f"{path}: missing; the checkpoint lists it but it is not there. Copy the complete checkpoint directory"
        ) from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory, expected a safetensors file") from None
    try:
        header = json.loads(raw, object_pairs_hook=_unique_keys)
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise UserError(f"{path}: corrupted safetensors header ({e}); copy the file again") from None
    meta = header.pop("__metadata__", None) or {}
    data_size = size - 8 - n
    out = {}
    for key, info in header.items():
        try:
            dtype, shape = info["dtype"], tuple(int(s) for s in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{path}: corrupted header entry for {key!r}; copy the file again") from None
        if dtype not in DTYPE_SIZES:
            raise UserError(
                f"{path}: tensor {key!r} has dtype {dtype!r}, which titan-pipe does not "
                f"convert (supported: {', '.join(DTYPE_SIZES)})"
            )
        if end - begin != math.prod(shape) * DTYPE_SIZES[dtype] or begin < 0:
            raise UserError(
                f"{path}: tensor {key!r} byte range {begin}..{end} does not match its "
                f"shape {shape} {dtype}; the header is corrupted"
            )
        if end > data_size:
            raise UserError(
                f"{path}: truncated: tensor {key!r} ends at byte {8 + n + end} but the "
                f"file has {size} bytes. Copy the file again"
            )
        out[key] = StoredTensor(dtype, shape, 8 + n + begin, end - begin)
    _check_disjoint(path, out)
    return out, meta


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """json object hook: a key given twice is refused (json.loads would silently keep the last)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {dup!r} appears twice")
    return out


def _check_disjoint(path: Path, tensors: dict[str, StoredTensor]) -> None:
    """No two tensors share bytes (a header that lies about offsets would make one read the other's data)."""
    spans = sorted((t.start, t.start + t.nbytes, k) for k, t in tensors.items() if t.nbytes)
    for (s0, e0, k0), (s1, e1, k1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise UserError(
                f"{path}: tensors {k0!r} (bytes {s0}..{e0}) and {k1!r} (bytes {s1}..{e1}) overlap; "
                "the header is corrupted or forged. Copy the file again"
            )
