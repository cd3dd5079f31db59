"""Export weights: plan them from safetensors headers, then stream them into ONE external-data file.

Planning reads only the headers (names, dtypes, shapes, byte offsets) of the unified directory and
checks them against config.json, so a bad directory fails before a byte is written. Streaming
then copies each tensor, chunk by chunk, from its source file into ``model.onnx.data``, cast to
the export dtype on the way and page-aligned so a runtime can mmap it; the sha256 of the data file
is computed from the same chunks as they pass (no second read). Memory: two chunk buffers.

Why pread and not mmap (see convert/readers/store.py): pages of a mapping count in the resident
set until unmapped, so a mapped 14 GB model reads as 14 GB RSS; pread into a reused buffer keeps
the bound real, and the page cache still serves the reads.
"""
from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from titan_pipe.convert.readers.store import StoredTensor, pread_into, read_header
from titan_pipe.dtypes import BY_NAME, HF_DTYPE_NAMES, TORCH_BY_NAME
from titan_pipe.errors import UserError
from titan_pipe.model_args import ModelArgs
from titan_pipe.training.model import build_model
from titan_pipe.unified_dir import CONFIG, locate_weights, native_name

ALIGN = 4096  # page-aligned tensors, so a runtime can mmap them
CHUNK = 32 * 2**20  # bytes per read; two buffers of this are the streaming's memory
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
    """Native parameter name -> shape, from the model built on the meta device (no memory)."""
    model = build_model(args, seed=None, device="meta")
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


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
            if stored not in header:
                raise UserError(f"{path}: the index says it holds {stored!r}, but it does not; re-run the conversion")
            name = native_name(stored, path)
            if name is None:
                continue
            if name not in expected:
                raise UserError(f"{path}: tensor {stored!r} has no place in a model with config "
                                f"{model_dir / CONFIG} ({args.n_layers} layers); the weights and "
                                "config.json do not belong together")
            if name in found:
                raise UserError(f"{path}: tensor {stored!r} is stored twice (as {name!r} already)")
            info = header[stored]
            if info.shape != expected[name]:
                raise UserError(f"{path}: tensor {stored!r} has shape {list(info.shape)}, but "
                                f"{model_dir / CONFIG} implies {list(expected[name])}; the weights and "
                                "config.json do not belong together")
            if info.dtype not in _CASTABLE:
                raise UserError(f"{path}: tensor {stored!r} has dtype {info.dtype}; export reads float32, "
                                "float16 or bfloat16 weights — convert the checkpoint with `titan-pipe convert`")
            found[name] = SourceTensor(name, path, stored, info)
    missing = sorted(set(expected) - set(found) - ({"output.weight"} if args.tie_embeddings else set()))
    if missing:
        raise UserError(f"{model_dir}: {len(missing)} parameter(s) missing from the weights, e.g. "
                        f"{missing[0]!r} (config.json: {args.n_layers} layers, dim {args.dim}); "
                        "the weights and config.json do not belong together")
    return found


class DataWriter:
    """Appends tensors to one data file, page-aligned, hashing every byte written (in a helper thread
    so the digest overlaps the next read). Use as a context manager; ``sha256`` after close."""

    def __init__(self, path: Path, dtype: str):
        self.path, self.target = Path(path), TORCH_BY_NAME[dtype]
        self.itemsize = BY_NAME[dtype].itemsize
        self._out = open(self.path, "wb")
        self._hash = hashlib.sha256()
        self._pool = ThreadPoolExecutor(max_workers=1)
        self._bufs = [bytearray(CHUNK), bytearray(CHUNK)]
        self._busy = [None, None]  # the hash future still reading each buffer
        self._turn = 0
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
        view = memoryview(buf)[:n]
        self._out.write(view)
        self._busy[self._turn] = self._pool.submit(self._hash.update, view)

    def _align(self) -> int:
        pos = self._out.tell()
        pad = (-pos) % ALIGN
        if pad:
            buf = self._buffer()
            buf[:pad] = bytes(pad)
            self._emit(buf, pad)
        return pos + pad

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
                buf = self._buffer()
                if src_dtype == self.target:
                    pread_into(fd, memoryview(buf)[:n * src_item], s.start + done * src_item, src.file)
                    self._emit(buf, n * src_item)
                else:
                    pread_into(fd, memoryview(buf)[:n * src_item], s.start + done * src_item, src.file)
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
        if self._out.closed:
            return
        try:
            self._out.close()
        finally:
            self._pool.shutdown(wait=True)
        self.sha256 = self._hash.hexdigest()
