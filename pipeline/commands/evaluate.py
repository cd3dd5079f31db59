"""`titan-pipe evaluate`: a thin shell over titan_pipe.evaluate.api.evaluate_model."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from titan_pipe.commands.common import TRACK, call_stage, console, handle_errors, out_option
from titan_pipe.commands.options import laid_over, with_section
from titan_pipe.config import EvaluateConfig
from titan_pipe.io.paths import resolve_inside


# The evaluate section's fields that are options here (their help, types and defaults: titan_pipe.config);
# each one not given keeps --config's value (or the section's default)
OPTIONS = ("dtype", "device", "batches", "operators", "dump", "max_memory")


def register(app: typer.Typer) -> None:
    @app.command("evaluate")
    @handle_errors
    @with_section(EvaluateConfig, OPTIONS, into="given", overlay="evaluate")
    def evaluate(
        out_dir: Path = out_option("REPORT_DIR for report.json/.md/.html, CSVs, plots"),
        checkpoint: Optional[Path] = typer.Option(
            None, "--checkpoint", help="Training checkpoint step dir (run under its own TP/PP layout with torchrun)"
        ),
        model_dir: Optional[Path] = typer.Option(None, "--model-dir", help="Unified model dir (titan-pipe convert)"),
        onnx: Optional[Path] = typer.Option(
            None, "--onnx", help="Exported prefill graph OUT_DIR/model.onnx (decode.onnx beside it is evaluated too)"
        ),
        om: Optional[Path] = typer.Option(None, "--om", help="ATC .om model (needs an Ascend runtime)"),
        data: Optional[Path] = typer.Option(
            None,
            "--data",
            help="Held-out text (.txt/.jsonl/.jsonl.gz/.parquet or "
            "a .bin/.idx prefix, used whole; a prepared dir: its validation documents; "
            "default: the validation split of --config's data, else of the shipped corpus)",
        ),
        config: Optional[Path] = typer.Option(
            None, "--config", help="flow.yaml whose evaluate section (batches, thresholds, ...) to use"
        ),
        flow: bool = TRACK,
        given: dict = None,
    ):
        """Compare training checkpoint, unified model, ONNX and OM per layer, per operator, per dtype.

        Exit code 1 when any threshold fails (the verdict names the first diverging layer and operator).
        """
        from titan_pipe.config import load_flow
        from titan_pipe.evaluate.api import evaluate_model
        from titan_pipe.evaluate.batches import held_out_text

        flow_cfg = load_flow(config) if config is not None else None
        settings = flow_cfg.evaluate if flow_cfg is not None else EvaluateConfig()
        if data is None and flow_cfg is not None and flow_cfg.evaluate.data:
            # a path read from a file stays inside that file's dir; one on the command line is the user's
            resolve_inside(
                config.parent,
                flow_cfg.evaluate.data,
                source=config,
                what="evaluate.data",
                kind="any",
                fix="put the file beside the flow.yaml, or pass it with --data FILE",
            )
        data, split = held_out_text(
            data=data,
            flow=flow_cfg,
            flow_dir=config.parent if config else None,
            run_dir=flow_cfg.run_dir() if flow_cfg is not None else None,
        )
        settings = laid_over(settings, given)  # validated as flow.yaml's section is: a bad value is one line
        r = call_stage(
            "evaluate",
            evaluate_model,
            track=flow,
            out_dir=out_dir,
            checkpoint=checkpoint,
            model_dir=model_dir,
            onnx=onnx,
            om=om,
            data=data,
            settings=settings,
            progress=True,
            split=split,
        )
        for cid, status in r.summary.comparisons.items():
            console.print(f"  {cid:20s} {status}", highlight=False, soft_wrap=True)
        console.print(r.summary.memory_line, highlight=False, soft_wrap=True)
        before = r.summary.perplexity_before_finetune
        if before is not None:  # a LoRA checkpoint: what the fine-tune changed on the held-out data
            after = next(iter((r.summary.perplexity or {}).values()), None)
            console.print(
                f"  perplexity {before:.4g} before the fine-tune (the base), {after:.4g} after",
                highlight=False,
                soft_wrap=True,
            )
        colour = "green" if r.passed else "red"
        console.print(f"[{colour}]{escape(r.summary.verdict)}[/{colour}]", highlight=False, soft_wrap=True)
        console.print(f"report: {r.report_json.parent / 'report.html'}", highlight=False, soft_wrap=True)
        if not r.passed:
            raise typer.Exit(1)
