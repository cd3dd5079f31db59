"""One writer per run dir, and per output: exclusive flocks held while a command writes.

Run dirs: ``<run dir>/.lock``, kept (below). Any other output a command writes (``-o OUT``, a
``--write`` file): ``path_lock`` holds ``.OUT.lock`` beside it and removes it when done, so two
``convert -o X`` at once cannot both succeed: the second stops at once naming the first's PID.

``run_lock(run_dir, what=...)`` takes the lock or fails at once with one line naming the PID that
holds it (written into the lock file). flock locks belong to the open file: the kernel drops them
when the holder exits in any way (kill -9 included), so a lock is never stale; the file itself is
left behind, empty.

Re-entrancy: ``titan-pipe run`` holds the lock for the whole flow and calls the stages in this
process, and training then starts torchrun children. Inside the holding process a nested
``run_lock`` on the same dir just counts. Child processes inherit ``TITAN_PIPE_RUN_LOCKS`` (the
dirs and the holder's PID) and take nothing: a child is trusted only while the lock file still
names that PID and the lock is still held, so a stale variable in some shell cannot skip the lock.

Read-only commands (inspect, validate, plan) take no lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path
from typing import Iterator

from titan_pipe.errors import UserError

LOCK_NAME = ".lock"
ENV = "TITAN_PIPE_RUN_LOCKS"  # "dir=pid" entries joined by os.pathsep, set while a lock is held
_held: dict[str, int] = {}  # resolved run dir -> nesting depth, in this process
_fds: dict[str, int] = {}  # lock file -> the descriptor holding its flock, in this process


def held_fds() -> list[int]:
    """The descriptors of every lock this process holds: titan_pipe.processes.procs passes them to the
    guardian of each child tree, so a lock stays held until the last writer under it is gone."""
    return list(_fds.values())


class RunDirBusy(UserError):
    """Another process holds the run dir's lock."""


HOLDER_BYTES = 512  # what a lock file's "PID command" line may show; a longer one is cut


def _holder(lock_file: Path) -> str:
    """The "PID command" line the holder wrote, bounded and on one line (it is foreign text: another
    user's, or a file someone put there); never read through a link."""
    try:
        fd = os.open(lock_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return "unknown"
    try:
        raw = os.read(fd, HOLDER_BYTES + 1)
    except OSError:
        return "unknown"
    finally:
        os.close(fd)
    text = " ".join(raw[:HOLDER_BYTES].decode("utf-8", errors="replace").split())
    return (text + (" ..." if len(raw) > HOLDER_BYTES else "")) or "unknown"


class LockPathInvalid(UserError):
    """The lock path is a link, a directory or another non-regular file: never opened, never written."""


def _open_lock(lock_file: Path) -> int:
    """The lock file's descriptor, created per the umask when missing; never through a symbolic link
    (someone else's file would be truncated and written) and never a directory, FIFO or device."""
    what = None
    try:
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            what = "a symbolic link"
        elif e.errno == errno.EISDIR:
            what = "a directory"
        else:
            raise
    else:
        import stat

        mode = os.fstat(fd).st_mode
        if stat.S_ISREG(mode):
            return fd
        os.close(fd)
        what = "not a regular file"
    raise LockPathInvalid(
        f"{lock_file}: the lock file is {what}; titan-pipe never opens a lock through one. "
        "Remove it (it is not titan-pipe's) and run again"
    )


def _inherited(key: str, lock_file: Path) -> bool:
    """True when an ancestor process holds this lock (its env entry, its PID in the file, still held)."""
    entries = dict(e.rpartition("=")[::2] for e in os.environ.get(ENV, "").split(os.pathsep) if "=" in e)
    pid = entries.get(key)
    if not pid or _holder(lock_file).split(" ")[0] != pid:
        return False
    try:
        fd = os.open(lock_file, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True  # held, by the PID the environment names
    finally:
        os.close(fd)  # closing drops a lock we may have just taken: the entry was stale
    return False


def _set_env(entries: list[str]) -> None:
    if entries:
        os.environ[ENV] = os.pathsep.join(entries)
    else:
        os.environ.pop(ENV, None)


def _try_lock(lock_file: Path, mode: int = fcntl.LOCK_EX) -> int | None:
    """The descriptor of ``lock_file`` (created per the umask) holding its flock of ``mode``
    (exclusive, or LOCK_SH); None when another process holds one that conflicts."""
    fd = _open_lock(lock_file)
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        return None
    return fd


@contextlib.contextmanager
def run_lock(run_dir: str | os.PathLike, *, what: str) -> Iterator[Path]:
    """Hold ``run_dir``'s lock for the block (creating the dir); ``what`` names the holder's command.

    Raises RunDirBusy (exit 1) when another process holds it: "<run dir>: in use by PID N (<what>)".
    """
    run_dir = Path(run_dir).resolve()
    key = str(run_dir)
    lock_file = run_dir / LOCK_NAME
    if key in _held:
        _held[key] += 1
        try:
            yield run_dir
        finally:
            _held[key] -= 1
        return
    if _inherited(key, lock_file):
        yield run_dir
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = _try_lock(lock_file)
    if fd is None:
        holder = _holder(lock_file)
        pid, _, cmd = holder.partition(" ")
        raise RunDirBusy(
            f"{run_dir}: in use by PID {pid}{f' ({cmd})' if cmd else ''}{_gone_note(pid)}, which "
            f"holds {lock_file}; wait for it to finish or stop it, then run again"
        ) from None
    previous_env = os.environ.get(ENV)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {what}\n".encode(), 0)
        _held[key] = 1
        _fds[str(lock_file)] = fd
        _set_env([e for e in (previous_env or "").split(os.pathsep) if e] + [f"{key}={os.getpid()}"])
        yield run_dir
    finally:
        _held.pop(key, None)
        _fds.pop(str(lock_file), None)
        if previous_env is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = previous_env
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)  # no PID left behind to mislead anyone reading the file
        os.close(fd)  # releases the flock


def _gone_note(pid: str) -> str:
    """For a lock whose named holder has exited: its child processes (which inherited the lock,
    titan_pipe.processes.procs) are still stopping."""
    if not pid.isdigit():
        return ""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return (
            " (it has exited; the processes it started still hold the lock while they stop: try again in a few seconds)"
        )
    except PermissionError:
        pass
    return ""


READS = "reads it"  # how a reader's line in a lock file ends (read_lock)


def _lock_file_busy(lock_file: Path, out: Path, what: str) -> RunDirBusy:
    pid, _, cmd = _holder(lock_file).partition(" ")
    doing = "in use" if cmd.endswith(READS) else "being written"
    return RunDirBusy(
        f"{out}: {doing} by PID {pid}{f' ({cmd})' if cmd else ''}{_gone_note(pid)}; wait for "
        f"it to finish or stop it, or choose another output path"
    )


def _lock_current(lock_file: Path, mode: int) -> int | None:
    """The descriptor of the lock file now on disk, holding a flock of ``mode`` (LOCK_EX, LOCK_SH);
    None when another process holds one that conflicts. A holder that released and removed the
    file between our open and flock leaves us an unlinked file: then again, on the new one."""
    while True:
        fd = _try_lock(lock_file, mode)
        if fd is None:
            return None
        try:
            if os.stat(lock_file).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


@contextlib.contextmanager
def read_lock(path: str | os.PathLike, *, what: str) -> Iterator[Path]:
    """Hold a shared lock on ``path`` (``.NAME.lock`` beside it, the file path_lock takes) while it is
    read: a command writing ``path`` meanwhile (`data prepare -o` the data dir a training reads)
    stops at once naming this process, and one already writing it stops this reader; readers share
    it. Where no lock file can be made (a read-only mount) nothing can write the path either: no lock."""
    out = Path(os.path.abspath(path))
    lock_file = out.parent / f".{out.name}.lock"
    try:
        fd = _lock_current(lock_file, fcntl.LOCK_SH)
    except OSError as e:
        if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        yield out
        return
    if fd is None:
        raise _lock_file_busy(lock_file, out, what)
    key = f"{lock_file}#{fd}"
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {what}, which {READS}\n".encode(), 0)
        _fds[key] = fd
        yield out
    finally:
        _fds.pop(key, None)
        try:  # the last reader out removes the file, as a writer does (no other holder: EX succeeds)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(lock_file)
        except OSError:
            pass
        os.close(fd)


@contextlib.contextmanager
def path_lock(out: str | os.PathLike, *, what: str) -> Iterator[Path]:
    """Hold the lock of one output path (a dir or a file) for the block: ``.OUT.lock`` beside it.

    The lock file is removed on release (while still locked, so a process that opened the old
    file and locks it afterwards sees it is no longer the one on disk and starts again). Raises
    RunDirBusy naming the holder's PID when another process writes ``out``.
    """
    out = Path(os.path.abspath(out))
    lock_file = out.parent / f".{out.name}.lock"
    out.parent.mkdir(parents=True, exist_ok=True)
    fd = _lock_current(lock_file, fcntl.LOCK_EX)
    if fd is None:
        raise _lock_file_busy(lock_file, out, what)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {what}\n".encode(), 0)
        _fds[str(lock_file)] = fd
        yield out
    finally:
        _fds.pop(str(lock_file), None)
        with contextlib.suppress(OSError):
            os.unlink(lock_file)
        os.close(fd)


def is_run_dir(path: str | os.PathLike) -> bool:
    """A directory some stage made a run dir: it holds the lock file, checkpoints/ or .stages/."""
    p = Path(path)
    return p.is_dir() and any((p / n).exists() for n in (LOCK_NAME, "checkpoints", ".stages"))


@contextlib.contextmanager
def output_lock(out_dir: str | os.PathLike | None, *, what: str) -> Iterator[None]:
    """For a stage command writing ``out_dir``: refuse a run dir itself as the output, hold the
    lock of the run dir it lies in (``runs/<name>/model``), if it lies in one, and the output's own
    lock (path_lock)."""
    if out_dir is None:
        yield
        return
    out_dir = Path(out_dir)
    if is_run_dir(out_dir):
        raise UserError(
            f"-o {out_dir}: is a run dir (it holds {LOCK_NAME}, checkpoints/ or .stages/), which "
            f"this output would replace; give a directory inside it (e.g. {out_dir}/model, "
            "/onnx or /report)"
        )
    parent = out_dir.absolute().parent
    with run_lock(parent, what=what) if is_run_dir(parent) else contextlib.nullcontext(), path_lock(out_dir, what=what):
        yield
