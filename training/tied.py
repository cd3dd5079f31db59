"""Tied embeddings (Qwen2.5-0.5B, Qwen3-0.6B) under tensor or pipeline parallelism.

One matrix cannot be both the vocab-parallel embedding of the first stage and the column-parallel
output projection of the last: the parallel model holds the output projection as a *copy* of the
embedding (initialised and loaded from it), and after every backward the two gradients are summed
into both -- locally when one rank holds both, else over the group of the (dp, tp) coordinate's
first- and last-stage ranks (Megatron's embedding group). Equal values, equal gradients and equal
optimizer states keep the copies equal; so the checkpoint stores the embedding alone (the
parameter list of a tied model has no output.weight), the gradient norm counts it once, and the
optimizer state of the copy is saved and loaded as the embedding's.

With tp 1 and pp 1 the module's own tie (one Parameter) is kept and none of this runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from titan_pipe.model import features
from titan_pipe.model.args import ModelArgs

EMBEDDING, OUTPUT = "tok_embeddings.weight", "output.weight"  # the parameters the tied head makes one (features.shared)


def needs_copy(args: ModelArgs, mesh: DeviceMesh) -> bool:
    """Whether the output projection is a synchronised copy of the embedding in this layout."""
    return OUTPUT in features.shared(args) and (mesh["tp"].size() > 1 or mesh["pp"].size() > 1)


def source_name(name: str, args: ModelArgs) -> str:
    """The parameter whose value ``name`` starts from: a tied output copy starts as the embedding."""
    return features.read_from(args, name)


class TiedGrads:
    """Sums the embedding's and the output copy's gradients after a backward (collective over pp)."""

    def __init__(self, mesh: DeviceMesh, last_pp_rank: int):
        self.group = None
        grid = mesh.mesh  # (dp, pp, tp) global ranks
        if grid.shape[1] > 1:
            me = dist.get_rank()
            for d in range(grid.shape[0]):  # every rank creates every group, in the same order
                for t in range(grid.shape[2]):
                    ranks = sorted({int(grid[d, 0, t]), int(grid[d, last_pp_rank, t])})
                    group = dist.new_group(ranks)
                    if me in ranks:
                        self.group = group

    def sync(self, named_params) -> None:
        """``named_params``: (name, parameter) of this rank's parts; the embedding and the copy
        end with the sum of both gradients, in each parameter's own placement."""
        ends = {n: p for n, p in named_params if n in (EMBEDDING, OUTPUT)}
        if not ends:
            return
        local = [_local_grad(p) for p in ends.values()]
        total = local[0] if len(local) == 1 else local[0] + local[1]
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        for p in ends.values():
            _set_local_grad(p, total)


def _local_grad(p: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``p``'s gradient in ``p``'s placement (a Replicate/Partial gradient of a
    sharded parameter is redistributed first); zeros when there is none."""
    g = p.grad
    if g is None:
        return torch.zeros_like(p.to_local() if isinstance(p, DTensor) else p)
    if isinstance(g, DTensor):
        if g.placements != p.placements:
            g = g.redistribute(p.device_mesh, p.placements)
        return g.to_local().clone()
    return g.clone()


def _set_local_grad(p: torch.Tensor, local: torch.Tensor) -> None:
    if isinstance(p, DTensor):
        p.grad = DTensor.from_local(
            local.clone(), p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    else:
        p.grad = local.clone()


def counted(named_params, copy: bool) -> list:
    """The parameters the gradient norm counts: all but the output copy (it is the embedding)."""
    return [p for n, p in named_params if not (copy and n == OUTPUT)]


def alias_optimizer_keys(flat: dict, *, drop_copy: bool) -> dict:
    """A flattened optimizer state (``state.<fqn>.<key>``, ``param_groups.<fqn>.<key>``) with the
    output copy's entries renamed to the embedding's; ``drop_copy``: where the embedding's own
    entries are there too (one rank holds both), the copy's are dropped instead."""
    out = {}
    for k, v in flat.items():
        kind, _, rest = k.partition(".")
        if rest.startswith(OUTPUT + "."):
            if drop_copy:
                continue
            k = f"{kind}.{EMBEDDING}{rest[len(OUTPUT) :]}"
        out[k] = v
    return out


def restore_copy_keys(flat: dict, copy_names: set[str]) -> dict:
    """The inverse for loading: the embedding's entries also as the output copy's, where this rank
    holds the copy (``copy_names`` its parameter names)."""
    if OUTPUT not in copy_names:
        return flat
    out = dict(flat)
    for k, v in flat.items():
        kind, _, rest = k.partition(".")
        if rest.startswith(EMBEDDING + "."):  # a copy of each state tensor: two params never share one
            out[f"{kind}.{OUTPUT}{rest[len(EMBEDDING) :]}"] = v.clone() if isinstance(v, torch.Tensor) else v
    return out
