"""q/k norms (Qwen3, Qwen3-MoE, Gemma 3): an RMSNorm over each head's head_dim values of q and of k,
after the projections and before RoPE. Switch ``model.qk_norm``."""

from __future__ import annotations

from titan_pipe.model.features.feature import Conformance, Feature
from titan_pipe.model.param_spec import Param


def _param(part: str) -> Param:
    """The norm of q or k (weight: head_dim), replicated and applied per head to the column-split heads."""
    return Param(
        f"attention.{part}_norm.weight",
        lambda a: (a.head_dim,),
        "replicate_heads",
        "layer",
        f"self_attn.{part}_norm.weight",
        f"attention.{part}_norm.weight",
        init="ones",
        matmul=False,
        megatron=(f"self_attention.{part}_layernorm.weight",),
        when=lambda a: a.qk_norm,
    )


def _build(attn, args, make_norm) -> None:
    attn.q_norm = make_norm(args.head_dim)
    attn.k_norm = make_norm(args.head_dim)


def _heads(attn, part: str, y):
    """(B, T, heads, hd): the norm sees the heads last but one, the dim tensor parallelism splits."""
    return getattr(attn, f"{part}_norm")(y) if part in ("q", "k") else y


def _onnx_heads(nodes, g, y: str, *, part: str, weight, eps: float, prefix: str, offset: bool) -> str:
    if part not in ("q", "k"):
        return y
    return nodes.rms_norm(g, y, weight(f"attention.{part}_norm.weight"), eps, f"{prefix}.attn.{part}_norm", offset)


def _activations(args, resid: int, tp: int, seq: int) -> dict[str, float]:
    """Per-head RMSNorm of q and k: float32 input, 1/rms per head, the normalised output."""
    heads = args.n_heads + args.kv_heads
    return {"qk_norm": ((4 + resid) * heads * args.head_dim + 4 * heads) / tp}


def _inputs(case: str, rng, scale: float) -> dict:
    """(B, T, heads, head_dim), as the model normalises q and k before RoPE."""
    t = 256 if case == "long" else 16
    return {
        "x": (rng.standard_normal((2, t, 4, 128)) * scale).astype("float32"),
        "weight": (1.0 + 0.1 * rng.standard_normal(128)).astype("float32"),
    }


FEATURE = Feature(
    name="qk_norm",
    label="q/k norms",
    params=(_param("q"), _param("k")),
    megatron_arg="qk_layernorm",
    rotate_half_in_torchtitan=True,  # torchtitan's qwen3
    build_attention=_build,
    attention_heads=_heads,
    onnx_heads=_onnx_heads,
    activation_terms=_activations,
    conformance=(
        Conformance(
            "qk_norm",
            "per-head RMSNorm over head_dim of (B, T, heads, hd) (the q/k norms)",
            _inputs,
            lambda kernels, eps, x, weight: kernels.rms_norm_ref(x, weight, eps),
            lambda nodes, b, n, eps: nodes.rms_norm(b, n["x"], n["weight"], eps, "norm"),
            norm=True,
        ),
    ),
)
