"""`titan-pipe data prepare` (raw text -> a prepared data dir) and `titan-pipe data inspect` (what one holds)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from titan_pipe.rules import limits
from titan_pipe.commands.common import call_stage, console, handle_errors, out_option
from titan_pipe.commands.options import with_section
from titan_pipe.config import DataConfig

data_app = typer.Typer(
    help="Prepare and inspect token data (Megatron indexed .bin/.idx + data.json).", no_args_is_help=True
)


# The data section's fields that are `data prepare` options (their help, types and defaults: titan_pipe.config)
PREPARE_OPTIONS = ("tokenizer", "val_fraction", "text_key", "format", "chat_template", "max_tokens", "max_bad_fraction")


@data_app.command()
@handle_errors
@with_section(DataConfig, PREPARE_OPTIONS)
def prepare(
    sources: List[Path] = typer.Argument(..., help=".txt/.jsonl/.jsonl.gz/.parquet files or directories"),
    out: Path = out_option("the prepared data dir to write"),
    workers: Optional[int] = typer.Option(
        None, "--workers", help="tokenizer processes (default: the usable CPUs, at most 8; 1 for corpora under 8 MB)"
    ),
    shard: Optional[str] = typer.Option(
        None,
        "--shard",
        help="I/N: prepare only part I of N of the sources (one host each; `data merge` joins the parts)",
    ),
    settings: DataConfig = None,
):
    """Tokenize SOURCES once into OUT (tokens.bin + tokens.idx + data.json; chat data also
    tokens.lossmask); a no-op when OUT is current."""
    from titan_pipe.training.prepare import Shard
    from titan_pipe.training.prepare import prepare as run_prepare

    limits.check_flag("--workers", workers, limits.WORKERS)  # one line naming the limit, before any work
    part = Shard.parse(shard) if shard is not None else None

    r = call_stage(
        "prepare",
        run_prepare,
        track=False,
        sources=sources,
        out_dir=out,
        tokenizer=settings.tokenizer,
        workers=workers,
        val_fraction=settings.val_fraction,
        text_key=settings.text_key,
        progress=True,
        shard=part,
        records=settings.format,
        chat_template=settings.chat_template,
        max_tokens=settings.max_tokens,
        max_bad=settings.max_bad_fraction,
    )
    rec = r.record
    if r.reused:
        console.print(
            f"{r.out_dir}: already prepared from the same inputs (key {rec.key[:12]}); nothing to do",
            highlight=False,
            soft_wrap=True,
        )
        return
    mb = sum(s.size for s in rec.sources) / 1e6
    console.print(
        f"prepared {r.out_dir}: {rec.n_documents:,} documents, {rec.n_tokens:,} tokens ({rec.dtype}); "
        f"validation {rec.split.val_documents:,} documents / {rec.split.val_tokens:,} tokens; "
        f"{mb:,.1f} MB in {r.seconds:.1f}s ({mb / max(r.seconds, 1e-9):.2f} MB/s)",
        highlight=False,
        soft_wrap=True,
    )
    if rec.bad_records:
        console.print(
            f"left out {rec.bad_records} record(s) that cannot be trained on (data.json bad_examples), "
            f"e.g. {rec.bad_examples[0]}",
            highlight=False,
            soft_wrap=True,
        )


@data_app.command()
@handle_errors
def merge(
    inputs: List[Path] = typer.Argument(
        ..., help="prepared data dirs: the N parts of `data prepare --shard`, or any prepared dirs of one tokenizer"
    ),
    out: Path = out_option("the merged data dir to write"),
):
    """Join prepared data dirs into one without tokenizing again (the N parts of a sharded prepare give
    what one unsharded prepare writes, byte for byte)."""
    from titan_pipe.training.merge import merge as run_merge

    r = call_stage("prepare", run_merge, track=False, inputs=inputs, out_dir=out, progress=True)
    rec = r.record
    console.print(
        f"merged {len(inputs)} dirs into {r.out_dir}: {rec.n_documents:,} documents, {rec.n_tokens:,} "
        f"tokens ({rec.dtype}); validation {rec.split.val_documents:,} documents in {r.seconds:.1f}s",
        highlight=False,
        soft_wrap=True,
    )


@data_app.command()
@handle_errors
def inspect(path: Path = typer.Argument(..., help="a prepared data dir or a .bin/.idx prefix")):
    """Show what token data holds: format, tokens, documents, split, tokenizer, sources."""
    from rich.table import Table

    from titan_pipe.tokens.dataset import summarize

    table = Table(title=str(path), show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    for k, v in summarize(path):
        table.add_row(k, v)
    console.print(table)


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data")
