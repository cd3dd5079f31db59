"""Where a launch runs: inside an existing torchrun/srun launch or not, who reports, and SLURM's
variables mapped to torch.distributed's env:// ones (for srun tasks torchrun did not start)."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Mapping

from titan_pipe.processes import procs
from titan_pipe.config import FlowConfig
from titan_pipe.errors import UserError

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")  # set by torchrun for each worker
SLURM_VARS = ("SLURM_PROCID",)  # set by srun for each task


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
            raise UserError(
                "launch.rdzv_endpoint: inside srun without a readable SLURM_JOB_NODELIST; "
                "set launch.rdzv_endpoint to host:port of the first node"
            )
        out["MASTER_ADDR"] = host
        out.setdefault("MASTER_PORT", environ.get("MASTER_PORT", port))
    return out


def first_slurm_host(nodelist: str) -> str | None:
    """The first host of a SLURM node list ('node[01-04],gpu7' -> 'node01'); scontrol if present."""
    if not nodelist:
        return None
    if shutil.which("scontrol"):
        try:
            done = procs.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
            out = done.stdout.split() if done.returncode == 0 else []
            if out:
                return out[0]
        except (subprocess.SubprocessError, OSError):
            pass
    first = nodelist.split(",")[0]
    if "[" in first:  # prefix[a-b,c] -> prefix + a
        prefix, rng = first.split("[", 1)
        return prefix + rng.rstrip("]").split(",")[0].split("-")[0]
    return first
