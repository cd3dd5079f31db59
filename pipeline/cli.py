"""The titan-pipe command line: a Typer root app; each stage registers its own thin commands."""
from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Callable

import typer
from rich.console import Console

from titan_pipe.atomic import write_text
from titan_pipe.config import ConfigError, load_flow
from titan_pipe.errors import UserError

app = typer.Typer(
    name="titan-pipe",
    help="Train -> convert -> export -> evaluate for LLaMA-family models (Ascend NPU, CUDA, CPU).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)

TEMPLATE = Path(__file__).parent / "templates" / "flow.yaml"


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


FLOW_HELP = "Track this run as a Prefect flow run (UI, logs); without it no Prefect is involved"


@app.command()
@handle_errors
def init(directory: Path = typer.Argument(..., help="Directory to write flow.yaml into"),
         force: bool = typer.Option(False, "--force", help="Overwrite an existing flow.yaml")):
    """Write a commented example flow.yaml (the debug model on CPU) into DIRECTORY."""
    target = directory / "flow.yaml"
    if target.exists() and not force:
        raise UserError(f"{target} already exists; pass --force to overwrite it")
    write_text(target, TEMPLATE.read_text())
    console.print(f"wrote {target}; check it with: titan-pipe validate {target}")


@app.command()
@handle_errors
def validate(flow: Path = typer.Argument(..., help="flow.yaml to check")):
    """Check a flow.yaml without running anything (exit 2 and one line per problem if invalid)."""
    cfg = load_flow(flow)
    args = cfg.model.args()
    from titan_pipe.model_args import count_params

    p = cfg.parallel
    typer.echo(f"{flow}: ok — model {cfg.model.flavour or 'custom'} ({count_params(args) / 1e6:.2f}M params), "
               f"dp={p.dp} tp={p.tp} pp={p.pp} ({p.pp_schedule}, {p.n_microbatches} microbatches), "
               f"world size {p.world_size}, {cfg.train.steps} steps")


def _register_stages() -> None:
    # Each stage owns its commands; the root only mounts them.
    from titan_pipe.convert import cli as convert_cli
    from titan_pipe.convert import export_cli
    from titan_pipe.evaluate import cli as evaluate_cli
    from titan_pipe.flows import cli as flows_cli
    from titan_pipe.training import cli as training_cli
    from titan_pipe.training import plan_cli

    for module in (training_cli, plan_cli, convert_cli, export_cli, evaluate_cli, flows_cli):
        module.register(app)


_register_stages()


def main() -> None:  # pragma: no cover - console entry
    sys.exit(app())


if __name__ == "__main__":  # python -m titan_pipe.cli
    app()
