"""What every command shares: the stderr console, error-to-exit-code mapping, and running a stage
directly or as a tracked Prefect flow run."""
from __future__ import annotations

import functools
from typing import Callable

import typer
from rich.console import Console

from titan_pipe.config import ConfigError
from titan_pipe.errors import UserError

console = Console(stderr=True)

FLOW_HELP = "Track this run as a Prefect flow run (UI, logs); without it no Prefect is involved"


def handle_errors(fn: Callable) -> Callable:
    """Map the errors a user can fix to one clear message and an exit code (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ConfigError as e:
            for line in e.lines:
                console.print(f"[red]error[/red] {e.source}: {line}", highlight=False, soft_wrap=True)
            raise typer.Exit(2)
        except UserError as e:
            console.print(f"[red]error[/red] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code)

    return wrapper


def call_stage(stage: str, fn: Callable, *, track: bool, **kwargs):
    """Run a stage's library function directly, or (``--flow``) inside a tracked Prefect flow run."""
    if not track:
        return fn(**kwargs)
    from titan_pipe.flows.track import run_tracked  # Prefect is imported only when asked for

    return run_tracked(stage, fn, **kwargs)
