"""The planner's time model: FLOPs per rank, pipeline bubble, communication per link and the step
time of one layout on a cluster. Pure arithmetic; formulas and sources: docs/plan.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from titan_pipe.rules.dtypes import DTYPE_BYTES_BY_NAME
from titan_pipe.errors import UserError
from titan_pipe.model import features
from titan_pipe.model.args import ModelArgs, flops_per_token
from titan_pipe.model.sharding import stages_per_rank
from titan_pipe.training.activation_checkpoint import ac_layer_ids
from titan_pipe.training.data_parallel import DPPlan
from titan_pipe.training.planner.memory import _dp_plan, act_dtypes, rank_params, rank_stage_layers
from titan_pipe.training.planner.workload import GB, Assumptions, Cluster, Layout, Link, Workload


# ---------------------------------------------------------------------------------------------
# FLOPs, bubble, communication, time


def rank_layers(args: ModelArgs, layout: Layout, pp_rank: int) -> list[int]:
    return [i for _, layers in rank_stage_layers(args, layout, pp_rank) for i in layers]


def _n_stages(layout: Layout) -> int:
    return layout.pp * stages_per_rank(layout.pp, layout.schedule, layout.virtual_stages)


def _has_last(args: ModelArgs, layout: Layout, pp_rank: int) -> bool:
    return any(s == _n_stages(layout) - 1 for s, _ in rank_stage_layers(args, layout, pp_rank))


def layer_train_flops(args: ModelArgs, seq_len: int) -> float:
    """Forward + backward FLOPs per token of one decoder layer (its share of model.flops_per_token)."""
    return (flops_per_token(args, seq_len) - head_train_flops(args, seq_len)) / args.n_layers


def head_train_flops(args: ModelArgs, seq_len: int) -> float:
    """Forward + backward FLOPs per token outside the layers: the output projection."""
    return flops_per_token(replace(args, n_layers=0), seq_len)


def recompute_flops(args: ModelArgs, seq_len: int) -> float:
    """FLOPs per token that recomputing one checkpointed layer costs in backward: its forward (a
    third of its training FLOPs) less the w2 projection, which torch's non-reentrant checkpoint
    never reruns (it stops early once the last tensor backward needs has been recomputed)."""
    return layer_train_flops(args, seq_len) / 3 - 2 * args.hidden_dim * args.dim


def step_flops_per_token(args: ModelArgs, seq_len: int, ac_every: int) -> float:
    """Training FLOPs per token of the whole model, recomputation included."""
    n_ckpt = len(ac_layer_ids(list(range(args.n_layers)), ac_every)) if ac_every else 0
    return flops_per_token(args, seq_len) + n_ckpt * recompute_flops(args, seq_len)


def rank_flops_per_token(args: ModelArgs, seq_len: int, layout: Layout, pp_rank: int, *, frozen: bool = False) -> float:
    """FLOPs per token of the global batch that one pp rank's stages execute (all tp ranks together).
    ``frozen`` (LoRA): the base's weight gradients, a third of its matmul FLOPs, are not computed
    (the adapters' own FLOPs, rank-sized, are left out)."""
    layers = rank_layers(args, layout, pp_rank)
    n_ckpt = len(ac_layer_ids(layers, layout.ac_every)) if layout.ac_every else 0
    layer = layer_train_flops(args, seq_len) - (layer_train_flops(args, 0) / 3 if frozen else 0.0)
    f = len(layers) * layer + n_ckpt * recompute_flops(args, seq_len)
    head = head_train_flops(args, seq_len) * (2 / 3 if frozen else 1.0)
    return f + (head if _has_last(args, layout, pp_rank) else 0.0)


def bubble_fraction(layout: Layout) -> float:
    """Idle fraction of a pipeline step: (p-1)/(m+p-1); the idle part divided by v when interleaved."""
    p, m = layout.pp, layout.microbatches
    if p == 1:
        return 0.0
    idle = (p - 1) / stages_per_rank(p, layout.schedule, layout.virtual_stages)
    return idle / (m + idle)


@dataclass(frozen=True)
class Comm:
    """One parallel dimension's traffic on the busiest rank: bytes it sends per step over ``link``."""

    kind: str
    bytes: float
    link: str
    seconds: float


def group_ranks(layout: Layout, dim: str) -> list[int]:
    """Ranks of the group through rank 0 along ``dim`` of the (dp, pp, tp) mesh (tp fastest; ep: the
    ep fastest-varying of the dp ranks, as ParallelDims lays dp out as dp_mod_ep x ep)."""
    if dim == "tp":
        return list(range(layout.tp))
    if dim == "pp":
        return [i * layout.tp for i in range(layout.pp)]
    if dim == "ep":
        return [i * layout.tp * layout.pp for i in range(layout.ep)]
    return [i * layout.tp * layout.pp for i in range(layout.dp)]


def _mb_tokens(w: Workload, layout: Layout) -> int:
    return w.global_batch // layout.dp // layout.microbatches * w.seq_len


def tp_bytes(w: Workload, layout: Layout, pp_rank: int) -> float:
    """TP bytes one device sends per step (ring: an all-reduce sends 2(t-1)/t of the tensor).

    Per layer and microbatch: 2 all-reduces of (b, s, h) forward, 2 backward (SP: the same volume
    as all-gathers + reduce-scatters), 1 more per recomputed layer (the recompute stops before
    w2 and its all-reduce); the vocab-parallel embedding
    all-reduces its output; the output projection all-reduces its input gradient and all-gathers
    the (b, s, V) logits.
    """
    t = layout.tp
    if t == 1:
        return 0.0
    args, a = w.args, DTYPE_BYTES_BY_NAME[layout.amp_dtype or "float32"]
    layers = rank_layers(args, layout, pp_rank)
    n_ckpt = len(ac_layer_ids(layers, layout.ac_every)) if layout.ac_every else 0
    stage_ids = {s for s, _ in rank_stage_layers(args, layout, pp_rank)}
    n_allreduce = 4 * len(layers) + n_ckpt + (1 if 0 in stage_ids else 0)
    per_mb = 2 * (t - 1) / t * n_allreduce * a * args.dim
    if _has_last(args, layout, pp_rank):
        per_mb += 2 * (t - 1) / t * a * args.dim + (t - 1) / t * a * args.vocab_size
    return per_mb * _mb_tokens(w, layout) * layout.microbatches


def pp_bytes(w: Workload, layout: Layout) -> float:
    """PP bytes a middle rank sends per step: (b, s, h) forward and its gradient back, per hop."""
    if layout.pp == 1:
        return 0.0
    hops = stages_per_rank(layout.pp, layout.schedule, layout.virtual_stages)
    a = act_dtypes(layout).resid
    shard = layout.tp if layout.sequence_parallel else 1
    return 2 * hops * layout.microbatches * _mb_tokens(w, layout) * w.args.dim * a / shard


def fsdp_gathers(layout: Layout, dpp: DPPlan) -> int:
    """How many times per step FSDP2 all-gathers a rank's parameters. Resharding after forward:
    once in forward and once in backward, per microbatch under pp (each microbatch's forward
    reshards again); without it (ZeRO-2), once per step."""
    if not dpp.reshard_after_forward:
        return 1
    return 2 * layout.microbatches if layout.pp > 1 else 2


def dp_bytes(w: Workload, layout: Layout, assume: Assumptions, pp_rank: int = 0) -> float:
    """DP bytes one device sends per step: DDP all-reduces gradients; FSDP2 all-gathers parameters
    (in amp dtype; ``fsdp_gathers`` times) and reduce-scatters gradients once. Under ep a rank's
    experts (E/ep of them) go through the same over the dp/ep ranks that share them."""
    d = layout.dp
    if d == 1:
        return 0.0
    rp = rank_params(w.args, layout, pp_rank=pp_rank, assume=assume, lora=w.lora)
    dpp = _dp_plan(layout, assume)
    a = DTYPE_BYTES_BY_NAME[layout.amp_dtype or "float32"]
    g = DTYPE_BYTES_BY_NAME[assume.gradient_sync_dtype]
    if w.lora is not None:  # LoRA: the base is gathered (FSDP2) but only the adapters' gradients are reduced
        gathered = (d - 1) / d * fsdp_gathers(layout, dpp) * a * rp.full_params if dpp.kind == "fsdp" else 0.0
        return gathered + (1 if dpp.kind == "fsdp" else 2) * (d - 1) / d * g * rp.trained_full
    if dpp.kind == "fsdp":
        groups = (
            [(d, rp.full_params - rp.expert_full_params), (d // layout.ep, rp.expert_full_params)]
            if layout.ep > 1
            else [(d, rp.full_params)]
        )
        return sum((n - 1) / n * (fsdp_gathers(layout, dpp) * a + g) * elems for n, elems in groups if n > 1)
    return 2 * (d - 1) / d * g * rp.full_params


def ep_bytes(w: Workload, layout: Layout, pp_rank: int) -> float:
    """Expert-parallel bytes one device sends per step: each routing layer's forward sends each
    (token, slot) row to the rank holding its expert and back (two all-to-alls of tokens x top-k x
    dim), backward the same again, a checkpointed layer's recompute once more; (ep-1)/ep of the rows
    leave the rank when routing spreads them evenly."""
    e = layout.ep
    if e == 1:
        return 0.0
    args = w.args
    layers = rank_layers(args, layout, pp_rank)
    routed = [i for i in layers if args.is_moe_layer(i)]
    if not routed:
        return 0.0
    ckpt = set(ac_layer_ids(layers, layout.ac_every)) if layout.ac_every else set()
    exchanges = sum(6 if i in ckpt else 4 for i in routed)
    a = DTYPE_BYTES_BY_NAME[layout.amp_dtype or "float32"]
    return (
        exchanges
        * (e - 1)
        / e
        * _mb_tokens(w, layout)
        * layout.microbatches
        * features.routing(args).top_k
        * args.dim
        * a
    )


def _comm(kind: str, b: float, link: Link, assume: Assumptions) -> Comm:
    return Comm(kind, b, link.name, b / (link.gbps * GB * assume.comm_efficiency))


def peak_flops(cluster: Cluster, layout: Layout) -> float:
    dtype = layout.amp_dtype or "float32"
    tflops = cluster.peak_tflops.get(dtype)
    if not tflops:
        raise UserError(
            f"device {cluster.device} has no {dtype} peak in titan_pipe.rules.device_profiles (its data/device_profiles.json); "
            "pick an AMP dtype it lists, or add the figure with its source"
        )
    return tflops * 1e12


@dataclass(frozen=True)
class Timing:
    step_s: float
    compute_s: float  # the slowest rank's FLOPs at peak * efficiency
    bubble: float
    comm: dict[str, Comm]
    exposed_dp_s: float


def step_time(w: Workload, layout: Layout, cluster: Cluster, assume: Assumptions = Assumptions()) -> Timing:
    """Seconds per optimizer step, from the slowest pipeline rank.

    Its compute (FLOPs incl. recomputation / (peak * compute_efficiency)) plus its TP and PP
    traffic are on the critical path and stretched by the bubble: t / (1 - bubble). DP traffic
    hides behind backward (FSDP2: forward and backward) when comm_overlap is on; only the excess adds.
    """
    peak = peak_flops(cluster, layout) * assume.compute_efficiency
    rank_tokens = w.tokens / layout.dp
    tp_link = cluster.link_for(group_ranks(layout, "tp"))
    worst = None
    ep_link = cluster.link_for(group_ranks(layout, "ep"))
    for r in range(layout.pp):
        compute = (
            rank_tokens
            * rank_flops_per_token(w.args, w.seq_len, layout, r, frozen=w.lora is not None)
            / layout.tp
            / peak
        )
        tp = _comm("tp", tp_bytes(w, layout, r), tp_link, assume)
        ep = _comm("ep", ep_bytes(w, layout, r), ep_link, assume)  # on the critical path, like tp
        if worst is None or compute + tp.seconds + ep.seconds > worst[0] + worst[1].seconds + worst[3].seconds:
            worst = (compute, tp, r, ep)
    compute, tp, r, ep = worst
    comm = {}
    if layout.tp > 1:
        comm["tp"] = tp
    if layout.ep > 1:
        comm["ep"] = ep
    if layout.pp > 1:
        comm["pp"] = _comm("pp", pp_bytes(w, layout), cluster.link_for(group_ranks(layout, "pp")), assume)
    if layout.dp > 1:
        comm["dp"] = _comm("dp", dp_bytes(w, layout, assume, r), cluster.link_for(group_ranks(layout, "dp")), assume)
    optimizer_s = 0.0
    if layout.offload:
        comm["host"] = _comm("host", host_bytes(w, layout, assume, r), cluster.host_link, assume)
        rp = rank_params(w.args, layout, pp_rank=r, assume=assume, lora=w.lora)
        # AdamW on the host reads parameter, gradient, m, v (16 B) and writes parameter, m, v (12 B).
        optimizer_s = 28 * rp.optimizer_params / (assume.host_memory_gbps * GB)
    bubble = bubble_fraction(layout)
    critical = (compute + tp.seconds + ep.seconds + (comm["pp"].seconds if "pp" in comm else 0.0)) / (1 - bubble)
    window = compute * (1.0 if layout.zero >= 2 else 2 / 3) if assume.comm_overlap else 0.0
    background = sum(comm[k].seconds for k in ("dp", "host") if k in comm)
    exposed = max(0.0, background - window)
    return Timing(critical + exposed + optimizer_s, compute, bubble, comm, exposed)


def host_bytes(w: Workload, layout: Layout, assume: Assumptions, pp_rank: int = 0) -> float:
    """CPU offload traffic per step: the fp32 shards copied to the device for every all-gather
    (``fsdp_gathers``) and the fp32 gradient shards copied back."""
    if not layout.offload:
        return 0.0
    rp = rank_params(w.args, layout, pp_rank=pp_rank, assume=assume)
    return 4 * rp.params_alloc * (fsdp_gathers(layout, _dp_plan(layout, assume)) + 1)
