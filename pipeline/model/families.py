"""The Hugging Face architectures of the LLaMA family titan-pipe computes, and how each spells its
variant in config.json. Pure data, no torch.

One decoder with four switches (titan_pipe.model.args) covers four architectures:

  LlamaForCausalLM    (llama)    the plain decoder; head_dim may differ from hidden_size / heads
  MistralForCausalLM  (mistral)  + ``sliding_window`` (null: full attention)
  Qwen2ForCausalLM    (qwen2)    + biases on q/k/v (always); sliding window per layer
                                   (``use_sliding_window``, ``max_window_layers`` or ``layer_types``)
  Qwen3ForCausalLM    (qwen3)    + RMSNorm over each q/k head before RoPE (always); same windows as qwen2

A config.json is read by its ``model_type``; what the model cannot compute (mixture-of-experts
families, a bias on o_proj, a window on some layers only) is refused in one line naming it.
The config written for a model is the simplest of the four that computes it.
"""
from __future__ import annotations

from dataclasses import dataclass

from titan_pipe.model.args import ModelArgs


@dataclass(frozen=True)
class Family:
    """One Hugging Face architecture: its class name, model_type and switches it always has."""

    architecture: str
    model_type: str
    qkv_bias: bool = False  # Qwen2 builds q/k/v with bias=True whatever the config says
    qk_norm: bool = False  # Qwen3 always has q_norm / k_norm
    window_keys: str = "none"  # none | mistral (sliding_window) | qwen (per-layer types)


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("LlamaForCausalLM", "llama"),
    Family("MistralForCausalLM", "mistral", window_keys="mistral"),
    Family("Qwen2ForCausalLM", "qwen2", qkv_bias=True, window_keys="qwen"),
    Family("Qwen3ForCausalLM", "qwen3", qk_norm=True, window_keys="qwen"),
)}
SUPPORTED = ", ".join(f.architecture for f in FAMILIES.values())
# Known relatives the model cannot compute, named so the refusal says what the file is.
UNSUPPORTED = {
    "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
}
FULL, SLIDING = "full_attention", "sliding_attention"


def family_of(args: ModelArgs) -> Family:
    """The architecture a config.json for ``args`` names; ValueError for a combination none has."""
    if args.qk_norm and args.qkv_bias:
        raise ValueError("q/k norms together with q/k/v biases: no Hugging Face architecture has both "
                         f"({SUPPORTED}); drop one of qk_norm / qkv_bias")
    if args.qk_norm:
        return FAMILIES["qwen3"]
    if args.qkv_bias:
        return FAMILIES["qwen2"]
    return FAMILIES["mistral"] if args.sliding_window is not None else FAMILIES["llama"]


def family_keys(args: ModelArgs) -> dict:
    """The architecture keys of ``args``' config.json (architectures, model_type, biases, windows)."""
    fam = family_of(args)
    cfg: dict = {"architectures": [fam.architecture], "model_type": fam.model_type}
    if fam.model_type in ("llama", "qwen3"):
        cfg["attention_bias"] = False
    if fam.model_type == "llama":
        cfg["mlp_bias"] = False
    w = args.sliding_window
    if fam.window_keys == "mistral":
        cfg["sliding_window"] = w
    elif fam.window_keys == "qwen":
        cfg.update(use_sliding_window=w is not None, sliding_window=w,
                   max_window_layers=0 if w is not None else args.n_layers,
                   layer_types=[SLIDING if w is not None else FULL] * args.n_layers)
    return cfg


def architecture_problem(cfg: dict) -> str | None:
    """Why ``cfg`` (a config.json) names an architecture titan-pipe cannot compute, or None."""
    kind = cfg.get("model_type", "llama")
    names = cfg.get("architectures")
    named = names[0] if isinstance(names, list) and names and isinstance(names[0], str) else None
    if not isinstance(kind, str):
        return f"model_type {kind!r} is not a name; titan-pipe computes {SUPPORTED}"
    if kind in FAMILIES:
        return None
    what = UNSUPPORTED.get(kind) or named or f"model_type {kind!r}"
    why = " (mixture of experts)" if kind in UNSUPPORTED else ""
    return f"architecture {what}{why} is not supported; titan-pipe computes {SUPPORTED}"


def read_variant(cfg: dict, n_layers: int, source: str) -> dict:
    """ModelArgs fields {qkv_bias, qk_norm, sliding_window} of a config.json of a supported family;
    ValueError naming the key for what the model cannot compute."""
    fam = FAMILIES[cfg.get("model_type", "llama")]
    if fam.model_type in ("llama", "qwen3") and cfg.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias true puts a bias on o_proj too, which titan-pipe's model "
                         "does not have; convert a model without it (Qwen2's q/k/v biases are supported)")
    if cfg.get("mlp_bias"):
        raise ValueError(f"{source}: mlp_bias true is not supported; convert a model without MLP biases")
    return {"qkv_bias": fam.qkv_bias, "qk_norm": fam.qk_norm,
            "sliding_window": _window(cfg, fam, n_layers, source)}


def _window(cfg: dict, fam: Family, n_layers: int, source: str) -> int | None:
    """The one sliding window every layer uses, or None; a window on some layers only is refused."""
    size = cfg.get("sliding_window")
    if fam.window_keys == "none":
        return None
    if fam.window_keys == "mistral":
        return _positive(size, source)
    types = cfg.get("layer_types")
    if types is None:  # Qwen2Config's rule: layers from max_window_layers on slide, when enabled
        if not cfg.get("use_sliding_window") or size is None:
            return None
        first = cfg.get("max_window_layers", 28)
        types = [SLIDING if i >= first else FULL for i in range(n_layers)]
    if not isinstance(types, list) or set(types) - {FULL, SLIDING} or len(types) != n_layers:
        raise ValueError(f"{source}: layer_types must list {n_layers} entries of {FULL!r} / {SLIDING!r}")
    if set(types) == {FULL, SLIDING}:
        raise ValueError(f"{source}: a sliding window on {types.count(SLIDING)} of {n_layers} layers only "
                         "(max_window_layers / layer_types) is not supported; titan-pipe's model uses one "
                         "attention for every layer")
    return _positive(size, source) if types and types[0] == SLIDING else None


def _positive(size, source: str) -> int | None:
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{source}: sliding_window {size!r} must be a positive number of positions or null")
    return size
