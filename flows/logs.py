"""Stage output into the Prefect run logs: follow a growing log file (rank-0 torchrun output) line by line."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import threading
from pathlib import Path
from typing import Iterator


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    """The Prefect logger of the current task/flow run; a plain logger outside one (``.fn`` calls)."""
    try:
        from prefect.exceptions import MissingContextError
        from prefect.logging import get_run_logger

        return get_run_logger()
    except (ImportError, MissingContextError):
        return logging.getLogger("titan_pipe.flows")


def api_only_logger() -> logging.Logger | logging.LoggerAdapter | None:
    """A logger that sends to the Prefect API only, not to the console.

    The stage already streams its output to the console (launch.py tees torchrun to the terminal and
    train.log); forwarding it through the normal run logger would print every line twice. Prefect's
    ``prefect.extra`` logger has only the API handler. The run ids are attached explicitly because the
    follower thread does not inherit the run context.
    """
    try:
        from prefect.context import FlowRunContext, TaskRunContext
        from prefect.logging.loggers import PrefectLogAdapter, get_logger
    except ImportError:
        return None
    task_ctx, flow_ctx = TaskRunContext.get(), FlowRunContext.get()
    extra: dict = {}
    if task_ctx is not None:
        extra = {
            "task_run_id": str(task_ctx.task_run.id),
            "flow_run_id": str(task_ctx.task_run.flow_run_id),
            "task_run_name": task_ctx.task_run.name,
        }
    elif flow_ctx is not None and flow_ctx.flow_run is not None:
        extra = {"flow_run_id": str(flow_ctx.flow_run.id), "flow_run_name": flow_ctx.flow_run.name}
    else:
        return None
    return PrefectLogAdapter(get_logger("extra"), extra=extra)


class _Follower(threading.Thread):
    """Reads lines appended to ``path`` after start-up and hands each to ``logger.info``."""

    def __init__(self, path: Path, logger, poll_s: float):
        super().__init__(name=f"follow-{path.name}", daemon=True)
        self.path, self.logger, self.poll_s = path, logger, poll_s
        self.stopped = threading.Event()
        # Start at the current end: older content belongs to earlier attempts, already logged then.
        self.pos = path.stat().st_size if path.is_file() else 0
        self.partial = ""
        self.lines = 0

    def _drain(self) -> None:
        if not self.path.is_file():
            return
        size = self.path.stat().st_size
        if size < self.pos:  # the launcher truncated the log for a new attempt
            self.pos = 0
        if size == self.pos:
            return
        with open(self.path, "r", errors="replace") as f:
            f.seek(self.pos)
            chunk = f.read()
            self.pos = f.tell()
        text = self.partial + chunk
        *complete, self.partial = text.split("\n")
        for line in complete:
            line = line.rstrip("\r")
            if line.strip():
                self.logger.info(line)
                self.lines += 1

    def run(self) -> None:
        while not self.stopped.wait(self.poll_s):
            self._drain()

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=5)
        self._drain()
        if self.partial.strip():
            self.logger.info(self.partial.rstrip("\r"))
            self.lines += 1
        self.partial = ""


@contextlib.contextmanager
def follow_log(path: Path, logger=None, *, poll_s: float = 0.5) -> Iterator[_Follower | None]:
    """Forward lines appended to ``path`` while the block runs; no-op without a logger or run context."""
    logger = logger if logger is not None else api_only_logger()
    if logger is None:
        yield None
        return
    follower = _Follower(path, logger, poll_s)
    # The thread runs in a copy of this context: Prefect's settings (logging to the API on or off)
    # and run context live in contextvars, which a plain new thread would not see.
    ctx = contextvars.copy_context()
    follower.run = functools.partial(ctx.run, follower.run)
    follower.start()
    try:
        yield follower
    finally:
        follower.stop()


class _NoUserErrorTraceback(logging.Filter):
    """Prefect logs a failed task or flow run with its traceback; for a UserError (bad input, an OS
    fault: titan_pipe.io.faults) or an interrupt the one-line message is the whole story, so the
    record keeps its message and drops the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        from titan_pipe.errors import UserError

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, (UserError, KeyboardInterrupt)):
            record.exc_info, record.exc_text = None, None
        return True


def quiet_user_error_tracebacks() -> None:
    """Install the filter on Prefect's task-run and flow-run loggers (once per process)."""
    for name in ("prefect.task_runs", "prefect.flow_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoUserErrorTraceback) for f in logger.filters):
            logger.addFilter(_NoUserErrorTraceback())


class _NoRepeats(logging.Filter):
    """Drops, from the console only, the run-logger lines `titan-pipe run` says in its own words:
    Prefect's "Finished in state ..." of each task and flow, and a failure's exception, which the
    command prints once, last. The API handler keeps them all for the UI; a retry's line stays, and
    so does a record with its traceback (an unexpected crash: a UserError's is stripped before)."""

    REPEATS = ("Finished in state ", "Encountered exception during execution")

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(("prefect.flow_runs", "prefect.task_runs")) or record.exc_info:
            return True
        msg = record.getMessage()
        if msg.startswith(self.REPEATS):
            return False
        return not (record.levelno >= logging.ERROR and msg.startswith("Task run failed with exception"))


@contextlib.contextmanager
def console_without_repeats() -> Iterator[None]:
    """Install _NoRepeats on the root logger's console handlers (Prefect's) while the block runs."""
    handlers = [h for h in logging.getLogger().handlers if type(h).__name__ == "PrefectConsoleHandler"]
    f = _NoRepeats()
    for h in handlers:
        h.addFilter(f)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(f)
