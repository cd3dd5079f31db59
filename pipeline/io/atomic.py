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
from contextlib import contextmanager, suppress
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
        boot = next(
            float(ln.split()[1]) for ln in Path("/proc/stat").read_text().splitlines() if ln.startswith("btime ")
        )
    except (OSError, ValueError, IndexError, StopIteration):
        return False
    return boot + ticks / os.sysconf("SC_CLK_TCK") > when + 1


def _pid_gone(pid: int, made: float) -> bool:
    """Whether process ``pid``, which made something at ``made`` (epoch s), is gone: no such
    process, or one that started later (a reused PID). Another user's live process is not gone."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return _started_after(pid, made)


def owner_gone(temp: Path) -> bool:
    """Whether the process that made ``temp`` (per its name) is gone; unknown owners count as alive."""
    m = _DIR_TEMP.match(temp.name) or _FILE_TEMP.match(temp.name)
    if m is None or m.groupdict().get("host", _HOST) != _HOST:
        return False  # another host's temp: its owner cannot be asked from here
    try:
        return _pid_gone(int(m.group("pid")), temp.lstat().st_mtime)
    except OSError:
        return False


@contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A private temp dir ``$TMPDIR/<prefix>-<host>-<pid>-<random>`` for the block, removed after it.
    A process killed with SIGKILL cannot remove its own: each new one first removes this user's
    dirs of the same prefix whose owner is gone (the same owner rule as outputs' temps)."""
    import tempfile

    root = Path(tempfile.gettempdir())
    pattern = re.compile(rf"^{re.escape(prefix)}-(?P<host>[A-Za-z0-9]+)-(?P<pid>\d+)-[0-9a-f]+$")
    with suppress(OSError):
        for entry in os.scandir(root):
            m = pattern.match(entry.name)
            if m is None or m.group("host") != _HOST or not entry.is_dir(follow_symlinks=False):
                continue
            with suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                if st.st_uid == os.getuid() and _pid_gone(int(m.group("pid")), st.st_mtime):
                    shutil.rmtree(entry.path, ignore_errors=True)
    while True:
        fixed = root / f"{prefix}-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.mkdir(fixed, 0o700)  # private, as mkdtemp makes it
            break
        except FileExistsError:
            continue
    try:
        yield fixed
    finally:
        shutil.rmtree(fixed, ignore_errors=True)


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
        print(
            f"removed {len(stale)} stale temporary output(s) of {out} left by processes that are gone: "
            f"{', '.join(p.name for p in stale)}",
            file=sys.stderr,
            flush=True,
        )
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
    _create_own(tmp)
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


def _create_own(tmp: Path) -> None:
    """Create ``tmp`` as a new empty regular file of ours. Whatever sits at that (predictable) name
    is removed first: a link someone placed there is unlinked, never followed, so the writes that
    follow land in our own file, not in the link's target."""
    for _ in range(3):
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666))
            return
        except FileExistsError:
            if os.path.isdir(tmp) and not os.path.islink(tmp):
                raise IsADirectoryError(errno.EISDIR, "a directory sits at a temp file's name", str(tmp)) from None
            with suppress(FileNotFoundError):
                os.unlink(tmp)
    raise FileExistsError(errno.EEXIST, "a temp file's name is taken again and again", str(tmp))


def open_append(path: Path, *, encoding: str = "utf-8"):
    """``path`` opened for appending text (created per the umask), never through a symbolic link
    and only when it is a regular file: a log or metrics file is ours, never someone else's file a
    link leads to. A link or a non-file there raises the OSError (ELOOP, EISDIR, ESPIPE) that
    titan_pipe.io.faults reports in one line."""
    import stat

    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.ESPIPE, "not a regular file", str(path))
    os.set_blocking(fd, True)
    return os.fdopen(fd, "a", encoding=encoding)


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
    if out_dir.exists() or out_dir.is_symlink():
        old = out_dir.with_name(f".{out_dir.name}.old-{_HOST}-{os.getpid()}")
        _remove(old)
        os.replace(out_dir, old)
    try:
        os.replace(tmp, out_dir)
    except BaseException:
        if old is not None:
            os.replace(old, out_dir)  # the previous output stays where it was
        raise
    if old is not None:
        _remove(old)
    return out_dir


def _remove(path: Path) -> None:
    """Remove what the swap set aside: a link (an ``-o`` that was one) itself, never its target;
    a directory with its contents."""
    if path.is_symlink() or path.is_file():
        with suppress(FileNotFoundError):
            path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)
