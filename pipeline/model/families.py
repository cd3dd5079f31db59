"""The Hugging Face architectures of the LLaMA family titan-pipe computes, and how each spells its
variant in config.json. Pure data, no torch.

One decoder with its switches (titan_pipe.model.args) covers six architectures:

  LlamaForCausalLM    (llama)    the plain decoder; head_dim may differ from hidden_size / heads
  MistralForCausalLM  (mistral)  + ``sliding_window`` (null: full attention)
  Qwen2ForCausalLM    (qwen2)    + biases on q/k/v (always); sliding window per layer
                                   (``use_sliding_window``, ``max_window_layers`` or ``layer_types``)
  Qwen3ForCausalLM    (qwen3)    + RMSNorm over each q/k head before RoPE (always); same windows as qwen2
  MixtralForCausalLM  (mixtral)  Mistral with a mixture of experts in every layer (num_local_experts
                                   of width intermediate_size, top num_experts_per_tok renormalized)
  Qwen3MoeForCausalLM (qwen3_moe) Qwen3 with a mixture of experts (num_experts of width
                                   moe_intermediate_size, norm_topk_prob) in the layers decoder_sparse_step
                                   and mlp_only_layers say; the other layers keep intermediate_size
  Gemma3ForCausalLM   (gemma3_text) its own keys and values: its module (titan_pipe.model.gemma3)

A family is a record (titan_pipe.model.family); one whose config says more than the shared keys
defines its record in its own module with ``OwnKeys``, and this list names it in one line.

A config.json is read by its ``model_type`` (titan_pipe.model.hf_config reads the rest), every key
typed strictly (titan_pipe.rules.values); what the model cannot compute (mixture-of-experts families, a
bias on o_proj, a window on some layers only) is refused in one line naming it.
The config written for a model is the simplest of the four that computes it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from titan_pipe.rules import limits
from titan_pipe.errors import UserError
from titan_pipe.model import features, gemma3
from titan_pipe.model.family import Family
from titan_pipe.model.features import qk_norm, qkv_bias
from titan_pipe.rules.limits import Bound, shown
from titan_pipe.rules.values import BOOL, FLOAT, INT, STR, read, refuse

if TYPE_CHECKING:  # annotations only: args.py imports this module (family checks), not the reverse
    from titan_pipe.model.args import ModelArgs


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("LlamaForCausalLM", "llama"),
        Family("MistralForCausalLM", "mistral", window_keys="mistral"),
        Family("Qwen2ForCausalLM", "qwen2", features=(qkv_bias.FEATURE,), window_keys="qwen"),
        Family("Qwen3ForCausalLM", "qwen3", features=(qk_norm.FEATURE,), window_keys="qwen"),
        Family("MixtralForCausalLM", "mixtral", window_keys="mistral", moe=True),
        Family("Qwen3MoeForCausalLM", "qwen3_moe", features=(qk_norm.FEATURE,), window_keys="qwen", moe=True),
        gemma3.FAMILY,
    )
}
SUPPORTED = ", ".join(f.architecture for f in FAMILIES.values())
# Known relatives the model cannot compute, named so the refusal says what the file is.
UNSUPPORTED = {
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
# Relatives that are not mixtures of experts: why each is not computed.
NOT_COMPUTED = {kind: why for f in FAMILIES.values() for kind, why in f.relatives.items()}
FULL, SLIDING = "full_attention", "sliding_attention"


def family_of(args: ModelArgs) -> Family:
    """The architecture a config.json for ``args`` names (its ``family`` where it keeps the one its
    checkpoint named); ValueError for a combination none has."""
    if args.family is not None:
        return _named_family(args)
    owner = _claimed_by(args)
    if owner is not None:
        why = owner.own.problem(args)
        if why is not None:
            raise ValueError(why)
        return owner
    clash = features.clashes(args)
    if clash:
        raise ValueError(f"{clash[0]} ({SUPPORTED})")
    if args.moe:
        return _moe_family(args)
    # the first dense architecture that holds it (llama before mistral: a window is Mistral's)
    return next(f for f in FAMILIES.values() if not f.moe and f.own is None and f.holds(args))


def _claimed_by(args: ModelArgs) -> Family | None:
    """The family a value of ``args`` belongs to alone (Gemma 3's layer pattern); None if none."""
    return next((f for f in FAMILIES.values() if f.claims(args)), None)


def claimed(args: ModelArgs) -> tuple[str, object] | None:
    """(field, value) of the first value of ``args`` only one family has; None if none."""
    owner = _claimed_by(args)
    return None if owner is None else owner.own.first_set(args)


def _named_family(args: ModelArgs) -> Family:
    """The family ``args.family`` names, if it computes ``args``; ValueError naming what it lacks."""
    fam = FAMILIES.get(args.family)
    if fam is None:
        raise ValueError(f"is not one of {', '.join(FAMILIES)} (Hugging Face model_type)")
    plain = replace(args, family=None)
    owner = _claimed_by(args)
    if fam.own is not None or owner is not None:
        if fam is not owner and fam.own is None:
            raise ValueError(
                f"{fam.architecture} cannot hold this model ({owner.architecture}'s values are set: "
                f"{owner.own.first_set(args)[0]}); drop model.family or those values"
            )
        why = fam.own.problem(args)
        if why is not None:
            raise ValueError(why)
        return fam
    if not fam.holds(args):
        raise ValueError(
            f"{fam.architecture} cannot hold this model ({family_of(plain).architecture} does); "
            "drop model.family or the feature it lacks"
        )
    if fam.moe:
        _moe_family(args)  # what the mixture's own config cannot say
    return fam


def _moe_family(args: ModelArgs) -> Family:
    """Qwen3-MoE with q/k norms, Mixtral without; ValueError naming what neither config can say."""
    held = {f for fam in FAMILIES.values() if fam.moe for f in fam.features}
    extra = [f for f in features.active(args) if f.switch and f not in held]
    if extra:
        raise ValueError(
            f"a mixture of experts with {', '.join(f.label for f in extra)}: no supported architecture has both "
            f"(Mixtral, Qwen3-MoE); drop {', '.join(f.name for f in extra)}"
        )
    if FAMILIES["qwen3_moe"].holds(args):
        return FAMILIES["qwen3_moe"]
    if args.dense_layers or args.moe_step != 1 or args.expert_dim != args.hidden_dim or not args.router_norm_topk:
        raise ValueError(
            "a mixture of experts without q/k norms is Mixtral's, which routes in every layer "
            "(no dense_layers, moe_step 1) over experts of the dense width (moe_hidden_dim = the "
            "FFN hidden size) with the top-k renormalized; or set "
            + ", ".join(f"{f.name}: true" for f in FAMILIES["qwen3_moe"].features)
            + " (Qwen3-MoE)"
        )
    return FAMILIES["mixtral"]


def family_keys(args: ModelArgs, *, family: Family | None = None) -> dict:
    """The architecture keys of ``args``' config.json (architectures, model_type, biases, windows);
    ``family``: ``family_of(args)`` where the caller holds it already."""
    fam = family or family_of(args)
    if fam.own is not None:
        return fam.own.write(args)
    cfg: dict = {"architectures": [fam.architecture], "model_type": fam.model_type}
    if fam.model_type in ("llama", "qwen3"):
        cfg["attention_bias"] = False
    if fam.model_type == "llama":
        cfg["mlp_bias"] = False
    if fam.model_type == "mixtral":
        cfg.update(
            num_local_experts=args.n_experts,
            num_experts_per_tok=args.experts_per_token,
            router_aux_loss_coef=args.router_aux_loss_coef,
            router_jitter_noise=0.0,
            output_router_logits=False,
        )
    elif fam.model_type == "qwen3_moe":
        cfg.update(
            attention_bias=False,
            num_experts=args.n_experts,
            num_experts_per_tok=args.experts_per_token,
            moe_intermediate_size=args.expert_dim,
            decoder_sparse_step=args.moe_step,
            mlp_only_layers=list(args.dense_layers),
            norm_topk_prob=args.router_norm_topk,
            router_aux_loss_coef=args.router_aux_loss_coef,
            output_router_logits=False,
        )
    w = args.sliding_window
    if fam.window_keys == "mistral":
        cfg["sliding_window"] = w
    elif fam.window_keys == "qwen":
        cfg.update(
            use_sliding_window=w is not None,
            sliding_window=w,
            max_window_layers=0 if w is not None else args.n_layers,
            layer_types=[SLIDING if w is not None else FULL] * args.n_layers,
        )
    return cfg


def config_family(cfg: dict, source: str) -> Family:
    """The supported family ``cfg``'s model_type names (a string; absent: llama); UserError naming
    the architecture otherwise (a mixture-of-experts relative says so)."""
    kind = read(
        cfg, "model_type", STR, source=source, default="llama", fix=f"write the model_type of one of {SUPPORTED}"
    )
    if kind in FAMILIES:
        return FAMILIES[kind]
    names = cfg.get("architectures")
    named = names[0] if isinstance(names, list) and names and isinstance(names[0], str) else None
    what = UNSUPPORTED.get(kind) or NOT_COMPUTED.get(kind) or (shown(named) if named else f"model_type {shown(kind)}")
    why = " (mixture of experts)" if kind in UNSUPPORTED else ""
    raise UserError(f"{source}: architecture {what}{why} is not supported; titan-pipe computes {SUPPORTED}")


def read_family(cfg: dict, *, n_layers: int, source: str) -> dict:
    """ModelArgs fields (the features' switches, sliding_window) of a config.json, every key typed
    strictly (titan_pipe.rules.values); UserError naming the key for what the model cannot compute."""
    fam = config_family(cfg, source)
    if fam.own is not None:
        return fam.own.read(cfg, n_layers=n_layers, source=source)
    if read(cfg, "attention_bias", BOOL, source=source, default=False) and fam.model_type in ("llama", "qwen3"):
        raise refuse(
            source,
            "attention_bias",
            True,
            "puts a bias on o_proj too, which titan-pipe's model does not have",
            "convert a model without it (Qwen2's q/k/v biases are supported)",
        )
    if read(cfg, "mlp_bias", BOOL, source=source, default=False):
        raise refuse(source, "mlp_bias", True, "is not supported", "convert a model without MLP biases")
    out = {
        **fam.switches(),
        "sliding_window": _window(cfg, fam, n_layers, source),
        "family": fam.model_type,
    }
    if fam.moe:
        out.update(_read_moe(cfg, fam, source))
    return out


def _read_moe(cfg: dict, fam: Family, source: str) -> dict:
    """The mixture-of-experts fields of a Mixtral or Qwen3-MoE config.json (transformers 5 writes
    num_local_experts, the released Qwen3-MoE configs num_experts: either is read, both must agree)."""
    experts = [
        read(cfg, k, INT, source=source, default=None, bound=limits.EXPERTS)
        for k in ("num_local_experts", "num_experts")
    ]
    given = [n for n in experts if n is not None]
    if not given:
        raise refuse(
            source,
            "num_local_experts",
            None,
            "is missing (a mixture of experts needs its expert count)",
            "write num_local_experts (or num_experts) as in the model's original config.json",
        )
    if len(set(given)) > 1:
        raise refuse(
            source, "num_experts", experts[1], f"disagrees with num_local_experts {experts[0]}", "keep one of them"
        )
    out = {
        "n_experts": given[0],
        "experts_per_token": read(
            cfg,
            "num_experts_per_tok",
            INT,
            source=source,
            bound=limits.EXPERTS,
            fix="write the router's top-k as in the model's original config.json",
        ),
        "router_aux_loss_coef": read(
            cfg, "router_aux_loss_coef", FLOAT, source=source, default=0.001, bound=Bound(0.0, 1e3)
        ),
    }
    if fam.model_type == "mixtral":
        jitter = read(cfg, "router_jitter_noise", FLOAT, source=source, default=0.0, bound=Bound(0.0, 1.0))
        if jitter:
            raise refuse(
                source,
                "router_jitter_noise",
                jitter,
                "is not supported (titan-pipe's router is deterministic)",
                "set router_jitter_noise to 0.0",
            )
        return out
    out.update(
        moe_hidden_dim=read(cfg, "moe_intermediate_size", INT, source=source, bound=limits.FFN),
        moe_step=read(cfg, "decoder_sparse_step", INT, source=source, default=1, bound=limits.LAYERS),
        router_norm_topk=read(cfg, "norm_topk_prob", BOOL, source=source, default=False),
    )
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(type(i) is not int for i in dense):
        raise refuse(source, "mlp_only_layers", dense, "is not a list of layer numbers", "write e.g. [] or [0, 1]")
    out["dense_layers"] = tuple(dense)
    return out


def _window(cfg: dict, fam: Family, n_layers: int, source: str) -> int | None:
    """The one sliding window every layer uses, or None; a window on some layers only is refused."""
    if fam.window_keys == "none":
        return None
    size = read(
        cfg,
        "sliding_window",
        INT,
        source=source,
        default=None,
        bound=limits.POSITIONS,
        fix="write a positive number of positions, or null for full attention",
    )
    if fam.window_keys == "mistral":
        return size
    types = cfg.get("layer_types")
    if types is None:  # Qwen2Config's rule: layers from max_window_layers on slide, when enabled
        if not read(cfg, "use_sliding_window", BOOL, source=source, default=False) or size is None:
            return None
        first = read(cfg, "max_window_layers", INT, source=source, default=28, bound=Bound(0, limits.LAYERS.hi))
        types = [SLIDING if i >= first else FULL for i in range(n_layers)]
    if not isinstance(types, list) or set(map(str, types)) - {FULL, SLIDING} or len(types) != n_layers:
        raise refuse(
            source,
            "layer_types",
            types,
            f"must list {n_layers} entries of {FULL!r} / {SLIDING!r}",
            "write one entry per layer",
        )
    if set(types) == {FULL, SLIDING}:
        raise UserError(
            f"{source}: a sliding window on {types.count(SLIDING)} of {n_layers} layers only "
            "(max_window_layers / layer_types) is not supported; titan-pipe's model uses one "
            "attention for every layer"
        )
    if types and types[0] == SLIDING and size is None:
        raise refuse(
            source, "sliding_window", None, "is null but layer_types slide", "give sliding_window a number of positions"
        )
    return size if types and types[0] == SLIDING else None
