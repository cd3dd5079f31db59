"""Export weights: plan them from safetensors headers, then stream them into ONE external-data file.

Planning reads only the headers (names, dtypes, shapes, byte offsets) of the unified directory and
checks them against config.json, so a bad directory fails before a byte is written. Streaming
then copies each tensor, chunk by chunk, from its source file into ``model.onnx.data``,
page-aligned so a runtime can mmap it: a tensor already in the export dtype is copied by the
kernel (copy_file_range, what `cp` does), a cast one through a chunk buffer. The sha256 of the
data file is computed from the same bytes as they pass, in a helper thread (no second pass).
Memory: two chunk buffers and one mmap window, whatever the model's size.

Why not mmap whole files (see convert/readers/store.py): pages of a mapping count in the resident
set until unmapped, so a mapped 14 GB model reads as 14 GB RSS; pread into a reused buffer, or a
window unmapped right after use, keeps the bound real, and the page cache still serves the reads.
"""
from __future__ import annotations

import hashlib
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from titan_pipe.convert.readers.store import StoredTensor, pread_into, read_header
from titan_pipe.dtypes import BY_NAME, HF_DTYPE_NAMES, TORCH_BY_NAME
from titan_pipe.errors import UserError
from titan_pipe.model.args import ModelArgs
from titan_pipe.model.params import native_shapes
from titan_pipe.unified_dir import check_all_placed, locate_weights, place_tensor

ALIGN = 4096  # page-aligned tensors, so a runtime can mmap them
CHUNK = 32 * 2**20  # bytes per copy/read; two buffers (casts) or one mmap window (digest) of this in memory
_CASTABLE = ("F32", "F16", "BF16")  # safetensors codes of the float types export reads


@dataclass(frozen=True)
class SourceTensor:
    """One parameter as stored: file, stored key, dtype name (safetensors), shape, byte range."""

    name: str  # native parameter name, e.g. layers.0.attention.wq.weight
    file: Path
    key: str
    stored: StoredTensor


@dataclass(frozen=True)
class DataEntry:
    """Where one initializer lives in the data file."""

    name: str
    offset: int
    length: int
    dims: tuple[int, ...]


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Native parameter name -> shape, from the dims alone; a tied model may still store output.weight
    (it is the embedding, and the graphs use the embedding)."""
    shapes = native_shapes(args)
    if args.tie_embeddings:
        shapes["output.weight"] = (args.vocab_size, args.dim)
    return shapes


def plan_weights(model_dir: Path, args: ModelArgs) -> dict[str, SourceTensor]:
    """Every parameter of the model -> where it is stored; UserError naming the tensor and file
    for a missing, extra, duplicated, mis-shaped or non-float tensor. Reads headers only."""
    model_dir = Path(model_dir)
    weights = locate_weights(model_dir)
    expected = expected_shapes(args)
    found: dict[str, SourceTensor] = {}
    for path in weights.files:
        header, _ = read_header(path)
        for stored in sorted(k for k, f in weights.key_to_file.items() if f == path):
            info = header.get(stored)
            name = place_tensor(model_dir, args, expected, path=path, stored=stored, present=header,
                                shape=info.shape if info is not None else None, placed=found)
            if name is None:
                continue
            if info.dtype not in _CASTABLE:
                raise UserError(f"{path}: tensor {stored!r} has dtype {info.dtype}; export reads float32, "
                                "float16 or bfloat16 weights — convert the checkpoint with `titan-pipe convert`")
            found[name] = SourceTensor(name, path, stored, info)
    check_all_placed(model_dir, args, expected, found)
    return found


class DataWriter:
    """Appends tensors to one data file, page-aligned, hashing every byte written unless ``hash`` is
    False; ``sha256`` after close (None when not hashed). Use as a context manager.

    A tensor already in the export dtype is copied file to file by the kernel (copy_file_range, as
    `cp` does; pread/pwrite where the file system refuses); a cast goes through a chunk buffer.
    The digest runs in a helper thread, in write order, over the same bytes (a short-lived mmap
    window of the source, or the chunk buffer), so it overlaps the copying.
    """

    def __init__(self, path: Path, dtype: str, *, hash: bool = True):
        self.path, self.target = Path(path), TORCH_BY_NAME[dtype]
        self.itemsize = BY_NAME[dtype].itemsize
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # the umask applies
        self._pos = 0
        self._hash = hashlib.sha256() if hash else None
        self._pool = ThreadPoolExecutor(max_workers=1)
        self._bufs = [bytearray(CHUNK), bytearray(CHUNK)]
        self._busy = [None, None]  # the hash future still reading each buffer
        self._turn = 0
        self._kernel_copy = hasattr(os, "copy_file_range")
        self.entries: dict[str, DataEntry] = {}
        self.sha256: str | None = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _buffer(self) -> bytearray:
        i = self._turn = 1 - self._turn
        if self._busy[i] is not None:
            self._busy[i].result()
        return self._bufs[i]

    def _emit(self, buf, n: int) -> None:
        """Write the first n bytes of a chunk buffer (from _buffer()) and queue their digest."""
        view = memoryview(buf)[:n]
        done = 0
        while done < n:
            done += os.pwrite(self._fd, view[done:], self._pos + done)
        self._pos += n
        if self._hash is not None:
            self._busy[self._turn] = self._pool.submit(self._hash.update, view)

    def _hash_range(self, path: Path, start: int, length: int) -> None:
        """Digest bytes of a file through an mmap window unmapped right after (it counts in RSS while mapped)."""
        base = start - start % mmap.ALLOCATIONGRANULARITY
        with open(path, "rb") as f, mmap.mmap(f.fileno(), start + length - base, offset=base,
                                             access=mmap.ACCESS_READ) as mm:
            with memoryview(mm) as whole, whole[start - base:] as part:
                self._hash.update(part)

    def _copy(self, fd: int, start: int, length: int, path: Path) -> None:
        """Kernel copy of a source byte range to the end of the data file (one chunk)."""
        done = 0
        while done < length:
            n = os.copy_file_range(fd, self._fd, length - done, start + done, self._pos + done)
            if n == 0:
                raise UserError(f"{path}: ended early while reading byte {start + done}; the file was "
                                "truncated during the export")
            done += n
        self._pos += length
        if self._hash is not None:
            self._pool.submit(self._hash_range, path, start, length)

    def _align(self) -> int:
        pad = (-self._pos) % ALIGN
        if pad:
            buf = self._buffer()
            buf[:pad] = bytes(pad)
            self._emit(buf, pad)
        return self._pos

    def add_source(self, name: str, src: SourceTensor) -> DataEntry:
        """Stream one stored tensor in, cast to the export dtype chunk by chunk."""
        offset = self._align()
        s = src.stored
        src_name = HF_DTYPE_NAMES[s.dtype]
        src_dtype, src_item = TORCH_BY_NAME[src_name], BY_NAME[src_name].itemsize
        numel = s.nbytes // src_item
        per_chunk = CHUNK // max(src_item, self.itemsize)
        fd = os.open(src.file, os.O_RDONLY)
        try:
            done = 0
            while done < numel:
                n = min(per_chunk, numel - done)
                at = s.start + done * src_item
                if src_dtype == self.target and self._kernel_copy:
                    try:
                        self._copy(fd, at, n * src_item, src.file)
                        done += n
                        continue
                    except OSError:  # EXDEV/EINVAL/ENOSYS: this file system pair cannot; buffer from here on
                        self._kernel_copy = False
                        os.ftruncate(self._fd, self._pos)
                buf = self._buffer()
                pread_into(fd, memoryview(buf)[:n * src_item], at, src.file)
                if src_dtype == self.target:
                    self._emit(buf, n * src_item)
                else:
                    cast = torch.frombuffer(buf, dtype=src_dtype, count=n).to(self.target)
                    nb = n * self.itemsize
                    buf[:nb] = memoryview(cast.numpy()).cast("B")
                    self._emit(buf, nb)
                done += n
        finally:
            os.close(fd)
        return self._record(name, offset, numel * self.itemsize, s.shape)

    def add_array(self, name: str, array: np.ndarray) -> DataEntry:
        """A computed tensor (the RoPE tables), already in the export dtype."""
        offset = self._align()
        raw = memoryview(np.ascontiguousarray(array)).cast("B")
        for start in range(0, len(raw), CHUNK):
            part = raw[start:start + CHUNK]
            buf = self._buffer()
            buf[:len(part)] = part
            self._emit(buf, len(part))
        return self._record(name, offset, len(raw), tuple(array.shape))

    def _record(self, name: str, offset: int, length: int, dims) -> DataEntry:
        if name in self.entries:
            raise ValueError(f"{name} written twice")
        entry = DataEntry(name, offset, length, tuple(int(d) for d in dims))
        self.entries[name] = entry
        return entry

    def close(self) -> None:
        if self._fd < 0:
            return
        try:
            os.close(self._fd)
        finally:
            self._fd = -1
            self._pool.shutdown(wait=True)
        self.sha256 = self._hash.hexdigest() if self._hash is not None else None
