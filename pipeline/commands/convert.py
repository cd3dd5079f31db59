"""CLI of the convert stage: `titan-pipe convert` and `titan-pipe inspect` (thin shells over the library)."""

from __future__ import annotations

from pathlib import Path

import typer

from titan_pipe.commands.common import OVERWRITE, TRACK, call_stage, console, handle_errors, out_option
from titan_pipe.commands.options import with_section
from titan_pipe.config import ConvertConfig


def register(app: typer.Typer) -> None:
    @app.command("convert")
    @handle_errors
    @with_section(ConvertConfig)  # every field an option: its default, help and flag are written there
    def convert(
        src: Path = typer.Argument(..., help="Checkpoint dir: titan-pipe, DCP/torchtitan, Megatron-LM or Hugging Face"),
        out: Path = out_option("Output directory (must be empty or absent)"),
        overwrite: bool = OVERWRITE,
        flow: bool = TRACK,
        settings: ConvertConfig = None,
    ):
        """Convert a sharded checkpoint into one Hugging Face safetensors model (or reshard it)."""
        from titan_pipe.convert.api import convert_checkpoint
        from titan_pipe.convert.finite import describe

        r = call_stage(
            "convert", convert_checkpoint, track=flow, src=src, out_dir=out, settings=settings, overwrite=overwrite
        )
        s = r.summary
        if s.nonfinite:
            console.print(
                f"[yellow]warning[/yellow] {r.out_dir}: NaN/Inf values in {len(s.nonfinite)} "
                f"tensor(s): {describe(s.nonfinite)}; the source holds them (or a --dtype cast "
                "overflowed): evaluate fails on such a model",
                highlight=False,
                soft_wrap=True,
            )
        step = f"step {s.step}, " if s.step is not None else ""
        typer.echo(
            f"converted {s.format} {s.src} ({step}{s.layout}) -> {r.out_dir}: "
            f"{s.tensors} tensors, {s.bytes / 1e6:.1f} MB in {s.files} file(s), "
            f"{s.wall_s:.2f} s"
        )
        if s.tokenizer is None:
            console.print(
                f"[yellow]warning[/yellow] {r.out_dir}: no tokenizer: {s.src} carries none (no "
                "tokenizer.json beside its weights); copy the model's tokenizer files into it before "
                "evaluating or serving it",
                highlight=False,
                soft_wrap=True,
            )
        if s.stop_ids is None:
            console.print(
                f"[yellow]warning[/yellow] {r.out_dir}: no eos_token_id: the source names no stop "
                "token, so generation runs to its token limit; add eos_token_id to config.json",
                highlight=False,
                soft_wrap=True,
            )

    @app.command("inspect")
    @handle_errors
    @with_section(ConvertConfig, ("source_format", "vocab_size", "source_config"))  # convert's own options
    def inspect(
        src: Path = typer.Argument(..., help="Checkpoint dir to describe (no tensor data is read)"),
        settings: ConvertConfig = None,
    ):
        """Print a checkpoint's format, layout, parameters (shape, dtype, split) and size."""
        from rich.console import Console

        from titan_pipe.convert.inspect import inspect_checkpoint, render

        config = Path(settings.source_config) if settings.source_config is not None else None
        render(
            inspect_checkpoint(
                src=src, source_format=settings.source_format, vocab_size=settings.vocab_size, model_config=config
            ),
            Console(width=160),
        )
