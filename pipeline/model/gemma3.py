"""Gemma 3 (text: ``Gemma3ForCausalLM``, model_type ``gemma3_text``): what its config.json says and
how the decoder's switches (titan_pipe.model.args) compute it. Pure data, no torch.

Gemma 3 is the LLaMA decoder with
  - RMSNorm weights stored as offsets from 1 (``norm_offset``: the norm multiplies by 1 + w, in float32),
  - a norm on each sub-layer's output too (``sandwich_norms``: post_attention_layernorm and
    post_feedforward_layernorm; pre_feedforward_layernorm is the norm before the MLP),
  - per-head q/k RMSNorm (``qk_norm``), GeGLU with the tanh GELU (``activation: gelu_tanh``),
  - embeddings times sqrt(hidden_size) (``embed_scale``), always tied to the output,
  - five sliding-window layers to one global (``global_every: 6``: layer_types / sliding_window_pattern),
    the sliding layers rotating with rope_local_base_freq (10,000), the global ones with rope_theta
    (1,000,000) and the config's linear scaling (``rope_local_theta``, ``rope_scaling``),
  - scores scaled by query_pre_attn_scalar^-1/2 (``attn_scalar``), head_dim 256.

Both layouts transformers writes are read: 4.x (rope_theta, rope_local_base_freq, rope_scaling,
sliding_window_pattern) and 5.x (rope_parameters per layer type, layer_types). What Gemma 3 configs
can say and the model does not compute (logit soft-capping, bidirectional attention, an o_proj bias,
scaling on the sliding layers) is refused in one line naming the key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan_pipe.rules import limits
from titan_pipe.errors import UserError
from titan_pipe.rules.limits import Bound
from titan_pipe.model import features
from titan_pipe.model.family import Family, OwnKeys
from titan_pipe.model.features import embed_scale, gates, norm_offset, qk_norm, sandwich_norms
from titan_pipe.model.rope_scaling import RopeScaling, read_rope_scaling
from titan_pipe.rules.values import BOOL, DICT, FLOAT, INT, STR, read, refuse

if TYPE_CHECKING:
    from titan_pipe.model.args import ModelArgs

MODEL_TYPE = "gemma3_text"
ARCHITECTURE = "Gemma3ForCausalLM"
FULL, SLIDING = "full_attention", "sliding_attention"
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
# Gemma3TextConfig's defaults, used where a config.json leaves a key out.
DEFAULTS = {
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "tie_word_embeddings": True,
}


# The switches Gemma 3 always has, together
FEATURES = (
    qk_norm.FEATURE,
    embed_scale.FEATURE,
    sandwich_norms.FEATURE,
    norm_offset.FEATURE,
)  # the features (titan_pipe.model.features) it always has
# of those, the ones only Gemma 3 among the families has (in the order a half-Gemma model is told them)
OWN = (norm_offset.FEATURE, sandwich_norms.FEATURE, embed_scale.FEATURE)
REQUIRED = {
    "activation": gates.GELU_TANH.name,
    **{f.name: True for f in FEATURES},
}


# Gemma 3's switches off (ModelArgs' defaults): a model setting any other value is a Gemma 3
OFF = {
    **{f.name: False for f in OWN},
    "activation": gates.DEFAULT.name,
    "global_every": 0,
    "rope_local_theta": None,
    "attn_scalar": None,
}


def first_set(args: ModelArgs) -> tuple[str, object] | None:
    """(field, value) of the first switch only Gemma 3 among the supported families has; None if none."""
    return next(((k, getattr(args, k)) for k, off in OFF.items() if getattr(args, k) != off), None)


def problem(args: ModelArgs) -> str | None:
    """Why Gemma3ForCausalLM cannot hold ``args``; None when it can."""
    missing = [f"{k}: {getattr(args, k)}" for k, v in REQUIRED.items() if getattr(args, k) != v]
    if missing:
        return (
            f"Gemma 3 computes {', '.join(f'{k}: {v}' for k, v in REQUIRED.items())}, together; this model "
            f"has {', '.join(missing)} instead (set them all, or none)"
        )
    extra = [f for f in features.active(args) if f.switch and f not in FEATURES]
    if extra:
        return f"Gemma 3 has no {', '.join(f.label for f in extra)}; drop {', '.join(f.name for f in extra)}"
    if args.moe:
        return "Gemma 3 has no mixture of experts; drop n_experts"
    if args.rope_scaling is not None and args.rope_scaling.rope_type != "linear":
        return "Gemma 3 scales its global layers' RoPE linearly; set rope_scaling.rope_type: linear (or no scaling)"
    return None


def write_config(args: ModelArgs) -> dict:
    """The Gemma 3 keys of a config.json for ``args`` (transformers 4.x layout, which 5.x reads)."""
    every = args.global_every
    types = [FULL if args.layer_window(i) is None else SLIDING for i in range(args.n_layers)]
    s = args.rope_scaling
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "attention_bias": False,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _number(args.attn_scalar or args.head_dim),
        "sliding_window": args.sliding_window,
        "layer_types": types,
        "sliding_window_pattern": every if every else (1 if args.sliding_window is None else args.n_layers + 1),
        "rope_local_base_freq": args.rope_local_theta if args.rope_local_theta is not None else args.rope_theta,
        "rope_scaling": None if s is None else {"rope_type": "linear", "factor": s.factor},
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "use_bidirectional_attention": False,
    }


def _number(x: float) -> int | float:
    """A whole number as an int (transformers types query_pre_attn_scalar as int)."""
    return int(x) if float(x).is_integer() else x


def read_config(cfg: dict, *, n_layers: int, source: str) -> dict:
    """The ModelArgs fields of a Gemma 3 config.json (either layout), every key typed strictly;
    UserError naming the key for what the model cannot compute."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        cap = read(cfg, key, FLOAT, source=source, default=None)
        if cap is not None:
            raise refuse(
                source,
                key,
                cap,
                "is not supported (Gemma 3 writes null; soft-capping is Gemma 2's)",
                f"set {key}: null",
            )
    for key in ("attention_bias", "use_bidirectional_attention"):
        if read(cfg, key, BOOL, source=source, default=False):
            raise refuse(
                source,
                key,
                True,
                "is not supported (titan-pipe's decoder is causal, without an o_proj bias)",
                f"set {key}: false",
            )
    act = read(cfg, "hidden_activation", STR, source=source, default="gelu_pytorch_tanh")
    if act not in GELU_TANH:
        raise refuse(
            source,
            "hidden_activation",
            act,
            "is not supported (Gemma 3's GeGLU uses gelu_pytorch_tanh)",
            "set hidden_activation: gelu_pytorch_tanh",
        )
    window = read(cfg, "sliding_window", INT, source=source, default=DEFAULTS["sliding_window"], bound=limits.POSITIONS)
    every = _global_every(cfg, n_layers, window, source)
    every = 0 if every > n_layers else every  # a pattern longer than the model: no layer is global
    theta, local, scaling = _rope(cfg, source)
    if every == 0:  # every layer slides: each rotates with the local base, unscaled (one RoPE for all)
        theta, scaling = local, None
    tie = read(cfg, "tie_word_embeddings", BOOL, source=source, default=DEFAULTS["tie_word_embeddings"])
    return {
        **FAMILY.switches(),  # the record's, defined below
        **REQUIRED,
        "family": MODEL_TYPE,
        "tie_embeddings": tie,
        "sliding_window": window if every != 1 else None,
        "global_every": every if every != 1 else 0,
        "rope_theta": theta,
        "rope_local_theta": local if every > 1 else None,
        "rope_scaling": scaling,
        "attn_scalar": float(
            read(
                cfg,
                "query_pre_attn_scalar",
                FLOAT,
                source=source,
                default=float(DEFAULTS["query_pre_attn_scalar"]),
                bound=Bound(1.0, 1e6),
            )
        ),
    }


def _global_every(cfg: dict, n_layers: int, window: int, source: str) -> int:
    """N where layer i attends fully exactly when (i + 1) % N == 0 (1: every layer; 0: none), from
    layer_types or sliding_window_pattern; another arrangement is refused."""
    types = cfg.get("layer_types")
    if types is None:
        return read(
            cfg,
            "sliding_window_pattern",
            INT,
            source=source,
            default=DEFAULTS["sliding_window_pattern"],
            bound=Bound(1, limits.LAYERS.hi),
        )
    if not isinstance(types, list) or len(types) != n_layers or set(map(str, types)) - {FULL, SLIDING}:
        raise refuse(
            source,
            "layer_types",
            types,
            f"must list {n_layers} entries of {FULL!r} / {SLIDING!r}",
            "write one entry per layer",
        )
    full = [i for i, t in enumerate(types) if t == FULL]
    if not full:
        return 0
    every = full[0] + 1
    if full != [i for i in range(n_layers) if (i + 1) % every == 0]:
        raise UserError(
            f"{source}: layer_types puts full attention on layers {full}, not on every {every}-th layer; "
            "titan-pipe computes one global layer in every N (Gemma 3: 1 in 6)"
        )
    return every


def _rope(cfg: dict, source: str):
    """(global base, sliding base, global layers' scaling) from either layout; disagreement refused."""
    theta = read(cfg, "rope_theta", FLOAT, source=source, default=None, bound=limits.ROPE_THETA)
    local = read(cfg, "rope_local_base_freq", FLOAT, source=source, default=None, bound=limits.ROPE_THETA)
    legacy = read(cfg, "rope_scaling", DICT, source=source, default=None)
    params = read(cfg, "rope_parameters", DICT, source=source, default=None)
    scaling = _scaling(legacy, "rope_scaling", source) if legacy else None
    if params:
        full = read(params, FULL, DICT, source=source, default=None, prefix="rope_parameters.")
        slide = read(params, SLIDING, DICT, source=source, default=None, prefix="rope_parameters.")
        if full is None and slide is None:  # one set for every layer
            full = slide = params
        for where, spec, top in (
            (f"rope_parameters.{FULL}", full, theta),
            (f"rope_parameters.{SLIDING}", slide, local),
        ):
            got = read(
                spec or {},
                "rope_theta",
                FLOAT,
                source=source,
                default=None,
                bound=limits.ROPE_THETA,
                prefix=f"{where}.",
            )
            if got is not None and top is not None and got != top:
                raise refuse(
                    source,
                    f"{where}.rope_theta",
                    got,
                    f"disagrees with the top-level value {top:g}",
                    "keep one of them (transformers >= 5 reads rope_parameters)",
                )
        theta = read(full or {}, "rope_theta", FLOAT, source=source, default=theta, prefix=f"rope_parameters.{FULL}.")
        local = read(
            slide or {}, "rope_theta", FLOAT, source=source, default=local, prefix=f"rope_parameters.{SLIDING}."
        )
        if _scaling(slide, f"rope_parameters.{SLIDING}", source) is not None:
            raise refuse(
                source,
                f"rope_parameters.{SLIDING}.rope_type",
                slide.get("rope_type"),
                "scales the sliding layers' RoPE, which Gemma 3 never does",
                "write rope_type: default",
            )
        new = _scaling(full, f"rope_parameters.{FULL}", source)
        if legacy is not None and new != scaling:
            raise refuse(
                source,
                "rope_scaling",
                legacy,
                "disagrees with rope_parameters",
                "keep one of them (transformers >= 5 reads rope_parameters)",
            )
        scaling = new
    theta = DEFAULTS["rope_theta"] if theta is None else theta
    local = DEFAULTS["rope_local_base_freq"] if local is None else local
    return theta, local, scaling


def _scaling(spec: dict | None, where: str, source: str) -> RopeScaling | None:
    """The global layers' linear scaling of a RoPE spec; None for plain RoPE; another kind refused."""
    return read_rope_scaling(spec, where, source, kinds=("linear",))


# Its released models' values (flow.yaml's ``model.flavour``; ModelArgs builds them: titan_pipe.model.args)
FLAVOURS = {
    # Gemma 3 1B (text only): offset norms around both sub-layers, GeGLU, embeddings times sqrt(dim),
    # 5 sliding (512, RoPE base 1e4) : 1 global (1e6) layers, head_dim 256, tied.
    "gemma3_1b": {
        "dim": 1152,
        "n_layers": 26,
        "n_heads": 4,
        "n_kv_heads": 1,
        "head_dim": 256,
        "vocab_size": 262144,
        "ffn_hidden_dim": 6912,
        "norm_eps": 1e-6,
        "rope_theta": 1e6,
        "max_seq_len": 32768,
        "tie_embeddings": True,
        "qk_norm": True,
        "sliding_window": 512,
        "norm_offset": True,
        "activation": "gelu_tanh",
        "sandwich_norms": True,
        "embed_scale": True,
        "global_every": 6,
        "rope_local_theta": 1e4,
        "attn_scalar": 256.0,
    },
}
RELATIVES = {  # model_types of Gemma 3's relatives it does not compute, and why (titan_pipe.model.families)
    "gemma3": "Gemma3ForConditionalGeneration (its vision tower); convert the text model "
    "(Gemma3ForCausalLM, model_type gemma3_text)",
    "gemma2": "Gemma2ForCausalLM (logit soft-capping)",
    "gemma": "GemmaForCausalLM",
}

# The family (one line in titan_pipe.model.families.FAMILIES): its config.json keys are its own.
FAMILY = Family(
    ARCHITECTURE,
    MODEL_TYPE,
    features=FEATURES,
    window_keys="own",
    own=OwnKeys(read=read_config, write=write_config, first_set=first_set, problem=problem),
    # its norm before the MLP is pre_feedforward_layernorm, and post_attention_layernorm is the norm
    # after attention (a sandwich norm), which no other family's checkpoint holds
    hf_names=(("ffn_norm.weight", "pre_feedforward_layernorm.weight"),),
    own_params=tuple(p.name for p in sandwich_norms.FEATURE.params),
    flavours=FLAVOURS,
    relatives=RELATIVES,
)
