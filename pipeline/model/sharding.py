"""THE sharding table: how each parameter splits under TP and which stage owns it under PP.

Training builds its DTensor plan from ``TP_PLAN``; the checkpoint writer and the converter read the
split dims from ``tp_split_dim``. One table, two users, so they cannot disagree. Both are keyed by
the parameter list (titan_pipe.model.params): each entry declares its module's TP style, its split
dim and its pipeline owner.

Module names are native names; ``*`` stands for a layer id.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

from titan_pipe.rules.choices import INTERLEAVED
from titan_pipe.model.args import ModelArgs
from titan_pipe.model.params import ADAPTER_PARAMS, LAYER_PARAMS, LAYER_PREFIX, MODEL_PARAMS, param_of, split_layer


@dataclass(frozen=True)
class TPRule:
    """One module's tensor-parallel style.

    style: "colwise" (weight Shard(0): output features split), "rowwise" (weight Shard(1): input
    features split, partial sums all-reduced), "vocab" (embedding table Shard(0) over the vocab,
    which torch's RowwiseParallel does for nn.Embedding), or one of the replicated styles
    (titan_pipe.model.params TP_STYLES says where each one's input comes from and its output goes).
    """

    module: str
    style: str


# Attention and FFN in Megatron's column-then-row pairing, so each block needs one all-reduce (or
# reduce-scatter under sequence parallel) after wo and after w2. One rule per module, in model order;
# LoRA adapters (titan_pipe.model.lora) pair the same way beside their base linears.
TP_PLAN: tuple[TPRule, ...] = tuple(
    dict.fromkeys(
        [TPRule(p.module, p.tp) for p in MODEL_PARAMS if p.scope == "first"]
        + [TPRule(f"{LAYER_PREFIX}*.{p.module}", p.tp) for p in LAYER_PARAMS + ADAPTER_PARAMS]
        + [TPRule(p.module, p.tp) for p in MODEL_PARAMS if p.scope == "last"]
    )
)


def tp_split_dim(param_name: str) -> int | None:
    """The dim a parameter is split on under TP, or None when replicated."""
    return _param(param_name).tp_dim


def _param(param_name: str):
    try:
        return param_of(param_name)
    except KeyError:
        raise KeyError(
            f"parameter {param_name!r} has no entry in the sharding table (titan_pipe.model.params)"
        ) from None


def tp_problems(args: ModelArgs, tp: int) -> list[str]:
    """Why ``tp`` ranks cannot split a model of ``args`` (the sharding table splits q heads, k/v heads,
    the FFN hidden size and the vocabulary): what follows "tp N" in each message. The one rule the
    flow's validation and convert's sharded output both apply."""
    out = []
    fits = ", ".join(map(str, tp_choices(args)))
    if args.n_heads % tp:
        out.append(
            f"does not divide model n_heads={args.n_heads} (tp splits the q heads of head_dim "
            f"{args.head_dim}); the tp sizes this model takes: {fits}"
        )
    if args.kv_heads % tp:
        out.append(
            f"does not divide model n_kv_heads={args.kv_heads} (tp splits the k/v heads of head_dim "
            f"{args.head_dim}); the tp sizes this model takes: {fits}"
        )
    if args.hidden_dim % tp:
        out.append(f"does not divide the FFN hidden size {args.hidden_dim}; the tp sizes this model takes: {fits}")
    if args.vocab_size % tp:
        out.append(f"does not divide vocab_size={args.vocab_size}; pad the vocabulary to a multiple of tp")
    return out


def tp_choices(args: ModelArgs) -> list[int]:
    """Every tp that divides the q heads, the k/v heads and the FFN width (the vocabulary can be padded)."""
    g = math.gcd(math.gcd(args.n_heads, args.kv_heads), args.hidden_dim)
    return [d for d in range(1, g + 1) if g % d == 0]


def layer_id(param_name: str) -> int | None:
    return split_layer(param_name)[0]


def split_stages(n_layers: int, n_stages: int) -> list[list[int]]:
    """Contiguous layer ids per pipeline stage, as even as possible (earlier stages get the extra).

    The first stage also holds the embedding and the last the final norm and output, so with an
    uneven split the extra layers go to the front stages, away from the output projection.
    """
    if n_stages < 1:
        raise ValueError(f"pipeline stages must be >= 1, got {n_stages}")
    if n_layers < n_stages:
        raise ValueError(
            f"cannot split {n_layers} layers into {n_stages} pipeline stages: "
            f"need n_layers >= pp * virtual stages ({n_stages})"
        )
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        n = base + (1 if s < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def stages_per_rank(pp: int, schedule: str, virtual_stages: int) -> int:
    """Virtual pipeline stages each pp rank runs: ``virtual_stages`` under interleaved 1F1B with
    pp > 1; else 1 (with pp 1 every schedule is one stage holding every layer). The one rule the
    config, the trainer, the planner and the sharded evaluation all use."""
    return virtual_stages if schedule == INTERLEAVED and pp > 1 else 1


def stage_of(param_name: str, stages: list[list[int]]) -> int:
    """The pipeline stage that owns a parameter, given ``split_stages``' layer lists."""
    scope = _param(param_name).scope
    if scope == "first":
        return 0
    if scope == "last":
        return len(stages) - 1
    lid = layer_id(param_name)
    for s, layers in enumerate(stages):
        if lid in layers:
            return s
    raise KeyError(f"layer {lid} of {param_name!r} is in no pipeline stage")


def stage_ranks(n_stages: int, pp: int, style: str = "loop") -> list[int]:
    """Which pp rank runs each virtual stage: 'loop' (interleaved: stage s on rank s % pp)."""
    if style != "loop":
        raise ValueError(f"unknown stage placement {style!r}")
    return [s % pp for s in range(n_stages)]
