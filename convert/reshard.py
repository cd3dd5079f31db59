"""The one loop: for each output file, write its header, then fill each tensor from the plan's reads.

A tensor whose every read is a contiguous byte range on both sides in the same dtype (TP shards
split on dim 0, whole tensors) is copied file-to-file by the kernel. Anything else (dim-1 splits,
dtype casts, the RoPE row reorder, pickled sources) is assembled in row blocks of at most
``BLOCK_BYTES``: the block buffer plus the source pieces that land in it are all the memory the
conversion holds, whatever the model size (DCP and Megatron sources add the one stored chunk or
rank file being read).
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from titan_pipe.convert.layout import Box
from titan_pipe.convert.plan import DTYPE_SIZES, OutFile, OutTensor, Read
from titan_pipe.convert.readers.store import TORCH_DTYPES, Store, contiguous_span
from titan_pipe.convert.writer import Entry, SafetensorsWriter

BLOCK_BYTES = 32 * 2**20


def deinterleave_rope(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of whole heads, Meta interleaved pairs -> rotate-half: row 2i+h of a head -> h*hd/2 + i.

    x: (n * head_dim, ...) -> same shape. This is the permutation Hugging Face's LLaMA conversion
    applies to q/k (``view(heads, hd/2, 2, ...).transpose(1, 2)``).
    """
    rows = x.shape[0]
    rest = x.shape[1:]
    return x.reshape(rows // head_dim, head_dim // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def _direct(t: OutTensor, reads: list[Read], store: Store) -> list[tuple[Read, tuple, tuple]] | None:
    """(read, source span, destination span) for every read, if all are plain byte copies."""
    itemsize = DTYPE_SIZES[t.dtype]
    out = []
    for r in reads:
        if r.rope_head_dim or t.source.dtype != t.dtype:
            return None
        src = store.byte_span(r.file, r.key, r.src_box)
        dst = contiguous_span(t.shape, r.dst_box, itemsize)
        if src is None or dst is None:
            return None
        out.append((r, src, dst))
    return out


def _row_blocks(t: OutTensor, reads: list[Read]) -> list[Box]:
    """Row ranges (dim 0) of the output tensor of at most BLOCK_BYTES, aligned to RoPE heads."""
    shape = t.shape
    if not shape:
        return [Box((), ())]
    row_bytes = max(1, math.prod(shape[1:]) * max(DTYPE_SIZES[t.dtype], DTYPE_SIZES[t.source.dtype]))
    rows = max(1, BLOCK_BYTES // row_bytes)
    align = max((r.rope_head_dim or 1) for r in reads) if reads else 1
    rows = max(align, rows // align * align)
    return [Box((a, *([0] * (len(shape) - 1))), (min(rows, shape[0] - a), *shape[1:]))
            for a in range(0, shape[0], rows)]


def _slices(box: Box, origin: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o - b, o - b + n) for o, n, b in zip(box.offsets, box.lengths, origin))


def fill_tensor(w: SafetensorsWriter, t: OutTensor, store: Store) -> None:
    """Write every byte of output tensor ``t`` into ``w``."""
    reads = t.reads()
    direct = _direct(t, reads, store)
    if direct is not None:
        for _, (fd, src_off, n), (dst_off, _) in direct:
            w.copy(t.key, dst_off, fd, src_off, n)
        return
    out_dtype = TORCH_DTYPES[t.dtype]
    for block in _row_blocks(t, reads):
        buf = torch.empty(block.lengths, dtype=out_dtype)
        for r in reads:
            c = r.clip(block)
            if c is None:
                continue
            piece = store.read_box(c.file, c.key, c.src_box)
            if c.rope_head_dim:
                piece = deinterleave_rope(piece, c.rope_head_dim)
            buf[_slices(c.dst_box, block.offsets)].copy_(piece)
        start = contiguous_span(t.shape, block, DTYPE_SIZES[t.dtype])[0]
        w.write(t.key, start, buf.reshape(-1).view(torch.uint8).numpy())


def write_file(out_dir: Path, f: OutFile, store: Store, *, metadata: dict[str, str] | None = None,
               advance: Callable[[int], None] = lambda n: None, threads: int = 2) -> Path:
    """Write one output safetensors file (atomically: a hidden partial name, renamed when whole).

    Tensors land at fixed offsets, so with a thread-safe store (safetensors sources) ``threads``
    of them are filled at once: the copies are kernel calls that release the GIL, and two of
    them keep a disk and a memory bus busier than one. Memory: ``threads`` blocks at most.
    """
    entries = [Entry(t.key, t.dtype, t.shape) for t in f.tensors]
    with SafetensorsWriter(out_dir / f.name, entries, metadata) as w:
        if threads > 1 and store.threadsafe and len(f.tensors) > 1:
            with ThreadPoolExecutor(threads, thread_name_prefix="titan-pipe-fill") as pool:
                futures = [pool.submit(fill_tensor, w, t, store) for t in f.tensors]
                try:
                    for t, fut in zip(f.tensors, futures):
                        fut.result()
                        advance(t.nbytes)
                except BaseException:
                    for fut in futures:
                        fut.cancel()
                    raise
        else:
            for t in f.tensors:
                fill_tensor(w, t, store)
                advance(t.nbytes)
        return w.commit()
