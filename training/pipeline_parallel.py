"""Pipeline parallelism: stage modules that keep global layer names, schedules, forward-only runs.

A stage is the ordinary ``Transformer`` with the layers it does not own deleted and, away from the
ends, ``tok_embeddings`` / ``norm`` / ``output`` set to None, so its parameter names
(``layers.5.attention.wq.weight``) are the names of the whole model. Virtual stage ``s`` of
``n_stages`` runs on pp rank ``s % pp`` (the "loop" placement interleaved 1F1B expects).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from titan_pipe.rules.choices import INTERLEAVED, PP_SCHEDULES
from titan_pipe.model import features
from titan_pipe.model.args import ModelArgs
from titan_pipe.model.kernels import Kernels
from titan_pipe.model.lora import LoRASpec
from titan_pipe.model.transformer import Transformer
from titan_pipe.model.sharding import split_stages, stage_ranks, stages_per_rank


@dataclass(frozen=True)
class StagePlan:
    """Which virtual stages (and so which layer ids) a pp rank runs. Pure data."""

    n_stages: int
    pp: int
    stages: list[list[int]]  # layer ids per virtual stage, over the whole pipeline
    local: list[int]  # virtual stage ids on this pp rank, in execution order

    def is_first(self, stage: int) -> bool:
        return stage == 0

    def is_last(self, stage: int) -> bool:
        return stage == self.n_stages - 1


def plan_stages(n_layers: int, pp: int, pp_rank: int, schedule: str, virtual_stages: int = 2) -> StagePlan:
    """Stage layout for one pp rank: gpipe/1f1b one stage per rank, interleaved ``virtual_stages``."""
    if schedule not in PP_SCHEDULES:
        raise ValueError(f"parallel.pp_schedule {schedule!r} is not one of {PP_SCHEDULES}")
    n_stages = pp * stages_per_rank(pp, schedule, virtual_stages)
    stages = split_stages(n_layers, n_stages)
    ranks = stage_ranks(n_stages, pp)
    return StagePlan(n_stages, pp, stages, [s for s in range(n_stages) if ranks[s] == pp_rank])


def build_stage_module(
    args: ModelArgs,
    layer_ids: list[int],
    *,
    first: bool,
    last: bool,
    kernels: Kernels | None = None,
    device: str | torch.device = "meta",
    lora: LoRASpec | None = None,
) -> Transformer:
    """The part of the model owning ``layer_ids`` (+ embedding if first, norm/output if last).

    Built on ``device`` without initialisation (meta by default: the caller parallelizes first and
    materializes local shards afterwards). A tied model's stage without both ends is built from
    untied args: build_parallel_model does that, making the output a synced copy (training/tied.py).
    """
    sharing = [f"model.{f.name}" for f in features.active(args) if f.shares]
    if sharing and not (first and last):
        raise ValueError(
            f"{', '.join(sharing)}: the output projection shares the embedding's tensor, but the two live "
            "on different stages here; build the stages through build_parallel_model, which keeps "
            "the output as a synced copy of the embedding"
        )
    with torch.device(device):
        model = Transformer(args, kernels, lora)
    keep = {str(i) for i in layer_ids}
    for key in [k for k in model.layers.keys() if k not in keep]:
        del model.layers[key]
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm = None
        model.output = None
    return model


def build_schedule(
    parts: list[nn.Module],
    plan: StagePlan,
    *,
    schedule: str,
    pp_mesh: DeviceMesh,
    n_microbatches: int,
    loss_fn: Callable,
    device: torch.device,
):
    """A torch.distributed.pipelining schedule over this rank's stage modules.

    ``loss_fn(logits (b, T, vocab), labels (b, T)) -> scalar`` runs per microbatch on the last
    stage; the schedule divides gradients by ``n_microbatches`` so they equal the whole-batch mean.
    """
    group = pp_mesh.get_group()
    stages = [
        PipelineStage(part, stage_index=s, num_stages=plan.n_stages, device=device, group=group)
        for part, s in zip(parts, plan.local)
    ]
    if schedule == INTERLEAVED:
        return ScheduleInterleaved1F1B(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)


@torch.no_grad()
def forward_logits(
    parts: list[nn.Module],
    plan: StagePlan,
    tokens: torch.Tensor,
    *,
    pp_mesh: DeviceMesh | None,
    args: ModelArgs,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Forward only through the whole pipeline; every rank returns the full logits (B, T, vocab).

    ``tokens`` (B, T) int64 must be the same on every rank. Hidden states (B, T, dim) go from the
    owner of stage s to the owner of stage s+1 point to point; the last stage's logits are then
    broadcast over the pp group. ``dtype`` is the dtype of those activations (the parameters').
    Without pp (one part holding everything) this is ``parts[0](tokens)``.
    Under sequence parallel the hidden states exchanged are (B, T/tp, dim) local shards.
    """
    if pp_mesh is None or pp_mesh.size() == 1:
        h = tokens
        for part in parts:
            h = part(h)
        return h
    group = pp_mesh.get_group()
    me = pp_mesh.get_local_rank()
    owner = stage_ranks(plan.n_stages, pp_mesh.size())
    local = dict(zip(plan.local, parts))
    device = tokens.device
    b, t = tokens.shape
    seq_shards = getattr(next(iter(local.values())), "seq_shards", 1)
    h = None
    for s in range(plan.n_stages):
        if owner[s] == me:
            if s == 0:
                x = tokens
            elif owner[s - 1] == me:
                x = h
            else:
                x = torch.empty(b, t // seq_shards, args.dim, device=device, dtype=dtype)
                dist.recv(x, group=group, group_src=owner[s - 1])
            h = local[s](x)
            if s + 1 < plan.n_stages and owner[s + 1] != me:
                dist.send(h.contiguous(), group=group, group_dst=owner[s + 1])
    last = owner[-1]
    logits = h if me == last else torch.empty(b, t, args.vocab_size, device=device, dtype=dtype)
    logits = logits.contiguous()
    dist.broadcast(logits, group=group, group_src=last)
    return logits
