"""The titan-pipe command line: the Typer root app (init, validate); the commands of every stage live in
titan_pipe.commands, one module per command group, each a thin shell over a stage's library function."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from titan_pipe.io import faults
from titan_pipe.io.atomic import write_text
from titan_pipe.commands.common import console, handle_errors
from titan_pipe.commands.example import InitRequest
from titan_pipe.commands.options import with_section
from titan_pipe.config import ConfigError
from titan_pipe.config import load_flow
from titan_pipe.errors import UserError
from titan_pipe.processes.run_lock import path_lock

app = typer.Typer(
    name="titan-pipe",
    help="Train -> convert -> export -> evaluate for LLaMA-family models (Ascend NPU, CUDA, CPU).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command()
@handle_errors
@with_section(InitRequest, into="request")
def init(directory: Path = typer.Argument(..., help="Directory to write flow.yaml into"), *, request: InitRequest):
    """Write a commented example flow.yaml (the debug model on CPU, a run of --flavour on --devices
    x --device with the planner's layout, or a run of the released model --from HF_DIR; --sft: a
    fine-tune of it) into DIRECTORY."""
    from titan_pipe.commands.example import SAMPLE_CHAT, example_flow, lora_flow, name_run, released_flow, sample_chat

    r = request
    target = directory / "flow.yaml"
    if r.lora is not None and not r.sft:
        raise UserError("--lora adapts a released model on chat data: add --sft (and --from HF_DIR or --flavour)")
    if r.released is not None and r.flavour != "debug":
        raise UserError("--from and --flavour both given; the released dir states the model: drop --flavour")
    # refused before anything is written
    text = (
        released_flow(r.released.resolve(), sft=r.sft, devices=r.devices, device=r.device)
        if r.released is not None
        else example_flow(r.flavour, devices=r.devices, device=r.device, sft=r.sft)
    )
    if r.lora is not None:
        text = lora_flow(text, r.lora)
    text = name_run(text, directory)
    with faults.writing(target, what="the example flow.yaml"), path_lock(target, what="titan-pipe init"):
        if target.exists() and not r.force:
            raise UserError(f"{target} already exists; pass --force to overwrite it")
        if r.sft and not (directory / SAMPLE_CHAT).exists():
            write_text(directory / SAMPLE_CHAT, sample_chat())
        write_text(target, text)
    extra = f" and {directory / SAMPLE_CHAT}" if r.sft else ""
    todo = "FILL IN" in text  # lines the user completes first (a fine-tune's init_from, a real tokenizer)
    console.print(
        f"wrote {target}{extra}; "
        + ("fill in the lines marked FILL IN, then check it with: " if todo else "check it with: ")
        + f"titan-pipe validate {target}",
        highlight=False,
        soft_wrap=True,
    )


@app.command()
@handle_errors
def validate(
    flow: Path = typer.Argument(..., help="flow.yaml to check"),
    elsewhere: bool = typer.Option(
        False,
        "--elsewhere",
        help="the flow runs on another host (a cluster's flow checked on a laptop): leave out this host's device",
    ),
):
    """Check a flow.yaml without running anything (exit 2 and one line per problem if invalid): its
    rules, and what train would meet before its first step on this host (its device, data, init_from)."""
    cfg = load_flow(flow)
    args = cfg.model.args()
    from titan_pipe.model.args import count_params
    from titan_pipe.training.preflight import check_before_launch, device_problem

    device = None if elsewhere else device_problem(cfg)
    if device:
        raise ConfigError(str(flow), [device + "; or pass --elsewhere to check it for another host"])
    check_before_launch(cfg, flow_path=flow, disk=False)  # what train would meet before its first step

    p = cfg.parallel
    model = f"init_from {cfg.init_from}" if cfg.init_from is not None else cfg.model.flavour or "custom"
    lora = cfg.train.lora
    if lora is not None:
        from titan_pipe.model.lora import adapter_count

        n = adapter_count(args, lora.spec())
        model += (
            f", LoRA rank {lora.rank} on {', '.join(lora.targets)}: {n / 1e6:.2f}M trained, the base frozen in "
            f"{lora.held_dtype(cfg.precision)}"
        )
    typer.echo(
        f"{flow}: ok — model {model} ({count_params(args) / 1e6:.2f}M params), "
        f"dp={p.dp} tp={p.tp} pp={p.pp} ({p.pp_schedule}, {p.n_microbatches} microbatches), "
        f"world size {p.world_size}, {cfg.train.steps} steps"
    )


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
