"""CLI of the convert stage: `titan-pipe convert` and `titan-pipe inspect` (thin shells over the library)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from titan_pipe import limits
from titan_pipe.choices import DIGESTS, NAMINGS, SOURCE_FORMATS
from titan_pipe.commands.common import FLOW_HELP, call_stage, console, handle_errors
from titan_pipe.config import ConvertConfig, section_from_flags
from titan_pipe.model.lora import CONVERT_MODES as LORA_CONVERT

CONVERT = {k: f.default for k, f in ConvertConfig.model_fields.items()}  # each default spelled once, in the section


def register(app: typer.Typer) -> None:
    @app.command("convert")
    @handle_errors
    def convert(
        src: Path = typer.Argument(..., help="Checkpoint dir: titan-pipe, DCP/torchtitan, Megatron-LM or Hugging Face"),
        out: Path = typer.Option(..., "-o", "--out", help="Output directory (must be empty or absent)"),
        source_format: str = typer.Option(CONVERT["source_format"], "--from", help=" | ".join(SOURCE_FORMATS)),
        naming: str = typer.Option(
            CONVERT["naming"], "--naming", help=" | ".join(NAMINGS) + " (hf: transformers loads it)"
        ),
        dtype: str = typer.Option(CONVERT["dtype"], "--dtype", help="keep | float32 | float16 | bfloat16"),
        max_shard_size: str = typer.Option(
            CONVERT["max_shard_size"], "--max-shard-size", help="Split the output past this size"
        ),
        tp: Optional[int] = typer.Option(None, "--tp", help="Write our sharded layout with this TP size"),
        pp: Optional[int] = typer.Option(None, "--pp", help="... and this number of pipeline stages"),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty output directory"),
        vocab_size: Optional[int] = typer.Option(None, "--vocab-size", help="True vocab size (Megatron padded vocab)"),
        model_config: Optional[Path] = typer.Option(
            None, "--model-config", help="params.json / config.json for DCP sources"
        ),
        no_verify: bool = typer.Option(
            False, "--no-verify", help="Skip hashing the source (sizes/headers still checked)"
        ),
        digest: str = typer.Option(
            CONVERT["digest"],
            "--digest",
            help=" | ".join(DIGESTS) + ": the source files' digests in provenance.json (xxh3_128: "
            "fast, detects corrupted or swapped files; sha256: cryptographic, what `sha256sum` "
            "and the Hub show). A titan-pipe checkpoint is checked against its manifest's sha256s",
        ),
        lora: str = typer.Option(
            CONVERT["lora"],
            "--lora",
            help=" | ".join(LORA_CONVERT) + ": a LoRA checkpoint as the merged model (W + "
            "alpha/rank B A, what export takes) or as a PEFT adapter dir for its base model",
        ),
        flow: bool = typer.Option(False, "--flow", help=FLOW_HELP),
    ):
        """Convert a sharded checkpoint into one Hugging Face safetensors model (or reshard it)."""
        from titan_pipe.convert.api import convert_checkpoint
        from titan_pipe.convert.finite import describe

        for flag, value, bound in (
            ("--tp", tp, limits.PARALLEL),
            ("--pp", pp, limits.PARALLEL),
            ("--vocab-size", vocab_size, limits.VOCAB),
        ):
            limits.check_flag(flag, value, bound)

        settings = section_from_flags(
            ConvertConfig,
            {
                "source_format": "--from",
                "naming": "--naming",
                "dtype": "--dtype",
                "max_shard_size": "--max-shard-size",
                "tp": "--tp",
                "pp": "--pp",
                "vocab_size": "--vocab-size",
                "source_config": "--model-config",
                "digest": "--digest",
                "lora": "--lora",
            },
            source_format=source_format,
            naming=naming,
            dtype=dtype,
            max_shard_size=max_shard_size,
            tp=tp,
            pp=pp,
            vocab_size=vocab_size,
            source_config=str(model_config) if model_config is not None else None,
            verify=not no_verify,
            digest=digest,
            lora=lora,
        )
        r = call_stage(
            "convert", convert_checkpoint, track=flow, src=src, out_dir=out, settings=settings, overwrite=overwrite
        )
        s = r.summary
        if s.get("nonfinite"):
            console.print(
                f"[yellow]warning[/yellow] {r.out_dir}: NaN/Inf values in {len(s['nonfinite'])} "
                f"tensor(s): {describe(s['nonfinite'])}; the source holds them (or a --dtype cast "
                "overflowed): evaluate fails on such a model",
                highlight=False,
                soft_wrap=True,
            )
        step = f"step {s['step']}, " if s.get("step") is not None else ""
        typer.echo(
            f"converted {s['format']} {s['src']} ({step}{s['layout']}) -> {r.out_dir}: "
            f"{s['tensors']} tensors, {s['bytes'] / 1e6:.1f} MB in {s['files']} file(s), "
            f"{s['wall_s']:.2f} s"
        )
        if s.get("tokenizer") is None:
            console.print(
                f"[yellow]warning[/yellow] {r.out_dir}: no tokenizer: {s['src']} carries none (no "
                "tokenizer.json beside its weights); copy the model's tokenizer files into it before "
                "evaluating or serving it",
                highlight=False,
                soft_wrap=True,
            )
        if s.get("stop_ids") is None:
            console.print(
                f"[yellow]warning[/yellow] {r.out_dir}: no eos_token_id: the source names no stop "
                "token, so generation runs to its token limit; add eos_token_id to config.json",
                highlight=False,
                soft_wrap=True,
            )

    @app.command("inspect")
    @handle_errors
    def inspect(
        src: Path = typer.Argument(..., help="Checkpoint dir to describe (no tensor data is read)"),
        source_format: str = typer.Option("auto", "--from", help="auto | titan | dcp | megatron | hf"),
        vocab_size: Optional[int] = typer.Option(None, "--vocab-size", help="True vocab size (Megatron)"),
        model_config: Optional[Path] = typer.Option(None, "--model-config", help="params.json / config.json for DCP"),
    ):
        """Print a checkpoint's format, layout, parameters (shape, dtype, split) and size."""
        from rich.console import Console

        from titan_pipe.convert.inspect import inspect_checkpoint, render

        limits.check_flag("--vocab-size", vocab_size, limits.VOCAB)

        render(
            inspect_checkpoint(src=src, source_format=source_format, vocab_size=vocab_size, model_config=model_config),
            Console(width=160),
        )
