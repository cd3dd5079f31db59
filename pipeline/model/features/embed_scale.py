"""Scaled embeddings (Gemma 3): the embedding rows times sqrt(dim), the factor rounded to the rows'
dtype as transformers does. Switch ``model.embed_scale``. No parameter of its own."""

from __future__ import annotations

from titan_pipe.model.features.feature import Feature


def _embed(h, args):
    """(B, T, dim) rows times sqrt(dim) as a tensor of their own dtype and device."""
    return h * h.new_tensor(args.dim**0.5)


def _onnx_embed(g, h: str, args) -> str:
    """The same in the graph: Mul by sqrt(dim) as a constant of the graph's dtype."""
    return g.op("Mul", [h, g.fconst(args.dim**0.5)], "embed.scaled")


FEATURE = Feature(name="embed_scale", label="embeddings x sqrt(dim)", embed=_embed, onnx_embed=_onnx_embed)
