"""Name tables: native (torchtitan-style) <-> Hugging Face LLaMA (ModelArgs <-> LlamaConfig: hf_config).

Native q/k rows are already in Hugging Face's rotate-half layout, so native <-> HF is renaming
only. (torchtitan/Meta checkpoints use interleaved RoPE pairs: their reader permutes q/k rows.)
"""
from __future__ import annotations

import re

from titan_pipe.model.args import ModelArgs
from titan_pipe.model.hf_config import from_hf_config, to_hf_config  # noqa: F401 (their callers import them here too)

# (native pattern, Hugging Face pattern); {i} is the layer id.
NATIVE_TO_HF: tuple[tuple[str, str], ...] = (
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.attention.wq.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.attention.wk.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("layers.{i}.attention.wv.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("layers.{i}.attention.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
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


# ---------------------------------------------------------------------------------------------
# Canonical order and the tables of the other source formats

_LAYER_PARAMS = ("attention_norm", "attention.wq", "attention.wk", "attention.wv", "attention.wo",
                 "ffn_norm", "feed_forward.w1", "feed_forward.w3", "feed_forward.w2")


def native_names(args: ModelArgs) -> list[str]:
    """Every native parameter name of a model, in model order (the order outputs are written in).

    With tied embeddings ``output.weight`` is the embedding matrix and is not listed.
    """
    names = ["tok_embeddings.weight"]
    for i in range(args.n_layers):
        names += [f"layers.{i}.{p}.weight" for p in _LAYER_PARAMS]
    names.append("norm.weight")
    if not args.tie_embeddings:
        names.append("output.weight")
    return names


# torchtitan / Meta (DCP) names are the native names; only the q/k row order differs (interleaved
# RoPE pairs), which the DCP reader undoes. Full training checkpoints nest the model under "model.".
TORCHTITAN_MODEL_PREFIX = "model."

# Megatron-LM (megatron-core GPTModel) names, with {i} the layer index LOCAL to a pipeline stage.
# Values: the native name, or a fused tensor the Megatron reader splits (qkv, fc1).
MEGATRON_TO_NATIVE: tuple[tuple[str, str], ...] = (
    ("embedding.word_embeddings.weight", "tok_embeddings.weight"),
    ("decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight", "layers.{i}.attention_norm.weight"),
    ("decoder.layers.{i}.input_layernorm.weight", "layers.{i}.attention_norm.weight"),
    ("decoder.layers.{i}.self_attention.linear_qkv.weight", "<qkv>"),
    ("decoder.layers.{i}.self_attention.linear_proj.weight", "layers.{i}.attention.wo.weight"),
    ("decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight", "layers.{i}.ffn_norm.weight"),
    ("decoder.layers.{i}.pre_mlp_layernorm.weight", "layers.{i}.ffn_norm.weight"),
    ("decoder.layers.{i}.mlp.linear_fc1.weight", "<fc1>"),
    ("decoder.layers.{i}.mlp.linear_fc2.weight", "layers.{i}.feed_forward.w2.weight"),
    ("decoder.final_layernorm.weight", "norm.weight"),
    ("output_layer.weight", "output.weight"),
)
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


def native_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Global shape of every parameter in ``native_names(args)``, from the dims alone."""
    d, hd, h = args.dim, args.head_dim, args.hidden_dim
    per_layer = {"attention_norm": (d,), "attention.wq": (args.n_heads * hd, d),
                 "attention.wk": (args.kv_heads * hd, d), "attention.wv": (args.kv_heads * hd, d),
                 "attention.wo": (d, args.n_heads * hd), "ffn_norm": (d,),
                 "feed_forward.w1": (h, d), "feed_forward.w3": (h, d), "feed_forward.w2": (d, h)}
    out = {"tok_embeddings.weight": (args.vocab_size, d)}
    for i in range(args.n_layers):
        out.update({f"layers.{i}.{p}.weight": s for p, s in per_layer.items()})
    out["norm.weight"] = (d,)
    if not args.tie_embeddings:
        out["output.weight"] = (args.vocab_size, d)
    return out
