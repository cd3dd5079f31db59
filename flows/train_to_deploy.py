"""The Prefect flows: ``train_to_deploy`` (train -> convert -> export -> evaluate) and one flow per stage.

The flows are thin: ``run_pipeline`` plans which stages run (flows/cache.py, pure), computes each
stage's key just before it would run (its inputs are the previous stage's outputs), calls the stage
task or takes the cached result, records it, publishes its artifacts and tells listeners (the CLI's
live summary). Stage callables are injectable so the orchestration logic is testable on its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from prefect import flow

from titan_pipe.records.checkpoint_format import newest_complete
from titan_pipe.config import FlowConfig, load_flow
from titan_pipe.errors import Interrupted, RankRefused, StageFailed, UserError
from titan_pipe.flows import cache
from titan_pipe.flows.logs import api_only_logger, quiet_user_error_tracebacks, run_logger
from titan_pipe.flows.stages import Context
from titan_pipe.flows.stages import publish as publish_stage
from titan_pipe.flows.stages import stage as stage_record
from titan_pipe.flows.tasks import StageOutput, convert_task, data_task, evaluate_task, export_task, train_task
from titan_pipe.run_dir import RunDir
from titan_pipe.processes.run_lock import run_lock

quiet_user_error_tracebacks()  # a stage's UserError is one line in the run logs too, not a traceback

DEFAULT_TASKS: dict[str, Callable[..., StageOutput]] = {
    "data": data_task,
    "train": train_task,
    "convert": convert_task,
    "export": export_task,
    "evaluate": evaluate_task,
}


@dataclass(frozen=True)
class StageEvent:
    """One step of the live summary: status is running | done | cached | reused | skipped | failed."""

    stage: str
    status: str
    duration_s: float = 0.0
    output: StageOutput | None = None
    message: str = ""


_listeners: list[Callable[[StageEvent], None]] = []


@contextlib.contextmanager
def listening(fn: Callable[[StageEvent], None]) -> Iterator[None]:
    """Call fn for every StageEvent of flows run in this process while the block runs."""
    _listeners.append(fn)
    try:
        yield
    finally:
        _listeners.remove(fn)


def _emit(event: StageEvent) -> None:
    for fn in list(_listeners):
        fn(event)


@dataclass
class PipelineOutcome:
    run_dir: Path
    stages: dict[str, str] = field(default_factory=dict)  # stage -> final status
    outputs: dict[str, StageOutput] = field(default_factory=dict)

    @property
    def passed(self) -> bool | None:
        ev = self.outputs.get("evaluate")
        return None if ev is None else ev.passed

    def to_json(self) -> dict:
        return {
            "run_dir": str(self.run_dir),
            "stages": self.stages,
            "passed": self.passed,
            "outputs": {k: v.to_json() for k, v in self.outputs.items()},
        }


def retryable(task, task_run, state) -> bool:
    """Retry a crashed launch (StageFailed, or anything unexpected), never bad input or an OS fault
    (UserError) and never an interrupt (Ctrl-C, SIGTERM: the user or the scheduler stopped it)."""
    try:
        state.result()
    except KeyboardInterrupt:
        return False
    except RankRefused:  # a rank named its error (bad data, divergence): a retry meets it again
        return False
    except StageFailed:
        return True
    except UserError:
        return False
    except BaseException:  # noqa: BLE001 - a crash of the launcher itself is worth a retry too
        return True
    return False


def _prepare_training(run_dir: Path, key: str, action: str) -> bool:
    """Resume an interrupted run of the same training, else start clean. Returns ``resume``.

    Same key as the last started training, not forced, a complete checkpoint on disk: continue it.
    Otherwise older checkpoints belong to other settings; they are moved to ``checkpoints.prev/`` (one
    generation kept) so the trainer never resumes from them or mixes its steps with theirs.
    """
    marker = cache.record_path(run_dir, "train.started")
    started = None
    if marker.is_file():
        with contextlib.suppress(OSError, ValueError, AttributeError):
            started = json.loads(marker.read_text()).get("key")
    rd = RunDir(run_dir)
    if action != cache.RUN and started == key and newest_complete(run_dir) is not None:
        return True
    if rd.step_dirs():
        prev = run_dir / "checkpoints.prev"
        shutil.rmtree(prev, ignore_errors=True)
        rd.checkpoints.rename(prev)
        why = "this run is forced" if action == cache.RUN else "they belong to other settings"
        run_logger().warning(f"moved the earlier checkpoints to {prev} ({why}); training starts at step 0")
    if rd.metrics.is_file():
        rd.metrics.replace(run_dir / "metrics.prev.jsonl")
    cache.write_json_atomic(marker, {"key": key, "started_at": time.time()})
    return False


def _call_stage(
    stage: str,
    fn: Callable,
    *,
    cfg: FlowConfig,
    flow_path: Path,
    flow_dir: Path,
    run_dir: Path,
    upstream: dict[str, StageOutput],
    resume: bool,
) -> StageOutput:
    """Call stage ``stage``'s task ``fn`` as its record says (titan_pipe.flows.stages)."""
    ctx = Context(
        cfg=cfg,
        flow_path=flow_path,
        flow_dir=flow_dir,
        run_dir=run_dir,
        upstream=upstream,
        resume=resume,
        retry=retryable,
    )
    return stage_record(stage).call(fn, ctx)


def run_pipeline(
    flow_path: Path,
    *,
    from_stage: str | None = None,
    only: str | None = None,
    force: bool = False,
    tasks: dict[str, Callable] | None = None,
    publish: bool = True,
    cfg: FlowConfig | None = None,
) -> PipelineOutcome:
    """Run the selected stages of flow.yaml in order, skipping those whose key is unchanged.

    ``cfg``: flow.yaml as the caller already loaded it (else it is loaded here).
    """
    tasks = {**DEFAULT_TASKS, **(tasks or {})}
    flow_path = Path(flow_path).resolve()
    cfg = cfg if cfg is not None else load_flow(flow_path)
    actions = cache.plan_actions(from_stage=from_stage, only=only, force=force, cache=cfg.orchestration.cache)
    run_dir = cfg.run_dir().resolve()
    with run_lock(run_dir, what=f"titan-pipe run {flow_path}"):  # re-entered when `titan-pipe run` holds it
        return _run_stages(cfg, flow_path, run_dir, actions, tasks, publish)


def _run_stages(
    cfg: FlowConfig, flow_path: Path, run_dir: Path, actions: dict[str, str], tasks: dict[str, Callable], publish: bool
) -> PipelineOutcome:

    reused = cache.check_reusable(actions, run_dir)
    log = run_logger()
    log.info(f"run dir {run_dir}; stages: " + ", ".join(f"{s}={a}" for s, a in actions.items()))
    hasher = cache.FileHasher(run_dir / ".stages" / "hashes.json")
    outcome = PipelineOutcome(run_dir)
    upstream: dict[str, StageOutput] = {}  # each earlier stage's output, by stage
    actions = cache.with_data_stage(actions, cache.needs_data_stage(cfg, flow_path.parent))
    for stage, action in actions.items():
        if action == cache.SKIP:
            outcome.stages[stage] = "skipped"
            _emit(StageEvent(stage, "skipped", message="not selected (--only)"))
            continue
        if action == cache.REUSE:
            out = StageOutput.from_json(reused[stage].result)
            outcome.stages[stage], outcome.outputs[stage] = "reused", out
            upstream[stage] = out
            _emit(StageEvent(stage, "reused", output=out, message="outputs of its last run"))
            continue
        doc = cache.stage_doc(
            cache.stage_inputs(stage, cfg, flow_dir=flow_path.parent, upstream=upstream), hasher, run_dir
        )
        key = cache.doc_key(doc)
        record = cache.read_record(run_dir, stage)
        if action == cache.AUTO and cache.cache_hit(record, key, hasher, run_dir):
            out, status, took = StageOutput.from_json(record.result), "cached", 0.0
            log.info(f"{stage}: cached (key {key[:12]}, inputs unchanged since {time.ctime(record.finished_at)})")
        else:
            why = (
                "selected to run"
                if action == cache.RUN
                else "; ".join(
                    cache.explain_change(record.inputs if record else None, doc)
                    if record is None or record.key != key
                    else ["its outputs changed on disk"]
                )
            )
            (api_only_logger() or log).info(f"{stage}: running ({why})")  # the event's line says it on the console
            cache.clear_record(run_dir, stage)
            resume = _prepare_training(run_dir, key, action) if stage_record(stage).resumes else False
            _emit(StageEvent(stage, "running", message=why))
            t0 = time.perf_counter()
            try:
                out = _call_stage(
                    stage,
                    tasks[stage],
                    cfg=cfg,
                    flow_path=flow_path,
                    flow_dir=flow_path.parent,
                    run_dir=run_dir,
                    upstream=upstream,
                    resume=resume,
                )
            except BaseException as e:
                outcome.stages[stage] = "failed"
                why = str(Interrupted.of(e)) if isinstance(e, KeyboardInterrupt) and not str(e) else str(e)
                _emit(
                    StageEvent(
                        stage,
                        "failed",
                        time.perf_counter() - t0,
                        message=why.splitlines()[0] if why else type(e).__name__,
                    )
                )
                hasher.save()
                raise
            took, status = time.perf_counter() - t0, "done"
            outputs = cache.hash_outputs([Path(p) for p in out.outputs], hasher, run_dir)
            cache.write_record(
                run_dir,
                cache.StageRecord(
                    stage=stage, key=key, outputs=outputs, result=out.to_json(), duration_s=took, inputs=doc
                ),
            )
        outcome.stages[stage], outcome.outputs[stage] = status, out
        upstream[stage] = out
        if publish:
            publish_stage(out, run_name=cfg.name, cached=status == "cached")
        _emit(StageEvent(stage, status, took, output=out))
    hasher.save()
    if outcome.passed is False:
        raise StageFailed(f"evaluation failed its thresholds; see {outcome.outputs['evaluate'].paths.report_json}")
    return outcome


def join_training(flow_path: Path, *, node_rank: int, tasks: dict[str, Callable] | None = None) -> PipelineOutcome:
    """A worker node's share of a multi-node training (launch.nnodes > 1, node_rank > 0).

    Node 0 runs ``train_to_deploy``; every other node runs this at the same time, so its torchrun
    joins the c10d rendezvous at launch.rdzv_endpoint. The run dir is on shared storage: this node
    computes the same train key as node 0 and skips when node 0 would (else node 0 would never
    start and the others would wait for it), and never writes records (node 0 owns them).
    """
    fn = (tasks or DEFAULT_TASKS)["train"]
    flow_path = Path(flow_path).resolve()
    cfg = load_flow(flow_path)
    if not 0 < node_rank < cfg.launch.nnodes:
        raise UserError(
            f"{flow_path}: node_rank {node_rank} must be 1..{cfg.launch.nnodes - 1} for a worker node "
            f"(launch.nnodes={cfg.launch.nnodes}); node 0 runs the train-to-deploy flow"
        )
    cfg = cfg.model_copy(update={"launch": cfg.launch.model_copy(update={"node_rank": node_rank})})
    run_dir = cfg.run_dir().resolve()
    hasher = cache.FileHasher()  # no shared memo: node 0 owns .stages/
    key = cache.stage_key(cache.stage_inputs("train", cfg, flow_dir=flow_path.parent, upstream={}), hasher, run_dir)
    outcome = PipelineOutcome(run_dir)
    record = cache.read_record(run_dir, "train")
    if cfg.orchestration.cache and cache.cache_hit(record, key, hasher, run_dir):
        outcome.stages["train"], outcome.outputs["train"] = "cached", StageOutput.from_json(record.result)
        _emit(StageEvent("train", "cached", output=outcome.outputs["train"]))
        return outcome
    _emit(StageEvent("train", "running", message=f"node {node_rank} of {cfg.launch.nnodes}"))
    out = _call_stage(
        "train", fn, cfg=cfg, flow_path=flow_path, flow_dir=flow_path.parent, run_dir=run_dir, upstream={}, resume=False
    )
    outcome.stages["train"], outcome.outputs["train"] = "done", out
    _emit(StageEvent("train", "done", output=out))
    return outcome


def _enter(workdir: str | None) -> None:
    # A deployment's runs start wherever the worker runs; runs_dir is relative to where it was scheduled.
    if workdir:
        os.chdir(workdir)


# The flows' parameters are plain JSON values (paths as str, flags, stage names): what Prefect
# validates against the deployment's schema when a worker or a served runner starts a run, and
# what the UI's "custom run" form shows. The config itself travels as the flow.yaml path: each run
# reads it (and the ranks read it again), so a scheduled run uses the file as it is at that time.
@flow(name="train-to-deploy", description="Train, convert, export and evaluate one flow.yaml.")
def train_to_deploy(
    flow_path: str,
    from_stage: str | None = None,
    only: str | None = None,
    force: bool = False,
    workdir: str | None = None,
) -> dict:
    _enter(workdir)
    return run_pipeline(Path(flow_path), from_stage=from_stage, only=only, force=force).to_json()


@flow(name="titan-pipe-train", description="The training stage of a flow.yaml alone (node_rank > 0: a worker node).")
def train_flow(flow_path: str, workdir: str | None = None, node_rank: int | None = None) -> dict:
    _enter(workdir)
    if node_rank:
        return join_training(Path(flow_path), node_rank=node_rank).to_json()
    return run_pipeline(Path(flow_path), only="train").to_json()


@flow(name="titan-pipe-convert", description="The convert stage alone, on the run's newest checkpoint.")
def convert_flow(flow_path: str, workdir: str | None = None) -> dict:
    _enter(workdir)
    return run_pipeline(Path(flow_path), only="convert").to_json()


@flow(name="titan-pipe-export", description="The export stage alone, on the run's converted model.")
def export_flow(flow_path: str, workdir: str | None = None) -> dict:
    _enter(workdir)
    return run_pipeline(Path(flow_path), only="export").to_json()


@flow(name="titan-pipe-evaluate", description="The evaluate stage alone, on the run's outputs.")
def evaluate_flow(flow_path: str, workdir: str | None = None) -> dict:
    _enter(workdir)
    return run_pipeline(Path(flow_path), only="evaluate").to_json()


STAGE_FLOWS = {"train": train_flow, "convert": convert_flow, "export": export_flow, "evaluate": evaluate_flow}
