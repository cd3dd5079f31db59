"""The torchrun command and environment of one node's launch (pure: from the flow config and a base env)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Mapping

from titan_pipe.config import FlowConfig
from titan_pipe.errors import UserError

TRAIN_MODULE = "titan_pipe.training.rank"


def nproc_per_node(cfg: FlowConfig) -> int:
    """Processes on this node: launch.nproc_per_node, else dp*tp*pp spread evenly over nnodes."""
    return cfg.launch.nproc_per_node or cfg.parallel.world_size // cfg.launch.nnodes


def build_torchrun_command(cfg: FlowConfig, flow_path: Path, *, resume: bool, log_dir: Path | None = None) -> list[str]:
    """The torchrun argv for this node. One node: --standalone (local rendezvous on a free port);
    several: c10d rendezvous at launch.rdzv_endpoint with the run name as the job id, so every
    node's launcher joins the same group. Only local rank 0 reaches the console; with ``log_dir``
    every rank's stdout/stderr is also kept in files there (torchrun --tee 3)."""
    la = cfg.launch
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc_per_node(cfg)),
        "--nnodes",
        str(la.nnodes),
        "--node_rank",
        str(la.node_rank),
    ]
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


def launch_env(
    cfg: FlowConfig, device_type: str, *, base: Mapping[str, str] | None = None, cpus: int | None = None
) -> dict[str, str]:
    """The environment torchrun and its workers get: ``base`` (default os.environ) plus, only
    where ``base`` does not set them already:

    - PYTHONUNBUFFERED=1: rank output reaches train.log line by line, not in 8 KB blocks.
    - OMP_NUM_THREADS=cpus // nproc (at least 1) on CPU with several ranks per node, so ranks
      sharing cores do not oversubscribe them (torchrun's own default is 1 with a warning).
    - TORCH_DEVICE_BACKEND_AUTOLOAD=0 on CPU: a torch_npu installed without CANN would otherwise
      break ``import torch`` in every rank.
    - the collective library's settings from the comm section (comm_env below): on
      NPU, HCCL_BUFFSIZE = comm.fusion_buffer_mb.
    """

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


def comm_env(cfg: FlowConfig, device_type: str) -> dict[str, str]:
    """Environment the collective library reads at init (set only where not already set).

    On Ascend, comm.fusion_buffer_mb sizes HCCL's shared buffer (HCCL_BUFFSIZE, MB).
    """
    env = {}
    if device_type == "npu":
        env["HCCL_BUFFSIZE"] = str(cfg.comm.fusion_buffer_mb)
    return env
