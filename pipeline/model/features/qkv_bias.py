"""q/k/v biases (Qwen2, Qwen2.5): a bias on each of the q, k and v projections (none on o).
Switch ``model.qkv_bias``. Megatron-LM fuses the three like the weights, per query group
(``add_qkv_bias``); torchtitan and Hugging Face store them beside their weights."""

from __future__ import annotations

from math import sqrt

from titan_pipe.model.features.feature import Conformance, Feature
from titan_pipe.model.param_spec import Param

_WIDTH = {"q": lambda a: a.q_dim, "k": lambda a: a.kv_dim, "v": lambda a: a.kv_dim}
_HF = {"q": "q_proj", "k": "k_proj", "v": "v_proj"}


def _param(part: str) -> Param:
    """The bias of projection w``part``: split with its weight's rows (their output dim); rotated rows for q, k."""
    width = _WIDTH[part]
    return Param(
        f"attention.w{part}.bias",
        lambda a: (width(a),),
        "colwise",
        "layer",
        f"self_attn.{_HF[part]}.bias",
        f"w{part}.bias",
        init="zeros",
        matmul=False,
        megatron=("self_attention.linear_qkv.bias",),
        fused=("qkv_bias", part),
        rope=part != "v",
        when=lambda a: a.qkv_bias,
    )


def _inputs(case: str, rng, scale: float) -> dict:
    rows, k = (4, 8192) if case == "long" else (16, 64)
    n_out = 256 if case == "long" else 96
    return {
        "x": (rng.standard_normal((rows, k)) * scale).astype("float32"),
        "w": (rng.standard_normal((n_out, k)) / sqrt(k)).astype("float32"),
        "bias": (rng.standard_normal(n_out) * 0.5).astype("float32"),
    }


FEATURE = Feature(
    name="qkv_bias",
    label="q/k/v biases",
    params=(_param("q"), _param("k"), _param("v")),
    megatron_arg="add_qkv_bias",
    biased_projections=("q", "k", "v"),
    adds_flops=True,  # one add per bias element
    conformance=(
        Conformance(
            "linear_bias",
            "linear with bias x @ W^T + b (Gemm's C input: the q/k/v projections)",
            _inputs,
            lambda kernels, eps, x, w, bias: kernels.linear_ref(x, w, bias),
            lambda nodes, b, n, eps: nodes.linear(b, n["x"], n["w"], bias=n["bias"]),
        ),
    ),
)
