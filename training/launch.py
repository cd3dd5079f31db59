"""The training launcher: builds the torchrun command and environment, runs it, streams rank 0.

``run_training`` is what ``titan-pipe train`` and the Prefect flow call. It starts
``python -m torch.distributed.run ... -m titan_pipe.training.trainer --flow FLOW [--resume]`` as a
subprocess, tees its output to the console and run_dir/train.log, and turns the run's files into a
TrainResult. Inside an existing launch (torchrun, srun) it runs the trainer in this process instead.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Mapping

from titan_pipe.atomic import copy_file
from titan_pipe.checkpoint_format import newest_complete
from titan_pipe.config import FlowConfig
from titan_pipe.errors import StageFailed, UserError
from titan_pipe.run_dir import RunDir
from titan_pipe.run_lock import run_lock
from titan_pipe.training.metrics import (bar_info, new_progress_bar, parse_progress_line, plot_metrics,
                                         step_records)

TRAIN_MODULE = "titan_pipe.training.trainer"
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")  # set by torchrun for each worker
SLURM_VARS = ("SLURM_PROCID",)  # set by srun for each task


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    checkpoint: Path | None  # newest complete step dir; None only on a node that holds none
    metrics: Path  # metrics.jsonl
    summary: dict  # final_loss, tokens_per_s, mfu, steps (+ start_step, peak_flops_source, plot)


# --- plan: command and environment (pure) -------------------------------------------------------

def nproc_per_node(cfg: FlowConfig) -> int:
    """Processes on this node: launch.nproc_per_node, else dp*tp*pp spread evenly over nnodes."""
    return cfg.launch.nproc_per_node or cfg.parallel.world_size // cfg.launch.nnodes


def build_torchrun_command(cfg: FlowConfig, flow_path: Path, *, resume: bool,
                           log_dir: Path | None = None) -> list[str]:
    """The torchrun argv for this node. One node: --standalone (local rendezvous on a free port);
    several: c10d rendezvous at launch.rdzv_endpoint with the run name as the job id, so every
    node's launcher joins the same group. Only local rank 0 reaches the console; with ``log_dir``
    every rank's stdout/stderr is also kept in files there (torchrun --tee 3)."""
    la = cfg.launch
    cmd = [sys.executable, "-m", "torch.distributed.run",
           "--nproc_per_node", str(nproc_per_node(cfg)), "--nnodes", str(la.nnodes),
           "--node_rank", str(la.node_rank)]
    if la.nnodes == 1:
        cmd.append("--standalone")
    else:
        if not la.rdzv_endpoint:
            raise UserError("launch.rdzv_endpoint: required when nnodes > 1 (host:port of node 0)")
        cmd += ["--rdzv_backend", "c10d", "--rdzv_endpoint", la.rdzv_endpoint, "--rdzv_id", cfg.name]
    cmd += ["--max_restarts", str(la.max_restarts)]
    if log_dir is not None:
        cmd += ["--log_dir", str(log_dir), "--tee", "3"]
    cmd += ["--local-ranks-filter", "0", "-m", TRAIN_MODULE, "--flow", str(flow_path)]
    if resume:
        cmd.append("--resume")
    return cmd


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def launch_env(cfg: FlowConfig, device_type: str, *, base: Mapping[str, str] | None = None,
               cpus: int | None = None) -> dict[str, str]:
    """The environment torchrun and its workers get: ``base`` (default os.environ) plus, only
    where ``base`` does not set them already:

    - PYTHONUNBUFFERED=1: rank output reaches train.log line by line, not in 8 KB blocks.
    - OMP_NUM_THREADS=cpus // nproc (at least 1) on CPU with several ranks per node, so ranks
      sharing cores do not oversubscribe them (torchrun's own default is 1 with a warning).
    - TORCH_DEVICE_BACKEND_AUTOLOAD=0 on CPU: a torch_npu installed without CANN would otherwise
      break ``import torch`` in every rank.
    - the collective library's settings from the comm section (training/trainer.py comm_env): on
      NPU, HCCL_BUFFSIZE = comm.fusion_buffer_mb.
    """
    from titan_pipe.training.trainer import comm_env

    env = dict(os.environ if base is None else base)
    extra = {"PYTHONUNBUFFERED": "1"}
    nproc = nproc_per_node(cfg)
    if device_type == "cpu":
        extra["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
        if nproc > 1:
            extra["OMP_NUM_THREADS"] = str(max(1, (cpus or usable_cpus()) // nproc))
    extra.update(comm_env(cfg, device_type))
    for k, v in extra.items():
        env.setdefault(k, v)
    return env


def slurm_tasks(environ: Mapping[str, str]) -> int:
    """Tasks of the current SLURM step (srun), else of the job; 1 outside SLURM."""
    for key in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"):
        if environ.get(key, "").isdigit():
            return int(environ[key])
    return 1


def inside_launch(environ: Mapping[str, str] | None = None) -> bool:
    """True in a torchrun worker or one of several srun tasks: the processes already exist.

    A single SLURM task (an sbatch script's own shell has SLURM_PROCID=0 too) is not a launch:
    there titan-pipe spawns torchrun for the node as usual.
    """
    environ = os.environ if environ is None else environ
    if any(k in environ for k in LAUNCH_VARS):
        return True
    return any(k in environ for k in SLURM_VARS) and slurm_tasks(environ) > 1


def reports(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process prints the run's summary: the launcher, or global rank 0 inside a launch."""
    environ = os.environ if environ is None else environ
    return environ.get("RANK", environ.get("SLURM_PROCID", "0")) == "0"


def slurm_env(environ: Mapping[str, str], cfg: FlowConfig) -> dict[str, str]:
    """torch.distributed's env:// variables for an srun task that torchrun did not start.

    RANK/WORLD_SIZE/LOCAL_RANK from SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID; MASTER_ADDR and
    MASTER_PORT from launch.rdzv_endpoint, else the first host of SLURM_JOB_NODELIST and 29500.
    Variables already set win.
    """
    out: dict[str, str] = {}
    if "RANK" in environ or "SLURM_PROCID" not in environ:
        return out
    out["RANK"] = environ["SLURM_PROCID"]
    out["WORLD_SIZE"] = str(slurm_tasks(environ))
    out["LOCAL_RANK"] = environ.get("SLURM_LOCALID", "0")
    if "MASTER_ADDR" not in environ:
        host, port = None, "29500"
        if cfg.launch.rdzv_endpoint:
            host, _, p = cfg.launch.rdzv_endpoint.rpartition(":")
            host, port = (host, p) if host else (p, port)
        else:
            host = first_slurm_host(environ.get("SLURM_JOB_NODELIST", ""))
        if not host:
            raise UserError("launch.rdzv_endpoint: inside srun without a readable SLURM_JOB_NODELIST; "
                            "set launch.rdzv_endpoint to host:port of the first node")
        out["MASTER_ADDR"] = host
        out.setdefault("MASTER_PORT", environ.get("MASTER_PORT", port))
    return out


def first_slurm_host(nodelist: str) -> str | None:
    """The first host of a SLURM node list ('node[01-04],gpu7' -> 'node01'); scontrol if present."""
    if not nodelist:
        return None
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                                 text=True, timeout=30, check=True).stdout.split()
            if out:
                return out[0]
        except (subprocess.SubprocessError, OSError):
            pass
    first = nodelist.split(",")[0]
    if "[" in first:  # prefix[a-b,c] -> prefix + a
        prefix, rng = first.split("[", 1)
        return prefix + rng.rstrip("]").split(",")[0].split("-")[0]
    return first


# --- I/O: run, stream, summarise ----------------------------------------------------------------

def stream_process(cmd: list[str], *, env: Mapping[str, str] | None, log_path: Path,
                   console: IO[str] | None = None, live: bool | None = None,
                   cwd: Path | None = None) -> int:
    """Run ``cmd``, copying each output line (stdout and stderr merged) to ``console`` and
    appending it to ``log_path`` as it arrives; returns the exit status.

    On a terminal (``live``), progress lines (metrics.format_progress_line) drive a rich bar and
    everything else prints above it; off a terminal every line is echoed as it is. Ctrl-C is
    passed on to the child, which gets 30 s to stop before it is killed.
    """
    console = console or sys.stdout
    live = console.isatty() if live is None else live
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("a", encoding="utf-8") as log:
        log.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} $ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(env) if env else None,
                                cwd=cwd, text=True, errors="replace", bufsize=1)
        bar = _LiveBar(console) if live else None
        try:
            assert proc.stdout is not None
            echo = True
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if not echo:
                    continue
                try:
                    if bar is not None:
                        bar.feed(line.rstrip("\n"))
                    else:
                        console.write(line)
                        console.flush()
                except BrokenPipeError:  # `titan-pipe train | head`: keep training, keep logging
                    echo = False
            return proc.wait()
        except KeyboardInterrupt:
            proc.send_signal(2)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
        finally:
            if bar is not None:
                bar.close()
            if proc.poll() is None:
                proc.kill()
                proc.wait()


class _LiveBar:
    """A rich progress bar fed with the child's lines (progress lines update it, others print)."""

    def __init__(self, stream: IO[str]):
        self.progress = new_progress_bar(stream)
        self.task = None

    def feed(self, line: str) -> None:
        parsed = parse_progress_line(line)
        if parsed is None:
            self.progress.console.print(line, markup=False, highlight=False, soft_wrap=True)
            return
        step, total, metrics = parsed
        if self.task is None:
            self.progress.start()
            self.task = self.progress.add_task("train", total=total, completed=step, info="")
        self.progress.update(self.task, completed=step, total=total, info=bar_info(metrics))

    def close(self) -> None:
        if self.task is not None:
            self.progress.stop()


def summarize(metrics_path: Path) -> dict:
    """final_loss, tokens_per_s (mean over logged steps after the first, which carries warm-up),
    mfu (same mean; None when never known), steps (last step logged) from metrics.jsonl."""
    recs = step_records(metrics_path)
    if not recs:
        return {"final_loss": None, "tokens_per_s": None, "mfu": None, "steps": 0}
    timed = recs[1:] or recs

    def mean(key: str) -> float | None:
        vals = [r[key] for r in timed if isinstance(r.get(key), (int, float))]
        return sum(vals) / len(vals) if vals else None

    last_loss = next((r["loss"] for r in reversed(recs) if isinstance(r.get("loss"), (int, float))), None)
    return {"final_loss": last_loss, "tokens_per_s": mean("tokens_per_s"), "mfu": mean("mfu"),
            "steps": recs[-1]["step"]}


_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+) \(local_rank: (\d+)\).*?exitcode\s*:\s*(-?\d+)",
                         re.S)


def root_cause(output: str) -> tuple[int, int, int] | None:
    """(rank, local_rank, exit code) of the first failure in torchrun's failure summary, if any."""
    found = _ROOT_CAUSE.findall(output)
    return tuple(int(x) for x in found[-1]) if found else None  # type: ignore[return-value]


def rank_log_dir(log_root: Path, local_rank: int, since: float) -> Path | None:
    """This launch's log dir of one local rank (torchrun --log_dir layout), newest attempt."""
    dirs = [d for d in log_root.glob(f"*/attempt_*/{local_rank}") if d.is_dir() and d.stat().st_mtime >= since]
    return max(dirs, key=lambda d: d.stat().st_mtime) if dirs else None


def node_log(cfg: FlowConfig, run: RunDir) -> Path:
    """train.log on node 0; train-node<k>.log on node k, so nodes sharing a run dir do not interleave."""
    return run.train_log if cfg.launch.node_rank == 0 else run.root / f"train-node{cfg.launch.node_rank}.log"


def failure_message(rc: int, run: RunDir, started: float, log_offset: int = 0, log: Path | None = None) -> str:
    """What failed and where its output is: torchrun's root cause rank and that rank's log files.

    ``log_offset``: the size of train.log before this launch (only its own part is searched).
    """
    log = log or run.train_log
    msg = f"training failed: torchrun exited with status {rc}; see {log}"
    text = ""
    if log.is_file():
        with log.open("rb") as f:
            f.seek(log_offset)
            text = f.read().decode("utf-8", errors="replace")
    cause = root_cause(text)
    if cause is not None:
        rank, local_rank, code = cause
        msg += f"; rank {rank} failed first (exit code {code})"
        d = rank_log_dir(run.root / "logs", local_rank, started)
        if d is not None:
            msg += f", its output: {d / 'stdout.log'} and {d / 'stderr.log'}"
    return msg


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
    from titan_pipe.devices import resolve_device

    flow_path = Path(flow_path).resolve()
    run = RunDir(cfg.run_dir().resolve())
    try:
        device = resolve_device(cfg.device)
    except (RuntimeError, ValueError) as e:
        raise UserError(f"{flow_path}: device: {e}") from None

    prepare_data_once(cfg, flow_path, None)  # token data: checked before anything is written
    with lock_run_dir(cfg, run):
        if inside_launch():
            return _run_in_process(flow_path, cfg, run, resume)
        return _launch(flow_path, cfg, run, resume, device.type)


def lock_run_dir(cfg: FlowConfig, run: RunDir):
    """The run dir's lock, held by the process that owns the run dir: the launcher on node 0, or
    global rank 0 inside an existing launch. Other nodes and ranks write beside it under node 0's
    lock (they cannot share one flock), and torchrun's children inherit it (titan_pipe.run_lock)."""
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
    try:
        rc = stream_process(cmd, env=launch_env(cfg, device_type), log_path=log)
    except KeyboardInterrupt:
        err = StageFailed(f"training interrupted; see {log}; continue with: titan-pipe train "
                          f"{flow_path} --resume")
        err.exit_code = 130
        raise err from None
    if rc != 0:
        err = StageFailed(failure_message(rc, run, started - 1, log_offset, log))
        err.exit_code = rc
        raise err
    return collect_result(run, cfg)


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
        raise UserError(f"{flow_path}: this launch has WORLD_SIZE={world} processes but dp*tp*pp = "
                        f"{cfg.parallel.world_size}; start {cfg.parallel.world_size} tasks or change parallel")
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
            for k in ("start_step", "peak_flops_source"):
                if k in theirs:
                    summary[k] = theirs[k]
        except ValueError:
            pass
    if reports() and cfg.launch.node_rank == 0:
        picture = plot_metrics(run.metrics, run.root / "metrics.png")
        if picture is not None:
            summary["plot"] = str(picture)
    checkpoint = newest_complete(run.checkpoints, warn=True)
    on_first_node = cfg.launch.node_rank == 0 and os.environ.get("RANK", "0") == "0"
    if checkpoint is None and on_first_node:
        raise StageFailed(f"training exited 0 but {run.checkpoints} holds no complete checkpoint "
                          f"(no step dir with manifest.json); see {run.train_log}")
    return TrainResult(run_dir=run.root, checkpoint=checkpoint, metrics=run.metrics, summary=summary)
