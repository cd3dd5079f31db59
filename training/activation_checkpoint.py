"""Activation checkpointing: recompute every N-th transformer block in backward instead of storing
its activations. Uses torch's composable ``checkpoint`` so parameter names do not change."""

from __future__ import annotations

from torch import nn
from torch.distributed._composable import checkpoint


def ac_layer_ids(layer_ids: list[int], every: int) -> list[int]:
    """Global layer ids to checkpoint: ids divisible by ``every`` (layer 0, N, 2N, ...).

    Counting by global id, not position in the stage, keeps the same layers checkpointed whatever
    the pipeline split.
    """
    if every < 1:
        raise ValueError(f"memory.activation_checkpointing_layers must be >= 1, got {every}")
    return [i for i in layer_ids if i % every == 0]


def apply_ac(part: nn.Module, every: int = 1) -> list[int]:
    """Checkpoint every ``every``-th block of a stage module in place; returns the layer ids done."""
    chosen = ac_layer_ids([int(k) for k in part.layers.keys()], every)
    for i in chosen:
        checkpoint(part.layers[str(i)])
    return chosen
