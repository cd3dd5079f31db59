"""Atomic publishing: a reader sees the old file or dir, or the complete new one, never half of one.

Files are written under a hidden temp name in the same directory and renamed onto the target
(``os.replace`` is atomic within a file system); a directory is built under a hidden temp name
beside the target and swapped in only once complete. On an error the temp is removed.

Temp names carry their owner (host and PID): ``.OUT.tmp-<host>-<pid>-<random>`` for a directory,
``.NAME.<pid>.partial`` for a file, ``.OUT.old-<host>-<pid>`` for the output being replaced. A
process killed with SIGKILL cannot remove its temp; the next writer of the same output removes the
ones whose owner is gone (``remove_stale``, one line on stderr) before making its own. Outputs
follow the umask (directories are made with mode 0o777 & ~umask, as ``mkdir`` does).
"""
from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import socket
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

_HOST = re.sub(r"[^A-Za-z0-9]", "", socket.gethostname().split(".")[0])[:24] or "host"
# .NAME.tmp-HOST-PID-RAND / .NAME.old-HOST-PID (dirs), .NAME.PID.partial (files)
_DIR_TEMP = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)-(?P<host>[A-Za-z0-9]+)-(?P<pid>\d+)(?:-[0-9a-f]+)?$")
_FILE_TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.partial$")


def temp_file(path: Path) -> Path:
    """The hidden temp name beside ``path`` that it is written under (unique per process)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.partial")


def final_path(path: str | os.PathLike) -> str:
    """What a path inside a temp output is to become: ``/r/.model.tmp-h-1-ab/x`` -> ``/r/model/x``."""
    parts = []
    for part in Path(path).parts:
        m = _DIR_TEMP.match(part) or _FILE_TEMP.match(part)
        parts.append(m.group("name") if m else part)
    return str(Path(*parts)) if parts else str(path)


def _started_after(pid: int, when: float) -> bool:
    """True when process ``pid`` started after ``when`` (epoch s): a reused PID, not the owner."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(ln.split()[1]) for ln in Path("/proc/stat").read_text().splitlines()
                    if ln.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return False
    return boot + ticks / os.sysconf("SC_CLK_TCK") > when + 1


def owner_gone(temp: Path) -> bool:
    """Whether the process that made ``temp`` (per its name) is gone; unknown owners count as alive."""
    m = _DIR_TEMP.match(temp.name) or _FILE_TEMP.match(temp.name)
    if m is None or m.groupdict().get("host", _HOST) != _HOST:
        return False  # another host's temp: its owner cannot be asked from here
    pid = int(m.group("pid"))
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, another user's
    try:
        return _started_after(pid, temp.lstat().st_mtime)
    except OSError:
        return False


def remove_stale(out: Path) -> list[Path]:
    """Remove ``out``'s temp siblings whose owner is gone; say so in one line on stderr."""
    out = Path(out)
    try:
        entries = list(os.scandir(out.parent))
    except OSError:
        return []
    stale = []
    for entry in entries:
        p = Path(entry.path)
        m = _DIR_TEMP.match(entry.name) or _FILE_TEMP.match(entry.name)
        if m is None or m.group("name") != out.name or not owner_gone(p):
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        if not p.exists():
            stale.append(p)
    if stale:
        print(f"removed {len(stale)} stale temporary output(s) of {out} left by processes that are gone: "
              f"{', '.join(p.name for p in stale)}", file=sys.stderr, flush=True)
    return stale


@contextmanager
def atomic_file(path: Path, *, fsync: bool = False) -> Iterator[Path]:
    """Yield a temp path to write; renamed onto ``path`` when the block ends without error.

    ``fsync``: flush the temp file to disk before the rename (a manifest that marks a checkpoint
    complete must not be renamed into place ahead of its bytes).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(path)
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


def check_replaceable(out_dir: Path) -> None:
    """Raise the OSError a swap would meet, before anything is written: ``out_dir`` is a mount
    point (EBUSY: a rename cannot replace it) or an existing non-directory (ENOTDIR)."""
    out_dir = Path(out_dir)
    if out_dir.is_dir() and os.path.ismount(out_dir):
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(out_dir))
    if out_dir.exists() and not out_dir.is_dir():
        raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(out_dir))


def temp_dir(out_dir: Path) -> Path:
    """A fresh hidden directory beside ``out_dir`` to build its new contents in (mode per the umask).

    Stale temps of ``out_dir`` whose owner is gone are removed first (remove_stale).
    """
    out_dir = Path(out_dir)
    check_replaceable(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out_dir)
    while True:
        tmp = out_dir.parent / f".{out_dir.name}.tmp-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.mkdir(tmp, 0o777)  # the umask applies, as for any directory the user makes
            return tmp
        except FileExistsError:
            continue


def swap_dir(tmp: Path, out_dir: Path) -> Path:
    """Rename the finished ``tmp`` dir to ``out_dir``, replacing an old one only at the very end."""
    out_dir = Path(out_dir)
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{_HOST}-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
    try:
        os.replace(tmp, out_dir)
    except BaseException:
        if old is not None:
            os.replace(old, out_dir)  # the previous output stays where it was
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out_dir
