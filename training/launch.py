"""The training launcher: run_training locks the run dir, starts torchrun for this node (or runs the
trainer in this process inside an existing launch) and turns the run's files into a TrainResult.

By concern: the torchrun command and environment (launch_command), SLURM and launch detection
(slurm), running and streaming the guarded process tree (stream), why a launch failed (failure).
``run_training`` is what ``titan-pipe train`` and the Prefect flow call.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

from titan_pipe.io.atomic import copy_file
from titan_pipe.records.checkpoint_format import newest_complete
from titan_pipe.config import FlowConfig
from titan_pipe.errors import Interrupted, StageFailed, UserError
from titan_pipe.run_dir import RunDir
from titan_pipe.processes.run_lock import run_lock
from titan_pipe.records.stage_summaries import TrainSummary
from titan_pipe.training.failure import launch_failure, node_log, torchrun_report
from titan_pipe.training.launch_command import build_torchrun_command, launch_env
from titan_pipe.training.metrics import plot_metrics, step_records
from titan_pipe.training.rank_records import RECORDS_ENV
from titan_pipe.training.slurm import inside_launch, reports, slurm_env
from titan_pipe.training.stream import stream_process
from titan_pipe.training.preflight import check_before_launch

__all__ = ["TrainResult", "run_training", "reports", "collect_result", "summarize", "resume_flag"]


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    checkpoint: Path | None  # newest complete step dir; None only on a node that holds none
    metrics: Path  # metrics.jsonl
    summary: TrainSummary


def summarize(metrics_path: Path) -> TrainSummary:
    """final_loss, tokens_per_s (mean over logged steps after the first, which carries warm-up),
    mfu (same mean; None when never known), steps (last step logged) from metrics.jsonl."""
    recs = step_records(metrics_path)
    if not recs:
        return TrainSummary()
    timed = recs[1:] or recs

    def mean(key: str) -> float | None:
        vals = [r[key] for r in timed if isinstance(r.get(key), (int, float))]
        return sum(vals) / len(vals) if vals else None

    last_loss = next((r["loss"] for r in reversed(recs) if isinstance(r.get("loss"), (int, float))), None)
    return TrainSummary(
        final_loss=last_loss, tokens_per_s=mean("tokens_per_s"), mfu=mean("mfu"), steps=recs[-1]["step"]
    )


def copy_flow(flow_path: Path, run: RunDir) -> None:
    """The flow.yaml beside the run's outputs, so the run dir records what produced it."""
    run.root.mkdir(parents=True, exist_ok=True)
    if run.flow_yaml.exists() and run.flow_yaml.resolve() == flow_path.resolve():
        return
    copy_file(flow_path, run.flow_yaml)


def run_training(*, flow_path: Path, cfg: FlowConfig, resume: bool = False) -> TrainResult:
    """Train ``cfg`` (loaded from ``flow_path``) and return where its outputs are.

    Spawns torchrun for this node, or inside an existing torchrun/srun launch runs the trainer in
    this process. A non-zero exit raises StageFailed carrying torchrun's status (``exit_code``) and
    naming run_dir/train.log.
    """
    from titan_pipe.rules.devices import resolve_device

    flow_path = Path(flow_path).resolve()
    run = RunDir(cfg.run_dir().resolve())
    try:
        device = resolve_device(cfg.device)
    except (UserError, ValueError) as e:
        raise UserError(f"{flow_path}: {e}") from None

    prepare_data_once(cfg, flow_path, None)  # token data: checked before anything is written
    with lock_run_dir(cfg, run):
        # Refused here, nothing written: not the run's flow.yaml record, not a torchrun log.
        check_before_launch(cfg, flow_path=flow_path, resume=resume)
        if inside_launch():
            return _run_in_process(flow_path, cfg, run, resume)
        return _launch(flow_path, cfg, run, resume, device.type)


def lock_run_dir(cfg: FlowConfig, run: RunDir):
    """The run dir's lock, held by the process that owns the run dir: the launcher on node 0, or
    global rank 0 inside an existing launch. Other nodes and ranks write beside it under node 0's
    lock (they cannot share one flock), and torchrun's children inherit it (titan_pipe.processes.run_lock)."""
    if cfg.launch.node_rank != 0 or not reports():
        return contextlib.nullcontext()
    return run_lock(run.root, what=f"titan-pipe train {cfg.name}")


def _launch(flow_path: Path, cfg: FlowConfig, run: RunDir, resume: bool, device_type: str) -> TrainResult:
    """torchrun for this node, its output teed into the run's log; StageFailed on a non-zero exit."""
    prepare_data_once(cfg, flow_path, run)
    copy_flow(flow_path, run)
    logs = run.root / "logs"
    cmd = build_torchrun_command(cfg, flow_path, resume=resume_flag(cfg, run, resume), log_dir=logs)
    started = time.time()
    log = node_log(cfg, run)
    log_offset = log.stat().st_size if log.is_file() else 0
    records = fresh_records_dir(logs, cfg.launch.node_rank)
    env = {**launch_env(cfg, device_type), RECORDS_ENV: str(records)}
    if reports():
        import sys

        p = cfg.parallel
        print(
            f"starting torchrun: {cfg.launch.nproc_per_node or p.world_size // cfg.launch.nnodes} rank(s) on this node "
            f"(dp{p.dp} x tp{p.tp} x pp{p.pp}, {device_type}); rank start-up and the model build print "
            f"'setup:' lines; log {log}",
            file=sys.stderr,
            flush=True,
        )
    try:
        with reading_data(cfg, flow_path):
            rc = stream_process(cmd, env=env, log_path=log, hide_from=torchrun_report)
    except KeyboardInterrupt as e:  # the tree is stopped; an interrupt, not a failure to retry
        raise Interrupted.of(
            e, f"torchrun and its ranks were stopped; see {log}; continue with: titan-pipe train {flow_path} --resume"
        ) from None
    if rc != 0:
        raise launch_failure(rc, run, started - 1, log_offset, log, records)
    return collect_result(run, cfg)


def fresh_records_dir(logs: Path, node_rank: int) -> Path:
    """This node's rank record dir (training/rank_records.py), emptied for this launch: a record left
    by an earlier launch must not explain this one's failure."""
    records = logs / f"records-node{node_rank}"
    if records.is_dir():
        for old in records.glob("rank-*.json"):
            old.unlink(missing_ok=True)
    records.mkdir(parents=True, exist_ok=True)
    return records


@contextlib.contextmanager
def reading_data(cfg: FlowConfig, flow_path: Path):
    """Shared locks on the prepared data dirs the ranks read (data.path / data.blend given as token
    data) while they run: `data prepare -o` one of them stops at once instead of replacing the
    tokens under a running training (titan_pipe.processes.run_lock.read_lock). Raw text is prepared into the
    run's own data dir, which the run dir's lock covers."""
    from titan_pipe.processes.run_lock import read_lock
    from titan_pipe.tokens.spec import data_spec

    spec = data_spec(cfg.data, base=flow_path.parent)
    dirs = [] if spec.text is not None else sorted({p.resolve() for p in spec.paths if p.is_dir()})
    with contextlib.ExitStack() as stack:
        for d in dirs:
            stack.enter_context(read_lock(d, what=f"titan-pipe train {cfg.name}"))
        yield


def prepare_data_once(cfg: FlowConfig, flow_path: Path, run: RunDir | None) -> None:
    """Open the flow's data once here, before any rank starts, so bad data (ids past the vocab, a
    foreign tokenizer, a damaged index) is one line instead of a failure in every rank. Raw text
    is first prepared into the run's data dir (``run``; node 0 only, under the run dir's lock; a
    no-op when current, titan_pipe.training.prepare); the ranks then only read it. ``run`` None:
    token data only (checked before the run dir is made), raw text is left for later."""
    from titan_pipe.tokens.spec import data_spec, open_spec
    from titan_pipe.training.prepare import prepare_spec

    spec = data_spec(cfg.data, base=flow_path.parent)
    if cfg.launch.node_rank != 0 or (spec.text is None) == (run is not None):
        return  # token data is checked on the first call (run None), raw text on the second
    if spec.text is not None:
        prepare_spec(spec, run.data, progress=reports())
    # the whole index of token data is verified once, by the pre-launch checks (preflight.corpus_problem)
    open_spec(spec, prepared=run.data if run else flow_path.parent, vocab_size=cfg.model.args().vocab_size)


def resume_flag(cfg: FlowConfig, run: RunDir, resume: bool) -> bool:
    """Whether the torchrun command carries --resume.

    Asked for, or torchrun may restart the ranks (launch.max_restarts > 0) and this run has no
    complete checkpoint yet: torchrun re-runs the same command, and with --resume a restarted
    attempt continues from what the failed one saved instead of from step 0, while the first
    attempt, finding nothing, starts fresh.
    """
    if resume or cfg.launch.max_restarts == 0:
        return resume
    return newest_complete(run.root) is None


def _run_in_process(flow_path: Path, cfg: FlowConfig, run: RunDir, resume: bool) -> TrainResult:
    from titan_pipe.training import trainer

    extra = slurm_env(os.environ, cfg)
    os.environ.update(extra)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != cfg.parallel.world_size:
        raise UserError(
            f"{flow_path}: this launch has WORLD_SIZE={world} processes but dp*tp*pp = "
            f"{cfg.parallel.world_size}; start {cfg.parallel.world_size} tasks or change parallel"
        )
    if os.environ.get("RANK", "0") == "0":
        copy_flow(flow_path, run)
    rc = trainer.main(["--flow", str(flow_path)] + (["--resume"] if resume else []))
    if rc != 0:
        err = StageFailed(f"training failed on rank {os.environ.get('RANK')} with status {rc}")
        err.exit_code = rc
        raise err
    return collect_result(run, cfg)


def collect_result(run: RunDir, cfg: FlowConfig) -> TrainResult:
    """The TrainResult of a finished run from its files (metrics.jsonl, summary.json, step dirs)."""
    summary = summarize(run.metrics)
    extra = run.root / "summary.json"  # the trainer's own summary, for what metrics.jsonl lacks
    if extra.is_file():
        try:
            theirs = json.loads(extra.read_text())
        except ValueError:
            theirs = None
        if isinstance(theirs, dict):
            start, source = theirs.get("start_step"), theirs.get("peak_flops_source")
            summary = replace(
                summary,
                start_step=start if type(start) is int else None,
                peak_flops_source=source if isinstance(source, str) else None,
            )
    if reports() and cfg.launch.node_rank == 0:
        picture = plot_metrics(run.metrics, run.root / "metrics.png")
        if picture is not None:
            summary = replace(summary, plot=str(picture))
    checkpoint = newest_complete(run.checkpoints, warn=True)
    on_first_node = cfg.launch.node_rank == 0 and os.environ.get("RANK", "0") == "0"
    if checkpoint is None and on_first_node:
        raise StageFailed(
            f"training exited 0 but {run.checkpoints} holds no complete checkpoint "
            f"(no step dir with manifest.json); see {run.train_log}"
        )
    return TrainResult(run_dir=run.root, checkpoint=checkpoint, metrics=run.metrics, summary=summary)
