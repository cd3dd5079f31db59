"""Whole tensors (or one box of them) read through a SourcePlan: what a reader of weights gets from
any format, where convert streams the same reads into files instead (titan_pipe.convert.reshard)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan_pipe.records.checkpoint_format import Box
from titan_pipe.weights.readers.store import Store
from titan_pipe.weights.source_plan import TensorPlan

if TYPE_CHECKING:
    import torch


def deinterleave_rope(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of whole heads, Meta interleaved pairs -> rotate-half: row 2i+h of a head -> h*hd/2 + i.

    x: (n * head_dim, ...) -> same shape. This is the permutation Hugging Face's LLaMA conversion
    applies to q/k (``view(heads, hd/2, 2, ...).transpose(1, 2)``).
    """
    rows = x.shape[0]
    rest = x.shape[1:]
    return x.reshape(rows // head_dim, head_dim // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def read_global(t: TensorPlan, store: Store, box: Box | None = None) -> torch.Tensor:
    """``box`` (default: all) of global tensor ``t`` in its stored dtype, from the reads that overlap
    it (each stored piece read once, RoPE rows reordered where the source interleaves them)."""
    import torch

    from titan_pipe.rules.dtypes import TORCH_DTYPES

    box = box or Box.full(t.shape)
    out = torch.empty(box.lengths, dtype=TORCH_DTYPES[t.dtype])
    for r in t.reads:
        c = r.clip(box)
        if c is None:
            continue
        piece = store.read_box(c.file, c.key, c.src_box)
        if c.rope_head_dim:
            piece = deinterleave_rope(piece, c.rope_head_dim)
        index = tuple(slice(o - b, o - b + n) for o, n, b in zip(c.dst_box.offsets, c.dst_box.lengths, box.offsets))
        out[index].copy_(piece.reshape(c.dst_box.lengths))
    return out
