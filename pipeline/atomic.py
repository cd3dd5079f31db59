"""Atomic publishing: a reader sees the old file or dir, or the complete new one, never half of one.

Files are written under a hidden temp name in the same directory and renamed onto the target
(``os.replace`` is atomic within a file system); a directory is built under a hidden temp name
beside the target and swapped in only once complete. On an error the temp is removed.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def temp_file(path: Path) -> Path:
    """The hidden temp name beside ``path`` that it is written under (unique per process)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.partial")


@contextmanager
def atomic_file(path: Path, *, fsync: bool = False) -> Iterator[Path]:
    """Yield a temp path to write; renamed onto ``path`` when the block ends without error.

    ``fsync``: flush the temp file to disk before the rename (a manifest that marks a checkpoint
    complete must not be renamed into place ahead of its bytes).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_file(path)
    try:
        yield tmp
        if fsync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: Path, text: str, *, fsync: bool = False) -> Path:
    with atomic_file(path, fsync=fsync) as tmp:
        tmp.write_text(text)
    return Path(path)


def copy_file(src: Path, path: Path) -> Path:
    with atomic_file(path) as tmp:
        shutil.copyfile(src, tmp)
    return Path(path)


def temp_dir(out_dir: Path) -> Path:
    """A fresh hidden directory beside ``out_dir`` to build its new contents in."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))


def swap_dir(tmp: Path, out_dir: Path) -> Path:
    """Rename the finished ``tmp`` dir to ``out_dir``, replacing an old one only at the very end."""
    out_dir = Path(out_dir)
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out_dir
