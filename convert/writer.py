"""Streaming safetensors writer: header first, then each tensor's byte range filled piece by piece.

Every shape and dtype is known before a byte is copied, so the header (and every tensor's offset)
is fixed up front; pieces are then written where they belong, either from a buffer (``write``) or
straight from a source file with ``copy_file_range`` (``copy``), which never passes through this
process's memory. The file is written under a hidden ``.partial`` name and renamed only when
every byte of every tensor has arrived; on any error it is removed. An OS fault (a full disk, a
file-size limit, ...) is raised as an OSError naming the file being written, which titan_pipe.faults
turns into one line.
"""

from __future__ import annotations

import errno
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from titan_pipe.atomic import temp_file
from titan_pipe.dtypes import DTYPE_SIZES
from titan_pipe.errors import UserError

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
