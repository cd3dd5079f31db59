"""Child processes that die with their command: every launcher of a child process starts it here.

``popen(cmd, ...)`` starts ``cmd`` under a guardian (titan_pipe's guard.py, standard library only)
in its own session. The guardian holds the read end of a pipe only this process writes to: when
this process ends in any way (exit, exception, SIGTERM, SIGKILL) the guardian sees end of file and
stops the whole tree — ``cmd``, and the processes ``cmd`` started even in their own sessions
(torchrun's ranks): SIGTERM, then SIGKILL after ``grace`` seconds. Locks this process holds
(titan_pipe.processes.run_lock) are passed to the guardian, which exits last, so a lock is never free while a
writer it covers is alive. ``Tree.stop(sig)`` stops the tree on purpose (Ctrl-C, a timeout).

``run`` is ``subprocess.run`` on top of it; ``watch(pid)`` guards a process someone else started
(Prefect's temporary API server); ``die_with_parent()`` is for workers a library starts (the
tokenizer pool of ``data prepare``); ``exit_rank(code)`` is a torchrun rank's way out.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence

GUARD = Path(__file__).with_name("guard.py")
GRACE_S = float(os.environ.get("TITAN_PIPE_STOP_GRACE_S", "10"))


def _start_guard(
    args: list[str], *, grace: float | None, hold: Sequence[int], **kwargs
) -> tuple[subprocess.Popen, int]:
    """Start guard.py with ``args`` in its own session; returns it and the pipe end only we hold."""
    r, w = os.pipe()
    # -I -S: no site-packages, no PYTHON* variables: the guardian imports the standard library only
    argv = [
        sys.executable,
        "-I",
        "-S",
        str(GUARD),
        "--parent-fd",
        str(r),
        "--grace",
        str(GRACE_S if grace is None else grace),
        *args,
    ]
    try:
        proc = subprocess.Popen(argv, pass_fds=[r, *hold], start_new_session=True, **kwargs)
    except BaseException:
        os.close(w)
        raise
    finally:
        os.close(r)
    return proc, w


def _held_locks() -> list[int]:
    from titan_pipe.processes.run_lock import held_fds

    return held_fds()


class Tree:
    """A guarded child process tree; ``proc`` is the guardian (its stdio is the child's)."""

    def __init__(self, proc: subprocess.Popen, parent_w: int):
        self.proc, self._w = proc, parent_w

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def stdout(self):
        return self.proc.stdout

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        rc = self.proc.poll()
        if rc is not None:
            self._release()
        return rc

    def wait(self, timeout: float | None = None) -> int:
        """The child's status (128+N when signal N ended it), once the whole tree is gone."""
        rc = self.proc.wait(timeout)
        self._release()
        return rc

    def stop(self, sig: int = signal.SIGTERM, timeout: float | None = None) -> int:
        """Send ``sig`` to the child (the guardian forwards it), SIGKILL what is left after the grace
        period, and wait until the whole tree is gone."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass
        return self.wait(timeout)

    def _release(self) -> None:
        if self._w >= 0:
            os.close(self._w)
            self._w = -1

    def __enter__(self) -> "Tree":
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.stop(signal.SIGTERM)
        self._release()
        for stream in (self.proc.stdout, self.proc.stderr, self.proc.stdin):
            if stream is not None:
                stream.close()


def popen(cmd: Sequence[str], *, grace: float | None = None, hold: Sequence[int] | None = None, **kwargs) -> Tree:
    """Start ``cmd`` under a guardian; ``kwargs`` as for subprocess.Popen (stdout, env, cwd, text...).

    ``hold``: file descriptors the guardian keeps open until the tree is gone (default: the locks
    this process holds, titan_pipe.processes.run_lock).
    """
    return Tree(
        *_start_guard(["--", *map(str, cmd)], grace=grace, hold=_held_locks() if hold is None else hold, **kwargs)
    )


def run(
    cmd: Sequence[str], *, timeout: float | None = None, capture_output: bool = False, **kwargs
) -> subprocess.CompletedProcess:
    """subprocess.run for a guarded tree: on a timeout or an interrupt the whole tree is stopped
    (then TimeoutExpired / KeyboardInterrupt propagates)."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with popen(cmd, **kwargs) as tree:
        try:
            out, err = tree.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            tree.stop(signal.SIGTERM)
            raise
        except KeyboardInterrupt as e:
            tree.stop(getattr(e, "signum", signal.SIGINT))
            raise
        rc = tree.wait()
    return subprocess.CompletedProcess(list(cmd), rc, out, err)


def die_with_parent(parent: int) -> None:
    """For a worker process that a library starts (a multiprocessing pool): be killed when
    ``parent`` (the PID that started it, passed in by that process) ends, however it ends, and exit
    now if that already happened. Call it first thing in the worker (a pool's ``initializer``).
    Linux; elsewhere nothing."""
    from titan_pipe.processes.guard import PR_SET_PDEATHSIG, prctl

    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if sys.platform.startswith("linux") and os.getppid() != parent:
        os._exit(1)  # re-parented before the death signal was armed: the parent is gone


def rank_dies_with_launcher() -> None:
    """First thing in a torchrun rank: be killed when the process that started it (torchrun's agent)
    ends, however it ends. torchrun itself dies with its guardian (guard.py arms the same signal for
    it), so ``kill -9`` of the guardian, the launcher or torchrun leaves no rank training on with no
    lock held. Only under torchrun (TORCHELASTIC_RUN_ID set); a rank re-parented before this ran is
    an orphan already, and the guardian it was re-parented to stops it."""
    if os.environ.get("TORCHELASTIC_RUN_ID") is not None:
        die_with_parent(os.getppid())


def exit_rank(code: int) -> None:
    """The last call of a torchrun rank, after ``destroy_process_group``: everything a normal exit
    does while the interpreter is still whole (wait for non-daemon threads, run the ``atexit``
    handlers: multiprocessing stops its workers, logging flushes), flush stdio, then end the process
    without the interpreter's finalization.

    A gloo worker thread may drop a finished collective's work object (and the tensors it holds)
    only after the main thread has returned; releasing a tensor takes the GIL, and a thread that
    asks for the GIL of a finalizing interpreter is unwound through C++ code that cannot be, so
    ``std::terminate`` ends a rank whose work was complete with SIGABRT (torch 2.13: 13 of 90
    ``sharded_forward`` launches on a loaded 2-core host, in ``~AsyncGatherWork``). Finalization
    only frees memory; what a program registered to run at exit still runs (CPython calls the same
    two steps, in this order, before it finalizes)."""
    import atexit
    import threading

    shutdown = getattr(threading, "_shutdown", None)  # what CPython itself calls at exit
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


class Watcher:
    """A guardian watching a process this one did not start; ``close()`` ends the watch."""

    def __init__(self, proc: subprocess.Popen, parent_w: int):
        self.proc, self._w = proc, parent_w

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)  # not a stop signal: the default action ends it
        self.proc.wait()
        if self._w >= 0:
            os.close(self._w)
            self._w = -1


def watch(pid: int, *, grace: float | None = None) -> Watcher:
    """Stop process ``pid`` and its descendants if this process ends before ``close()``."""
    return Watcher(*_start_guard(["--watch", str(pid)], grace=grace, hold=(), stdin=subprocess.DEVNULL))
