"""Model arguments: the LLaMA family's dims (ModelArgs), its flavours (Llama 2/3, Qwen2.5, Qwen3, Mistral),
parameter and FLOP counts.

Pure data shared by every stage (the trainer builds its nn.Module from it, the converter and the
exporter read it from manifests and config.json, the planner costs it); no torch here.

The family's variants are switches on one decoder: ``qkv_bias`` (Qwen2/2.5: biases on the q,
k and v projections), ``qk_norm`` (Qwen3: RMSNorm over each head of q and k, before RoPE),
``head_dim`` apart from dim / n_heads (Qwen3: 128 whatever the width), ``sliding_window``
(Mistral-7B v0.1: a query sees the ``sliding_window`` newest positions, itself included), and a
mixture of experts in place of the feed-forward (``n_experts`` > 0: Mixtral, Qwen3-MoE): a router
sends each token to ``experts_per_token`` of ``n_experts`` SwiGLU experts of width
``moe_hidden_dim``, in every ``moe_step``-th layer but ``dense_layers`` (Qwen3's
decoder_sparse_step / mlp_only_layers), with a load-balancing loss of weight ``router_aux_loss_coef``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import get_type_hints

from titan_pipe.rules import limits
from titan_pipe.rules.limits import Bound
from titan_pipe.errors import UserError
from titan_pipe.model import features
from titan_pipe.model.features import gates
from titan_pipe.model.families import FAMILIES, claimed, family_of
from titan_pipe.model.rope_scaling import ROPE_TYPES, RopeScaling
from titan_pipe.rules.values import BOOL, DICT, FLOAT, INT, LIST, STR, check, refuse


ACTIVATIONS = tuple(gates.GATES)  # the gated MLP's gate kinds (titan_pipe.model.features.gates)


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 32000
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    ffn_hidden_dim: int | None = None  # explicit intermediate size wins over the formula
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    # None: dim // n_heads. Stored once set, so two spellings of one model compare equal and every
    # manifest records it; a flavour's derived value is dropped when its dims are overridden
    # (resolve_args), an explicit one (Qwen3's 128) is kept.
    head_dim: int | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None  # None: full causal attention
    n_experts: int = 0  # 0: a dense SwiGLU feed-forward in every layer
    experts_per_token: int = 0  # top-k of the router (k >= 1 when n_experts > 0)
    moe_hidden_dim: int | None = None  # each expert's SwiGLU width (None: hidden_dim)
    moe_step: int = 1  # layer i routes when (i + 1) % moe_step == 0 ...
    dense_layers: tuple[int, ...] = ()  # ... and i is not one of these (they keep the dense FFN)
    router_norm_topk: bool = True  # the k chosen probabilities renormalized to sum to 1 (Mixtral; Qwen3 norm_topk_prob)
    router_aux_loss_coef: float = 0.0  # weight of the load-balancing loss added to the training loss
    # Gemma 3's switches (titan_pipe.model.gemma3 reads and writes its config.json):
    norm_offset: bool = False  # RMSNorm weights are offsets from 1: the norm multiplies by (1 + w), in float32
    activation: str = "silu"  # the gated MLP's gate: silu (SwiGLU) or gelu_tanh (GeGLU, tanh-approximated GELU)
    sandwich_norms: bool = False  # a norm on attention's and on the MLP's output too, before each residual add
    embed_scale: bool = False  # the embeddings multiplied by sqrt(dim), in the weights' dtype
    global_every: int = (
        0  # 0: every layer attends alike; N: layer i with (i+1) % N == 0 attends fully, the others slide
    )
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (unscaled); None: rope_theta
    attn_scalar: float | None = None  # query_pre_attn_scalar: scores scaled by its -1/2 power; None: head_dim's
    # The Hugging Face model_type a checkpoint names (titan_pipe.model.families), kept so a Mistral with
    # full attention converts back as MistralForCausalLM; None: the simplest family that computes it.
    # A name, not a computation: two args that compute the same model compare equal whatever it is.
    family: str | None = field(default=None, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers or ()))
        # Derived only from dims that give a whole head; otherwise it stays None and args_problems
        # (which every reader runs) names the dims, never a ZeroDivisionError or a truncated head.
        d, h = self.dim, self.n_heads
        if self.head_dim is None and _whole(d) and _whole(h) and h > 0 and d % h == 0:
            object.__setattr__(self, "head_dim", d // h)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def q_dim(self) -> int:
        """Width of the queries (and of attention's output): n_heads x head_dim."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the keys and of the values: n_kv_heads x head_dim."""
        return self.kv_heads * self.head_dim

    def is_global_layer(self, i: int) -> bool:
        """Whether layer ``i`` attends to every position before it (Gemma 3's 1 in ``global_every``)."""
        return self.global_every > 0 and (i + 1) % self.global_every == 0

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer ``i`` (None: full causal attention)."""
        return None if self.is_global_layer(i) else self.sliding_window

    @property
    def attn_scale(self) -> float:
        """The factor on q.k: a feature's (Gemma 3's query_pre_attn_scalar^-1/2), else head_dim^-1/2."""
        scale = features.attention_scale(self)
        return self.head_dim**-0.5 if scale is None else scale

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` routes through experts (else it has the dense feed-forward)."""
        return self.moe and (i + 1) % self.moe_step == 0 and i not in self.dense_layers

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.n_layers) if self.is_moe_layer(i))

    @property
    def expert_dim(self) -> int:
        """Each expert's SwiGLU intermediate size."""
        return self.moe_hidden_dim if self.moe_hidden_dim is not None else self.hidden_dim

    @property
    def hidden_dim(self) -> int:
        """SwiGLU intermediate size: 2/3 of 4*dim, times the multiplier, rounded up to multiple_of."""
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ffn_hidden_dim"] = self.hidden_dim
        return d

    @classmethod
    def from_dict(cls, d: dict, *, source: object = "model") -> "ModelArgs":
        """ModelArgs from ``to_dict()``'s output (a manifest's ``model``), every value typed strictly
        and bounded (``validate_args``); UserError naming ``source``, the key and the value."""
        check(d, DICT, source=source, key="model")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise refuse(
                source,
                f"model.{unknown[0]}",
                d[unknown[0]],
                "is not a model field",
                f"known fields: {', '.join(sorted(known))}",
            )
        values = {}
        for name, kind in _KINDS[cls].items():
            v = d.get(name)
            if name == "dense_layers":
                v = tuple(
                    check(x, INT, source=source, key=f"model.{name}")
                    for x in check(v if v is not None else [], LIST, source=source, key=f"model.{name}")
                )
            elif name == "rope_scaling":
                v = _read_scaling(v, source) if v is not None and not isinstance(v, RopeScaling) else v
            elif v is not None:
                v = check(v, kind, source=source, key=f"model.{name}")
            if v is not None or name in d:
                values[name] = v
        return validate_args(cls(**values), source=source)


def _whole(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _kinds(cls) -> dict[str, str]:
    """Field name -> value kind (titan_pipe.rules.values) of a dataclass of ints, floats and bools."""
    out = {}
    for name, hint in get_type_hints(cls).items():
        text = str(hint)
        out[name] = (
            LIST
            if "tuple" in text
            else BOOL
            if "bool" in text
            else INT
            if "int" in text
            else FLOAT
            if "float" in text
            else STR
            if "str" in text
            else DICT
        )
    return out


_KINDS = {RopeScaling: _kinds(RopeScaling), ModelArgs: _kinds(ModelArgs)}

# The bound of every numeric field (titan_pipe.rules.limits): flow.yaml's model section and every
# reader of a model from a file (config.json, params.json, manifest, Megatron args) use these.
FIELD_BOUNDS: dict[str, limits.Bound] = {
    "dim": limits.DIM,
    "n_layers": limits.LAYERS,
    "n_heads": limits.HEADS,
    "n_kv_heads": limits.HEADS,
    "vocab_size": limits.VOCAB,
    "multiple_of": limits.FFN,
    "ffn_dim_multiplier": limits.ROPE_FACTOR,
    "ffn_hidden_dim": limits.FFN,
    "norm_eps": limits.NORM_EPS,
    "rope_theta": limits.ROPE_THETA,
    "max_seq_len": limits.POSITIONS,
    "head_dim": limits.HEAD_DIM,
    "router_aux_loss_coef": Bound(0.0, 1e3),
    **features.bounds(),  # the values the features own (titan_pipe.model.features)
}
SCALING_BOUNDS: dict[str, limits.Bound] = {
    "factor": limits.ROPE_FACTOR,
    "low_freq_factor": limits.ROPE_FACTOR,
    "high_freq_factor": limits.ROPE_FACTOR,
    "original_max_position_embeddings": limits.POSITIONS,
}


def _read_scaling(d: object, source: object) -> RopeScaling:
    check(d, DICT, source=source, key="model.rope_scaling")
    unknown = sorted(set(d) - set(_KINDS[RopeScaling]))
    if unknown:
        raise refuse(
            source,
            f"model.rope_scaling.{unknown[0]}",
            d[unknown[0]],
            "is not a rope_scaling field",
            f"known fields: {', '.join(_KINDS[RopeScaling])}",
        )
    return RopeScaling(
        **{k: check(v, _KINDS[RopeScaling][k], source=source, key=f"model.rope_scaling.{k}") for k, v in d.items()}
    )


def _bound_problem(key: str, value: float, bound: limits.Bound) -> str | None:
    why = bound.problem(value)
    shown = value if isinstance(value, int) else f"{value:g}"
    return None if why is None else f"{key}: {shown} {why}; use a value in {bound.range}"


def args_problems(args: ModelArgs) -> list[str]:
    """One line per rule ``args`` breaks (bounds, divisibility, RoPE), each '<field>: <value> ...; <fix>'.

    The one list of what a model must satisfy: flow.yaml validation and every reader of a model
    from a file check it, so a value either is refused everywhere or works everywhere.
    """
    out = [
        p
        for k, b in FIELD_BOUNDS.items()
        if getattr(args, k) is not None and (p := _bound_problem(k, getattr(args, k), b))
    ]
    if out:  # the rules below divide by these
        return out
    s = args.rope_scaling
    if s is not None:
        out += [p for k, b in SCALING_BOUNDS.items() if (p := _bound_problem(f"rope_scaling.{k}", getattr(s, k), b))]
        if s.rope_type not in ROPE_TYPES:
            out.append(
                f"rope_scaling.rope_type: {limits.shown(s.rope_type)} is not one of {', '.join(ROPE_TYPES)}; "
                "use llama3 (Llama-3.1) or linear (Gemma 3)"
            )
        elif s.rope_type == "llama3" and s.high_freq_factor <= s.low_freq_factor:
            out.append(
                f"rope_scaling.high_freq_factor: {s.high_freq_factor:g} must exceed low_freq_factor "
                f"{s.low_freq_factor:g}"
            )
    if args.head_dim is None:  # not given, and dim / n_heads is no whole head
        return [
            f"dim: {args.dim} is not divisible by n_heads={args.n_heads}; pick dim = n_heads x head_dim, "
            "or set head_dim"
        ]
    if args.head_dim % 2:
        out.append(f"head_dim: {args.head_dim} must be even (RoPE rotates pairs); change head_dim (or dim / n_heads)")
    owned = claimed(args)  # a value only one family has (Gemma 3's layer pattern)
    if args.moe or args.family is not None or owned is not None:  # the architecture that says it (families)
        try:
            family_of(args)
        except ValueError as e:
            key, value = (
                ("family", args.family)
                if args.family is not None
                else (("n_experts", args.n_experts) if args.moe else owned)
            )
            out.append(f"{key}: {value}: {e}")
    out += features.problems(args)  # to_hf_config could name no architecture (titan_pipe.model.families)
    if args.activation not in ACTIVATIONS:
        out.append(
            f"activation: {limits.shown(args.activation)} is not one of {', '.join(ACTIVATIONS)}; use "
            + gates.choices()
        )
    if args.n_heads % args.kv_heads:
        out.append(f"n_kv_heads: {args.kv_heads} does not divide n_heads={args.n_heads}; pick a divisor")
    rows = args.max_seq_len * args.head_dim
    if not out and rows > limits.ROPE_TABLE.hi:
        out.append(
            f"max_seq_len: {args.max_seq_len} positions x head_dim {args.head_dim} = {rows:,} RoPE table "
            f"entries {limits.ROPE_TABLE.problem(rows)}; lower max_seq_len"
        )
    p = _bound_problem("ffn hidden size", args.hidden_dim, limits.FFN)
    if p:
        out.append(p + " (set ffn_hidden_dim)")
    n = count_params(args)
    if not out and n > limits.PARAMS.hi:
        out.append(f"dims: {n:.3g} parameters {limits.PARAMS.problem(n)}; check the dims")
    return out


def validate_args(args: ModelArgs, *, source: object) -> ModelArgs:
    """``args`` if ``args_problems`` finds nothing; else UserError ``source: <first problem>``."""
    problems = args_problems(args)
    if problems:
        raise UserError(f"{source}: {problems[0]}")
    return args


_LLAMA31_SCALING = RopeScaling(8.0, 1.0, 4.0, 8192)

FLAVOURS: dict[str, ModelArgs] = {
    # Tiny, for CPU tests and the shipped example; vocab covers the byte tokenizer (258) and
    # divides by every tp up to 8.
    "debug": ModelArgs(
        dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=320, multiple_of=32, max_seq_len=256, rope_theta=10000.0
    ),
    "llama2_7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, multiple_of=256),
    "llama2_13b": ModelArgs(dim=5120, n_layers=40, n_heads=40, vocab_size=32000, multiple_of=256),
    "llama2_70b": ModelArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=32000, multiple_of=4096, ffn_dim_multiplier=1.3
    ),
    "llama3_8b": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        rope_theta=500000.0,
        rope_scaling=_LLAMA31_SCALING,
        max_seq_len=8192,
    ),
    "llama3_70b": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=4096,
        ffn_dim_multiplier=1.3,
        rope_theta=500000.0,
        rope_scaling=_LLAMA31_SCALING,
        max_seq_len=8192,
    ),
    # Qwen2.5: biases on q/k/v, rope_theta 1e6, eps 1e-6; the small ones tie their embeddings.
    "qwen2.5_0.5b": ModelArgs(
        dim=896,
        n_layers=24,
        n_heads=14,
        n_kv_heads=2,
        vocab_size=151936,
        ffn_hidden_dim=4864,
        norm_eps=1e-6,
        rope_theta=1e6,
        max_seq_len=32768,
        tie_embeddings=True,
        qkv_bias=True,
    ),
    "qwen2.5_7b": ModelArgs(
        dim=3584,
        n_layers=28,
        n_heads=28,
        n_kv_heads=4,
        vocab_size=152064,
        ffn_hidden_dim=18944,
        norm_eps=1e-6,
        rope_theta=1e6,
        max_seq_len=32768,
        qkv_bias=True,
    ),
    "qwen2.5_72b": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=152064,
        ffn_hidden_dim=29568,
        norm_eps=1e-6,
        rope_theta=1e6,
        max_seq_len=32768,
        qkv_bias=True,
    ),
    # Qwen3 (dense): per-head q/k RMSNorm, head_dim 128 whatever the width.
    "qwen3_0.6b": ModelArgs(
        dim=1024,
        n_layers=28,
        n_heads=16,
        n_kv_heads=8,
        head_dim=128,
        vocab_size=151936,
        ffn_hidden_dim=3072,
        norm_eps=1e-6,
        rope_theta=1e6,
        max_seq_len=40960,
        tie_embeddings=True,
        qk_norm=True,
    ),
    "qwen3_8b": ModelArgs(
        dim=4096,
        n_layers=36,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        vocab_size=151936,
        ffn_hidden_dim=12288,
        norm_eps=1e-6,
        rope_theta=1e6,
        max_seq_len=40960,
        qk_norm=True,
    ),
    "qwen3_32b": ModelArgs(
        dim=5120,
        n_layers=64,
        n_heads=64,
        n_kv_heads=8,
        head_dim=128,
        vocab_size=151936,
        ffn_hidden_dim=25600,
        norm_eps=1e-6,
        rope_theta=1e6,
        max_seq_len=40960,
        qk_norm=True,
    ),
    # Mistral-7B v0.1: a 4096-token sliding window (v0.2 and later: full attention, vocab 32768).
    "mistral_7b": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=32000,
        ffn_hidden_dim=14336,
        norm_eps=1e-5,
        rope_theta=10000.0,
        max_seq_len=32768,
        sliding_window=4096,
    ),
    # Mixtral 8x7B: 8 experts of Mistral-7B's width in every layer, top-2 (46.7B total, 12.9B active).
    "mixtral_8x7b": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=32000,
        ffn_hidden_dim=14336,
        norm_eps=1e-5,
        rope_theta=1e6,
        max_seq_len=32768,
        n_experts=8,
        experts_per_token=2,
        router_aux_loss_coef=0.02,
    ),
    # Qwen3-MoE: 128 narrow experts, top-8 renormalized, in every layer (30.5B / 3.3B and 235B / 22B).
    "qwen3_30b_a3b": ModelArgs(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        vocab_size=151936,
        ffn_hidden_dim=6144,
        norm_eps=1e-6,
        rope_theta=1e6,
        max_seq_len=40960,
        qk_norm=True,
        n_experts=128,
        experts_per_token=8,
        moe_hidden_dim=768,
        router_aux_loss_coef=0.001,
    ),
    "qwen3_235b_a22b": ModelArgs(
        dim=4096,
        n_layers=94,
        n_heads=64,
        n_kv_heads=4,
        head_dim=128,
        vocab_size=151936,
        ffn_hidden_dim=12288,
        norm_eps=1e-6,
        rope_theta=1e6,
        max_seq_len=40960,
        qk_norm=True,
        n_experts=128,
        experts_per_token=8,
        moe_hidden_dim=1536,
        router_aux_loss_coef=0.001,
    ),
    # the released models of families defined in their own module (Gemma 3 1B: titan_pipe.model.gemma3)
    **{name: ModelArgs(**values) for fam in FAMILIES.values() for name, values in fam.flavours.items()},
    # A tiny Mixtral-shaped mixture for CPU tests and examples.
    "debug_moe": ModelArgs(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=320,
        ffn_hidden_dim=64,
        max_seq_len=256,
        n_experts=4,
        experts_per_token=2,
        router_aux_loss_coef=0.01,
    ),
}


def resolve_args(flavour: str | None, **overrides) -> ModelArgs:
    """Flavour defaults with any dims given in the config laid over them; a None given is a value
    (``rope_scaling=None``: no scaling, ``sliding_window=None``: full attention), never dropped.

    A flavour's head_dim that is just dim // n_heads follows overridden dims; a decoupled one
    (Qwen3) stays unless head_dim itself is given.
    """
    if flavour is None:
        base = ModelArgs()
    elif flavour in FLAVOURS:
        base = FLAVOURS[flavour]
    else:
        raise ValueError(f"unknown model flavour {flavour!r}; known: {', '.join(FLAVOURS)}")
    if isinstance(overrides.get("rope_scaling"), dict):
        overrides["rope_scaling"] = RopeScaling(**overrides["rope_scaling"])
    coupled = base.head_dim == base.dim // base.n_heads
    if coupled and "head_dim" not in overrides and {"dim", "n_heads"} & set(overrides):
        overrides["head_dim"] = None  # derived again from the new dims in __post_init__
    return replace(base, **overrides)


def count_params(args: ModelArgs, *, active: bool = False) -> int:
    """Exact parameter count from the dims alone (matches the published sizes of every flavour).
    ``active``: the parameters one token passes through (a mixture of experts: its top-k experts of
    each routing layer, and the router)."""
    d, q, kv = args.dim, args.q_dim, args.kv_dim
    attn = d * q + 2 * d * kv + q * d
    attn += sum(f.layer_params(args) for f in features.FEATURES)  # features' own: in the layer's count
    norms = 2
    n_moe = len(args.moe_layers)
    dense = (args.n_layers - n_moe) * 3 * d * args.hidden_dim
    experts = args.experts_per_token if active else args.n_experts
    routed = n_moe * (experts * 3 * d * args.expert_dim + args.n_experts * d)  # experts + router
    emb = args.vocab_size * d
    out = 0 if "output.weight" in features.shared(args) else args.vocab_size * d  # a tied head is the embedding
    return args.n_layers * (attn + norms * d) + dense + routed + emb + out + d


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward): 6*N_matmul + causal attention.

    Counts every matmul FLOP as 2 (multiply + add) and every bias element as 1 (its add). The
    attention scores/values term uses the full T x T product of the q heads (n_heads x head_dim),
    as SDPA's math path and the masked kernels compute it: a sliding window masks scores, it does
    not skip computing them. Norms (q/k norms too) and embedding lookups are not matmuls.
    """
    # matmul-free parameters: the norms (no FLOPs counted) and each feature's own (norm weights; biases,
    # one add each)
    norms = args.dim * (2 * args.n_layers + 1)
    free = norms + args.n_layers * sum(f.layer_matmul_free(args) for f in features.FEATURES)
    adds = args.n_layers * sum(f.layer_adds(args) for f in features.FEATURES)
    # The embedding is a gather, not a matmul; a tied matrix still runs once as the output matmul.
    # A mixture of experts: the top-k experts a token is routed to, and the router.
    gather = 0 if "output.weight" in features.shared(args) else args.vocab_size * args.dim
    n_matmul = count_params(args, active=True) - free - gather
    attn = 2 * 2 * args.n_layers * seq_len * args.q_dim  # QK^T and PV, per token
    return 3 * (2 * n_matmul + adds + attn)


# The narrowest element a model's weights are stored in (float16 / bfloat16), for check_fits.
MIN_WEIGHT_ITEMSIZE = 2


def check_fits(args: ModelArgs, have_bytes: int, *, source: object, where: object) -> None:
    """Refuse a model whose declared parameters cannot be in the ``have_bytes`` bytes of weight
    files at ``where`` (even at 2 bytes each), before anything is sized from the dims: a config
    claiming 10 million layers is one line, not minutes of planning and gigabytes of memory."""
    n = count_params(args)
    need = n * MIN_WEIGHT_ITEMSIZE
    if have_bytes < need:
        raise UserError(
            f"{source}: declares {n:,} parameters ({args.n_layers} layers, dim {args.dim}, vocab "
            f"{args.vocab_size}), at least {need:,} bytes of weights, but {where} hold(s) "
            f"{have_bytes:,} bytes; the model config and the weights do not belong together"
        )


# Every dim that sizes a tensor: what weights must match to load into a model.
SHAPE_KEYS = (
    "dim",
    "n_layers",
    "n_heads",
    "kv_heads",
    "head_dim",
    "vocab_size",
    "hidden_dim",
    *(k for f in features.FEATURES for k in f.shape_keys()),  # what sizes the features' tensors
)
# The shapes plus the numerics of the forward: what two artifacts must share to be compared.
SAME_MODEL_KEYS = SHAPE_KEYS + (
    "norm_eps",
    "rope_theta",
    "activation",
    # the others change the numerics only (each value a feature owns, by what it computes)
    *dict.fromkeys(prop for f in features.FEATURES for _, prop in f.compared_fields() if prop not in f.shape_keys()),
    "rope_scaling",
)


def model_differences(
    a: ModelArgs, b: ModelArgs, *, keys: tuple[str, ...] = SAME_MODEL_KEYS, labels: tuple[str, str] | None = None
) -> list[str]:
    """One line per key where ``a`` and ``b`` differ: ``k A vs B``, or with ``labels`` (la, lb)
    ``k=A la vs B lb``; empty when they are the same model."""
    out = []
    for k in keys:
        x, y = getattr(a, k), getattr(b, k)
        if x != y:
            out.append(f"{k}={x} {labels[0]} vs {y} {labels[1]}" if labels else f"{k} {x} vs {y}")
    return out
