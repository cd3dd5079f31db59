"""A failing-write shim for fault tests: the operating system refuses writes under one directory.

Why a shim: CI runs as root on a small machine where mounting a tmpfs may not be permitted, and
root ignores permission bits, so a full or read-only disk cannot always be made for real. This
raises the errors the kernel would raise, from the calls that hit the kernel, so the code under
test meets them exactly where it would. Tests that can mount a real small tmpfs do so as well
(tests/test_faults_os.py).

Set in the environment (a subprocess with this directory on PYTHONPATH loads it at start-up, and
so do its children: torchrun and every rank), or call ``install`` in-process:

  TITAN_FAULT_ROOT=DIR      where the faults apply (DIR and everything below it)
  TITAN_FAULT_ERRNO=ENOSPC  the error: ENOSPC, EROFS, EACCES, EDQUOT, EMFILE, ENAMETOOLONG, ...
  TITAN_FAULT_AFTER=N       bytes written under DIR (os.write/pwrite/copy_file_range) before the
                            error; 0 (default): creating a file or directory there already fails
  TITAN_FAULT_FREE=N        free bytes os.statvfs reports for DIR (a full disk a pre-check sees;
                            a large N lets a write start on a disk that then fills up)
  TITAN_FAULT_DELAY=S       sleep S seconds before each write under DIR (a slow disk: a command
                            caught mid-write, for the kill and two-writer tests); with no
                            TITAN_FAULT_ERRNO nothing fails
"""

from __future__ import annotations

import builtins
import errno as _errno
import io
import os
import time

_REAL = {
    name: getattr(os, name)
    for name in (
        "open",
        "mkdir",
        "rename",
        "replace",
        "write",
        "pwrite",
        "copy_file_range",
        "statvfs",
        "truncate",
        "ftruncate",
    )
}
_REAL_OPEN = builtins.open
_state: dict = {}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _under(path) -> bool:
    if not _state or path is None or isinstance(path, int):
        return False
    try:
        p = os.path.abspath(os.fsdecode(path))
    except (TypeError, ValueError):
        return False
    root = _state["root"]
    return p == root or p.startswith(root + os.sep)


def _fail(path) -> OSError:
    code = _state["errno"]
    return OSError(code, os.strerror(code), os.fsdecode(path) if path is not None else None)


def _creating(path) -> bool:
    return _under(path) and _state["errno"] is not None and _state["after"] == 0


def _open(path, flags, mode=0o777, *, dir_fd=None):
    if flags & _WRITE_FLAGS and _creating(path):
        raise _fail(path)
    fd = _REAL["open"](path, flags, mode, dir_fd=dir_fd)
    if flags & _WRITE_FLAGS and _under(path):
        _state["fds"][fd] = os.fsdecode(path)
    return fd


def _mkdir(path, mode=0o777, *, dir_fd=None):
    if _creating(path):
        raise _fail(path)
    return _REAL["mkdir"](path, mode, dir_fd=dir_fd)


def _moving(name):
    def move(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
        if _creating(dst) or _creating(src):
            raise _fail(dst)
        return _REAL[name](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

    return move


def _spend(fd: int, n: int) -> None:
    path = _state["fds"].get(fd)
    if path is None:
        return
    time.sleep(_state["delay"])
    if _state["errno"] is not None and _state["written"] + n > _state["after"]:
        raise _fail(path)
    _state["written"] += n
    _state["by_file"][path] = _state["by_file"].get(path, 0) + n


def _write(fd, data):
    _spend(fd, len(data))
    return _REAL["write"](fd, data)


def _pwrite(fd, data, offset):
    _spend(fd, len(memoryview(data).cast("B")))
    return _REAL["pwrite"](fd, data, offset)


def _copy_file_range(src, dst, count, offset_src=None, offset_dst=None):
    _spend(dst, count)
    return _REAL["copy_file_range"](src, dst, count, offset_src, offset_dst)


def _statvfs(path):
    st = _REAL["statvfs"](path)
    if _state.get("free") is None or not _under(path):
        return st
    blocks = _state["free"] // st.f_frsize
    fields = list(st)
    fields[3] = fields[4] = blocks  # f_bfree, f_bavail
    return os.statvfs_result(fields)


def _builtin_open(file, mode="r", *args, **kwargs):
    if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+") and _creating(file):
        raise _fail(file)
    return _REAL_OPEN(file, mode, *args, **kwargs)


def install(*, root: str, errno: int | str | None, after: int = 0, free: int | None = None, delay: float = 0.0) -> None:
    """Make the OS refuse writes under ``root`` with ``errno`` (a number or a name like "ENOSPC";
    None: never), after ``after`` bytes, each write ``delay`` seconds late."""
    code = getattr(_errno, errno) if isinstance(errno, str) else errno
    _state.update(
        root=os.path.abspath(root), errno=code, after=after, free=free, delay=delay, written=0, fds={}, by_file={}
    )
    os.open, os.mkdir, os.write, os.pwrite = _open, _mkdir, _write, _pwrite
    os.rename, os.replace = _moving("rename"), _moving("replace")
    os.copy_file_range, os.statvfs = _copy_file_range, _statvfs
    builtins.open = io.open = _builtin_open


def uninstall() -> None:
    _state.clear()
    for name, fn in _REAL.items():
        setattr(os, name, fn)
    builtins.open = io.open = _REAL_OPEN


if os.environ.get("TITAN_FAULT_ROOT"):
    install(
        root=os.environ["TITAN_FAULT_ROOT"],
        errno=os.environ.get("TITAN_FAULT_ERRNO") or None,
        after=int(os.environ.get("TITAN_FAULT_AFTER", "0")),
        free=int(os.environ["TITAN_FAULT_FREE"]) if os.environ.get("TITAN_FAULT_FREE") else None,
        delay=float(os.environ.get("TITAN_FAULT_DELAY", "0")),
    )
