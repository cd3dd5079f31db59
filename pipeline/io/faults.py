"""Operating-system faults as one line: the path, what was being written, the reason and the fix.

A full disk, a read-only or unwritable directory, too many open files, a name too long, a mount
point or a file where a directory must be made: every command and every Prefect task reports these
the same way (``OutputFault``, a UserError: exit 1, never retried), through ``writing`` around the
work that writes an output, or ``fault_message`` on an OSError that reached the CLI unwrapped.
Where the size of an output is known before writing (convert, export), ``check_free_space``
refuses before a byte is written.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from titan_pipe.io.atomic import final_path
from titan_pipe.errors import UserError

FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
# errno -> (reason, fix); {out} is the output path, {need} the "free N" advice for a full disk
_KNOWN: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("the disk filled up", "{need} or choose another output directory"),
    errno.EDQUOT: ("the disk filled up (the disk quota is exhausted)", "{need} or choose another output directory"),
    errno.EFBIG: (
        "the disk filled up (a file-size limit, ulimit -f, stopped the write)",
        "raise the limit (ulimit -f unlimited) or choose another output directory",
    ),
    errno.EROFS: ("the file system is read-only", "choose a writable directory"),
    errno.EACCES: ("permission denied", "choose a directory you can write, or fix its permissions"),
    errno.EPERM: ("operation not permitted", "choose a directory you can write, or fix its permissions"),
    errno.EMFILE: ("too many open files in this process", "raise the limit (ulimit -n 65536) and run again"),
    errno.ENFILE: ("too many open files on this machine", "close other programs or raise fs.file-max, then run again"),
    errno.ENAMETOOLONG: ("the path is too long for the file system", "choose a shorter output path"),
    errno.ENOTDIR: ("a file stands where a directory must be made", "remove that file or choose another output path"),
    errno.EEXIST: ("a file stands where a directory must be made", "remove that file or choose another output path"),
    errno.EISDIR: ("a directory stands where a file must be written", "remove it or choose another output path"),
    errno.EBUSY: (
        "it is a mount point (or in use), which cannot be replaced by a rename",
        "give a directory inside it, e.g. {out}/out",
    ),
    errno.EXDEV: (
        "the output and its temporary copy lie on different file systems",
        "choose an output directory that is not a mount point",
    ),
    errno.EIO: ("the device reported an I/O error", "check the disk (dmesg) or choose another output directory"),
    errno.ELOOP: (
        "a symbolic link stands where titan-pipe writes (it never writes through one), or the path loops",
        "remove the link or choose another path",
    ),
    errno.ESPIPE: (
        "a FIFO, socket or device stands where a file must be written",
        "remove it or choose another output path",
    ),
    errno.ENXIO: (
        "a FIFO, socket or device stands where a file must be written",  # a FIFO with no reader
        "remove it or choose another output path",
    ),
}
FAULT_ERRNOS = frozenset(_KNOWN)
# what each stage writes, for the line its faults become ("<path>: cannot write <what>: ...")
STAGE_OUTPUTS = {
    "train": "the training run (checkpoints, logs, metrics)",
    "convert": "the converted model",
    "export": "the ONNX export",
    "evaluate": "the evaluation report",
    "prepare": "the prepared data",
}
# A Rust library (safetensors) reports an OS error inside its own message: "... Os { code: 28, ..."
_RUST_OS_ERROR = re.compile(r"(?:Os \{ code: |os error )(\d+)")


class OutputFault(UserError):
    """The operating system refused to write an output; the message has the path and the fix."""

    def __init__(self, message: str, *, path: Path | None = None, errno_: int | None = None):
        super().__init__(message)
        self.path, self.errno = path, errno_


def human(n: int) -> str:
    """Bytes for a person: 1.3 GB, 420 MB, 12 kB (decimal units, as df -H prints)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (where the file system can be asked)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the file system that holds (or will hold) ``path``."""
    return shutil.disk_usage(existing_ancestor(path)).free


def os_error_in(exc: BaseException) -> OSError | None:
    """The OSError with a known errno behind ``exc``: itself, its cause/context chain, or an error a
    Rust library reported as text (safetensors' ``Os { code: 28, ... }``)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in FAULT_ERRNOS:
            return e
        m = _RUST_OS_ERROR.search(str(e)) if not isinstance(e, UserError) else None
        if m and int(m.group(1)) in FAULT_ERRNOS:
            code = int(m.group(1))
            return OSError(code, os.strerror(code))
        e = e.__cause__ or e.__context__
    return None


def _need(out: Path | None, needs: int | None) -> str:
    where = out or Path(".")
    free = free_bytes(where)
    if needs is None:
        return f"free space there ({human(free)} free now)"
    if free >= needs:  # the space went to another writer meanwhile, or a quota applies
        return (
            f"free space there (the output needs {human(needs)}; {human(free)} are free now, so another "
            "writer or a disk quota took the rest)"
        )
    return f"free at least {human(needs - free)} there (the output needs {human(needs)}, {human(free)} are free now)"


def fault_message(e: OSError, *, path: Path | None = None, what: str | None = None, needs: int | None = None) -> str:
    """One line: ``<path>: cannot write <what>: <reason> (<ERRNO>); <fix>``.

    ``path``: the output; the message names the file the error names instead when that lies
    inside the output (a temporary name is shown as the file it was to become). An error naming a
    file outside the output (an input, a scratch file in /tmp), or given no ``what``, is not
    called a write: ``<file>: <reason> (<ERRNO>); <fix>``. ``needs``: the output's size in bytes,
    for a full disk's "free N" advice.
    """
    reason, fix = _KNOWN.get(e.errno, (e.strerror or "error", "check the path and run again"))
    named = Path(final_path(e.filename)) if isinstance(e.filename, (str, os.PathLike)) else None
    ours = named is None or path is None or _part_of(named, Path(path))
    shown = named if named is not None and (path is None or _inside(named, path)) else path if ours else named
    if not ours and e.errno in (errno.EACCES, errno.EPERM):
        fix = "fix its permissions, or run as a user who may use it"
    fix = fix.format(out=shown, need=_need(shown, needs if ours else None) if e.errno in FULL else "")
    code = errno.errorcode.get(e.errno, str(e.errno))
    doing = f"cannot write {what}: " if what and ours else ""
    return f"{shown or 'output'}: {doing}{reason} ({code}); {fix}"


def _part_of(p: Path, out: Path) -> bool:
    """``p`` is made in making ``out``: inside it, a directory above it, or its lock/temp sibling."""
    p, out = Path(os.path.abspath(p)), Path(os.path.abspath(out))
    return _inside(p, out) or p in out.parents or (p.parent == out.parent and p.name.startswith(f".{out.name}."))


def _inside(p: Path, root: Path) -> bool:
    p, root = Path(os.path.abspath(p)), Path(os.path.abspath(root))
    return p == root or root in p.parents


def as_fault(
    exc: BaseException, *, path: Path | None = None, what: str | None = None, needs: int | None = None
) -> OutputFault | None:
    """``exc`` as an OutputFault, when an OS error with a known errno is behind it; else None."""
    if isinstance(exc, OutputFault):
        return exc
    e = os_error_in(exc)
    if e is None:
        return None
    return OutputFault(fault_message(e, path=path, what=what, needs=needs), path=path, errno_=e.errno)


@contextmanager
def writing(path: Path | str | None, *, what: str, needs: int | None = None) -> Iterator[None]:
    """Turn an OS fault raised in the block into OutputFault naming ``path`` and ``what``.

    Cleanup of temporary outputs is the writers' own (titan_pipe.io.atomic removes them as the error
    passes); this only gives the error its one line. Other errors pass unchanged.
    """
    try:
        yield
    except (UserError, KeyboardInterrupt):
        raise
    except Exception as exc:  # noqa: BLE001 - mapped when an OS fault is behind it, else re-raised
        fault = as_fault(exc, path=Path(path) if path is not None else None, what=what, needs=needs)
        if fault is None:
            raise
        raise fault from None


def check_free_space(path: Path, *, needs: int, what: str) -> None:
    """Refuse before writing when the file system holding ``path`` has less than ``needs`` bytes free."""
    free = free_bytes(path)
    if free < needs:
        raise OutputFault(
            f"{path}: cannot write {what}: it needs {human(needs)} and the disk holding it has "
            f"{human(free)} free (ENOSPC); free at least {human(needs - free)} there or choose "
            "another output directory",
            path=Path(path),
            errno_=errno.ENOSPC,
        )
