"""Expert parallelism: a mixture of experts' experts split over the ``ep`` ranks of the mesh.

``parallel.ep`` divides ``parallel.dp`` (as torchtitan's does): the dp ranks are laid out as
``dp_mod_ep x ep`` (ParallelDims), every rank routes its own tokens, and the experts of each
routing layer are split over the ``ep`` ranks on dim 0 of their stacks (DTensor ``Shard(0)``):
rank e holds experts [e E/ep, (e+1) E/ep). A forward sends each token to the rank holding each of
its k experts and back (two all-to-alls, their split sizes exchanged first), so an expert computes
on every token of the ep group routed to it; FSDP shards the local experts over ``dp_mod_ep`` and
everything else over the whole ``dp``.

The gradient of an expert's weights arrives summed over the ep group's tokens; FSDP then averages
over dp_mod_ep, not over dp, so the expert weights' gradient is scaled by 1/ep on its way back
(``_GradScale``): what reaches the optimizer is the gradient of the mean loss over all dp ranks,
as for every other parameter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.nn.functional import all_to_all_single
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

EXPERT_WEIGHTS = ("w1", "w3", "w2")


class _GradScale(torch.autograd.Function):
    """Identity forward; the gradient times ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def shard_experts(part: nn.Module, ep_mesh: DeviceMesh) -> int:
    """Split every routing layer's stacked experts of stage module ``part`` over ``ep_mesh``
    (parameters become DTensors ``Shard(0)``, on meta until materialised) and install the token
    dispatch; returns how many layers were split. Before FSDP, which then shards the local experts
    over dp_mod_ep."""
    n = 0
    for layer in part.layers.values():
        moe = getattr(layer, "moe", None)
        if moe is None:
            continue
        experts = moe.experts
        for name in EXPERT_WEIGHTS:
            p = getattr(experts, name)
            setattr(experts, name, nn.Parameter(distribute_tensor(p.data, ep_mesh, [Shard(0)], src_data_rank=None)))
        experts.dispatch = dispatch(ep_mesh)
        n += 1
    return n


def dispatch(ep_mesh: DeviceMesh):
    """The experts' forward across the ep ranks: ``run(x, counts, w1, w3, w2, compute)`` with ``x``
    this rank's (token, slot) rows sorted by expert, ``counts`` (E,) rows per expert, the stacked
    weights (DTensors over ep) and ``compute`` the local experts' kernel (kernels.experts);
    returns the rows' outputs in ``x``'s order."""
    group, ep = ep_mesh.get_group(), ep_mesh.size()

    def run(x: torch.Tensor, counts: torch.Tensor, w1, w3, w2, compute) -> torch.Tensor:
        experts = counts.numel()
        local = experts // ep
        # how many rows each rank sends to each of my local experts
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=group)
        send = counts.view(ep, local).sum(1).tolist()
        from_rank = got.view(ep, local)  # [source rank, my local expert]
        recv = from_rank.sum(1).tolist()
        rows = all_to_all_single(
            x.new_empty(sum(recv), x.shape[1]), x, output_split_sizes=recv, input_split_sizes=send, group=group
        )
        # received: source-major, each source's rows by local expert; the kernel wants expert-major
        ids = torch.repeat_interleave(torch.arange(from_rank.numel(), device=x.device), from_rank.reshape(-1))
        order = (ids % local * ep + ids // local).argsort(stable=True)
        weights = [_GradScale.apply(w.to_local() if isinstance(w, DTensor) else w, 1.0 / ep) for w in (w1, w3, w2)]
        y = compute(rows[order], from_rank.sum(0), *weights)
        back = torch.empty_like(y).index_copy(0, order, y)
        return all_to_all_single(
            x.new_empty(x.shape[0], y.shape[1]), back, output_split_sizes=send, input_split_sizes=recv, group=group
        )

    return run
