"""Forward-only stage modules whose decoder layers stay unmaterialised (meta) until they run.

``stream_layers(module, weights=..., device=...)`` hooks every decoder layer of a stage module built
by build_parallel_model: a forward pre-hook allocates the layer's local shards and fills them from
``weights.box`` (this rank's box of each parameter: a checkpoint read through its manifest reads
only this rank's own chunk), a forward hook puts the layer back on meta, closes the shard files
(their mapped pages) and hands the freed memory back to the system. The layer's modules, its
DTensor TP placements and hooks are the ones the resident model runs; only where its parameters'
storage lives changes, so its outputs are bit-identical to the resident model's.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titan_pipe.records.checkpoint_format import Box, split_box
from titan_pipe.processes.host_memory import trim_heap
from titan_pipe.model.sharding import tp_split_dim
from titan_pipe.model.weights import WeightSource


def local_box(name: str, p: torch.Tensor) -> Box:
    """The box of the global tensor (p.shape) this rank holds of parameter ``name``: the declared
    sharding table's TP split (titan_pipe.model.sharding, what the checkpoint writer stores each
    rank's chunk by) over ``p``'s TP mesh; a plain tensor: all of it."""
    if not isinstance(p, DTensor):
        return Box.full(tuple(p.shape))
    mesh = p.device_mesh  # the 1-D TP mesh: streamed runs have no dp wrapper
    return split_box(tuple(p.shape), tp_split_dim(name), mesh.size(), mesh.get_local_rank())


@torch.no_grad()
def fill_local(
    params: Iterable[tuple[str, torch.Tensor]],
    *,
    weights: WeightSource,
    source: Callable[[str], str] = lambda name: name,
) -> None:
    """Fill each allocated (global name, parameter) with its local box read from ``weights``
    (``source(name)``: the stored name, e.g. the embedding for a tied output copy)."""
    for name, p in params:
        local = weights.box(source(name), local_box(name, p))
        target = p.to_local() if isinstance(p, DTensor) else p
        if tuple(local.shape) != tuple(target.shape):
            raise ValueError(
                f"weights for {name}: local shard {tuple(local.shape)} but the model holds {tuple(target.shape)}"
            )
        target.copy_(local.to(target.dtype))


def materialize_layer(layer: nn.Module, *, prefix: str, weights: WeightSource, device: torch.device) -> None:
    """Allocate ``layer``'s local shards on ``device`` and fill them from ``weights``
    (``prefix`` + parameter name is the global name, e.g. ``layers.5``)."""
    layer.to_empty(device=device)
    fill_local(((f"{prefix}.{n}", p) for n, p in layer.named_parameters()), weights=weights)


def release_layer(layer: nn.Module, weights: WeightSource) -> None:
    """Back to meta: the layer's storage is freed, then the reads' memory handed back."""
    layer.to_empty(device="meta")
    hand_back(weights)


def hand_back(weights: WeightSource) -> None:
    """Close the shard files (their mapped pages count in the process while open) and trim
    glibc's free lists (large freed blocks otherwise stay in the process)."""
    close = getattr(weights, "close", None)
    if close is not None:
        close()
    trim_heap()


def stream_layers(module: nn.Module, *, weights: WeightSource, device: torch.device) -> None:
    """Hook every decoder layer of ``module`` (its ``layers`` ModuleDict, global ids as keys, on
    meta) so it is materialised for its forward and released after it."""
    for key, layer in module.layers.items():
        layer.register_forward_pre_hook(
            lambda m, _args, prefix=f"layers.{key}": materialize_layer(m, prefix=prefix, weights=weights, device=device)
        )
        layer.register_forward_hook(lambda m, _args, _out: release_layer(m, weights))
