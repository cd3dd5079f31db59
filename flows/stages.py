"""The stages of a flow, one record each: what a stage reads, how the flow calls its task, the line
its summary's class (titan_pipe.records.stage_summaries) prints and the Prefect tables it publishes. The cache (flows/cache.py), the flow
(flows/train_to_deploy.py), the artifacts (flows/artifacts.py) and `titan-pipe run`'s live table loop
over these records instead of spelling the stages out; adding a stage is one record here.

No Prefect at import: a stage's ``call`` takes the task (or a plain function: tests) as ``fn``, and
``publish`` imports Prefect's artifact API when it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from titan_pipe.config import FlowConfig
from titan_pipe.evaluate.batches import held_out_text
from titan_pipe.flows.artifacts import (
    artifact_key,
    evaluate_markdown,
    export_record,
    files_markdown,
    links,
    operator_table,
)
from titan_pipe.flows.stage_files import checkpoint_files, data_files, files_under, resolve
from titan_pipe.run_dir import RunDir

# Training keys that say nothing about the weights: where the ranks run and the fault-injection hook.
TRAIN_SECTIONS = (
    "device",
    "model",
    "data",
    "train",
    "parallel",
    "precision",
    "memory",
    "zero_stage",
    "comm",
    "checkpoint",
    "init_from",
)
TRAIN_IGNORED = {"train": {"log_every"}}


@dataclass(frozen=True)
class StageInputs:
    """What a stage depends on: a JSON-able config section and the files it reads."""

    stage: str
    section: dict
    files: tuple[Path, ...]


@dataclass(frozen=True)
class Context:
    """What a stage's call may need of the flow: its config, files and the earlier stages' outputs."""

    cfg: FlowConfig
    flow_path: Path
    flow_dir: Path
    run_dir: Path
    upstream: dict  # stage -> flows.tasks.StageOutput
    resume: bool = False
    retry: Callable | None = None  # train's retry condition (Prefect's retry_condition_fn)

    def path(self, stage: str, name: str) -> Path:
        """An earlier stage's output path ``name`` (its typed paths record's field)."""
        return Path(getattr(self.upstream[stage].paths, name))


@dataclass(frozen=True)
class Table:
    """One Prefect artifact of a stage: a table (rows) or a markdown text, under key ``what``."""

    what: str
    description: str
    rows: list[dict] | None = None
    markdown: str | None = None


@dataclass(frozen=True)
class Stage:
    name: str
    inputs: Callable[[FlowConfig, Path, dict], StageInputs]  # (cfg, flow_dir, upstream)
    call: Callable[[Callable, Context], object]  # (the task, the flow's context) -> StageOutput
    tables: Callable[[object], list[Table]]  # (StageOutput) -> its artifacts
    # its run continues an interrupted one of the same key (training: the flow moves other settings'
    # checkpoints aside, or resumes from the newest complete one)
    resumes: bool = False


def _chat_keys(cfg: FlowConfig) -> set[str]:
    """Keys only chat/instruction data reads: text flows keep the cache keys they always had."""
    return {"format", "chat_template", "max_tokens", "max_bad_fraction"} if cfg.data.format != "text" else set()


# -- data -------------------------------------------------------------------------------------


def _data_inputs(cfg: FlowConfig, flow_dir: Path, upstream: dict) -> StageInputs:
    section = cfg.data.model_dump(
        mode="json", include={"path", "tokenizer", "text_key", "val_fraction", *_chat_keys(cfg)}
    )
    return StageInputs("data", section, tuple(data_files(cfg, flow_dir)))


# -- train ------------------------------------------------------------------------------------


def _train_inputs(cfg: FlowConfig, flow_dir: Path, upstream: dict) -> StageInputs:
    chat = _chat_keys(cfg)
    ignored = TRAIN_IGNORED if chat else {**TRAIN_IGNORED, "data": {"max_tokens", "max_bad_fraction"}}
    section = cfg.model_dump(mode="json", include=set(TRAIN_SECTIONS), exclude=ignored)
    files = data_files(cfg, flow_dir)
    if cfg.init_from is not None:
        files += files_under(resolve(cfg.init_from, flow_dir))
    return StageInputs("train", section, tuple(files))


def _train_call(fn: Callable, ctx: Context):
    if hasattr(fn, "with_options"):  # a Prefect task: the retries of this flow.yaml
        o = ctx.cfg.orchestration
        fn = fn.with_options(
            retries=o.train_retries(ctx.cfg.launch.max_restarts),
            retry_delay_seconds=o.retry_delay_s,
            retry_condition_fn=ctx.retry,
        )
    return fn(flow_path=ctx.flow_path, cfg=ctx.cfg, resume=ctx.resume)


def _train_tables(out) -> list[Table]:
    return [Table("metrics", "Training: final loss, tokens/s, MFU", out.summary.rows())]


# -- convert ----------------------------------------------------------------------------------


def _convert_inputs(cfg: FlowConfig, flow_dir: Path, upstream: dict) -> StageInputs:
    files = checkpoint_files(Path(upstream["train"].paths.checkpoint))
    return StageInputs("convert", cfg.convert.model_dump(mode="json"), tuple(files))


def _convert_tables(out) -> list[Table]:
    return [Table("summary", "Conversion summary", out.summary.rows())]


# -- export -----------------------------------------------------------------------------------


def _export_inputs(cfg: FlowConfig, flow_dir: Path, upstream: dict) -> StageInputs:
    files = files_under(Path(upstream["convert"].paths.model_dir))
    return StageInputs("export", cfg.export_settings().model_dump(mode="json"), tuple(files))


def _export_tables(out) -> list[Table]:
    return [
        Table(
            "operators",
            "ONNX operators of the exported graphs (all on the ATC list: export checks it)",
            operator_table(export_record(out.paths.export_json)),
        ),
        Table("summary", f"Export; ATC status: {out.summary.atc_status}", out.summary.rows()),
    ]


# -- evaluate ---------------------------------------------------------------------------------


def _evaluate_inputs(cfg: FlowConfig, flow_dir: Path, upstream: dict) -> StageInputs:
    section = {"evaluate": cfg.evaluate.model_dump(mode="json")}
    if cfg.evaluate.data is None:  # evaluate then reads the validation split of the training data
        files = data_files(cfg, flow_dir)
        section["split"] = cfg.data.model_dump(
            mode="json", include={"path", "blend", "val_fraction", "text_key", *_chat_keys(cfg)}, exclude_none=True
        )
    else:
        files = [resolve(cfg.evaluate.data, flow_dir)]
    files += checkpoint_files(Path(upstream["train"].paths.checkpoint))
    files += files_under(Path(upstream["convert"].paths.model_dir))
    files += files_under(Path(upstream["export"].paths.onnx_dir))
    return StageInputs("evaluate", section, tuple(files))


def _evaluate_call(fn: Callable, ctx: Context):
    data, split = held_out_text(data=None, flow=ctx.cfg, flow_dir=ctx.flow_dir, run_dir=ctx.run_dir)
    om = ctx.upstream["export"].paths.om
    return fn(
        out_dir=RunDir(ctx.run_dir).report,
        checkpoint=ctx.path("train", "checkpoint"),
        model_dir=ctx.path("convert", "model_dir"),
        onnx=ctx.path("export", "onnx"),
        om=Path(om) if om else None,
        data=data,
        settings=ctx.cfg.evaluate,
        split=split,
    )


def _evaluate_tables(out) -> list[Table]:
    md_path = out.paths.report_md
    report_md = Path(md_path).read_text() if md_path and Path(md_path).is_file() else None
    return [
        Table(
            "report",
            f"Evaluation report: {'PASS' if out.passed else 'FAIL'}",
            markdown=evaluate_markdown(out, report_md),
        )
    ]


def _no_tables(out) -> list[Table]:
    return []


STAGES: tuple[Stage, ...] = (
    Stage(
        "data",
        _data_inputs,
        lambda fn, c: fn(flow_dir=c.flow_dir, cfg=c.cfg, out_dir=RunDir(c.run_dir).data),
        _no_tables,
    ),
    Stage("train", _train_inputs, _train_call, _train_tables, resumes=True),
    Stage(
        "convert",
        _convert_inputs,
        lambda fn, c: fn(
            checkpoint=c.path("train", "checkpoint"), out_dir=RunDir(c.run_dir).model, settings=c.cfg.convert
        ),
        _convert_tables,
    ),
    Stage(
        "export",
        _export_inputs,
        lambda fn, c: fn(
            model_dir=c.path("convert", "model_dir"), out_dir=RunDir(c.run_dir).onnx, settings=c.cfg.export_settings()
        ),
        _export_tables,
    ),
    Stage(
        "evaluate",
        _evaluate_inputs,
        _evaluate_call,
        _evaluate_tables,
    ),
)
BY_NAME: dict[str, Stage] = {s.name: s for s in STAGES}


def stage(name: str) -> Stage:
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown stage {name!r}; stages are {', '.join(BY_NAME)}") from None


def figures(output) -> str:
    """The one-line summary of a finished stage (the live output and the final table of `titan-pipe run`):
    its typed summary's line (titan_pipe.records.stage_summaries)."""
    return output.summary.line()


def publish(output, *, run_name: str, cached: bool) -> list[str]:
    """Create a finished stage's artifacts (its record's tables, and links to its files) in the current
    Prefect run; returns their keys."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    note = " (cached: inputs unchanged since the last run)" if cached else ""
    keys: list[str] = []
    for t in BY_NAME[output.stage].tables(output):
        key = artifact_key(run_name, output.stage, t.what)
        if t.markdown is not None:
            create_markdown_artifact(t.markdown, key=key, description=t.description + note)
        elif t.rows:
            create_table_artifact(t.rows, key=key, description=t.description + note)
        else:
            continue
        keys.append(key)
    found = links(output)
    if found:
        key = artifact_key(run_name, output.stage, "files")
        create_markdown_artifact(
            files_markdown(output.stage, found), key=key, description=f"Files written by {output.stage}"
        )
        keys.append(key)
    return keys
