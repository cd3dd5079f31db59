"""Digests of source files in background threads, so verification overlaps the copy.

hashlib (and xxhash) release the GIL on large buffers, so the hashes run on other cores while the
fill threads move bytes; the conversion waits for them at the end and fails (leaving no output) on a
mismatch. One digest cannot be split (each block depends on the last), so the parallelism is across
files: ``threads`` files at once (default: one per core, at most the number of files). The algorithm
is one of titan_pipe.io.hashing.DIGESTS: sha256 (~1.8 GB/s a core here, so a single 1 GB file is 0.55 s
whatever the cores) or xxh3_128 (~25 GB/s: the read is the cost).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from titan_pipe.convert.finite import checks, has_nonfinite, itemsize
from titan_pipe.errors import UserError
from titan_pipe.io.hashing import new_hasher

BLOCK = 8 * 2**20
Span = tuple[int, int, str, str]  # (absolute byte offset, byte length, safetensors dtype, key)


def sha256_file(path: Path, stop: threading.Event | None = None) -> str:
    """Hex sha256 of the file; '' if ``stop`` was set before the end (the caller gave up)."""
    return scan_file(path, stop)[0]


def scan_file(
    path: Path, stop: threading.Event | None = None, tensors: list[Span] = (), algorithm: str = "sha256"
) -> tuple[str, list[str]]:
    """(hex ``algorithm`` digest of the file, keys of ``tensors`` holding NaN/Inf), in one sequential read.

    ``tensors``: (absolute start, byte length, safetensors dtype, key) of disjoint tensors (a
    safetensors header, checked by read_header); the bytes between and after them are hashed too.
    Each tensor is read in pieces of whole elements, so every element is seen whole.
    """
    h = new_hasher(algorithm)
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    bad: list[str] = []
    with open(path, "rb", buffering=0) as f:
        pos = 0
        for start, nbytes, dtype, key in sorted(tensors) + [(None, None, None, None)]:
            gap = None if start is None else start - pos
            if not _feed(f, h, view, gap, stop, None):
                return "", bad
            if start is None:
                break
            step = BLOCK // itemsize(dtype) * itemsize(dtype) if checks(dtype) else BLOCK
            found = _feed(f, h, view[:step], nbytes, stop, dtype if checks(dtype) else None)
            if found is False:
                return "", bad
            if found == "nonfinite":
                bad.append(key)
            pos = start + nbytes
    return h.hexdigest(), bad


def _feed(f, h, view: memoryview, n: int | None, stop, dtype: str | None):
    """Hash the next ``n`` bytes (None: to the end), checking them as ``dtype`` floats if given.
    False if stopped; "nonfinite" if a NaN/Inf was seen; True otherwise."""
    seen = False
    while n is None or n > 0:
        got = f.readinto(view if n is None or n >= len(view) else view[:n])
        if not got:
            return True if not seen else "nonfinite"  # a short file: the size checks report it
        if stop is not None and stop.is_set():
            return False
        h.update(view[:got])
        if dtype is not None and not seen and got % itemsize(dtype) == 0:
            seen = has_nonfinite(view[:got], dtype)
        if n is not None:
            n -= got
    return "nonfinite" if seen else True


class BackgroundHasher:
    """Hash ``files`` (relative to ``root``) in daemon threads; ``result()`` joins and checks them
    against ``expected`` (digests of the same ``algorithm``)."""

    def __init__(
        self,
        root: Path,
        files: list[str],
        expected: dict[str, str] | None = None,
        threads: int | None = None,
        tensors: dict[str, list[Span]] | None = None,
        algorithm: str = "sha256",
    ):
        self.root, self.files, self.expected = root, list(files), dict(expected or {})
        self.algorithm = algorithm
        self.tensors = dict(tensors or {})  # file -> its tensors, checked for NaN/Inf on the way
        self.digests: dict[str, str] = {}
        self.nonfinite: dict[str, list[str]] = {}  # file -> keys of tensors holding NaN/Inf
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._todo = iter(self.files)
        self._lock = threading.Lock()
        n = max(1, min(threads or os.cpu_count() or 1, len(self.files)))
        self._threads = [
            threading.Thread(target=self._run, name=f"titan-pipe-sha256-{i}", daemon=True) for i in range(n)
        ]

    def _next(self) -> str | None:
        with self._lock:
            return next(self._todo, None)

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and self.error is None and (f := self._next()) is not None:
                self.digests[f], bad = scan_file(self.root / f, self._stop, self.tensors.get(f, []), self.algorithm)
                if bad:
                    self.nonfinite[f] = bad
        except BaseException as e:  # reported by result() in the main thread
            self.error = e

    def start(self) -> "BackgroundHasher":
        for t in self._threads:
            t.start()
        return self

    def _join(self) -> None:
        for t in self._threads:
            t.join()

    def stop(self) -> None:
        self._stop.set()
        self._join()

    def result(self) -> dict[str, str]:
        """file -> sha256; raises UserError naming the first file that does not match."""
        self._join()
        if isinstance(self.error, OSError):
            raise UserError(
                f"{getattr(self.error, 'filename', self.root)}: cannot be read while "
                f"hashing ({os.strerror(self.error.errno or 0)})"
            )
        if self.error is not None:
            raise self.error
        for f, want in self.expected.items():
            got = self.digests.get(f)
            if got is not None and got != want:
                raise UserError(
                    f"{self.root / f}: {self.algorithm} {got[:16]}... does not match the manifest "
                    f"({want[:16]}...); the shard is corrupted. Copy it again"
                )
        return {f: self.digests[f] for f in self.files if f in self.digests}
