"""Name tables: native (torchtitan-style) <-> Hugging Face LLaMA <-> Megatron, and ModelArgs <-> LlamaConfig.

The tables are derived from the parameter list (titan_pipe.model.params), never spelled here.

Native q/k rows are already in Hugging Face's rotate-half layout, so native <-> HF is renaming
only. (torchtitan/Meta checkpoints use interleaved RoPE pairs: their reader permutes q/k rows.)
"""
from __future__ import annotations

import re

from titan_pipe.model.args import ModelArgs, RopeScaling
from titan_pipe.model.params import LAYER_PARAMS, LAYER_PREFIX, MODEL_PARAMS

# (native pattern, Hugging Face pattern); {i} is the layer id. Derived from the parameter list.
NATIVE_TO_HF: tuple[tuple[str, str], ...] = (
    *((p.name, p.hf) for p in MODEL_PARAMS if p.scope == "first"),
    *((f"{LAYER_PREFIX}{{i}}.{p.name}", f"model.layers.{{i}}.{p.hf}") for p in LAYER_PARAMS),
    *((p.name, p.hf) for p in MODEL_PARAMS if p.scope == "last"),
)


def _compile(pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(pattern).replace(r"\{i\}", r"(?P<i>\d+)") + "$")


_N2H = [(_compile(n), h) for n, h in NATIVE_TO_HF]
_H2N = [(_compile(h), n) for n, h in NATIVE_TO_HF]


def _translate(name: str, table) -> str:
    for rx, target in table:
        m = rx.match(name)
        if m:
            return target.format(**m.groupdict())
    raise KeyError(name)


def native_to_hf(name: str) -> str:
    try:
        return _translate(name, _N2H)
    except KeyError:
        raise KeyError(f"no Hugging Face name for native parameter {name!r} (titan_pipe.model.names)") from None


def hf_to_native(name: str) -> str:
    try:
        return _translate(name, _H2N)
    except KeyError:
        raise KeyError(f"no native name for Hugging Face parameter {name!r} (titan_pipe.model.names)") from None


def to_hf_config(args: ModelArgs, *, torch_dtype: str = "float32") -> dict:
    """A LlamaConfig dict (config.json) for ``args``."""
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": torch_dtype,
        "rope_scaling": None,
    }
    if args.rope_scaling is not None:
        s = args.rope_scaling
        cfg["rope_scaling"] = {
            "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    return cfg


def from_hf_config(cfg: dict, *, source: str = "config.json") -> ModelArgs:
    """ModelArgs from a LlamaConfig dict; raises ValueError naming the field on anything unusable."""
    try:
        if cfg.get("model_type", "llama") not in ("llama", "mistral"):
            raise ValueError(f"{source}: model_type {cfg.get('model_type')!r} is not a LLaMA model")
        n_heads = int(cfg["num_attention_heads"])
        dim = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or dim // n_heads
        if head_dim * n_heads != dim:
            raise ValueError(f"{source}: head_dim {head_dim} x {n_heads} heads != hidden_size {dim}, "
                             "which titan-pipe's model does not support")
        scaling = cfg.get("rope_scaling")
        rope_scaling = None
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind != "llama3":
                raise ValueError(f"{source}: rope_scaling type {kind!r} is not supported (only llama3)")
            rope_scaling = RopeScaling(float(scaling["factor"]), float(scaling["low_freq_factor"]),
                                       float(scaling["high_freq_factor"]),
                                       int(scaling["original_max_position_embeddings"]))
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise ValueError(f"{source}: attention_bias/mlp_bias are not supported")
        return ModelArgs(
            dim=dim, n_layers=int(cfg["num_hidden_layers"]), n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            vocab_size=int(cfg["vocab_size"]), ffn_hidden_dim=int(cfg["intermediate_size"]),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-5)), rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rope_scaling=rope_scaling, max_seq_len=int(cfg.get("max_position_embeddings", 4096)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)))
    except KeyError as e:
        raise ValueError(f"{source}: missing field {e.args[0]!r}") from None


# ---------------------------------------------------------------------------------------------
# The tables of the other source formats (the native names and shapes: titan_pipe.model.params)

# torchtitan / Meta (DCP) names are the native names; only the q/k row order differs (interleaved
# RoPE pairs), which the DCP reader undoes. Full training checkpoints nest the model under "model.".
TORCHTITAN_MODEL_PREFIX = "model."

# Megatron-LM (megatron-core GPTModel) names, with {i} the layer index LOCAL to a pipeline stage.
# Values: the native name, or a fused tensor the Megatron reader splits (qkv, fc1).
MEGATRON_TO_NATIVE: tuple[tuple[str, str], ...] = tuple(dict.fromkeys((
    *((m, p.name) for p in MODEL_PARAMS if p.scope == "first" for m in p.megatron),
    *((f"decoder.layers.{{i}}.{m}", f"<{p.fused[0]}>" if p.fused else f"{LAYER_PREFIX}{{i}}.{p.name}")
      for p in LAYER_PARAMS for m in p.megatron),
    *((m, p.name) for p in MODEL_PARAMS if p.scope == "last" for m in p.megatron),
)))
_M2N = [(_compile(m), n) for m, n in MEGATRON_TO_NATIVE]


def megatron_to_native(name: str, layer_offset: int) -> str | None:
    """Native name (or '<qkv>'/'<fc1>' with the global layer id: '<qkv>:5') of a Megatron key.

    None for keys that hold no weights (``_extra_state`` of Transformer Engine modules); KeyError
    for anything else unknown (a bias, an MoE expert...), which the reader reports.
    """
    if name.endswith("._extra_state"):
        return None
    for rx, target in _M2N:
        m = rx.match(name)
        if m:
            i = m.groupdict().get("i")
            gid = None if i is None else int(i) + layer_offset
            if target.startswith("<"):
                return f"{target}:{gid}"
            return target.format(i=gid) if gid is not None else target
    raise KeyError(f"no native name for Megatron parameter {name!r} (titan_pipe.model.names)")
