"""One Prefect task per stage: thin wrappers over the stage library functions, returning paths + a summary.

Each task takes paths and its config section, calls the stage's library function (the contract in
docs/flows.md) and returns a ``StageOutput``. An OS fault (full disk, read-only dir, ...) becomes
titan_pipe.io.faults' one line (a UserError: the flow never retries it). Caching is not Prefect's here (``NO_CACHE``; see
flows/cache.py and docs/flows.md for why); retries are set per run by the flow (``with_options``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import task_run

from titan_pipe.records.checkpoint_format import newest_complete
from titan_pipe.config import ConvertConfig, EvaluateConfig, ExportConfig, FlowConfig
from titan_pipe.io.faults import STAGE_OUTPUTS, writing
from titan_pipe.flows.logs import follow_log, run_logger
from titan_pipe.run_dir import RunDir
from titan_pipe.records.stage_summaries import (
    SUMMARIES,
    DataSummary,
    Summary,
)


class _Paths:
    """A stage's output paths (absolute, as str): one typed record per stage below."""

    def named(self) -> dict[str, str]:
        """{field: path} of the paths this run produced (for links and the stage record)."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class DataPaths(_Paths):
    data_dir: str


@dataclass(frozen=True)
class TrainPaths(_Paths):
    run_dir: str
    metrics: str
    checkpoint: str | None = None  # None on a worker node of a multi-node run: node 0 holds the files


@dataclass(frozen=True)
class ConvertPaths(_Paths):
    model_dir: str


@dataclass(frozen=True)
class ExportPaths(_Paths):
    onnx_dir: str
    onnx: str
    export_json: str
    decode_onnx: str | None = None
    om: str | None = None  # when ATC ran and built it


@dataclass(frozen=True)
class EvaluatePaths(_Paths):
    report_dir: str
    report_json: str
    report_md: str | None = None
    report_html: str | None = None


def _text(path: Path | None) -> str | None:
    return None if path is None else str(path)


STAGE_PATHS: dict[str, type[_Paths]] = {
    "data": DataPaths,
    "train": TrainPaths,
    "convert": ConvertPaths,
    "export": ExportPaths,
    "evaluate": EvaluatePaths,
}


@dataclass(frozen=True)
class StageOutput:
    """What a stage hands to the next: its typed paths, output roots, a small summary."""

    stage: str
    paths: _Paths
    outputs: list[str]  # files/dirs whose sha256 go into the stage record
    summary: Summary | None = None  # the stage's own class (titan_pipe.records.stage_summaries); None: empty
    passed: bool | None = None  # the evaluation verdict; None for the other stages

    def __post_init__(self):
        if not isinstance(self.paths, STAGE_PATHS[self.stage]):
            raise TypeError(f"{self.stage}: paths must be a {STAGE_PATHS[self.stage].__name__}, not {self.paths!r}")
        kind = SUMMARIES[self.stage]
        if self.summary is None:
            object.__setattr__(self, "summary", kind())
        elif not isinstance(self.summary, kind):
            raise TypeError(f"{self.stage}: summary must be a {kind.__name__}, not {self.summary!r}")

    def to_json(self) -> dict:
        return {
            "stage": self.stage,
            "paths": self.paths.named(),
            "outputs": self.outputs,
            "summary": self.summary.to_dict(),
            "passed": self.passed,
        }

    @classmethod
    def from_json(cls, data: dict) -> "StageOutput":
        return cls(
            stage=data["stage"],
            paths=STAGE_PATHS[data["stage"]](**data["paths"]),
            outputs=list(data["outputs"]),
            summary=SUMMARIES[data["stage"]].of(data.get("summary")),
            passed=data.get("passed"),
        )


def _written(stage: str, out_dir: Path, before: str, call, after):
    """A stage's library ``call`` writing ``out_dir``: a log line before and ``after(result)`` once
    done, an OS fault while writing as titan_pipe.io.faults' one line. Returns the call's result."""
    run_logger().info(before)
    with writing(out_dir, what=STAGE_OUTPUTS[stage]):
        r = call()
    run_logger().info(after(r))
    return r


def resume_decision(*, requested: bool, attempt: int, run_dir: Path, torchrun_restarts: int = 0) -> bool:
    """Resume on a retry (attempt > 1) or when asked, and only if a complete checkpoint exists.

    With torchrun owning failures (launch.max_restarts > 0) the command always carries --resume: torchrun
    restarts re-run the same command, and the trainer then continues from the newest complete checkpoint
    instead of step 0 (with none yet it starts fresh). The flow clears checkpoints of other settings first.
    """
    if torchrun_restarts > 0:
        return True
    return (requested or attempt > 1) and newest_complete(run_dir) is not None


@task(name="data", cache_policy=NO_CACHE, persist_result=False)
def data_task(flow_dir: Path, cfg: FlowConfig, out_dir: Path) -> StageOutput:
    from titan_pipe.tokens.spec import data_spec
    from titan_pipe.training.prepare import prepare_spec

    spec = data_spec(cfg.data, base=flow_dir)
    run_logger().info(f"preparing {spec.text} -> {out_dir} (tokenizer {spec.tokenizer})")
    with writing(out_dir, what=STAGE_OUTPUTS["prepare"]):
        r = prepare_spec(spec, out_dir, progress=False)
    rec = r.record
    run_logger().info(
        ("already prepared from the same inputs: " if r.reused else "prepared: ")
        + f"{rec.n_documents:,} documents, {rec.n_tokens:,} tokens in {r.seconds:.1f}s"
    )
    return StageOutput(
        "data",
        DataPaths(str(r.out_dir)),
        outputs=[str(r.out_dir)],
        summary=DataSummary(
            tokens=rec.n_tokens, documents=rec.n_documents, val_documents=rec.split.val_documents, reused=r.reused
        ),
    )


@task(name="train", cache_policy=NO_CACHE, persist_result=False)
def train_task(flow_path: Path, cfg: FlowConfig, resume: bool = False) -> StageOutput:
    from titan_pipe.training.launch import run_training

    log, run_dir = run_logger(), cfg.run_dir().resolve()
    attempt = task_run.get_run_count()
    resume = resume_decision(
        requested=resume, attempt=attempt, run_dir=run_dir, torchrun_restarts=cfg.launch.max_restarts
    )
    start = newest_complete(run_dir) if resume else None
    log.info(f"attempt {max(attempt, 1)}: " + (f"resuming from {start}" if start else "training from step 0"))
    with writing(run_dir, what=STAGE_OUTPUTS["train"]), follow_log(RunDir(run_dir).train_log):
        r = run_training(flow_path=flow_path, cfg=cfg, resume=resume)
    log.info(f"training done: checkpoint {r.checkpoint}, summary {r.summary}")
    paths = TrainPaths(str(r.run_dir), str(r.metrics), _text(r.checkpoint))
    return StageOutput("train", paths, outputs=[str(r.checkpoint)] if r.checkpoint else [], summary=r.summary)


@task(name="convert", cache_policy=NO_CACHE, persist_result=False)
def convert_task(checkpoint: Path, out_dir: Path, settings: ConvertConfig) -> StageOutput:
    from titan_pipe.convert.api import convert_checkpoint

    r = _written(
        "convert",
        out_dir,
        f"converting {checkpoint} -> {out_dir} ({settings.naming} names, dtype {settings.dtype})",
        lambda: convert_checkpoint(checkpoint, out_dir, settings, overwrite=True),
        lambda r: f"wrote {len(r.files)} file(s): {', '.join(p.name for p in r.files)}",
    )
    summary = r.summary
    if summary.nonfinite:
        run_logger().warning(
            f"NaN/Inf values in {len(summary.nonfinite)} tensor(s): "
            f"{', '.join(summary.nonfinite[:8])}; evaluate fails on such a model"
        )
    return StageOutput("convert", ConvertPaths(str(r.out_dir)), outputs=[str(r.out_dir)], summary=summary)


@task(name="export", cache_policy=NO_CACHE, persist_result=False)
def export_task(model_dir: Path, out_dir: Path, settings: ExportConfig) -> StageOutput:
    from titan_pipe.convert.onnx.export import export_model

    r = _written(
        "export",
        out_dir,
        f"exporting {model_dir} -> {out_dir} (opset {settings.opset}, {settings.dtype})",
        lambda: export_model(model_dir, out_dir, settings, overwrite=True),
        lambda r: f"ONNX {r.onnx}; ATC: {r.atc_status}",
    )
    paths = ExportPaths(str(r.out_dir), str(r.onnx), str(r.export_json), _text(r.decode_onnx), _text(r.om))
    return StageOutput(
        "export",
        paths,
        outputs=[str(r.out_dir)],
        summary=r.summary,
    )


@task(name="evaluate", cache_policy=NO_CACHE, persist_result=False)
def evaluate_task(
    out_dir: Path,
    checkpoint: Path,
    model_dir: Path,
    onnx: Path,
    om: Path | None,
    data: Path | None,
    settings: EvaluateConfig,
    split=None,
) -> StageOutput:
    from titan_pipe.evaluate.api import evaluate_model

    r = _written(
        "evaluate",
        out_dir,
        f"evaluating {checkpoint.name} / {model_dir.name} / {onnx.name} -> {out_dir}",
        lambda: evaluate_model(
            out_dir=out_dir,
            checkpoint=checkpoint,
            model_dir=model_dir,
            onnx=onnx,
            om=om,
            data=data,
            settings=settings,
            progress=True,
            split=split,
        ),
        lambda r: f"verdict: {'PASS' if r.passed else 'FAIL'} ({r.report_json})",
    )
    md, html = (r.out_dir / "report.md", r.out_dir / "report.html")
    paths = EvaluatePaths(
        str(r.out_dir), str(r.report_json), _text(md if md.is_file() else None), _text(html if html.is_file() else None)
    )
    return StageOutput("evaluate", paths, outputs=[str(r.report_json)], summary=r.summary, passed=bool(r.passed))
