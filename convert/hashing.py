"""sha256 of source files in a background thread, so verification overlaps the copy.

hashlib releases the GIL on large buffers, so the hash runs on another core while the main thread
moves bytes; the conversion waits for it at the end and fails (leaving no output) on a mismatch.
"""
from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

from titan_pipe.errors import UserError

BLOCK = 8 * 2**20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


class BackgroundHasher:
    """Hash ``files`` (relative to ``root``) in a daemon thread; ``result()`` joins and checks."""

    def __init__(self, root: Path, files: list[str], expected: dict[str, str] | None = None):
        self.root, self.files, self.expected = root, list(files), dict(expected or {})
        self.digests: dict[str, str] = {}
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="titan-pipe-sha256", daemon=True)

    def _run(self) -> None:
        try:
            for f in self.files:
                if self._stop.is_set():
                    return
                self.digests[f] = sha256_file(self.root / f)
        except BaseException as e:  # reported by result() in the main thread
            self.error = e

    def start(self) -> "BackgroundHasher":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def result(self) -> dict[str, str]:
        """file -> sha256; raises UserError naming the first file that does not match."""
        self._thread.join()
        if isinstance(self.error, OSError):
            raise UserError(f"{getattr(self.error, 'filename', self.root)}: cannot be read while "
                            f"hashing ({os.strerror(self.error.errno or 0)})")
        if self.error is not None:
            raise self.error
        for f, want in self.expected.items():
            got = self.digests.get(f)
            if got is not None and got != want:
                raise UserError(f"{self.root / f}: sha256 {got[:16]}... does not match the manifest "
                                f"({want[:16]}...); the shard is corrupted. Copy it again")
        return self.digests
