"""The guardian of a child process tree: it dies with the command that started it, and takes the tree along.

Started by titan_pipe.processes.procs (never by hand), by file path with ``python -I -S`` so it imports the
standard library only and starts in milliseconds:

  guard.py --parent-fd FD [--grace S] -- CMD ...   run CMD as our child and guard its whole tree
  guard.py --parent-fd FD [--grace S] --watch PID  guard a process someone else started

FD is the read end of a pipe whose write end only the starting process holds: end of file on it
means that process is gone, however it died (SIGKILL included). Then the tree is stopped: SIGTERM
to CMD (torchrun stops its ranks itself), and after S seconds SIGKILL to every descendant left.
The guardian is a child subreaper (Linux), so ranks that torchrun started in their own sessions
are re-parented to it when torchrun dies and are still found and reaped. SIGTERM/SIGINT/SIGHUP
sent to the guardian are forwarded to CMD the same way. When CMD exits on its own, descendants it
left behind are stopped too. The guardian exits last, with CMD's status (128+N for signal N), so
a lock file descriptor the starting process passed to it stays held while any writer lives.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_requested: list[int] = []


def prctl(option: int, value: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process on this machine (from /proc)."""
    out = {}
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    out[int(name)] = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    return out


def descendants(root: int) -> list[int]:
    """Every live descendant of ``root``, parents before children."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _parents().items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _reap(child: int, status: dict) -> bool:
    """Reap every exited child (ours and re-parented orphans); True while any child is left."""
    while True:
        try:
            pid, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True
        if pid == child:
            status["code"] = os.waitstatus_to_exitcode(st)


def _parent_gone(fd: int | None, timeout: float) -> bool:
    if fd is None:
        time.sleep(timeout)
        return False
    ready, _, _ = select.select([fd], [], [], timeout)
    if not ready:
        return False
    try:
        return os.read(fd, 4096) == b""
    except OSError:
        return True


def guard_child(cmd: list[str], parent_fd: int, grace: float) -> int:
    """Run ``cmd`` and guard its tree; returns the status to exit with."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    child = subprocess.Popen(cmd, preexec_fn=lambda: prctl(PR_SET_PDEATHSIG, signal.SIGKILL))
    status: dict = {}
    deadline = None  # when the stop's grace ends
    fd: int | None = parent_fd
    while True:
        alive = _reap(child.pid, status)
        if "code" in status:
            break
        stop = _requested.pop(0) if _requested else None
        if fd is not None and _parent_gone(fd, 0):
            os.close(fd)
            fd, stop = None, stop or signal.SIGTERM
        if stop is not None:
            _signal_all([child.pid], stop)
            deadline = deadline or time.monotonic() + grace
        if deadline is not None and time.monotonic() > deadline:
            _signal_all(descendants(os.getpid()), signal.SIGKILL)
        if not alive:
            break
        if fd is not None and not _requested:
            select.select([fd], [], [], 0.1)  # wakes on the parent's end of file, a signal, or after 0.1 s
        else:
            time.sleep(0.05)
    child.returncode = status.get("code", -signal.SIGKILL)  # reaped here, not by Popen
    _stop_rest(grace if deadline is None else max(0.0, deadline - time.monotonic()))
    code = status.get("code", -signal.SIGKILL)
    return 128 - code if code < 0 else code


def _stop_rest(grace: float) -> None:
    """SIGTERM every descendant still alive (orphaned ranks), SIGKILL after ``grace``, reap all."""
    left = descendants(os.getpid())
    if left:
        _signal_all(left, signal.SIGTERM)
    end = time.monotonic() + grace
    while _reap(-1, {}):
        if time.monotonic() > end:
            _signal_all(descendants(os.getpid()), signal.SIGKILL)
        time.sleep(0.05)


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return started is None or _start_time(pid) == started


def guard_watch(pid: int, parent_fd: int, grace: float) -> int:
    """Stop ``pid`` and its descendants when the starting process is gone; exit when ``pid`` ends."""
    started = _start_time(pid)
    while _alive(pid, started):
        if _parent_gone(parent_fd, 0.5):
            break
    else:
        return 0
    tree = [pid] + descendants(pid)
    _signal_all(tree, signal.SIGTERM)
    end = time.monotonic() + grace
    while any(_alive(p, None) for p in tree) and time.monotonic() < end:
        time.sleep(0.05)
    _signal_all([p for p in tree if _alive(p, None)], signal.SIGKILL)
    return 0


def main(argv: list[str]) -> int:
    parent_fd, grace, watch, cmd = None, 10.0, None, []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            cmd = argv[i + 1 :]
            break
        if a in ("--parent-fd", "--grace", "--watch"):
            value = argv[i + 1]
            if a == "--parent-fd":
                parent_fd = int(value)
            elif a == "--grace":
                grace = float(value)
            else:
                watch = int(value)
            i += 2
            continue
        raise SystemExit(f"guard.py: unknown argument {a!r}")
    if parent_fd is None or (watch is None) == (not cmd):
        raise SystemExit("guard.py: give --parent-fd FD and either -- CMD ... or --watch PID")
    if watch is not None:
        # A watch ends its process when the command that asked for it is gone, never on a signal of
        # its own: SIGTERM to every process of a service reaches this guardian too, and the watched
        # process (Prefect's temporary server) must outlive the command's last reports.
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        return guard_watch(watch, parent_fd, grace)
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda s, _f: _requested.append(s))
    return guard_child(cmd, parent_fd, grace)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
