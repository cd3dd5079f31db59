"""`titan-pipe export`: a thin shell over titan_pipe.convert.onnx.export.export_model."""

from __future__ import annotations

from pathlib import Path

import typer

from titan_pipe.rules import limits
from titan_pipe.commands.common import OVERWRITE, TRACK, call_stage, console, handle_errors, out_option
from titan_pipe.commands.options import with_section
from titan_pipe.config import ExportConfig


def register(app: typer.Typer) -> None:
    @app.command("export")
    @handle_errors
    @with_section(ExportConfig)  # every field an option: its default, help and flag are written there
    def export(
        model_dir: Path = typer.Argument(
            ..., help="Unified model dir (titan-pipe convert output or a Hugging Face LLaMA dir)"
        ),
        out_dir: Path = out_option("Directory to write model.onnx, decode.onnx, atc/, export.json"),
        overwrite: bool = OVERWRITE,
        flow: bool = TRACK,
        settings: ExportConfig = None,
    ):
        """Export MODEL_DIR to ONNX (prefill + KV-cache decode) for Ascend ATC, with an operator report."""
        from titan_pipe.convert.onnx.export import export_model

        for flag, value, bound in (
            ("--batch", settings.batch, limits.BATCH),
            ("--seq-len", settings.seq_len, limits.SEQ_LEN),
            ("--cache-len", settings.cache_len, limits.CACHE_LEN),
        ):
            limits.check_flag(flag, value, bound)  # before the model is read: one line naming the limit
        r = call_stage(
            "export",
            export_model,
            track=flow,
            model_dir=model_dir,
            out_dir=out_dir,
            settings=settings,
            overwrite=overwrite,
        )
        s = r.summary
        graphs = ", ".join(f"{f} ({g['nodes']} nodes, {g['bytes'] / 1e6:.1f} MB)" for f, g in s.graphs.items())
        console.print(
            f"exported {graphs}; weights {s.data_bytes / 1e6:.1f} MB in {len(s.data_files)} external-data "
            f"file(s) beside them, at opset {s.opset}, {s.dtype}, "
            f"{'dynamic' if s.dynamic else 'static'} shapes in {s.export_seconds:.1f} s; "
            f"ATC: {r.atc_status}; report: {r.export_json}",
            highlight=False,
            soft_wrap=True,
        )
