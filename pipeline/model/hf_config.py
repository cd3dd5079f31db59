"""ModelArgs <-> a Hugging Face config.json (Llama, Mistral, Qwen2, Qwen3), both layouts transformers writes.

transformers 4.x writes ``rope_theta`` and ``rope_scaling`` at the top level; transformers >= 5
writes ``rope_parameters: {rope_type, rope_theta, factor, ...}`` and may omit the top-level
``rope_theta``. Both are read; a file carrying both with different values is refused rather than
guessed at. Every value is typed strictly (titan_pipe.rules.values): a string "false", 4.7 layers or a
null dimension is one line naming the file, the key, the value and the fix.

A field is one row of ``HF_FIELDS``; what tells the families apart (model_type, biases, q/k norms,
windows) is read and written by titan_pipe.model.families.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_pipe.rules import limits
from titan_pipe.errors import UserError
from titan_pipe.model import features
from titan_pipe.model.args import ModelArgs, RopeScaling, validate_args
from titan_pipe.model.families import config_family, family_keys, family_of, read_family
from titan_pipe.model.rope_scaling import read_rope_scaling
from titan_pipe.rules.values import BOOL, DICT, FLOAT, INT, REQUIRED, STR, read, refuse

DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class HFField:
    """config.json key -> ModelArgs field, its type, bound and default (REQUIRED: must be present)."""

    key: str
    field: str
    kind: str
    bound: limits.Bound | None = None
    default: object = REQUIRED


HF_FIELDS: tuple[HFField, ...] = (
    HFField("hidden_size", "dim", INT, limits.DIM),
    HFField("num_hidden_layers", "n_layers", INT, limits.LAYERS),
    HFField("num_attention_heads", "n_heads", INT, limits.HEADS),
    HFField("num_key_value_heads", "n_kv_heads", INT, limits.HEADS, None),
    HFField("vocab_size", "vocab_size", INT, limits.VOCAB),
    HFField("intermediate_size", "ffn_hidden_dim", INT, limits.FFN),
    HFField("rms_norm_eps", "norm_eps", FLOAT, limits.NORM_EPS, 1e-5),
    HFField("max_position_embeddings", "max_seq_len", INT, limits.POSITIONS, 4096),
    *(HFField(f.hf_key, f.name, BOOL, None, False) for f in features.FEATURES if f.hf_key),
    HFField("head_dim", "head_dim", INT, limits.HEAD_DIM, None),  # Qwen3: 128 apart from hidden_size / heads
)
SUPPORTED_ACTS = ("silu",)


def to_hf_config(args: ModelArgs, *, torch_dtype: str = "float32") -> dict:
    """A config.json dict for ``args`` (its family: titan_pipe.model.families), in the 4.x layout
    both 4.x and 5.x load."""
    family = family_of(args)
    own = family.own is not None  # a family whose RoPE and activation keys are its own (Gemma 3)
    fam = family_keys(args, family=family)
    cfg = {
        "architectures": fam.pop("architectures"),
        "model_type": fam.pop("model_type"),
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
        **{f.hf_key: f.on(args) for f in features.FEATURES if f.hf_key},
        "hidden_act": "silu",
        **fam,
        "torch_dtype": torch_dtype,
        "rope_scaling": None,
    }
    if own:
        del cfg["hidden_act"]
        cfg["rope_scaling"] = fam["rope_scaling"]
    elif args.rope_scaling is not None:
        s = args.rope_scaling
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    return cfg


def _activation(cfg: dict, source: str) -> None:
    """Refuse an activation other than SwiGLU's silu."""
    act = read(cfg, "hidden_act", STR, source=source, default="silu")
    if act not in SUPPORTED_ACTS:
        raise refuse(
            source,
            "hidden_act",
            act,
            "is not supported (LLaMA's SwiGLU uses silu)",
            "convert a model with hidden_act silu",
        )


def _scaling(spec: dict | None, where: str, source: str) -> RopeScaling | None:
    """Llama-3.1 scaling from a rope_scaling / rope_parameters object; None for plain RoPE."""
    return read_rope_scaling(spec, where, source, kinds=("llama3",))


def _rope(cfg: dict, source: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either layout; a disagreement between the two is refused."""
    top = read(cfg, "rope_theta", FLOAT, source=source, default=None, bound=limits.ROPE_THETA)
    legacy = read(cfg, "rope_scaling", DICT, source=source, default=None)
    params = read(cfg, "rope_parameters", DICT, source=source, default=None)
    if params is None:
        return (DEFAULT_ROPE_THETA if top is None else top), _scaling(legacy, "rope_scaling", source)
    if params and all(isinstance(v, dict) for v in params.values()):
        raise refuse(
            source,
            "rope_parameters",
            params,
            "holds per-layer-type RoPE settings",
            "titan-pipe's LLaMA model uses one RoPE for every layer",
        )
    theta = read(
        params, "rope_theta", FLOAT, source=source, default=None, bound=limits.ROPE_THETA, prefix="rope_parameters."
    )
    if theta is not None and top is not None and theta != top:
        raise refuse(
            source,
            "rope_parameters.rope_theta",
            theta,
            f"disagrees with the top-level rope_theta {top:g}",
            "keep one of them (transformers >= 5 reads rope_parameters)",
        )
    scaling = _scaling(params, "rope_parameters", source)
    if legacy is not None and _scaling(legacy, "rope_scaling", source) != scaling:
        raise refuse(
            source,
            "rope_scaling",
            legacy,
            "disagrees with rope_parameters",
            "keep one of them (transformers >= 5 reads rope_parameters)",
        )
    theta = theta if theta is not None else top
    return (DEFAULT_ROPE_THETA if theta is None else theta), scaling


def from_hf_config(cfg: dict, *, source: str = "config.json") -> ModelArgs:
    """ModelArgs from a config.json dict of a supported family (either layout); UserError naming the
    key (or the architecture) on anything unusable."""
    if not isinstance(cfg, dict):
        raise UserError(f"{source}: holds {type(cfg).__name__}, not a JSON object (a LlamaConfig)")
    config_family(cfg, source)  # another architecture is named before its keys are read
    values = {f.field: read(cfg, f.key, f.kind, source=source, default=f.default, bound=f.bound) for f in HF_FIELDS}
    family = read_family(cfg, n_layers=values["n_layers"], source=source)  # a family's defaults win (Gemma: tied)
    values.update(family)
    if "activation" not in family:  # a family with its own keys reads them (Gemma 3)
        _activation(cfg, source)
    if "rope_theta" not in family:
        values["rope_theta"], values["rope_scaling"] = _rope(cfg, source)
    return validate_args(ModelArgs(**values), source=source)
