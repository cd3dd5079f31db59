"""The titan-pipe command line: the Typer root app (init, validate); the commands of every stage live in
titan_pipe.commands, one module per command group, each a thin shell over a stage's library function."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import typer

from titan_pipe import faults
from titan_pipe.atomic import write_text
from titan_pipe.commands.common import console, handle_errors
from titan_pipe.config import load_flow
from titan_pipe.errors import UserError
from titan_pipe.run_lock import path_lock

app = typer.Typer(
    name="titan-pipe",
    help="Train -> convert -> export -> evaluate for LLaMA-family models (Ascend NPU, CUDA, CPU).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
TEMPLATE = Path(__file__).parent / "templates" / "flow.yaml"


@app.command()
@handle_errors
def init(directory: Path = typer.Argument(..., help="Directory to write flow.yaml into"),
         flavour: str = typer.Option("debug", "--flavour", help="Model flavour (debug, llama3_8b, qwen3_8b, ...)"),
         force: bool = typer.Option(False, "--force", help="Overwrite an existing flow.yaml")):
    """Write a commented example flow.yaml (the debug model on CPU, or --flavour's) into DIRECTORY."""
    target = directory / "flow.yaml"
    text = example_flow(flavour)  # an unknown flavour is refused before anything is written
    with faults.writing(target, what="the example flow.yaml"), path_lock(target, what="titan-pipe init"):
        if target.exists() and not force:
            raise UserError(f"{target} already exists; pass --force to overwrite it")
        write_text(target, text)
    console.print(f"wrote {target}; check it with: titan-pipe validate {target}")


def example_flow(flavour: str) -> str:
    """The template with ``flavour`` in place of debug (its comment kept in its column where the
    name allows)."""
    from titan_pipe.model.args import FLAVOURS

    if flavour not in FLAVOURS:
        raise UserError(f"--flavour {flavour!r} is unknown; use one of {', '.join(FLAVOURS)}")
    return re.sub(r"(?m)^(  flavour: )debug( *)",
                  lambda m: m.group(1) + flavour.ljust(len("debug") + len(m.group(2)) - 1) + " ", TEMPLATE.read_text())


@app.command()
@handle_errors
def validate(flow: Path = typer.Argument(..., help="flow.yaml to check")):
    """Check a flow.yaml without running anything (exit 2 and one line per problem if invalid)."""
    cfg = load_flow(flow)
    args = cfg.model.args()
    from titan_pipe.model.args import count_params
    from titan_pipe.training.preflight import check_before_launch

    check_before_launch(cfg, flow_path=flow, disk=False)  # what train would meet before its first step

    p = cfg.parallel
    typer.echo(f"{flow}: ok — model {cfg.model.flavour or 'custom'} ({count_params(args) / 1e6:.2f}M params), "
               f"dp={p.dp} tp={p.tp} pp={p.pp} ({p.pp_schedule}, {p.n_microbatches} microbatches), "
               f"world size {p.world_size}, {cfg.train.steps} steps")


def _register_commands() -> None:
    # One module per command group under titan_pipe.commands; the root only mounts them.
    from titan_pipe.commands import convert, data, evaluate, export, plan, run, train

    for module in (data, train, plan, convert, export, evaluate, run):
        module.register(app)


_register_commands()


def main() -> None:  # pragma: no cover - console entry
    sys.exit(app())


if __name__ == "__main__":  # python -m titan_pipe.cli
    app()
