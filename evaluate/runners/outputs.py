"""What every runner returns for a batch of tokens: logits and the per-layer values, on the CPU."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Outputs:
    """logits (B, T, vocab); hidden[i] (B, T, dim) the residual stream after decoder layer i ([] if
    not available); attn[i] / mlp[i] (B, T, dim) layer i's attention / MLP block output before its
    residual Add (None entries, or [], where a candidate has no such value)."""

    logits: torch.Tensor
    hidden: list[torch.Tensor] = field(default_factory=list)
    attn: list[torch.Tensor | None] = field(default_factory=list)
    mlp: list[torch.Tensor | None] = field(default_factory=list)


def _cat(parts: list[list], dim: int = 0) -> list:
    """Per-layer lists of several batches joined along ``dim`` ([] unless every part has them)."""
    if not parts or not all(parts):
        return []
    return [
        None if any(p[i] is None for p in parts) else torch.cat([p[i] for p in parts], dim=dim)
        for i in range(len(parts[0]))
    ]


def concat_outputs(parts: list[Outputs], dim: int = 0) -> Outputs:
    """Batches stacked along the batch dim (B_total, T, ...) (``dim=1``: steps along T)."""
    logits = torch.cat([p.logits for p in parts], dim=dim) if all(p.logits.numel() for p in parts) else torch.empty(0)
    return Outputs(
        logits,
        _cat([p.hidden for p in parts], dim),
        _cat([p.attn for p in parts], dim),
        _cat([p.mlp for p in parts], dim),
    )


class OutputsSink:
    """A LayerSink that keeps everything as one Outputs per sequence (small models, tests)."""

    def __init__(self, n_seqs: int, n_layers: int):
        self.outputs = [
            Outputs(torch.empty(0), [None] * n_layers, [None] * n_layers, [None] * n_layers) for _ in range(n_seqs)
        ]

    def embed(self, seq, h):
        pass

    def layer(self, seq, i, attn, mlp, hidden):
        o = self.outputs[seq]
        o.attn[i], o.mlp[i], o.hidden[i] = attn, mlp, hidden

    def own(self, seq, i, hidden):
        pass

    def logits(self, seq, logits):
        self.outputs[seq].logits = logits
