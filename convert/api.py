"""convert_checkpoint: any supported checkpoint -> a unified Hugging Face model, or our sharded layout.

Plan first (reader -> SourcePlan -> OutputPlan, all pure data and header reads), then stream: each
output file is written by reshard.write_file into a hidden temporary directory beside ``out_dir``
while a background thread hashes the sources; only when every file is complete and every hash
checks out is the directory renamed into place. On any error the temporary directory is removed,
an existing ``out_dir`` is left as it was, and the source is never opened for writing.
"""

from __future__ import annotations

import functools
import gc
import json
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from titan_pipe.io.atomic import swap_dir, temp_dir, write_text
from titan_pipe.records.checkpoint_format import (
    MANIFEST_NAME,
    Box,
    CheckpointExtra,
    Chunk,
    FileInfo,
    LayoutError,
    Manifest,
    ParallelLayout,
    ParamSpec,
)
from titan_pipe.weights.detect import open_source
from titan_pipe.convert.hashing import BackgroundHasher
from titan_pipe.convert.reshard import write_file
from titan_pipe.weights.readers import lora
from titan_pipe.weights.source_plan import (
    OutFile,
    OutputPlan,
    OutTensor,
    SourcePlan,
    output_dtype,
    plan_sharded,
    plan_unified,
)
from titan_pipe.convert.tokenizer_files import copy_tokenizer_files, plan_tokenizer_files, source_token_ids
from titan_pipe.config import ConvertConfig
from titan_pipe.rules.dtypes import HF_DTYPE_NAMES
from titan_pipe.io.paths import overlaps
from titan_pipe.errors import UserError
from titan_pipe.io.faults import as_fault, check_free_space
from titan_pipe.model.hf_config import to_hf_config
from titan_pipe.model.params import native_shapes
from titan_pipe.model.sharding import stage_ranks, tp_split_dim
from titan_pipe.model.unified_dir import CONFIG, INDEX
from titan_pipe.records.provenance import PROVENANCE_FILE, Provenance, SourceInfo
from titan_pipe.rules.sizes import parse_size
from titan_pipe.records.stage_summaries import ConvertSummary

CONVERTER_VERSION = "titan-pipe-convert 1"
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"  # PEFT's file names
WHAT = "the converted model"


@dataclass(frozen=True)
class ConvertResult:
    out_dir: Path
    files: list[Path]
    summary: ConvertSummary = field(default_factory=ConvertSummary)


def check_shapes(plan: SourcePlan) -> None:
    """Every tensor has the shape the model config implies."""
    want = native_shapes(plan.args)
    for name, t in plan.tensors.items():
        if name in want and want[name] != t.shape:
            raise UserError(
                f"{plan.root}: {name} has shape {list(t.shape)} but the model config "
                f"implies {list(want[name])}; the checkpoint and its config disagree"
            )


def source_digest(plan: SourcePlan, chosen: str) -> str:
    """The algorithm of the source digests provenance.json records: sha256 for a source whose
    manifest records sha256s (ours: they are what the files are checked against), else ``chosen``."""
    return "sha256" if plan.expected_sha256 else chosen


def output_bytes(plan: SourcePlan, out: OutputPlan, *, sharded: bool) -> int:
    """What the output will take on disk: every tensor's bytes, 512 bytes a tensor for its entries in
    safetensors headers and the index or manifest, the tokenizer files it carries, and 64 kB for
    config.json and provenance.json."""
    tokenizer = sum(f.stat().st_size for f in plan_tokenizer_files(plan).values())
    tensors = sum(len(f.tensors) for f in out.files)
    return sum(f.nbytes for f in out.files) + 512 * tensors + tokenizer + 65536


def plan_adapter(plan: SourcePlan, *, dtype: str) -> OutputPlan:
    """A LoRA checkpoint's adapters as PEFT stores them: one adapter_model.safetensors under PEFT's keys."""
    keys = lora.peft_keys(plan)
    return OutputPlan(
        "adapter",
        (
            OutFile(
                ADAPTER_WEIGHTS,
                tuple(
                    OutTensor(keys[n], t, Box.full(t.shape), output_dtype(t.dtype, dtype))
                    for n, t in plan.tensors.items()
                ),
            ),
        ),
    )


def _check_out_dir(src: Path, out_dir: Path, overwrite: bool) -> None:
    s, o = src.resolve(), out_dir.resolve()
    if o == s or s in o.parents or o in s.parents or overlaps(src, out_dir):  # overlaps: bind mounts too
        raise UserError(
            f"{out_dir}: the output directory must lie outside the source {src} (and not contain it); choose another -o"
        )
    if out_dir.exists():
        if not out_dir.is_dir():
            raise UserError(f"{out_dir}: exists and is not a directory; choose another -o")
        if any(out_dir.iterdir()) and not overwrite:
            raise UserError(f"{out_dir}: is not empty; pass --overwrite to replace it or choose another -o")


def _config_dtype(out: OutputPlan) -> str:
    dtypes = {t.dtype for f in out.files for t in f.tensors}
    return HF_DTYPE_NAMES.get(dtypes.pop(), "float32") if len(dtypes) == 1 else "float32"


def _write_json(path: Path, obj) -> None:
    write_text(path, json.dumps(obj, indent=2) + "\n")


def _write_unified_meta(tmp: Path, src: SourcePlan, out: OutputPlan, *, token_ids: dict) -> list[Path]:
    """The index (several files) and config.json: the model's architecture and the source's token ids."""
    written = []
    if len(out.files) > 1:
        index = {
            "metadata": {"total_size": sum(f.nbytes for f in out.files)},
            "weight_map": {t.key: f.name for f in out.files for t in f.tensors},
        }
        _write_json(tmp / INDEX, index)
        written.append(tmp / INDEX)
    _write_json(tmp / CONFIG, {**to_hf_config(src.args, torch_dtype=_config_dtype(out)), **token_ids})
    written.append(tmp / CONFIG)
    return written


def _write_manifest(
    tmp: Path,
    src: SourcePlan,
    out: OutputPlan,
    *,
    tokenizer: str | None,
    attached: dict[str, FileInfo],
    token_ids: dict,
) -> Path:
    """manifest.json for a sharded output, written last (it marks the checkpoint complete); it names
    the side files copied beside it (``attached``: tokenizer, template, generation config) and the
    source's token ids, so a conversion back to Hugging Face carries them."""
    params: dict[str, ParamSpec] = {}
    for f in out.files:
        for t in f.tensors:
            p = params.setdefault(
                t.key, ParamSpec(t.key, t.source.shape, t.dtype, tp_split_dim(t.key) if out.tp > 1 else None, f.stage)
            )
            p.chunks.append(Chunk(f.name, t.key, t.region))
    names = [f.name for f in out.files]
    digests = BackgroundHasher(tmp, names).start().result()  # one file per core at once
    files = {n: FileInfo((tmp / n).stat().st_size, digests[n]) for n in names}
    m = Manifest(
        step=src.step or 0,
        model=src.args.to_dict(),
        parallel=ParallelLayout(
            tp=out.tp,
            pp=out.pp,
            pp_schedule=src.pp_schedule or ("1f1b" if out.pp > 1 else "gpipe"),
            stages=tuple(map(tuple, out.stages)),
            stage_ranks=tuple(stage_ranks(out.pp, out.pp)),
        ),
        params=params,
        files=files,
        extra=CheckpointExtra(
            converted_from={"format": src.format, "path": str(src.root)},
            tokenizer=tokenizer,
            attached=attached,
            token_ids=token_ids or None,
        ),
    )
    m.validate()
    return write_text(tmp / MANIFEST_NAME, m.to_json())


def _progress():
    console = Console(stderr=True)
    if not console.is_terminal:
        return nullcontext(None)
    return Progress(
        TextColumn("[bold]convert[/bold] {task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )


def _without_cyclic_gc(fn):
    """Run ``fn`` with Python's cyclic garbage collector paused (restored afterwards).

    The conversion allocates only small acyclic objects, which reference counting frees; but right
    after ``import torch`` the interpreter holds ~10^6 objects, and the first full collection the
    conversion's allocations trigger walks them all: ~0.1 s, a tenth of a plain copy of 2 GB.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()

    return wrapper


@_without_cyclic_gc
def convert_checkpoint(
    src: Path, out_dir: Path, settings: ConvertConfig = ConvertConfig(), *, overwrite: bool = False
) -> ConvertResult:
    """Convert ``src`` into ``out_dir`` as ``settings`` (the convert section) says.

    Default: ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` + index past
    ``max_shard_size``), ``config.json`` and ``provenance.json``. With ``tp``/``pp``: our sharded
    layout (``manifest.json`` + shard files named by checkpoint_format.shard_file, native names, no
    optimizer state). ``source_config``: a params.json/config.json for sources without one (DCP).
    ``verify=False`` skips hashing the source (sizes, headers and shapes are still checked); the
    provenance then records the manifest's sha256s as unverified. ``digest``: the algorithm of the
    source digests recorded (source_digest). A progress bar shows on a terminal.
    """
    t0 = time.perf_counter()
    src, out_dir = Path(src), Path(out_dir)
    naming, dtype, verify, tp, pp = settings.naming, settings.dtype, settings.verify, settings.tp, settings.pp
    limit = parse_size(settings.max_shard_size)  # checked when the section was built
    model_config = Path(settings.source_config) if settings.source_config is not None else None
    sharded = settings.sharded
    _check_out_dir(src, out_dir, overwrite)
    spec = None  # a LoRA checkpoint's adapters (pipeline/weights/readers/lora.py)
    if settings.source_format in ("auto", "titan") and lora.lora_step(src) is not None:
        plan, store, spec = lora.open_source(src, mode=settings.lora)
    else:
        if settings.lora != "merge":
            raise UserError(
                f"--lora {settings.lora}: {src} holds no LoRA adapters (a titan-pipe checkpoint trained "
                "with train.lora); drop --lora"
            )
        plan, store = open_source(
            src, settings.source_format, vocab_size=settings.vocab_size, model_config=model_config
        )
    adapter = spec is not None and settings.lora == "adapter"
    if adapter and sharded:
        raise UserError(
            "--lora adapter writes PEFT's adapter dir for the base model; drop --tp/--pp (or use --lora "
            "merge for a sharded merged model)"
        )
    token_ids = source_token_ids(plan)
    with store:
        check_shapes(plan)
        try:
            plan.check()
            out = (
                plan_adapter(plan, dtype=dtype)
                if adapter
                else plan_sharded(plan, tp=tp or 1, pp=pp or 1, dtype=dtype)
                if sharded
                else plan_unified(plan, naming=naming, dtype=dtype, max_shard_size=limit)
            )
        except (LayoutError, ValueError) as e:
            raise UserError(f"{plan.root}: {e}") from None
        total = sum(f.nbytes for f in out.files)
        needs = output_bytes(plan, out, sharded=sharded)
        check_free_space(out_dir, needs=needs, what=WHAT)  # refuse before a byte is written
        tmp = temp_dir(out_dir)
        headers = getattr(store, "headers", {})  # safetensors sources: check NaN/Inf while hashing
        spans = {f: [(t.start, t.nbytes, t.dtype, k) for k, t in h.items()] for f, h in headers.items()}
        algorithm = source_digest(plan, settings.digest)
        hasher = BackgroundHasher(
            plan.root, plan.files if verify else [], plan.expected_sha256, tensors=spans, algorithm=algorithm
        ).start()
        nonfinite: set[str] = set()
        try:
            with _progress() as bar:
                task = bar.add_task(str(src), total=total) if bar else None
                advance = (lambda n: bar.advance(task, n)) if bar else (lambda n: None)
                written = [
                    write_file(tmp, f, store, metadata={"format": "pt"}, advance=advance, nonfinite=nonfinite)
                    for f in out.files
                ]
            digests = hasher.result()
            out_name = {(r.file, r.key): t.key for f in out.files for t in f.tensors for r in t.reads()}
            nonfinite.update(out_name.get((f, k), k) for f, keys in hasher.nonfinite.items() for k in keys)
            tok_files, tok_record, tok_infos = copy_tokenizer_files(plan, tmp, byte_files=not sharded)
            if sharded:
                written += tok_files
                written.append(
                    _write_manifest(tmp, plan, out, tokenizer=tok_record.kind, attached=tok_infos, token_ids=token_ids)
                )
            elif adapter:
                _write_json(tmp / ADAPTER_CONFIG, lora.adapter_config(plan, spec))
                written += [tmp / ADAPTER_CONFIG] + tok_files
            else:
                written += _write_unified_meta(tmp, plan, out, token_ids=token_ids) + tok_files
            provenance = Provenance(
                source=SourceInfo(
                    plan.format,
                    str(plan.root.resolve()),
                    plan.step,
                    plan.layout,
                    digests if verify else dict(sorted(plan.expected_sha256.items())),
                    algorithm,
                    verify,
                ),
                converter=CONVERTER_VERSION,
                tokenizer=tok_record,
                output={
                    "kind": out.kind,
                    "naming": "native" if sharded else "peft" if adapter else naming,
                    "dtype": dtype,
                    "tp": out.tp,
                    "pp": out.pp,
                    "files": [str(p.relative_to(tmp)) for p in written],
                },
                created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            )
            write_text(tmp / PROVENANCE_FILE, provenance.to_json())
            swap_dir(tmp, out_dir)
        except BaseException as e:
            hasher.stop()
            shutil.rmtree(tmp, ignore_errors=True)
            fault = as_fault(e, path=out_dir, what=WHAT, needs=needs) if isinstance(e, Exception) else None
            if fault is not None:  # after the cleanup, so "N free now" counts the space it gave back
                raise fault from None
            raise
    files = [out_dir / p.relative_to(tmp) for p in written] + [out_dir / PROVENANCE_FILE]
    wall = time.perf_counter() - t0
    summary = ConvertSummary(
        format=plan.format,
        src=str(plan.root),
        step=plan.step,
        layout=plan.layout,
        output=out.kind,
        tp=out.tp,
        pp=out.pp,
        tensors=len(plan.tensors),
        bytes=total,
        files=len(out.files),
        wall_s=round(wall, 3),
        gb_per_s=round(total / wall / 1e9, 3) if wall > 0 else None,
        tokenizer=tok_record.kind,
        stop_ids=token_ids.get("eos_token_id"),
        nonfinite=tuple(sorted(nonfinite)),
        nonfinite_checked="all" if verify or not headers else "assembled tensors only",
    )
    return ConvertResult(out_dir=out_dir, files=files, summary=summary)
