"""Sandwich norms (Gemma 3): an RMSNorm on attention's output and on the MLP's output too, before
each residual add (``post_attention_norm``, ``post_ffn_norm``; Hugging Face's post_attention_layernorm
and post_feedforward_layernorm). Switch ``model.sandwich_norms``."""

from __future__ import annotations

from titan_pipe.model.features.feature import Feature
from titan_pipe.model.param_spec import Param

# (the block's sub-layer, the module attribute that norms its output)
_NORMS = {"attention": "post_attention_norm", "mlp": "post_ffn_norm"}


def _param(name: str, hf: str) -> Param:
    """A norm on a sub-layer's (dim wide) output: its input is the row-parallel projection's, whole."""
    return Param(
        f"{name}.weight",
        lambda a: (a.dim,),
        "replicate_output",
        "layer",
        hf,
        f"{name}.weight",
        init="ones",
        matmul=False,
        when=lambda a: a.sandwich_norms,
    )  # held only by the checkpoints of a family that says so (Family.own_params: Gemma 3's)


def _build(block, args, make_norm) -> None:
    for name in _NORMS.values():
        setattr(block, name, make_norm(args.dim))


def _output(block, part: str, y):
    """(B, T, dim): the sub-layer ``part``'s output as its residual add takes it."""
    return getattr(block, _NORMS[part])(y)


def _onnx_output(nodes, g, y: str, *, part: str, weight, eps: float, prefix: str, offset: bool) -> str:
    name = _NORMS[part]
    return nodes.rms_norm(g, y, weight(f"{name}.weight"), eps, f"{prefix}.{name}", offset)


def _activations(args, resid: int, tp: int, seq: int) -> dict[str, float]:
    """Two more norms a layer, kept as the others (float32 input, 1/rms, the normalised output);
    split by tp under sequence parallel (``seq``) like them."""
    return {"sandwich_norms": 2 * ((4 + resid) * args.dim + 4) / seq}


FEATURE = Feature(
    name="sandwich_norms",
    label="norms after attention and MLP too",
    params=(
        _param("post_attention_norm", "post_attention_layernorm.weight"),
        _param("post_ffn_norm", "post_feedforward_layernorm.weight"),
    ),
    build_block=_build,
    sublayer_output=_output,
    onnx_sublayer_output=_onnx_output,
    activation_terms=_activations,
)
