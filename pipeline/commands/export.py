"""`titan-pipe export`: a thin shell over titan_pipe.convert.onnx.export.export_model."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer

from titan_pipe import limits
from titan_pipe.choices import DIGESTS, EXPORT, PRECISION_MODES
from titan_pipe.commands.common import FLOW_HELP, call_stage, console, handle_errors
from titan_pipe.dtypes import EXPORT_NAMES

Dtype = Enum("Dtype", {n: n for n in EXPORT_NAMES}, type=str)  # the dtype table's export types
Precision = Enum("Precision", {n: n for n in PRECISION_MODES}, type=str)  # titan_pipe.choices
Digest = Enum("Digest", {n: n for n in DIGESTS}, type=str)  # titan_pipe.choices (from titan_pipe.hashing)


def register(app: typer.Typer) -> None:
    @app.command("export")
    @handle_errors
    def export(
        model_dir: Path = typer.Argument(
            ..., help="Unified model dir (titan-pipe convert output or a Hugging Face LLaMA dir)"
        ),
        out_dir: Path = typer.Option(
            ..., "-o", "--out", help="Directory to write model.onnx, decode.onnx, atc/, export.json"
        ),
        opset: int = typer.Option(
            EXPORT.opset, "--opset", help="ONNX opset (ATC takes 11-15; the exporter needs >= 14)"
        ),
        dtype: Dtype = typer.Option(Dtype(EXPORT.dtype), "--dtype", help="Weights/activations dtype in the graph"),
        batch: int = typer.Option(EXPORT.batch, "--batch", help="Batch size (static shape, and the ATC gears)"),
        seq_len: int = typer.Option(
            EXPORT.seq_len, "--seq-len", help="Prompt length T of model.onnx (static shape, and the ATC gears)"
        ),
        cache_len: int = typer.Option(
            EXPORT.cache_len,
            "--cache-len",
            help="KV-cache slots of decode.onnx (default: min(max_position_embeddings, 4096)); >= seq-len + 1",
        ),
        dynamic: bool = typer.Option(
            EXPORT.dynamic, "--dynamic/--static", help="Dynamic batch/sequence dims, or fixed ones"
        ),
        kv_cache: bool = typer.Option(
            EXPORT.kv_cache, "--kv-cache/--no-kv-cache", help="Also export decode.onnx with past/present KV"
        ),
        soc_version: str = typer.Option(EXPORT.soc_version, "--soc-version", help="ATC --soc_version"),
        atc: bool = typer.Option(EXPORT.run_atc, "--atc/--no-atc", help="Run atc when it is on PATH"),
        precision_mode: Precision = typer.Option(
            Precision(EXPORT.precision_mode), "--precision-mode", help="ATC precision: origin keeps the graph dtype"
        ),
        expose_hidden: bool = typer.Option(False, "--expose-hidden", help="Add hidden.{i} outputs (for evaluation)"),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT_DIR if it exists"),
        hash_weights: bool = typer.Option(
            EXPORT.hash_weights,
            "--hash-weights/--no-hash-weights",
            help="The digests of the weights' data files in export.json (one pass over the weights)",
        ),
        data_files: int = typer.Option(
            EXPORT.data_files,
            "--data-files",
            help="Split the weights over this many external-data files, each written on a "
            "thread of its own (1: one model.onnx.data)",
        ),
        digest: Digest = typer.Option(
            Digest(EXPORT.digest),
            "--digest",
            help="export.json's file digests: xxh3_128 (fast; detects corrupted or swapped "
            "files) or sha256 (cryptographic, ~10x slower)",
        ),
        flow: bool = typer.Option(False, "--flow", help=FLOW_HELP),
    ):
        """Export MODEL_DIR to ONNX (prefill + KV-cache decode) for Ascend ATC, with an operator report."""
        from titan_pipe.config import ExportConfig, section_from_flags
        from titan_pipe.convert.onnx.export import export_model

        for flag, value, bound in (
            ("--batch", batch, limits.BATCH),
            ("--seq-len", seq_len, limits.SEQ_LEN),
            ("--cache-len", cache_len, limits.CACHE_LEN),
            ("--data-files", data_files, limits.DATA_FILES),
        ):
            limits.check_flag(flag, value, bound)  # before the model is read: one line naming the limit
        settings = section_from_flags(
            ExportConfig,
            {k: "--" + k.replace("_", "-") for k in ExportConfig.model_fields},
            opset=opset,
            dtype=dtype.value,
            batch=batch,
            seq_len=seq_len,
            cache_len=cache_len,
            dynamic=dynamic,
            kv_cache=kv_cache,
            soc_version=soc_version,
            atc=atc,
            precision_mode=precision_mode.value,
            expose_hidden=expose_hidden,
            hash_weights=hash_weights,
            digest=digest.value,
            data_files=data_files,
        )
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
        graphs = ", ".join(f"{f} ({g['nodes']} nodes, {g['bytes'] / 1e6:.1f} MB)" for f, g in s["graphs"].items())
        console.print(
            f"exported {graphs}; weights {s['data_bytes'] / 1e6:.1f} MB in {len(s['data_files'])} external-data "
            f"file(s) beside them, at opset {s['opset']}, {s['dtype']}, "
            f"{'dynamic' if s['dynamic'] else 'static'} shapes in {s['export_seconds']:.1f} s; "
            f"ATC: {r.atc_status}; report: {r.export_json}",
            highlight=False,
            soft_wrap=True,
        )
