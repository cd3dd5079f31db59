"""The one loop: for each output file, write its header, then fill each tensor from the plan's reads.

A tensor whose every read is a contiguous byte range on both sides in the same dtype (TP shards
split on dim 0, whole tensors) is copied file-to-file by the kernel. Anything else is assembled in
row blocks of at most ``BLOCK_BYTES`` in a buffer each thread keeps for the whole run. Same-dtype
reads whose source bytes are contiguous (dim-1 TP splits of safetensors shards: each output row
interleaves one run from every shard) are scattered straight into their places in that buffer by
one ``preadv`` per read, an iovec per run, so each byte is copied once into the buffer and once out;
the RoPE row reorder of q/k is the same scatter with the rows' destinations permuted. The rest
(dtype casts, pickled Megatron sources, strided chunks) goes through torch. The block buffer
plus the source pieces that land in it are all the memory the conversion holds, whatever the model
size (legacy Megatron sources add the mapped pages of the rank files being read).
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from titan_pipe.records.checkpoint_format import Box
from titan_pipe.convert.finite import has_nonfinite
from titan_pipe.weights.readers.store import Store, contiguous_span
from titan_pipe.weights.read import deinterleave_rope, read_global
from titan_pipe.weights.source_plan import OutFile, OutTensor, Read
from titan_pipe.io.safetensors_io import Entry, SafetensorsWriter
from titan_pipe.rules.dtypes import DTYPE_SIZES
from titan_pipe.errors import UserError

if TYPE_CHECKING:
    import torch

BLOCK_BYTES = 32 * 2**20
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_local = threading.local()  # each fill thread's block buffer, reused across blocks and tensors


def _block_buffer(nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` from this thread's reusable buffer (grown when needed).

    Reusing it matters: a fresh 32 MiB allocation per block is a fresh mapping whose every page
    faults and is zeroed before the first byte lands.
    """
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _local.buf = bytearray(max(nbytes, 1))
    return memoryview(buf)[:nbytes]


def box_runs(shape: tuple[int, ...], box: Box, itemsize: int) -> tuple[np.ndarray, int]:
    """(byte offset of every contiguous run, run length in bytes) of ``box`` in a row-major tensor.

    The run is the box's extent from its last partial dim on (every later dim is whole); the
    offsets enumerate the box's index grid over the dims before it, in row-major order.
    """
    if not shape:
        return np.zeros(1, dtype=np.int64), itemsize
    d = max((k for k in range(len(shape)) if box.lengths[k] != shape[k]), default=0)
    strides = [math.prod(shape[k + 1 :]) * itemsize for k in range(len(shape))]
    run = math.prod(box.lengths[d:]) * itemsize
    offs = np.array([box.offsets[d] * strides[d]], dtype=np.int64)
    for k in range(d - 1, -1, -1):
        idx = (box.offsets[k] + np.arange(box.lengths[k], dtype=np.int64)) * strides[k]
        offs = (idx[:, None] + offs[None, :]).reshape(-1)
    return offs, run


def _scatter_read(fd: int, src_off: int, buf: memoryview, offs: np.ndarray, run: int, path) -> None:
    """Read ``len(offs) * run`` contiguous bytes at ``src_off`` into ``buf[o:o + run]`` for each o."""
    views = [buf[o : o + run] for o in offs.tolist()]
    pos, i = src_off, 0
    while i < len(views):
        batch = views[i : i + IOV_MAX]
        got = os.preadv(fd, batch, pos)
        if got == 0:
            raise UserError(
                f"{path}: ended early while reading byte {pos}; the file was truncated during the conversion"
            )
        pos += got
        full, part = divmod(got, run)
        i += full
        if part:  # a short read stopped inside a run: finish that run from where it stopped
            views[i] = views[i][part:]
            run_left = len(views[i])
            while run_left:
                n = os.preadv(fd, [views[i][len(views[i]) - run_left :]], pos)
                if n == 0:
                    raise UserError(
                        f"{path}: ended early while reading byte {pos}; the file was truncated during the conversion"
                    )
                pos += n
                run_left -= n
            i += 1


def rope_row_runs(shape: tuple[int, ...], box: Box, itemsize: int, head_dim: int) -> tuple[np.ndarray, int]:
    """Where each source row of ``box`` lands after the RoPE reorder, in source row order.

    For a box of whole rows (every dim after 0 taken whole) of whole heads: source row 2i + h of
    a head lands on row h*hd/2 + i of that head (see ``deinterleave_rope``). Returns (byte offset
    in the row-major ``shape`` buffer of each source row's destination, row bytes), or (empty, 0)
    when the box is not whole rows of whole heads (then the torch path does the reorder).
    """
    if not shape or tuple(box.lengths[1:]) != tuple(shape[1:]) or box.lengths[0] % head_dim:
        return np.zeros(0, dtype=np.int64), 0
    row = math.prod(shape[1:]) * itemsize
    j = np.arange(box.lengths[0], dtype=np.int64)
    w = j % head_dim
    dest = j - w + (w % 2) * (head_dim // 2) + w // 2
    return (box.offsets[0] + dest) * row, row


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
    return [
        Box((a, *([0] * (len(shape) - 1))), (min(rows, shape[0] - a), *shape[1:])) for a in range(0, shape[0], rows)
    ]


def _slices(box: Box, origin: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o - b, o - b + n) for o, n, b in zip(box.offsets, box.lengths, origin))


def _add_low_rank(buf: torch.Tensor, t: OutTensor, block: Box, ab: tuple[torch.Tensor, torch.Tensor], scale: float):
    """Add scale * B A over ``block`` (of output tensor ``t``, whose region sits in the global tensor)."""
    from titan_pipe.model.lora_modules import merge  # here, not at the top: byte copies need no torch

    a, b = ab
    r0 = t.region.offsets[0] + block.offsets[0]
    c0 = t.region.offsets[1] + block.offsets[1]
    buf.copy_(merge(buf, a[:, c0 : c0 + block.lengths[1]], b[r0 : r0 + block.lengths[0]], scale))


def fill_tensor(w: SafetensorsWriter, t: OutTensor, store: Store, nonfinite: set[str] | None = None) -> None:
    """Write every byte of output tensor ``t`` into ``w``; a block it assembles that holds NaN/Inf
    adds ``t.key`` to ``nonfinite`` (byte-copied tensors are checked by the sha256 pass instead).
    A tensor with a low-rank ``delta`` (a LoRA merge) is assembled in blocks, the term added to each."""
    reads = t.reads()
    low = t.source.delta
    ab = None if low is None else (read_global(low.a, store).float(), read_global(low.b, store).float())
    direct = None if low is not None else _direct(t, reads, store)
    if direct is not None:
        for _, (fd, src_off, n), (dst_off, _) in direct:
            w.copy(t.key, dst_off, fd, src_off, n)
        return
    itemsize = DTYPE_SIZES[t.dtype]
    for block in _row_blocks(t, reads):
        raw = _block_buffer(block.numel * itemsize)
        buf = None  # the torch view of raw, made only when a read needs torch
        for r in reads:
            c = r.clip(block)
            if c is None:
                continue
            span = None if t.source.dtype != t.dtype else store.byte_span(c.file, c.key, c.src_box)
            rel = Box(tuple(o - b for o, b in zip(c.dst_box.offsets, block.offsets)), c.dst_box.lengths)
            if span is not None:
                fd, src_off, n = span
                offs, run = (
                    rope_row_runs(block.lengths, rel, itemsize, c.rope_head_dim)
                    if c.rope_head_dim
                    else box_runs(block.lengths, rel, itemsize)
                )
                if run and n == len(offs) * run:
                    _scatter_read(fd, src_off, raw, offs, run, store.root / c.file)
                    continue
            if buf is None:
                import torch  # only here: byte copies and scatters need none

                from titan_pipe.rules.dtypes import TORCH_DTYPES

                out_dtype = TORCH_DTYPES[t.dtype]
                buf = (
                    torch.frombuffer(raw, dtype=torch.uint8).view(out_dtype).view(block.lengths)
                    if raw.nbytes
                    else torch.empty(block.lengths, dtype=out_dtype)
                )
            piece = store.read_box(c.file, c.key, c.src_box)
            if c.rope_head_dim:
                piece = deinterleave_rope(piece, c.rope_head_dim)
            buf[_slices(c.dst_box, block.offsets)].copy_(piece)
        if ab is not None:
            if buf is None:
                import torch

                from titan_pipe.rules.dtypes import TORCH_DTYPES

                buf = torch.frombuffer(raw, dtype=torch.uint8).view(TORCH_DTYPES[t.dtype]).view(block.lengths)
            _add_low_rank(buf, t, block, ab, low.scale)
        start = contiguous_span(t.shape, block, itemsize)[0]
        if nonfinite is not None and t.key not in nonfinite and has_nonfinite(raw, t.dtype):
            nonfinite.add(t.key)
        w.write(t.key, start, raw)


def write_file(
    out_dir: Path,
    f: OutFile,
    store: Store,
    *,
    metadata: dict[str, str] | None = None,
    advance: Callable[[int], None] = lambda n: None,
    threads: int = 2,
    nonfinite: set[str] | None = None,
) -> Path:
    """Write one output safetensors file (atomically: a hidden partial name, renamed when whole).

    Tensors land at fixed offsets, so with a thread-safe store (safetensors sources) ``threads``
    of them are filled at once: the copies are kernel calls that release the GIL, and two of
    them keep a disk and a memory bus busier than one. Memory: ``threads`` blocks at most.
    """
    entries = [Entry(t.key, t.dtype, t.stored_shape or t.shape) for t in f.tensors]
    with SafetensorsWriter(out_dir / f.name, entries, metadata) as w:
        if threads > 1 and store.threadsafe and len(f.tensors) > 1:
            with ThreadPoolExecutor(threads, thread_name_prefix="titan-pipe-fill") as pool:
                futures = [pool.submit(fill_tensor, w, t, store, nonfinite) for t in f.tensors]
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
                fill_tensor(w, t, store, nonfinite)
                advance(t.nbytes)
        return w.commit()
