"""What every command shares: the stderr console, error-to-exit-code mapping (bad input, OS faults,
interrupts), and running a stage directly or as a tracked Prefect flow run."""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from pathlib import Path
from typing import Callable, Iterator

import typer
from rich.console import Console
from rich.markup import escape

from titan_pipe.io import faults
from titan_pipe.config import ConfigError
from titan_pipe.errors import Interrupted, UserError
from titan_pipe.processes.run_lock import output_lock

console = Console(stderr=True)

FLOW_HELP = "Track this run as a Prefect flow run (UI, logs); without it no Prefect is involved"
# the one --flow option every stage command takes (its value: whether call_stage tracks the call)
TRACK = typer.Option(False, "--flow", help=FLOW_HELP)


def out_option(what: str):
    """The one -o/--out option of the commands that write a directory; ``what``: what it receives."""
    return typer.Option(..., "-o", "--out", help=what)


# the one --overwrite of the commands that write an output directory
OVERWRITE = typer.Option(
    False, "--overwrite", help="Replace the output directory if it exists (written beside, then swapped)"
)


def _error(text: str) -> None:
    console.print(f"[red]error[/red] {escape(text)}", highlight=False, soft_wrap=True)


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP (what Slurm, Kubernetes and a closed terminal send) raise Interrupted like
    Ctrl-C does, so the same cleanup runs: children stopped, temp outputs removed, locks released."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, _frame):
        raise Interrupted(signum)

    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def handle_errors(fn: Callable) -> Callable:
    """Map the errors a user can fix to one clear message and an exit code (no traceback):
    ConfigError 2, UserError (OS faults included) 1, an interrupt 128+signal."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            with _terminate_as_interrupt():
                return fn(*args, **kwargs)
        except ConfigError as e:
            for line in e.lines:
                console.print(f"[red]error[/red] {escape(f'{e.source}: {line}')}", highlight=False, soft_wrap=True)
            raise typer.Exit(2)
        except UserError as e:
            _error(str(e))
            raise typer.Exit(e.exit_code)
        except KeyboardInterrupt as e:
            stop = Interrupted.of(e)
            _error(str(stop))
            raise typer.Exit(stop.exit_code)
        except OSError as e:
            if e.errno not in faults.FAULT_ERRNOS or e.filename is None:
                raise
            _error(faults.fault_message(e))
            raise typer.Exit(1)

    return wrapper


def call_stage(stage: str, fn: Callable, *, track: bool, writes: Path | None = None, **kwargs):
    """Run a stage's library function directly, or (``--flow``) inside a tracked Prefect flow run,
    holding the locks of its ``out_dir`` and of the run dir that lies in (titan_pipe.processes.run_lock). An
    OS fault becomes one line naming ``writes`` (default ``out_dir``) and what the stage writes."""
    out_dir = kwargs.get("out_dir")

    @functools.wraps(fn)
    def stage_fn(**kw):
        with faults.writing(writes or out_dir, what=faults.STAGE_OUTPUTS[stage]):
            return fn(**kw)

    with (
        faults.writing(writes or out_dir, what=faults.STAGE_OUTPUTS[stage]),
        output_lock(out_dir, what=f"titan-pipe {stage}"),
    ):  # one writer per output
        if not track:
            return stage_fn(**kwargs)
        from titan_pipe.flows.track import run_tracked  # Prefect is imported only when asked for

        return run_tracked(stage, stage_fn, **kwargs)
