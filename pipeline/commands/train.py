"""`titan-pipe train FLOW [--resume]`: validate the flow, launch training, print a short summary."""

from __future__ import annotations

from pathlib import Path

import typer

from titan_pipe.commands.common import TRACK, call_stage, console, handle_errors
from titan_pipe.records.stage_summaries import TrainSummary


def _format_summary(s: TrainSummary) -> str:
    def num(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    return (
        f"steps {s.steps} | final loss {num(s.final_loss, '.4f')} | {num(s.tokens_per_s, ',.0f')} tok/s | "
        f"MFU {'n/a' if s.mfu is None else f'{100 * s.mfu:.2f}%'}"
    )


def register(app: typer.Typer) -> None:
    @app.command()
    @handle_errors
    def train(
        flow: Path = typer.Argument(..., help="flow.yaml describing the run"),
        resume: bool = typer.Option(False, "--resume", help="continue from the newest complete checkpoint of the run"),
        track: bool = TRACK,
    ):
        """Train the model of FLOW on dp*tp*pp processes (torchrun); exits with torchrun's status."""
        from titan_pipe.config import load_flow
        from titan_pipe.training.launch import reports, run_training
        from titan_pipe.training.preflight import check_before_launch

        cfg = load_flow(flow)  # ConfigError -> exit 2 before anything starts or any dir is made
        p = cfg.parallel
        if not reports():  # another rank of an existing torchrun/srun launch: rank 0 speaks
            run_training(flow_path=flow, cfg=cfg, resume=resume)
            return
        check_before_launch(cfg, flow_path=flow, resume=resume)  # before the first line is printed
        console.print(
            f"training {cfg.name}: dp={p.dp} tp={p.tp} pp={p.pp}, {cfg.train.steps} steps, run dir {cfg.run_dir()}",
            highlight=False,
            soft_wrap=True,
        )
        result = call_stage(
            "train", run_training, track=track, writes=cfg.run_dir(), flow_path=flow, cfg=cfg, resume=resume
        )
        console.print(f"done: {_format_summary(result.summary)}", highlight=False, soft_wrap=True)
        if result.summary.peak_flops_source:
            console.print(f"peak FLOPs: {result.summary.peak_flops_source}", highlight=False, soft_wrap=True)
        console.print(f"checkpoint: {result.checkpoint}\nmetrics:    {result.metrics}", highlight=False, soft_wrap=True)
        if result.summary.plot:
            console.print(f"curves:     {result.summary.plot}", highlight=False, soft_wrap=True)
