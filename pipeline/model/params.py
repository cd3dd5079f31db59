"""THE parameter list: every per-model and per-layer parameter, its shape from ModelArgs, and what
each stage needs to know about it. Pure data, no torch.

The name tables (titan_pipe.model.names: Hugging Face, Megatron), the sharding table
(titan_pipe.model.sharding), the module's initialisation (titan_pipe.model.transformer), the
planner's memory model, the converters' readers and the exported graphs' initializers all derive
from ``MODEL_PARAMS`` + ``LAYER_PARAMS``; tests check the nn.Module holds exactly this list.

A new optional parameter (a q/k/v bias) is one ``Param`` entry (a feature's own: in its file under
titan_pipe.model.features) with its ``when``
condition on ModelArgs (and the module attribute that holds it); every table follows. A per-layer
entry may also hold in some layers only (``in_layer``: a mixture of experts routes in some layers
and keeps the dense feed-forward in the others). Expert weights are stacked: dim 0 of an
``expert`` parameter indexes the experts (Hugging Face stores one tensor per expert: ``hf`` holds
``{e}``, titan_pipe.model.names spells it per family).
"""

from __future__ import annotations


from titan_pipe.model.args import ModelArgs
from titan_pipe.model.features import FEATURES, experts, shared
from titan_pipe.model.param_spec import INITS, SCOPES, TP_STYLES, Param

__all__ = ["INITS", "SCOPES", "TP_STYLES", "Param"]  # the record lives in param_spec; readers import it here too


def _dense_ffn(args: ModelArgs, i: int) -> bool:
    return not args.is_moe_layer(i)


def _norm(name: str, hf: str, megatron: tuple[str, ...], scope: str, **kw) -> Param:
    return Param(
        name, lambda a: (a.dim,), "replicate", scope, hf, name, init="ones", matmul=False, megatron=megatron, **kw
    )


MODEL_PARAMS: tuple[Param, ...] = (
    Param(
        "tok_embeddings.weight",
        lambda a: (a.vocab_size, a.dim),
        "vocab",
        "first",
        "model.embed_tokens.weight",
        "tok_embeddings.weight",
        matmul=False,
        megatron=("embedding.word_embeddings.weight",),
        vocab_rows=True,
    ),
    _norm("norm.weight", "model.norm.weight", ("decoder.final_layernorm.weight",), "last"),
    # Tied embeddings: the output projection is the embedding matrix, stored once as that.
    Param(
        "output.weight",
        lambda a: (a.vocab_size, a.dim),
        "colwise",
        "last",
        "lm_head.weight",
        "output.weight",
        init="fan_in",
        megatron=("output_layer.weight",),
        vocab_rows=True,
        when=lambda a: "output.weight" not in shared(a),  # a tied head is the embedding (features.shared)
    ),
)

LAYER_PARAMS: tuple[Param, ...] = (
    _norm(
        "attention_norm.weight",
        "input_layernorm.weight",
        ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
        "layer",
    ),
    Param(
        "attention.wq.weight",
        lambda a: (a.q_dim, a.dim),
        "colwise",
        "layer",
        "self_attn.q_proj.weight",
        "wq",
        megatron=("self_attention.linear_qkv.weight",),
        fused=("qkv", "q"),
        rope=True,
    ),
    Param(
        "attention.wk.weight",
        lambda a: (a.kv_dim, a.dim),
        "colwise",
        "layer",
        "self_attn.k_proj.weight",
        "wk",
        megatron=("self_attention.linear_qkv.weight",),
        fused=("qkv", "k"),
        rope=True,
    ),
    Param(
        "attention.wv.weight",
        lambda a: (a.kv_dim, a.dim),
        "colwise",
        "layer",
        "self_attn.v_proj.weight",
        "wv",
        megatron=("self_attention.linear_qkv.weight",),
        fused=("qkv", "v"),
    ),
    Param(
        "attention.wo.weight",
        lambda a: (a.dim, a.q_dim),
        "rowwise",
        "layer",
        "self_attn.o_proj.weight",
        "wo",
        init="depth_scaled",
        megatron=("self_attention.linear_proj.weight",),
    ),
    *(p for feature in FEATURES for p in feature.params),  # each feature's own (titan_pipe.model.features)
    _norm(
        "ffn_norm.weight",
        "post_attention_layernorm.weight",
        ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
        "layer",
    ),
    Param(
        "feed_forward.w1.weight",
        lambda a: (a.hidden_dim, a.dim),
        "colwise",
        "layer",
        "mlp.gate_proj.weight",
        "w1",
        megatron=("mlp.linear_fc1.weight",),
        fused=("fc1", "gate"),
        in_layer=_dense_ffn,
    ),
    Param(
        "feed_forward.w3.weight",
        lambda a: (a.hidden_dim, a.dim),
        "colwise",
        "layer",
        "mlp.up_proj.weight",
        "w3",
        megatron=("mlp.linear_fc1.weight",),
        fused=("fc1", "up"),
        in_layer=_dense_ffn,
    ),
    Param(
        "feed_forward.w2.weight",
        lambda a: (a.dim, a.hidden_dim),
        "rowwise",
        "layer",
        "mlp.down_proj.weight",
        "w2",
        init="depth_scaled",
        megatron=("mlp.linear_fc2.weight",),
        in_layer=_dense_ffn,
    ),
    *experts.PARAMS,  # a routing layer's, in place of the dense feed-forward's (features/experts.py)
)


def adapter_param(module: str, part: str) -> str:
    """The name of a LoRA adapter weight (titan_pipe.model.lora) of base linear ``module``, relative to
    the layer: ``attention.wq`` + ``a`` -> ``attention.lora.wq.a.weight``."""
    owner, linear = module.split(".", 1)
    return f"{owner}.lora.{linear}.{part}.weight"


def _no_shape(_args: ModelArgs) -> tuple[int, ...]:
    raise ValueError("an adapter's shape depends on its rank: titan_pipe.model.lora.adapter_shape")


def _adapter_entries() -> tuple[Param, ...]:
    """LoRA adapter weights (titan_pipe.model.lora), two per adaptable linear (the attention's and the
    dense feed-forward's weights), never part of a base model (``when`` is false). With a column-split
    base (its output rows split) A meets the replicated input and is replicated, B is split by rows
    like its base; with a row-split base (its input columns split) A is split by columns like its base
    (its partial sums all-reduced) and B is replicated. ``hf``: the PEFT name relative to the layer."""
    out = []
    for base in LAYER_PARAMS:
        if not base.module.startswith(("attention.w", "feed_forward.w")) or not base.name.endswith(".weight"):
            continue
        styles = {"colwise": ("replicate_input", "colwise"), "rowwise": ("rowwise", "replicate_output")}[base.tp]
        for part, style in zip(("a", "b"), styles):
            name = adapter_param(base.module, part)
            out.append(
                Param(
                    name,
                    _no_shape,
                    style,
                    "layer",
                    f"{base.hf[: -len('.weight')]}.lora_{part.upper()}.weight",
                    name,
                    init="zeros" if part == "b" else "normal",
                    in_layer=base.in_layer,
                    when=lambda a: False,
                )
            )
    return tuple(out)


ADAPTER_PARAMS: tuple[Param, ...] = _adapter_entries()
LAYER_PREFIX = "layers."
_MODEL = {p.name: p for p in MODEL_PARAMS}
_LAYER = {p.name: p for p in LAYER_PARAMS + ADAPTER_PARAMS}


def layer_name(i: int, p: Param) -> str:
    """The native name of per-layer parameter ``p`` in layer ``i``: ``layers.{i}.<p.name>``."""
    return f"{LAYER_PREFIX}{i}.{p.name}"


def split_layer(name: str) -> tuple[int | None, str]:
    """(layer id, name within the layer) of a native name; (None, name) for a per-model one."""
    if name.startswith(LAYER_PREFIX):
        lid, _, rest = name[len(LAYER_PREFIX) :].partition(".")
        if lid.isdigit():
            return int(lid), rest
    return None, name


def param_of(name: str) -> Param:
    """The entry of a native parameter name (``layers.3.attention.wq.weight``); KeyError if none."""
    lid, rest = split_layer(name)
    p = (_LAYER if lid is not None else _MODEL).get(rest)
    if p is None:
        raise KeyError(f"parameter {name!r} is not in the model's parameter list (titan_pipe.model.params)")
    return p


def params(args: ModelArgs) -> list[tuple[str, Param]]:
    """(native name, entry) of every parameter a model of ``args`` holds, in model order: the
    first-stage ones, the layers, the last-stage ones (the order outputs are written in)."""
    model = [p for p in MODEL_PARAMS if p.when(args)]
    layer = [p for p in LAYER_PARAMS if p.when(args)]
    out = [(p.name, p) for p in model if p.scope == "first"]
    for i in range(args.n_layers):
        out += [(layer_name(i, p), p) for p in layer if p.in_layer(args, i)]
    return out + [(p.name, p) for p in model if p.scope == "last"]


def native_names(args: ModelArgs) -> list[str]:
    """Every native parameter name of a model, in model order (tied: no ``output.weight``)."""
    return [n for n, _ in params(args)]


def initializer_names(args: ModelArgs) -> dict[str, str]:
    """ONNX graph initializer name -> native parameter name, in the order export writes them to the
    data files (export builds the graphs with these names; evaluate checks a graph's shapes by them)."""
    out = {}
    for native, p in params(args):
        lid, _ = split_layer(native)
        out[p.onnx if lid is None else f"layers.{lid}.{p.onnx}"] = native
    return out


def native_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Global shape of every parameter in ``native_names(args)``, from the dims alone."""
    return {n: tuple(p.shape(args)) for n, p in params(args)}


def fused_parts(group: str) -> dict[str, Param]:
    """{part: entry} of the per-layer parameters Megatron fuses into ``group`` ("qkv", the q/k/v biases',
    "fc1"), in the order of their rows in the fused tensor."""
    parts = {p.fused[1]: p for p in LAYER_PARAMS if p.fused and p.fused[0] == group}
    if not parts:
        raise KeyError(f"no parameters fused as {group!r} (titan_pipe.model.params)")
    return parts
