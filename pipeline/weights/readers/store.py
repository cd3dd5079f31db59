"""Access to stored tensors by box: safetensors files read with pread (no whole-file load, no mmap).

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (dtype, shape,
data_offsets per tensor), then raw row-major bytes. ``read_box`` reads only the rows a box spans;
``byte_span`` tells the writer where a contiguous box lies so it can copy file-to-file.

Why pread and not mmap: pages of a mapping stay counted in the process's resident set until it is
unmapped, so mmapping a 100 GB checkpoint reads as 100 GB RSS; pread into a buffer the size of one
tensor keeps the memory bound real.
"""

from __future__ import annotations

import math
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from titan_pipe.records.checkpoint_format import Box
from titan_pipe.rules.dtypes import DTYPE_SIZES
from titan_pipe.errors import UserError
from titan_pipe.io.safetensors_io import StoredTensor, pread_into, read_header

if TYPE_CHECKING:
    import torch


def contiguous_span(shape: tuple[int, ...], box: Box, itemsize: int) -> tuple[int, int] | None:
    """(byte offset, byte length) of ``box`` inside a row-major tensor, or None if not contiguous.

    Contiguous: after the first dim whose length exceeds 1, every dim is taken whole.
    """
    k = next((d for d, n in enumerate(box.lengths) if n != 1), len(shape))
    if any(box.lengths[d] != shape[d] for d in range(k + 1, len(shape))):
        return None
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    offset = sum(o * s for o, s in zip(box.offsets, strides))
    return offset * itemsize, box.numel * itemsize


class Store:
    """Stored tensors of one source, addressed by (file, key). Subclasses per storage kind."""

    threadsafe = False  # may several threads read at once?

    def __init__(self, root: Path):
        self.root = root

    def stored(self, file: str, key: str) -> StoredTensor | None:
        """Shape/dtype of a stored tensor, or None when it is not in a byte-addressable file."""
        return None

    def byte_span(self, file: str, key: str, box: Box) -> tuple[int, int, int] | None:
        """(fd, absolute offset, length) when ``box`` of the stored tensor is one contiguous range."""
        return None

    def read_box(self, file: str, key: str, box: Box) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class SafetensorsStore(Store):
    """Tensors in safetensors files under ``root``; headers parsed once, data read by pread."""

    threadsafe = True  # pread has no shared file position; the caches below are lock-guarded

    def __init__(self, root: Path, headers: dict[str, dict[str, StoredTensor]] | None = None):
        super().__init__(root)
        self.headers: dict[str, dict[str, StoredTensor]] = dict(headers or {})
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def header(self, file: str) -> dict[str, StoredTensor]:
        with self._lock:
            if file not in self.headers:
                self.headers[file] = read_header(self.root / file)[0]
            return self.headers[file]

    def stored(self, file: str, key: str) -> StoredTensor:
        h = self.header(file)
        if key not in h:
            raise UserError(
                f"{self.root / file}: has no tensor {key!r}; the file does not belong "
                "to this checkpoint or was overwritten"
            )
        return h[key]

    def fd(self, file: str) -> int:
        with self._lock:
            if file not in self._fds:
                self._fds[file] = os.open(self.root / file, os.O_RDONLY)
            return self._fds[file]

    def byte_span(self, file: str, key: str, box: Box) -> tuple[int, int, int] | None:
        t = self.stored(file, key)
        span = contiguous_span(t.shape, box, DTYPE_SIZES[t.dtype])
        if span is None:
            return None
        return self.fd(file), t.start + span[0], span[1]

    def read_box(self, file: str, key: str, box: Box) -> torch.Tensor:
        """The box as a tensor of the stored dtype; reads only the rows (dim 0) the box spans."""
        import torch  # here, not at the top: export reads headers and bytes through this module without torch

        from titan_pipe.rules.dtypes import TORCH_DTYPES

        t = self.stored(file, key)
        if not t.shape:
            rows, row_bytes, first = 1, DTYPE_SIZES[t.dtype], 0
        else:
            rows, first = box.lengths[0], box.offsets[0]
            row_bytes = math.prod(t.shape[1:]) * DTYPE_SIZES[t.dtype]
        buf = torch.empty(rows * row_bytes, dtype=torch.uint8)
        pread_into(self.fd(file), memoryview(buf.numpy()), t.start + first * row_bytes, self.root / file)
        x = buf.view(TORCH_DTYPES[t.dtype]).view((rows, *t.shape[1:]) if t.shape else ())
        for d in range(1, len(t.shape)):
            x = x.narrow(d, box.offsets[d], box.lengths[d])
        return x

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
