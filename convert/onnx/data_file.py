"""The external-data writer: tensors streamed into ONE page-aligned file, cast, written and hashed in one pass.

Every offset is planned up front in the caller's thread (``add_source``/``add_array`` return at once
with the tensor's place); the bytes move on worker threads; write and hash take the chunks in file order:

  load    (LOADERS threads, a chunk each) cast a chunk of the source, read through a short-lived
          mmap window of it (numpy, titan_pipe.convert.casts), into a chunk buffer of the export dtype
  write   pwrite that buffer at its offset, WRITE_SLICE bytes a call; a tensor already in the export
          dtype skips load and is copied file to file by the kernel here instead (copy_file_range,
          what `cp` does; pread/pwrite where the file system refuses)
  hash    the digest (titan_pipe.hashing: xxh3_128 or sha256) of the same bytes: the chunk buffer,
          or for a kernel copy a short-lived mmap window of the source, whose bytes the copy's are
          (no second read of the data file)

so reading, casting, writing and hashing of different chunks overlap; numpy, the file calls and
the hashers release the GIL. Each tensor's blocks are reserved (fallocate) before its bytes are
written. Memory: DEPTH chunk buffers and LOADERS source windows of a chunk, whatever the model's size;
the caller blocks when all chunk buffers are in flight. No torch is imported.

Why not mmap whole files (see convert/readers/store.py): pages of a mapping count in the resident
set until unmapped, so a mapped 14 GB model reads as 14 GB RSS; a window unmapped right after use
keeps the bound real, and the page cache still serves the reads. A source shorter than its header
says is refused before its window is mapped (touching a mapping past the end of a file faults).
"""
from __future__ import annotations

import errno
import mmap
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from titan_pipe.convert.casts import bits_dtype, cast_bits
from titan_pipe.convert.onnx.weights import DataEntry, SourceTensor
from titan_pipe.convert.readers.store import pread_into
from titan_pipe.dtypes import BY_NAME, DTYPE_SIZES
from titan_pipe.errors import UserError
from titan_pipe.hashing import new_hasher

ALIGN = 4096  # page-aligned tensors, so a runtime can mmap them
# A load window's pages mapped in one call (MAP_POPULATE) rather than a fault per few pages as the cast
# touches them: the cast of a 2.14 GB bf16 model measured 0.80-0.82 CPU-s instead of 0.89-0.97 (-> fp32)
# and 1.23-1.26 instead of 1.29-1.39 (-> fp16). The pages are the page cache's; nothing is read twice.
_WINDOW_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
CHUNK = 16 * 2**20  # bytes of the larger side of a chunk (source or export dtype)
DEPTH = 4  # chunk buffers in flight: two being filled, one being written and hashed, one free to fill
LOADERS = 2  # load threads: the cast is the largest cost (numpy releases the GIL), so two chunks cast at once
# Bytes per pwrite call. The page cache sizes a new folio by the write that creates it, and on these VMs
# (free page reporting: memory freed a few seconds ago goes back to the host) the cost of a folio
# depends on where its pages come from. Measured here, bf16 -> fp32 (4.28 GB written), pages freed by
# the previous export just before: 128 kB calls 1.24-1.45 s, 256 kB 1.25-1.6, 512 kB 0.99-1.09,
# 1 MB 1.00-1.09 (best of 4 each); 3 GB into memory the host had taken back: 128 kB 5.3-9.6 s, 256 kB
# 6.4, 512 kB 10.4-11.1, 1 MB 16-17. 512 kB is as fast as 1 MB where pages are at hand (any host that
# does not hand its free memory back) and ~1.5x, not ~2.5x, 128 kB's cost where they are not.
WRITE_SLICE = 512 * 1024


class DataWriter:
    """Appends tensors to one data file, page-aligned, hashing every byte written with ``digest`` (an
    algorithm of titan_pipe.hashing.DIGESTS; None: not hashed); ``digest`` after close is the hex digest
    (None when not hashed). Use as a context manager: leaving it waits for every byte, and raises the
    first error a worker met (nothing is complete before that).
    """

    def __init__(self, path: Path, dtype: str, *, digest: str | None):
        self.path, self.code = Path(path), BY_NAME[dtype].code
        self.itemsize = BY_NAME[dtype].itemsize
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # the umask applies
        self._pos = 0  # end of what is planned so far
        self._hash = new_hasher(digest) if digest is not None else None
        self._load = ThreadPoolExecutor(LOADERS, thread_name_prefix="export-load")
        self._write = ThreadPoolExecutor(1, thread_name_prefix="export-write")
        self._hashing = ThreadPoolExecutor(1, thread_name_prefix="export-hash") if digest is not None else None
        self._bufs = [np.empty(CHUNK, np.uint8) for _ in range(DEPTH)]
        self._buf_jobs: list[tuple[Future, ...]] = [() for _ in range(DEPTH)]  # last jobs reading each buffer
        self._turn = -1
        self._inflight: deque[Future] = deque()
        self._sources: dict[Path, int] = {}  # source file -> fd, closed at close()
        self._fallocate = hasattr(os, "posix_fallocate")  # cleared where the file system refuses
        self._kernel_copy = hasattr(os, "copy_file_range")  # cleared by the write thread when refused
        self._fallback_buf: bytearray | None = None  # the write thread's, allocated on the first refusal
        self.entries: dict[str, DataEntry] = {}
        self.digest: str | None = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(failed=exc[0] is not None)

    # -- planning (caller's thread) -------------------------------------------------------------

    def add_source(self, name: str, src: SourceTensor) -> DataEntry:
        """Stream one stored tensor in, cast to the export dtype chunk by chunk."""
        s = src.stored
        offset = self._align()
        src_item = DTYPE_SIZES[s.dtype]
        numel = s.nbytes // src_item
        self._reserve(offset, numel * self.itemsize)
        fd = self._source_fd(src.file)
        per_chunk = CHUNK // max(src_item, self.itemsize)
        for done in range(0, numel, per_chunk):
            n = min(per_chunk, numel - done)
            at, pos = s.start + done * src_item, self._pos
            self._pos += n * self.itemsize
            if s.dtype == self.code:
                self._submit(self._write.submit(self._copy, fd, at, n * src_item, pos, src.file))
                self._queue_hash(self._hash_range, src.file, at, n * src_item)
            else:
                buf, slot = self._next_buffer()
                loaded = self._load.submit(self._read_cast, fd, at, n, s.dtype, buf, src.file)
                self._chunk_done(slot, loaded, buf, n * self.itemsize, pos)
        return self._record(name, offset, numel * self.itemsize, s.shape)

    def add_array(self, name: str, array: np.ndarray) -> DataEntry:
        """A computed tensor (the RoPE tables), already in the export dtype; kept alive until written."""
        offset = self._align()
        raw = memoryview(np.ascontiguousarray(array)).cast("B")
        self._reserve(offset, len(raw))
        self._submit(self._write.submit(self._pwrite, raw, offset))
        self._queue_hash(self._hash_bytes, raw)
        self._pos += len(raw)
        return self._record(name, offset, len(raw), tuple(array.shape))

    def _align(self) -> int:
        pad = (-self._pos) % ALIGN
        if pad:
            zeros = bytes(pad)
            self._submit(self._write.submit(self._pwrite, zeros, self._pos))
            self._queue_hash(self._hash_bytes, zeros)
            self._pos += pad
        return self._pos

    def _reserve(self, offset: int, length: int) -> None:
        """Allocate the tensor's blocks before its bytes are written: ext4 then allocates at once instead of
        at each write (writing 4.3 GB measured 0.76-0.79 s instead of 0.94-1.34 s here), and a full disk
        fails here, before the tensor's work. Skipped from the first file system that cannot."""
        if self._fallocate and length:
            try:
                os.posix_fallocate(self._fd, offset, length)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
                self._fallocate = False

    def _source_fd(self, path: Path) -> int:
        if path not in self._sources:
            self._sources[path] = os.open(path, os.O_RDONLY)
        return self._sources[path]

    def _next_buffer(self) -> tuple[np.ndarray, int]:
        """The next chunk buffer, once the jobs still reading it are done (their errors raise here)."""
        self._turn = (self._turn + 1) % DEPTH
        for job in self._buf_jobs[self._turn]:
            job.result()
        return self._bufs[self._turn], self._turn

    def _chunk_done(self, slot: int, loaded: Future, buf: np.ndarray, nbytes: int, pos: int) -> None:
        """Queue the write and the digest of a chunk buffer once ``loaded`` has filled it."""
        written = self._write.submit(self._after, loaded, self._pwrite, memoryview(buf)[:nbytes], pos)
        jobs = [loaded, written]
        if self._hashing is not None:
            jobs.append(self._hashing.submit(self._after, loaded, self._hash_bytes, memoryview(buf)[:nbytes]))
        self._buf_jobs[slot] = tuple(jobs)
        for job in jobs:
            self._submit(job)

    def _queue_hash(self, fn, *args) -> None:
        if self._hashing is not None:
            self._submit(self._hashing.submit(fn, *args))

    def _submit(self, job: Future) -> None:
        """Track a job; finished ones are checked as we go, so a worker's error surfaces early."""
        self._inflight.append(job)
        while self._inflight and self._inflight[0].done():
            self._inflight.popleft().result()

    def _record(self, name: str, offset: int, length: int, dims) -> DataEntry:
        if name in self.entries:
            raise ValueError(f"{name} written twice")
        entry = DataEntry(name, offset, length, tuple(int(d) for d in dims))
        self.entries[name] = entry
        return entry

    # -- the workers ----------------------------------------------------------------------------

    def _read_cast(self, fd: int, at: int, n: int, src_code: str, buf: np.ndarray, path: Path) -> None:
        """load thread: n elements at byte ``at`` of the source -> export-dtype bits at the head of ``buf``,
        cast straight from a window of the page cache (one copy fewer than pread into a buffer)."""
        nbytes = n * DTYPE_SIZES[src_code]
        if os.fstat(fd).st_size < at + nbytes:  # a mapping past the end would fault, not raise
            raise UserError(f"{path}: ended early while reading byte {at}; the file was truncated during the export")
        base = at - at % mmap.ALLOCATIONGRANULARITY
        with mmap.mmap(fd, at + nbytes - base, flags=_WINDOW_FLAGS, prot=mmap.PROT_READ, offset=base) as window:
            src = np.frombuffer(window, np.uint8, nbytes, at - base).view(bits_dtype(src_code))
            cast_bits(src, src_code, buf[:n * self.itemsize].view(bits_dtype(self.code)), self.code)
            del src  # the mapping closes only once no array views it

    @staticmethod
    def _after(first: Future, fn, *args) -> None:
        first.result()  # raises if the chunk failed to load: then there is nothing to write or hash
        fn(*args)

    def _pwrite(self, data, pos: int) -> None:
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:done + WRITE_SLICE], pos + done)

    def _copy(self, fd: int, start: int, length: int, pos: int, path: Path) -> None:
        """write thread: a source byte range to ``pos`` of the data file, by the kernel where it can."""
        if self._kernel_copy:
            try:
                done = 0
                while done < length:
                    n = os.copy_file_range(fd, self._fd, length - done, start + done, pos + done)
                    if n == 0:
                        raise UserError(f"{path}: ended early while reading byte {start + done}; the file was "
                                        "truncated during the export")
                    done += n
                return
            except OSError:  # EXDEV/EINVAL/ENOSYS: this file system pair cannot; pread/pwrite from here on
                self._kernel_copy = False
        for at in range(0, length, CHUNK):
            if self._fallback_buf is None:
                self._fallback_buf = bytearray(CHUNK)
            part = memoryview(self._fallback_buf)[:min(CHUNK, length - at)]
            pread_into(fd, part, start + at, path)
            self._pwrite(part, pos + at)

    def _hash_bytes(self, data) -> None:
        self._hash.update(data)

    def _hash_range(self, path: Path, start: int, length: int) -> None:
        """Digest bytes of a file through an mmap window unmapped right after (it counts in RSS while mapped)."""
        base = start - start % mmap.ALLOCATIONGRANULARITY
        with open(path, "rb") as f, mmap.mmap(f.fileno(), start + length - base, offset=base,
                                             access=mmap.ACCESS_READ) as mm:
            with memoryview(mm) as whole, whole[start - base:] as part:
                self._hash.update(part)

    # -- the end --------------------------------------------------------------------------------

    def close(self, *, failed: bool = False) -> None:
        """Wait for every job (drop the queued ones when ``failed``), close the files, raise a worker's error."""
        if self._fd < 0:
            return
        try:
            for pool in (self._load, self._write, self._hashing):
                if pool is not None:
                    pool.shutdown(wait=True, cancel_futures=failed)
            if not failed:
                while self._inflight:
                    self._inflight.popleft().result()
        finally:
            for fd in (self._fd, *self._sources.values()):
                os.close(fd)
            self._fd = -1
            self._sources.clear()
        self.digest = self._hash.hexdigest() if self._hash is not None else None
