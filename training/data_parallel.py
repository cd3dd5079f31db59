"""Data parallelism: FSDP2 (ZeRO-2/3), FSDP2-based replication (DDP semantics under TP), DDP.

``plan_dp`` maps the flow.yaml knobs (parallel.dp_mode, zero_stage, memory.optimizer_offload,
comm.*) onto one of these, as pure data; ``apply_dp`` executes it on this rank's stage modules.
Classic DDP cannot wrap DTensor (TP) parameters, and the old composable ``replicate`` with TP
loses gradients silently, so with tp > 1 DDP semantics come from FSDP2's ``replicate``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from titan_pipe.rules.dtypes import TORCH_BY_NAME


@dataclass(frozen=True)
class DPPlan:
    """kind: none | fsdp | replicate | ddp. zero1: shard optimizer states (ZeroRedundancyOptimizer)."""

    kind: str
    reshard_after_forward: bool = True
    zero1: bool = False
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    cpu_offload: bool = False
    bucket_cap_mb: float = 25.0
    overlap: bool = True


def plan_dp(
    *,
    dp: int,
    tp: int,
    dp_mode: str,
    zero_stage: int | None,
    offload: str = "none",
    amp_dtype: str | None = None,
    gradient_sync_dtype: str = "float32",
    fusion_buffer_mb: float = 25,
    comm_overlap: bool = True,
) -> DPPlan:
    """Which data-parallel wrapper this layout gets (see docs/training.md, "ZeRO mapping").

    zero_stage 3 -> FSDP2 resharding after forward; 2 -> FSDP2 keeping parameters unsharded
    between forward and backward; 1 -> DDP + ZeroRedundancyOptimizer (tp == 1) else as 2;
    0 -> DDP (tp == 1) or FSDP2 replicate (tp > 1). None: dp_mode decides (fsdp = 3, ddp = 0).
    """
    common = dict(
        param_dtype=TORCH_BY_NAME[amp_dtype] if amp_dtype else None,
        reduce_dtype=TORCH_BY_NAME[gradient_sync_dtype],
        cpu_offload=offload == "cpu",
        bucket_cap_mb=float(fusion_buffer_mb),
        overlap=comm_overlap,
    )
    stage = zero_stage if zero_stage is not None else (3 if dp_mode == "fsdp" else 0)
    if offload == "cpu":
        # CPU offload lives in FSDP2; it applies even at dp == 1 (a one-rank "shard").
        return DPPlan("fsdp", reshard_after_forward=stage != 2, **common)
    if dp == 1:
        return DPPlan("none", **common)
    if stage == 3:
        return DPPlan("fsdp", reshard_after_forward=True, **common)
    if stage == 2 or (stage == 1 and tp > 1):
        return DPPlan("fsdp", reshard_after_forward=False, **common)
    if tp > 1:
        return DPPlan("replicate", reshard_after_forward=False, **common)
    return DPPlan("ddp", zero1=stage == 1, **common)


def _fsdp_kwargs(plan: DPPlan, dp_mesh: DeviceMesh) -> dict:
    return dict(
        mesh=dp_mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype),
        # Pinned host memory speeds accelerator <-> host copies; a CPU-only run has neither.
        offload_policy=(
            CPUOffloadPolicy(pin_memory=dp_mesh.device_type != "cpu") if plan.cpu_offload else OffloadPolicy()
        ),
    )


def apply_fsdp(part: nn.Module, dp_mesh: DeviceMesh, plan: DPPlan) -> nn.Module:
    """FSDP2 ``fully_shard`` per transformer block, then the stage root (embedding, norm, output).

    Parameters become DTensors sharded on dim 0 over dp (on top of TP: ``(_StridedShard(0), Shard)``
    placements on the 2-D (dp, tp) mesh). Without comm_overlap only the root is wrapped: one
    all-gather before forward and one reduce-scatter after the whole backward.
    """
    kw = _fsdp_kwargs(plan, dp_mesh)
    for layer in part.layers.values():  # experts split over ep: their own FSDP, over the dp ranks sharing them
        experts = getattr(getattr(layer, "moe", None), "experts", None)
        if experts is not None and experts.dispatch is not None:
            root = experts.w1.device_mesh._get_root_mesh()
            fully_shard(
                experts, reshard_after_forward=plan.reshard_after_forward, **_fsdp_kwargs(plan, root["dp_mod_ep"])
            )
    if plan.overlap:
        for layer in part.layers.values():
            fully_shard(layer, reshard_after_forward=plan.reshard_after_forward, **kw)
    # The root's parameters are needed first in backward (output) and last (embedding): keeping
    # them unsharded after forward saves one all-gather at little memory cost.
    fully_shard(part, reshard_after_forward=False, **kw)
    return part


def apply_replicate(part: nn.Module, dp_mesh: DeviceMesh, plan: DPPlan) -> nn.Module:
    """DDP semantics (every dp rank keeps whole parameters; gradients all-reduced) through FSDP2's
    replicate, which, unlike classic DDP, accepts TP DTensor parameters."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    kw = _fsdp_kwargs(plan, dp_mesh)
    if plan.overlap:
        for layer in part.layers.values():
            replicate(layer, **kw)
    replicate(part, **kw)
    return part


def apply_ddp(part: nn.Module, dp_mesh: DeviceMesh, plan: DPPlan) -> nn.Module:
    """Classic DDP (plain tensors only): gradients all-reduced in buckets of comm.fusion_buffer_mb.

    Without comm_overlap the bucket is made larger than the model, so one all-reduce runs after
    the whole backward instead of overlapping it. Returns the wrapper (names gain ``module.``).
    """
    if plan.overlap:
        bucket = plan.bucket_cap_mb
    else:
        bucket = 2 * sum(p.numel() * p.element_size() for p in part.parameters()) / 2**20 + 1
    return DistributedDataParallel(
        part, process_group=dp_mesh.get_group(), bucket_cap_mb=bucket, broadcast_buffers=False
    )


def apply_dp(part: nn.Module, dp_mesh: DeviceMesh, plan: DPPlan) -> nn.Module:
    """Execute ``plan`` on one stage module; returns the module to run (maybe a DDP wrapper)."""
    if plan.kind == "fsdp":
        return apply_fsdp(part, dp_mesh, plan)
    if plan.kind == "replicate":
        return apply_replicate(part, dp_mesh, plan)
    if plan.kind == "ddp":
        return apply_ddp(part, dp_mesh, plan)
    return part


def unwrap(part: nn.Module) -> nn.Module:
    """The stage module itself, under a DDP wrapper if there is one."""
    return part.module if isinstance(part, DistributedDataParallel) else part
