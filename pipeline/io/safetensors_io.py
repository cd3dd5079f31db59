"""Every safetensors read and write of titan-pipe, in one module: the header, ranged reads, mapped
reads, whole small files, and the streaming writer.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (dtype, shape,
data_offsets per tensor), then raw row-major bytes.

- ``read_header`` reads and checks the header without reading tensor data or importing torch: every
  entry is validated against the file's size (a truncated or forged header is one line naming the
  file), so every reader — convert's stores, the unified model dir, export's weight plan — starts
  from the same checked facts.
- ``pread_into``: a byte range of a file into a buffer the size of what is read (pread, not mmap:
  the pages of a mapping stay counted in the resident set until it is unmapped), what convert's
  stores read boxes of tensors with (titan_pipe.weights.readers.store).
- ``open_tensors``: a file's tensors by name, mapped (safetensors' own reader): what the model's
  weight sources read whole tensors and slices of them with.
- ``load`` / ``save``: a small file whole (a sharded forward's outputs, a checkpoint's shards).
- ``SafetensorsWriter``: the streaming writer convert writes with: header first, then each
  tensor's byte range filled piece by piece. Every shape and dtype is known before a byte is
  copied, so the header (and every tensor's offset) is fixed up front; pieces are then written
  where they belong, from a buffer (``write``) or straight from a source file with
  ``copy_file_range`` (``copy``), which never passes through this process's memory. The file is
  written under a hidden ``.partial`` name and renamed only when every byte of every tensor has
  arrived; on any error it is removed. An OS fault (a full disk, a file-size limit, ...) is raised
  as an OSError naming the file being written, which titan_pipe.io.faults turns into one line.
"""

from __future__ import annotations

import errno
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from titan_pipe.io.atomic import temp_file
from titan_pipe.rules.dtypes import DTYPE_SIZES
from titan_pipe.errors import UserError

if TYPE_CHECKING:
    import torch

# -- the header --------------------------------------------------------------------------------

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


# -- reads -------------------------------------------------------------------------------------


def pread_into(fd: int, buf: memoryview, offset: int, path: Path) -> None:
    """Fill ``buf`` from ``fd`` at ``offset`` (pread may return short counts)."""
    done = 0
    while done < len(buf):
        got = os.preadv(fd, [buf[done:]], offset + done)
        if got == 0:
            raise UserError(
                f"{path}: ended early while reading byte {offset + done}; the file was truncated during the conversion"
            )
        done += got


def open_tensors(path: Path):
    """A context manager over ``path``'s tensors: ``get_tensor(key)``, ``get_slice(key)[index]``, ``keys()``
    (mapped; nothing is read until asked)."""
    from safetensors import safe_open

    return safe_open(str(path), framework="pt")


def load(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a (small) file."""
    from safetensors.torch import load_file

    return load_file(str(path))


def save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (contiguous) as one file at ``path``."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)


# -- the streaming writer ----------------------------------------------------------------------

_NO_COPY_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF}
COPY_BLOCK = 64 * 2**20


@dataclass(frozen=True)
class Entry:
    key: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


def build_header(entries: list[Entry], metadata: dict[str, str] | None = None) -> tuple[bytes, dict[str, int]]:
    """(8-byte length + JSON header padded to 8 bytes, data offset of each key), in entry order."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offsets, pos = {}, 0
    for e in entries:
        if e.key in offsets:
            raise ValueError(f"duplicate tensor name {e.key!r} in one output file")
        header[e.key] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [pos, pos + e.nbytes]}
        offsets[e.key] = pos
        pos += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as safetensors does
    return len(raw).to_bytes(8, "little") + raw, offsets


def _named(path: Path, e: OSError) -> OSError:
    """The error of a write through a descriptor, naming the file (pwrite errors carry no name)."""
    return OSError(e.errno, e.strerror, str(path))


class SafetensorsWriter:
    """Write one safetensors file; use as a context manager (removes the partial file on error)."""

    def __init__(self, path: Path, entries: list[Entry], metadata: dict[str, str] | None = None):
        self.path = path
        self.partial = temp_file(path)
        self.entries = {e.key: e for e in entries}
        self.head, self.offsets = build_header(entries, metadata)
        self.written = {e.key: 0 for e in entries}
        self.fd: int | None = None

    @property
    def size(self) -> int:
        return len(self.head) + sum(e.nbytes for e in self.entries.values())

    def __enter__(self) -> "SafetensorsWriter":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o666)
        self._pwrite(memoryview(self.head), 0)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if exc_type is not None:
            self.partial.unlink(missing_ok=True)

    def _base(self, key: str, offset: int, n: int) -> int:
        e = self.entries[key]
        if offset < 0 or offset + n > e.nbytes:
            raise ValueError(f"{key}: write of {n} bytes at {offset} overruns its {e.nbytes} bytes")
        self.written[key] += n
        return len(self.head) + self.offsets[key] + offset

    def _pwrite(self, data: memoryview, pos: int) -> None:
        done = 0
        try:
            while done < len(data):
                done += os.pwrite(self.fd, data[done:], pos + done)
        except OSError as e:
            raise _named(self.path, e) from None

    def write(self, key: str, offset: int, data) -> None:
        """Write a bytes-like object at byte ``offset`` of tensor ``key``'s data."""
        mv = memoryview(data).cast("B")
        self._pwrite(mv, self._base(key, offset, len(mv)))

    def copy(self, key: str, offset: int, src_fd: int, src_offset: int, n: int) -> None:
        """Copy ``n`` bytes from ``src_fd`` at ``src_offset`` to tensor ``key`` at ``offset``."""
        pos = self._base(key, offset, n)
        done = 0
        try:
            while done < n:
                try:
                    got = os.copy_file_range(src_fd, self.fd, min(n - done, 2**30), src_offset + done, pos + done)
                except OSError as e:
                    if e.errno in _NO_COPY_RANGE:
                        break  # another filesystem or kernel: copy through a buffer instead
                    raise
                if got == 0:
                    raise UserError(
                        f"source ended early at byte {src_offset + done} while writing "
                        f"{self.path}; the source was truncated during the conversion"
                    )
                done += got
        except OSError as e:
            raise _named(self.path, e) from None
        buf = bytearray(min(COPY_BLOCK, n - done)) if done < n else None
        while done < n:
            m = min(len(buf), n - done)
            view = memoryview(buf)[:m]
            got = os.preadv(src_fd, [view], src_offset + done)
            if got == 0:
                raise UserError(
                    f"source ended early at byte {src_offset + done} while writing "
                    f"{self.path}; the source was truncated during the conversion"
                )
            self._pwrite(view[:got], pos + done)
            done += got

    def commit(self) -> Path:
        """Check every tensor is complete, close and rename into place."""
        short = [k for k, e in self.entries.items() if self.written[k] != e.nbytes]
        if short:
            raise RuntimeError(
                f"{self.path}: tensors {short[:3]} were not completely written (a plan that does not cover them; a bug)"
            )
        os.close(self.fd)
        self.fd = None
        os.replace(self.partial, self.path)
        return self.path
