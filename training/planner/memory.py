"""The planner's memory model: per-rank parameters, gradients and optimizer states (exact), the
activations a layer keeps for backward, and the bytes per device they add up to. Pure arithmetic.

The parallel rules are the trainer's own: the data-parallel wrapper is ``data_parallel.plan_dp``,
stage layers ``pipeline_parallel.plan_stages``, checkpointed layers
``activation_checkpoint.ac_layer_ids``, per-parameter splits ``sharding.tp_split_dim``.
Formulas and sources: docs/plan.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from titan_pipe.rules.dtypes import DTYPE_BYTES_BY_NAME
from titan_pipe.model import features
from titan_pipe.model.args import ModelArgs
from titan_pipe.model.lora import LoRASpec, adapter_shapes, is_adapter
from titan_pipe.training.activation_checkpoint import ac_layer_ids
from titan_pipe.training.data_parallel import DPPlan, plan_dp
from titan_pipe.training.pipeline_parallel import plan_stages
from titan_pipe.training.planner.workload import Assumptions, Layout, Workload
from titan_pipe.model.params import native_shapes, param_of
from titan_pipe.model.sharding import layer_id, stages_per_rank, tp_split_dim


# ---------------------------------------------------------------------------------------------
# Parameters, gradients, optimizer states per rank (exact)


@lru_cache(maxsize=8)
def param_shapes(args: ModelArgs) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(native name, global shape) of every parameter: the model's declared parameter list."""
    return tuple(native_shapes(args).items())


def layout_params(args: ModelArgs, layout: Layout) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """What the trainer holds under ``layout``: the list, plus, for tied embeddings under tp or pp,
    the output projection's copy of the embedding on the last stage (training/tied.py)."""
    shapes = param_shapes(args)
    if layout.tp > 1 or layout.pp > 1:
        held = dict(shapes)
        shapes += tuple((name, held[source]) for name, source in features.shared(args).items())
    return shapes


def _chunk(n: int, parts: int, index: int) -> int:
    """Length of ``torch.chunk``'s piece ``index`` of a dim of length n (FSDP2 shards this way)."""
    size = -(-n // parts)
    return max(0, min(size, n - index * size))


def _numel(shape) -> int:
    return math.prod(shape)


def _is_matmul(name: str) -> bool:
    return param_of(name).matmul


@dataclass(frozen=True)
class RankParams:
    """Elements one rank holds. ``params`` are the local shards (FSDP2: this rank's dim-0 chunk);
    ``params_alloc`` counts FSDP2's padded shard storage (ceil(dim0/dp) rows each)."""

    names: tuple[str, ...]
    params: int
    params_alloc: int
    optimizer_params: int  # elements whose optimizer state this rank keeps
    optimizer_tensors: int  # parameters with a state entry here (each has a scalar ``step``)
    full_params: int  # the TP-local, unsharded elements of this rank's stages (before FSDP)
    matmul_params: int  # of which weights of Linear layers (what autocast casts)
    grads: int  # gradient elements after backward (see _rank_params for the one exception)
    expert_full_params: int = 0  # of full_params, a mixture of experts' experts (this rank's E/ep of them)
    trained_full: int = -1  # of full_params, those that train (LoRA: the adapters); -1: all
    trained_alloc: int = -1  # of params_alloc, those that train; -1: all


def rank_stage_layers(args: ModelArgs, layout: Layout, pp_rank: int) -> list[tuple[int, list[int]]]:
    """(virtual stage id, layer ids) run by ``pp_rank``."""
    return _stage_layers(args.n_layers, layout.pp, pp_rank, layout.schedule, layout.virtual_stages)


@lru_cache(maxsize=4096)
def _stage_layers(n_layers: int, pp: int, pp_rank: int, schedule: str, v: int) -> list[tuple[int, list[int]]]:
    plan = plan_stages(n_layers, pp, pp_rank, schedule, v)
    return [(s, plan.stages[s]) for s in plan.local]


def _owned(name: str, stages: list[tuple[int, list[int]]], n_stages: int) -> bool:
    """Whether one of a rank's (virtual stage id, layer ids) holds ``name`` (its declared scope)."""
    scope = param_of(name).scope
    if scope == "layer":
        return any(layer_id(name) in layers for _, layers in stages)
    return (0 if scope == "first" else n_stages - 1) in {s for s, _ in stages}


def _dp_plan(layout: Layout, assume: Assumptions) -> DPPlan:
    return plan_dp(
        dp=layout.dp,
        tp=layout.tp,
        dp_mode=layout.dp_mode,
        zero_stage=layout.zero,
        offload="cpu" if layout.offload else "none",
        amp_dtype=layout.amp_dtype,
        gradient_sync_dtype=assume.gradient_sync_dtype,
        fusion_buffer_mb=assume.fusion_buffer_mb,
        comm_overlap=assume.comm_overlap,
    )


def rank_params(
    args: ModelArgs,
    layout: Layout,
    *,
    pp_rank: int,
    tp_rank: int = 0,
    dp_rank: int = 0,
    assume: Assumptions = Assumptions(),
    lora: LoRASpec | None = None,
) -> RankParams:
    """Exactly what the trainer allocates for parameters and optimizer states on one rank.

    TP splits a parameter's split dim (sharding table) by tp; FSDP2 then takes this rank's
    ``torch.chunk`` piece of the TP-local dim 0; DDP/replicate keep the whole TP-local tensor.
    AdamW keeps state for every local parameter (training/optim.py builds one per stage module).
    ``lora``: the adapters are parameters too (split by the sharding table's rows for them), and
    only they have gradients and optimizer states; the base is frozen.
    """
    static = replace(layout, microbatches=1, sequence_parallel=False, ac_every=0)
    return _rank_params(args, static, pp_rank, tp_rank, dp_rank, assume, lora)


@lru_cache(maxsize=4096)
def _rank_params(
    args: ModelArgs,
    layout: Layout,
    pp_rank: int,
    tp_rank: int,
    dp_rank: int,
    assume: Assumptions,
    lora: LoRASpec | None = None,
) -> RankParams:
    stages = rank_stage_layers(args, layout, pp_rank)
    n_stages = layout.pp * stages_per_rank(layout.pp, layout.schedule, layout.virtual_stages)
    dpp = _dp_plan(layout, assume)
    names, local, alloc, full, experts = [], [], [], [], 0
    adapters = tuple(adapter_shapes(args, lora).items()) if lora is not None else ()
    for name, shape in layout_params(args, layout) + adapters:
        if not _owned(name, stages, n_stages):
            continue
        shape = list(shape)
        dim = tp_split_dim(name)
        if dim is not None and layout.tp > 1:
            shape[dim] = _chunk(shape[dim], layout.tp, tp_rank)
        shards = layout.dp
        if param_of(name).expert and layout.ep > 1:  # E/ep experts here, FSDP over the dp/ep sharing them
            shape[0] = _chunk(shape[0], layout.ep, dp_rank % layout.ep)
            shards = layout.dp // layout.ep
        names.append(name)
        full.append(_numel(shape))
        experts += _numel(shape) if param_of(name).expert else 0
        if dpp.kind == "fsdp":
            rest = _numel(shape[1:])
            local.append(_chunk(shape[0], shards, dp_rank // (layout.dp // shards)) * rest)
            alloc.append(-(-shape[0] // shards) * rest)
        else:
            local.append(_numel(shape))
            alloc.append(_numel(shape))
    if lora is not None:  # the base takes no gradient and has no optimizer state
        trained = [i for i, n in enumerate(names) if is_adapter(n)]
        mine = sum(local[i] for i in trained)
        return RankParams(
            tuple(names),
            sum(local),
            sum(alloc),
            mine,
            len(trained),
            sum(full),
            sum(n for name, n in zip(names, full) if _is_matmul(name)),
            mine,
            experts,
            trained_full=sum(full[i] for i in trained),
            trained_alloc=sum(alloc[i] for i in trained),
        )
    grads = sum(local)
    if dpp.kind == "none" and layout.tp > 1 and "tok_embeddings.weight" in names:
        # Without a data-parallel wrapper, DTensor's embedding backward leaves the vocab-parallel
        # table's gradient Replicate: every tp rank holds the full (vocab, dim) gradient.
        i = names.index("tok_embeddings.weight")
        grads += args.vocab_size * args.dim - local[i]
    return RankParams(
        tuple(names),
        sum(local),
        sum(alloc),
        sum(local),
        len(local),
        sum(full),
        sum(n for name, n in zip(names, full) if _is_matmul(name)),
        grads,
        experts,
    )


def optimizer_bytes(rp: RankParams, optimizer: str = "adamw") -> int:
    """AdamW: exp_avg + exp_avg_sq in float32 per element, a float32 ``step`` per parameter."""
    if optimizer == "sgd":
        return 0
    return 8 * rp.optimizer_params + 4 * rp.optimizer_tensors


# ---------------------------------------------------------------------------------------------
# Activations: bytes kept for backward


@dataclass(frozen=True)
class ActDtypes:
    """Bytes per element: ``matmul`` = outputs of Linear/SDPA (the AMP dtype under autocast),
    ``resid`` = the residual stream (the parameters' compute dtype: AMP dtype under FSDP2 mixed
    precision, float32 under DDP + autocast, where only matmuls run in low precision)."""

    matmul: int = 4
    resid: int = 4


def act_dtypes(layout: Layout, assume: Assumptions = Assumptions()) -> ActDtypes:
    if layout.amp_dtype is None:
        return ActDtypes(4, 4)
    a = DTYPE_BYTES_BY_NAME[layout.amp_dtype]
    low_params = _dp_plan(layout, assume).kind in ("fsdp", "replicate")
    return ActDtypes(a, a if low_params else 4)


def layer_activation_terms(
    args: ModelArgs, *, tp: int = 1, sp: bool = False, dt: ActDtypes = ActDtypes()
) -> dict[str, float]:
    """Bytes one token keeps for backward in one decoder layer, per tp rank (see docs/plan.md).

    Korthikanti et al. (2022) count a GPT layer as sbh(34 + 5as/h) bytes; this is the same count for
    our block as it really runs: RMSNorm in float32 (input in float32, 1/rms, the normalised
    tensor), SwiGLU (four (T, ffn) tensors), GQA with k/v repeated to n_heads before attention, and
    a fused (flash) SDPA that keeps q, k, v, its output and the float32 log-sum-exp instead of the
    a*s*s score and softmax matrices. Under sequence parallel the norm tensors are split by tp; the
    gathered input of the column-parallel projections is kept whole (DTensor saves the
    all-gathered tensor, where Megatron re-gathers it in backward).
    """
    h, f, a, r = args.dim, args.hidden_dim, dt.matmul, dt.resid
    q = args.q_dim  # n_heads x head_dim: dim for Llama, not for Qwen3
    kv = q  # k and v are repeated to n_heads before attention (GQA), so they are q wide too
    seq = tp if sp else 1
    norms = 2  # before attention and before the MLP (a feature's own: its terms)
    terms = {
        "norm_input_fp32": norms * 4 * h / seq,
        "norm_rstd_fp32": norms * 4 / seq,
        "norm_normalised": norms * r * h / seq,
        # Autocast casts the float32 norm output once per projection (wq, wk, wv; w1, w3) and
        # keeps each copy; with low-precision parameters the one norm output is shared.
        "projection_inputs": (2 if r == a else 5) * a * h,
        "attention_qkv": a * (q + 2 * kv) / tp,
        "attention_out": a * q / tp,
        "attention_lse_fp32": 4 * args.n_heads / tp,
        "ffn_swiglu": 4 * a * f / tp,
    }
    for f in features.active(args):  # what each feature keeps (titan_pipe.model.features)
        if f.activation_terms is not None:
            terms.update(f.activation_terms(args, r, tp, seq))
    return terms


def layer_activation_bytes(args: ModelArgs, *, tp: int = 1, sp: bool = False, dt: ActDtypes = ActDtypes()) -> float:
    return sum(layer_activation_terms(args, tp=tp, sp=sp, dt=dt).values())


def checkpointed_layer_bytes(args: ModelArgs, *, tp: int = 1, sp: bool = False, dt: ActDtypes = ActDtypes()) -> float:
    """A checkpointed layer keeps only its input (B, T, dim) (sequence-split under SP)."""
    return dt.resid * args.dim / (tp if sp else 1)


def head_activation_bytes(args: ModelArgs, *, tp: int = 1, sp: bool = False, dt: ActDtypes = ActDtypes()) -> float:
    """Per token: the final norm, the output projection's (gathered) input and the float32
    log-softmax of the full-vocabulary logits the loss keeps (logits are gathered over tp)."""
    h, seq = args.dim, (tp if sp else 1)
    return (4 * h + 4 + dt.resid * h) / seq + dt.matmul * h + 4 * args.vocab_size


def embedding_activation_bytes() -> float:
    return 8.0  # the int64 token ids


def in_flight(layout: Layout, pp_rank: int) -> int:
    """Microbatch-stage forwards whose activations a pp rank holds at once (its peak).

    GPipe: all m. 1F1B: pp - rank. Interleaved 1F1B (torch.distributed.pipelining): warmup of
    (v-1)*pp + 2*(pp-1-rank) chunk forwards, plus the one in flight.
    """
    m, p = layout.microbatches, layout.pp
    if p == 1:
        return 1
    if layout.schedule == "gpipe":
        return m
    if layout.schedule == "1f1b":
        return min(m, p - pp_rank)
    v = layout.virtual_stages
    return min(m * v, (v - 1) * p + 2 * (p - 1 - pp_rank) + 1)


def activation_bytes(
    w: Workload, layout: Layout, pp_rank: int, assume: Assumptions = Assumptions()
) -> tuple[float, float]:
    """(kept for backward at the peak, recompute transient) on one rank, bytes.

    Interleaved stages of one rank are charged at their average size; a checkpointed layer keeps
    its input, and the one being recomputed in backward briefly holds a full layer's tensors.
    """
    args = w.args
    mb_tokens = w.global_batch // layout.dp // layout.microbatches * w.seq_len
    kw = dict(tp=layout.tp, sp=layout.sequence_parallel, dt=act_dtypes(layout, assume))
    full, ckpt = layer_activation_bytes(args, **kw), checkpointed_layer_bytes(args, **kw)
    full += features.mask_bytes(args, w.seq_len, kw["dt"].matmul) / max(mb_tokens, 1)  # per token, like the rest
    stages = rank_stage_layers(args, layout, pp_rank)
    n_stages = layout.pp * len(stages)
    per_stage = []
    for s, layers in stages:
        done = set(ac_layer_ids(layers, layout.ac_every)) if layout.ac_every else set()
        b = sum(ckpt if i in done else full for i in layers)
        if s == 0:
            b += embedding_activation_bytes()
        if s == n_stages - 1:
            b += head_activation_bytes(args, **kw)
        per_stage.append(b)
    kept = in_flight(layout, pp_rank) * sum(per_stage) / len(per_stage) * mb_tokens
    recompute = full * mb_tokens if layout.ac_every else 0.0
    return kept, recompute


# ---------------------------------------------------------------------------------------------
# Memory per device


@dataclass(frozen=True)
class Memory:
    """Bytes on the most loaded rank, by kind."""

    params: float
    grads: float
    optimizer: float
    param_copies: float  # unsharded/low-precision copies: FSDP2 all-gathers, autocast cache
    activations: float
    recompute: float
    buffers: float  # DDP gradient buckets, FSDP reduce-scatter output
    pp_rank: int = 0
    host: float = 0.0  # bytes kept in host memory instead (CPU offload), not counted in total
    grad_accum: float = 0.0  # FSDP2 under pp: unsharded float32 gradients held across microbatches

    def items(self) -> dict[str, float]:
        return {
            "parameters": self.params,
            "gradients": self.grads,
            "optimizer states": self.optimizer,
            "parameter copies": self.param_copies,
            "unsharded gradients": self.grad_accum,
            "activations": self.activations,
            "recompute": self.recompute,
            "comm buffers": self.buffers,
        }

    @property
    def total(self) -> float:
        return sum(self.items().values())


@lru_cache(maxsize=64)
def _layer_param_elems(args: ModelArgs, tp: int, ep: int = 1) -> tuple[int, ...]:
    """TP-local elements of each decoder layer (the unit FSDP2 gathers); a routing layer's experts
    count E/ep (what one rank holds under expert parallelism)."""
    totals = [0] * args.n_layers
    for name, shape in param_shapes(args):
        i = layer_id(name)
        if i is not None:
            dim = tp_split_dim(name)
            n = _numel(shape) // (tp if dim is not None else 1)
            totals[i] += n // ep if param_of(name).expert else n
    return tuple(totals)


def memory_on_rank(
    w: Workload, layout: Layout, pp_rank: int, assume: Assumptions = Assumptions(), optimizer: str = "adamw"
) -> Memory:
    rp = rank_params(w.args, layout, pp_rank=pp_rank, assume=assume, lora=w.lora)
    dpp = _dp_plan(layout, assume)
    master, a = 4, DTYPE_BYTES_BY_NAME[layout.amp_dtype or "float32"]
    params = master * rp.params_alloc
    if (
        w.lora is not None
    ):  # the frozen base held in the AMP dtype (train.lora.base_dtype: auto), the adapters in float32
        params = a * (rp.params_alloc - rp.trained_alloc) + master * rp.trained_alloc
    # Gradients land in the parameters' dtype (FSDP2: the padded shard); LoRA: the adapters' only.
    grads = master * (rp.params_alloc + rp.grads - rp.params) if w.lora is None else master * rp.grads
    trained = rp.full_params if rp.trained_full < 0 else rp.trained_full  # unsharded elements that take gradients
    per_layer = _layer_param_elems(w.args, layout.tp, layout.ep)
    mine = [i for _, ids in rank_stage_layers(w.args, layout, pp_rank) for i in ids]
    layer = max((per_layer[i] for i in mine), default=0)  # the largest layer this rank gathers
    copies = buffers = accum = 0.0
    if dpp.kind == "fsdp" and layout.pp > 1:
        # torch.distributed.pipelining turns off FSDP's reshard-after-backward and gradient sync
        # until the last microbatch: after a backward the whole stage stays gathered, and its
        # unsharded gradients accumulate in float32 until the step's one reduce-scatter.
        copies = a * rp.full_params
        accum = 4 * trained
    elif dpp.kind == "fsdp":
        root = rp.full_params - sum(per_layer[i] for i in mine)
        if dpp.reshard_after_forward:
            # Current and prefetched layer gathered, plus the root (kept unsharded after forward).
            copies = a * (2 * layer + root)
        else:
            copies = a * rp.full_params
        buffers = 4 * (layer if w.lora is None else trained)  # one layer's unsharded gradients before reduce-scatter
    elif dpp.kind == "replicate":
        copies = a * rp.full_params if layout.amp_dtype else 0.0
    else:  # ddp / none: autocast's low-precision copy of every Linear weight, kept for backward
        copies = a * rp.matmul_params if layout.amp_dtype else 0.0
        if w.lora is not None:  # a base already in the AMP dtype is not copied; the adapters are
            copies = a * rp.trained_full if layout.amp_dtype else 0.0
        if dpp.kind == "ddp":
            buffers = 4 * trained  # the Reducer's flat buckets (gradient_as_bucket_view off)
    acts, recompute = activation_bytes(w, layout, pp_rank, assume)
    opt = optimizer_bytes(rp, optimizer)
    if dpp.cpu_offload:  # sharded parameters, their gradients and AdamW live in host memory
        return Memory(
            0.0, 0.0, 0.0, copies, acts, recompute, buffers, pp_rank, host=params + grads + opt, grad_accum=accum
        )
    return Memory(params, grads, opt, copies, acts, recompute, buffers, pp_rank, grad_accum=accum)


def memory_per_device(
    w: Workload, layout: Layout, assume: Assumptions = Assumptions(), optimizer: str = "adamw"
) -> Memory:
    """The pp rank with the largest total (first stages hold more microbatches, last the logits)."""
    return max((memory_on_rank(w, layout, r, assume, optimizer) for r in range(layout.pp)), key=lambda m: m.total)
