"""evaluate_model: check the inputs, run every comparison the given artifacts allow, write the report.

The reference is the model as it ran in training: the checkpoint under its own TP/PP layout when
``checkpoint`` is given, proven equal (comparison 1) to the single-process float32 model that
then serves as the reference of every other comparison. Candidates: the exported ONNX graphs
(ONNX Runtime) and the .om (Ascend runtime). Absent artifacts make their rows "skipped: ..."
with the reason, never a pass. How much is loaded at once is evaluate.max_memory's call
(evaluate/memory.py): everything, or one decoder layer at a time.

  inputs.py  input checks     prepare.py / run.py  the Run     comparisons/  one module per row
  compare.py rows, verdict    report.py / summary.py  the files
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from pathlib import Path

from titan_pipe.records.checkpoint_format import complete_step
from titan_pipe.config import EvaluateConfig
from titan_pipe.errors import UserError
from titan_pipe.evaluate import compare as cmp
from titan_pipe.evaluate.batches import ValidationSplit
from titan_pipe.evaluate.comparisons import COMPARISONS
from titan_pipe.evaluate.inputs import check_inputs
from titan_pipe.evaluate.prepare import prepare
from titan_pipe.evaluate.report import check_out_dir, write_report
from titan_pipe.evaluate.summary import report_dict, sharded_memory, summary
from titan_pipe.records.stage_summaries import EvaluateSummary


@dataclass(frozen=True)
class EvalResult:
    out_dir: Path
    passed: bool
    report_json: Path
    summary: EvaluateSummary = field(default_factory=EvaluateSummary)


class Steps:
    """The evaluation's steps shown as they go (quiet when ``enabled`` is False): a rich bar on a
    terminal; off one (a Prefect worker's log, a pipe) one line per step and, while a step runs, a
    line every HEARTBEAT_S seconds, so a long step never looks like a hang."""

    HEARTBEAT_S = 5.0

    def __init__(self, enabled: bool, total: int):
        import sys
        import threading

        from rich.console import Console

        self.progress = None
        self.plain = None
        if not enabled:
            return
        console = Console(stderr=True)
        if console.is_terminal:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(
                TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), transient=False, console=console
            )
            self.progress.start()
            self.task = self.progress.add_task("evaluate", total=total)
            return
        self.plain, self.total, self.done, self.what = sys.stderr, total, 0, "starting"
        self.start = self.since = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="titan-pipe-evaluate-steps", daemon=True)
        self._thread.start()

    def _say(self, text: str) -> None:
        try:
            self.plain.write(f"evaluate [{self.done}/{self.total}] {time.monotonic() - self.start:.0f} s: {text}\n")
            self.plain.flush()
        except (ValueError, OSError):
            pass

    def _beat(self) -> None:
        while not self._stop.wait(self.HEARTBEAT_S):
            self._say(f"{self.what} ({time.monotonic() - self.since:.0f} s so far)")

    def step(self, what: str, advance: float = 1) -> None:
        if self.progress:
            self.progress.update(self.task, description=f"evaluate: {what}", advance=advance)
        elif self.plain is not None:
            self.done, self.what, self.since = self.done + advance, what, time.monotonic()
            self._say(what)

    def close(self) -> None:
        if self.progress:
            self.progress.stop()
        elif self.plain is not None:
            self._stop.set()


def evaluate_model(
    *,
    out_dir: Path,
    checkpoint: Path | None = None,
    model_dir: Path | None = None,
    onnx: Path | None = None,
    om: Path | None = None,
    data: Path | None = None,
    settings: EvaluateConfig | None = None,
    progress: bool = False,
    split: ValidationSplit | None = None,
) -> EvalResult:
    """Compare everything given, write REPORT_DIR/{report.json, report.md, report.html, *.csv, *.png}.

    Held-out text: ``data`` (or ``settings.data``), a file used whole; else ``split``, the
    validation split of a training corpus (default: the shipped corpus's). Not both.

    Raises UserError for missing or mismatched inputs, or a memory budget too small for one layer
    (nothing is written then); a failed verdict is not an exception: ``EvalResult.passed`` is False
    (the CLI turns it into exit code 1).
    """
    settings = settings or EvaluateConfig()
    data = data if data is not None else settings.data  # flow.yaml evaluate.data
    if checkpoint is not None and Path(checkpoint).is_dir():  # a run dir or its checkpoints/: the newest complete step
        checkpoint = complete_step(Path(checkpoint)) or checkpoint
    check_inputs(checkpoint=checkpoint, model_dir=model_dir, onnx=onnx, om=om, data=data)
    if data is not None and split is not None:
        raise UserError(
            f"--data {data} and the validation split of {split.corpus or 'the shipped corpus'} "
            "were both given; pass one of them"
        )
    out_dir = Path(out_dir)
    check_out_dir(out_dir)  # fail before the work, not after
    steps = Steps(progress, total=len(COMPARISONS) + 3)
    gc.freeze()  # what exists now lives on: the collections between layers (memory.release) skip it
    try:
        start = time.perf_counter()
        run = prepare(
            out_dir=out_dir,
            checkpoint=checkpoint,
            model_dir=model_dir,
            onnx=onnx,
            om=om,
            data=data,
            settings=settings,
            steps=steps,
            split=split,
        )
        took = run.ledger.seconds
        took["set-up"] = time.perf_counter() - start - sum(took.values())  # inputs, data, plan, opening
        try:
            comparisons = [c for c in (_timed(compare, run) for compare in COMPARISONS) if c is not None]
            verdict = cmp.decide(comparisons, run.ledger.op_rows, run.ledger.op_dtypes)
            steps.step("writing the report")
            files = write_report(out_dir, report_dict(run, comparisons, verdict), run.ledger.hist, dump=run.dump)
        finally:
            run.close()
    finally:
        steps.close()
        gc.unfreeze()
    return EvalResult(
        out_dir,
        verdict.passed,
        files["report.json"],
        summary(verdict, comparisons, run.memory.mode, sharded_memory(run)),
    )


def _timed(compare, run):
    """One comparison, its seconds recorded under its id (the report's timing)."""
    start = time.perf_counter()
    c = compare(run)
    if c is not None and not c.status.startswith("skipped"):
        run.ledger.seconds[c.id] = time.perf_counter() - start
    return c
