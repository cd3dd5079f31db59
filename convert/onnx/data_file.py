"""The external-data writer: tensors streamed into page-aligned data files, cast, written and hashed in one pass.

The weights go into ``len(names)`` files (lanes), each tensor whole in one of them: the lane with
the fewest bytes planned so far. Planning is pure data (``add_source``/``add_array`` return at once
with the tensor's file and place); ``write`` then moves the bytes, one thread per lane, each going
through its own tensors in file order a PIECE at a time:

  cast    a piece of the source, read through a short-lived mmap window of it (WINDOW bytes,
          numpy, titan_pipe.convert.casts), into the lane's PIECE-sized buffer of the export dtype
  write   pwrite that buffer at its offset, WRITE_SLICE bytes a call
  hash    the lane file's digest (titan_pipe.io.hashing: xxh3_128 or sha256) of the same buffer

A tensor already in the export dtype is copied file to file by the kernel instead (copy_file_range,
what `cp` does; pread/pwrite where the file system refuses) and hashed from a window of the source,
whose bytes the copy's are (no second read of a data file).

Why a piece at a time in one thread, not a pipeline of threads: a piece fits in the core's L2
cache, so the write and the hash read what the cast has just written from cache, and nothing waits
for another thread. bf16 -> fp32 of 2.14 GB, two files, pages pre-backed, in-process: the weights took
0.81-0.83 s this way (the export 0.91-0.98 s, 0.6-0.7 user-CPU-s), against 0.97 s (1.14 s, 0.79
user-CPU-s) for 16 MB chunks handed between two cast threads, a writer and a hasher per file.

Why lanes: a file system serializes buffered writes to one file (ext4 takes the inode's lock for
each), so one file is written at one writer's speed however many cores there are. Writing 4.28 GB
here: one file 0.69-0.83 s, the same bytes as two files on two threads 0.42-0.43 s, two threads
into one file 0.71-0.83 s. A bf16 -> fp32 export writes twice the bytes it reads and was bound by
its single writer.

Numpy, the file calls and the hashers release the GIL. Each lane file's blocks are reserved
(fallocate) before a byte is written, so a full disk fails first. Memory: per lane one PIECE buffer
and one source window of at most WINDOW bytes, for at most as many lanes at once as there are
cores, whatever the model's size. No torch is imported.

Why not mmap whole files (see pipeline/weights/readers/store.py): pages of a mapping count in the resident
set until unmapped, so a mapped 14 GB model reads as 14 GB RSS; a window unmapped right after use
keeps the bound real, and the page cache still serves the reads. A source shorter than its header
says is refused before its window is mapped (touching a mapping past the end of a file faults).
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from titan_pipe.convert.casts import bits_dtype, cast_bits
from titan_pipe.convert.onnx.weights import DataEntry
from titan_pipe.io.safetensors_io import pread_into
from titan_pipe.rules.dtypes import BY_NAME, DTYPE_SIZES
from titan_pipe.errors import UserError
from titan_pipe.io.hashing import new_hasher
from titan_pipe.model.unified_dir import StoredParam

ALIGN = 4096  # page-aligned tensors, so a runtime can mmap them
# A window's pages mapped in one call (MAP_POPULATE) rather than a fault per few pages as the cast
# touches them: the cast of a 2.14 GB bf16 model measured 0.80-0.82 CPU-s instead of 0.89-0.97 (-> fp32)
# and 1.23-1.26 instead of 1.29-1.39 (-> fp16). The pages are the page cache's; nothing is read twice.
_WINDOW_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
WINDOW = 16 * 2**20  # bytes of the larger side (source or export dtype) of a source window mapped at once
# Bytes of the larger side of a piece: cast, written and hashed while in the core's L2 cache (2 MB here).
# bf16 -> fp32 as above: 512 kB pieces 0.77-0.93 s, 2 MB 0.70-0.74 s.
PIECE = 2 * 2**20
# Bytes per pwrite call. The page cache sizes a new folio by the write that creates it, and on these VMs
# (free page reporting: memory freed a few seconds ago goes back to the host) the cost of a folio
# depends on where its pages come from. Measured here, bf16 -> fp32 (4.28 GB written), pages freed by
# the previous export just before: 128 kB calls 1.24-1.45 s, 256 kB 1.25-1.6, 512 kB 0.99-1.09,
# 1 MB 1.00-1.09 (best of 4 each); 3 GB into memory the host had taken back: 128 kB 5.3-9.6 s, 256 kB
# 6.4, 512 kB 10.4-11.1, 1 MB 16-17. 512 kB is as fast as 1 MB where pages are at hand (any host that
# does not hand its free memory back) and ~1.5x, not ~2.5x, 128 kB's cost where they are not.
WRITE_SLICE = 512 * 1024
_ZEROS = memoryview(bytes(ALIGN))  # alignment padding


@dataclass
class _Lane:
    """One data file: its planned steps in file order, and its digest."""

    name: str
    fd: int
    hasher: object | None
    steps: list[tuple] = field(default_factory=list)  # ("bytes", view, pos) | ("source", StoredParam, pos)
    end: int = 0  # bytes planned so far


class DataWriter:
    """Tensors into the data files ``names`` under ``folder``, page-aligned, each file hashed with
    ``digest`` (an algorithm of titan_pipe.io.hashing.DIGESTS; None: not hashed). Plan with ``add_source``
    and ``add_array``, then ``write``; ``entries`` says where each tensor is, and ``write`` returns
    (and ``digests`` keeps) each file's hex digest (None when not hashed). Use as a context manager:
    leaving it closes the files.
    """

    def __init__(self, folder: Path, names: Sequence[str], dtype: str, *, digest: str | None):
        if not names or len(set(names)) != len(names):
            raise ValueError(f"data file names must be distinct and at least one, got {list(names)}")
        self.code, self.itemsize = BY_NAME[dtype].code, BY_NAME[dtype].itemsize
        self.folder = Path(folder)
        self.entries: dict[str, DataEntry] = {}
        self.digests: dict[str, str | None] = {}
        self._lanes: list[_Lane] = []
        self._stop = threading.Event()  # set by the first lane that fails: the others stop at their next piece
        self._kernel_copy = hasattr(os, "copy_file_range")  # cleared by a lane when refused
        try:
            for name in names:
                fd = os.open(self.folder / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # the umask applies
                self._lanes.append(_Lane(name, fd, new_hasher(digest) if digest is not None else None))
        except BaseException:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- planning (pure data) -------------------------------------------------------------------

    def add_source(self, name: str, src: StoredParam) -> DataEntry:
        """Plan one stored tensor, cast to the export dtype when written."""
        s = src.stored
        lane = self._lane_for()
        offset = self._align(lane)
        length = s.nbytes // DTYPE_SIZES[s.dtype] * self.itemsize
        lane.steps.append(("source", src, offset))
        lane.end += length
        return self._record(name, lane, offset, length, s.shape)

    def add_stacked(self, name: str, parts: Sequence[StoredParam]) -> DataEntry:
        """Plan tensors stored one per expert as one stacked tensor (E, ...): their bytes back to back
        (the row-major stack), each cast when written."""
        lane = self._lane_for()
        offset = pos = self._align(lane)
        for src in parts:
            lane.steps.append(("source", src, pos))
            pos += src.stored.nbytes // DTYPE_SIZES[src.stored.dtype] * self.itemsize
        lane.end = pos
        return self._record(name, lane, offset, pos - offset, (len(parts), *parts[0].stored.shape))

    def add_array(self, name: str, array: np.ndarray) -> DataEntry:
        """Plan a computed tensor (the RoPE tables), already in the export dtype; kept alive until written."""
        lane = self._lane_for()
        offset = self._align(lane)
        raw = memoryview(np.ascontiguousarray(array)).cast("B")
        lane.steps.append(("bytes", raw, offset))
        lane.end += len(raw)
        return self._record(name, lane, offset, len(raw), tuple(array.shape))

    def _lane_for(self) -> _Lane:
        """The lane with the fewest bytes planned (the first of equals): the files end up within one
        tensor of each other's size."""
        return min(self._lanes, key=lambda lane: lane.end)

    @staticmethod
    def _align(lane: _Lane) -> int:
        pad = (-lane.end) % ALIGN
        if pad:
            lane.steps.append(("bytes", _ZEROS[:pad], lane.end))
            lane.end += pad
        return lane.end

    def _record(self, name: str, lane: _Lane, offset: int, length: int, dims) -> DataEntry:
        if name in self.entries:
            raise ValueError(f"{name} written twice")
        entry = DataEntry(name, lane.name, offset, length, tuple(int(d) for d in dims))
        self.entries[name] = entry
        return entry

    # -- doing ----------------------------------------------------------------------------------

    def write(self) -> dict[str, str | None]:
        """Write every planned byte, each file on a thread of its own (at most one thread per core: the
        files beyond wait for a free one); {file name: hex digest (None when not hashed)}. Raises the first error a lane met (the other lanes stop at their next piece)."""
        for lane in self._lanes:
            self._reserve(lane)
        threads = min(len(self._lanes), os.cpu_count() or 1)  # more would only share the cores (and memory)
        with ThreadPoolExecutor(threads, thread_name_prefix="export-lane") as pool:
            jobs = [pool.submit(self._run_lane, lane) for lane in self._lanes]
            try:
                for job in jobs:
                    job.result()
            except BaseException:  # an interrupt here, or a lane's error: the others stop at their next piece
                self._stop.set()
                raise
        self.digests = {lane.name: lane.hasher.hexdigest() if lane.hasher is not None else None for lane in self._lanes}
        return self.digests

    def _reserve(self, lane: _Lane) -> None:
        """Allocate the file's blocks before its bytes are written: ext4 then allocates at once instead of
        at each write (writing 4.3 GB measured 0.76-0.79 s instead of 0.94-1.34 s here), and a full disk
        fails here, before any work. Skipped where the file system cannot."""
        if lane.end and hasattr(os, "posix_fallocate"):
            try:
                os.posix_fallocate(lane.fd, 0, lane.end)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise

    def _run_lane(self, lane: _Lane) -> None:
        """A lane's thread: its steps in file order; on an error the other lanes are told to stop."""
        sources: dict[Path, int] = {}
        buf = np.empty(PIECE, np.uint8)
        try:
            for step in lane.steps:
                if self._stop.is_set():
                    return
                if step[0] == "bytes":
                    self._put(lane, step[1], step[2])
                    continue
                _, src, pos = step
                if src.file not in sources:
                    sources[src.file] = os.open(src.file, os.O_RDONLY)
                if src.stored.dtype == self.code:
                    self._copy(lane, sources[src.file], src, pos, buf)
                else:
                    self._cast(lane, sources[src.file], src, pos, buf)
        except BaseException:
            self._stop.set()
            raise
        finally:
            for fd in sources.values():
                os.close(fd)

    def _put(self, lane: _Lane, data, pos: int) -> None:
        """Write bytes at ``pos`` of the lane's file, WRITE_SLICE a call, and hash them."""
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.pwrite(lane.fd, view[done : done + WRITE_SLICE], pos + done)
        if lane.hasher is not None:
            lane.hasher.update(view)

    def _cast(self, lane: _Lane, fd: int, src: StoredParam, pos: int, buf: np.ndarray) -> None:
        """A tensor cast a PIECE at a time from WINDOW-sized windows of the page cache (one copy fewer than
        pread into a buffer) into ``buf``, each piece written and hashed while in cache."""
        s = src.stored
        src_item = DTYPE_SIZES[s.dtype]
        numel = s.nbytes // src_item
        larger = max(src_item, self.itemsize)
        per_window, per_piece = max(1, WINDOW // larger), max(1, PIECE // larger)
        src_bits, out_bits = bits_dtype(s.dtype), bits_dtype(self.code)
        for first in range(0, numel, per_window):
            if self._stop.is_set():
                return
            n = min(per_window, numel - first)
            at, nbytes = s.start + first * src_item, n * src_item
            if os.fstat(fd).st_size < at + nbytes:  # a mapping past the end would fault, not raise
                raise UserError(
                    f"{src.file}: ended early while reading byte {at}; the file was truncated during the export"
                )
            base = at - at % mmap.ALLOCATIONGRANULARITY
            with mmap.mmap(fd, at + nbytes - base, flags=_WINDOW_FLAGS, prot=mmap.PROT_READ, offset=base) as window:
                whole = np.frombuffer(window, np.uint8, nbytes, at - base).view(src_bits)
                for i in range(0, n, per_piece):
                    part = whole[i : i + per_piece]
                    out = buf[: len(part) * self.itemsize]
                    cast_bits(part, s.dtype, out.view(out_bits), self.code)
                    self._put(lane, out, pos + (first + i) * self.itemsize)
                del whole, part  # the mapping closes only once no array views it

    def _copy(self, lane: _Lane, fd: int, src: StoredParam, pos: int, buf: np.ndarray) -> None:
        """A tensor already in the export dtype: copied by the kernel where it can, a WINDOW at a time,
        each hashed from a window of the source (the copy's bytes)."""
        s = src.stored
        for done in range(0, s.nbytes, WINDOW):
            if self._stop.is_set():
                return
            n = min(WINDOW, s.nbytes - done)
            at = s.start + done
            if not self._copy_range(lane, fd, src.file, at, n, pos + done):
                self._copy_through(lane, fd, src.file, at, n, pos + done, buf)
                continue
            if lane.hasher is not None:
                self._hash_range(lane, src.file, fd, at, n)

    def _copy_range(self, lane: _Lane, fd: int, path: Path, start: int, length: int, pos: int) -> bool:
        """copy_file_range of the bytes; False where this file system pair refuses (from then on)."""
        if not self._kernel_copy:
            return False
        try:
            done = 0
            while done < length:
                n = os.copy_file_range(fd, lane.fd, length - done, start + done, pos + done)
                if n == 0:
                    raise UserError(
                        f"{path}: ended early while reading byte {start + done}; the file was "
                        "truncated during the export"
                    )
                done += n
            return True
        except OSError:  # EXDEV/EINVAL/ENOSYS: this file system pair cannot; pread/pwrite from here on
            self._kernel_copy = False
            return False

    def _copy_through(
        self, lane: _Lane, fd: int, path: Path, start: int, length: int, pos: int, buf: np.ndarray
    ) -> None:
        """pread a PIECE at a time into ``buf``, then write and hash it."""
        for at in range(0, length, len(buf)):
            part = memoryview(buf)[: min(len(buf), length - at)]
            pread_into(fd, part, start + at, path)
            self._put(lane, part, pos + at)

    @staticmethod
    def _hash_range(lane: _Lane, path: Path, fd: int, start: int, length: int) -> None:
        """Digest bytes of a file through an mmap window unmapped right after (it counts in RSS while mapped)."""
        if os.fstat(fd).st_size < start + length:
            raise UserError(f"{path}: ended early while reading byte {start}; the file was truncated during the export")
        base = start - start % mmap.ALLOCATIONGRANULARITY
        with mmap.mmap(fd, start + length - base, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=base) as mm:
            with memoryview(mm) as whole, whole[start - base :] as part:
                lane.hasher.update(part)

    # -- the end --------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the data files (idempotent)."""
        for lane in self._lanes:
            if lane.fd >= 0:
                os.close(lane.fd)
                lane.fd = -1
