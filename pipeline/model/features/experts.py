"""Mixtures of experts (Mixtral, Qwen3-MoE, Megatron-LM / torchtitan MoE checkpoints): a router sends
each token to ``experts_per_token`` of ``n_experts`` SwiGLU experts of width ``moe_hidden_dim``
(None: the dense width), in every ``moe_step``-th layer but ``dense_layers``; the chosen
probabilities renormalised to sum to 1 (``router_norm_topk``) or not. Field ``model.n_experts``
(0: a dense model).

It owns those fields' bounds, how two models are compared by them, their rules, the parameter rows
of a routing layer (torchtitan's and Hugging Face's names, megatron-core's stacked tensors), how a
Megatron-LM checkpoint states them, and how they split over expert-parallel ranks. The stages take
``Routing`` (``features.routing``): what a routing layer computes with. How a config.json states
them is the family's (titan_pipe.model.families: Mixtral and Qwen3-MoE spell them otherwise)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from titan_pipe.errors import UserError
from titan_pipe.model.features.feature import Feature
from titan_pipe.model.param_spec import Param
from titan_pipe.rules import limits
from titan_pipe.rules.limits import Bound
from titan_pipe.rules.values import BOOL, FLOAT, INT

if TYPE_CHECKING:
    from titan_pipe.model.args import ModelArgs


@dataclass(frozen=True)
class Routing:
    """What a routing layer computes with, as the module, the graph, the planner, expert
    parallelism and evaluate take it."""

    experts: int  # E experts in each routing layer
    top_k: int  # each token goes to k of them
    width: int  # each expert's SwiGLU intermediate size
    renormalize: bool  # the k chosen probabilities renormalised to sum to 1 (Mixtral; Qwen3's norm_topk_prob)
    layers: tuple[int, ...]  # the layers that route (the others keep the dense feed-forward)


def routing(args: "ModelArgs") -> Routing | None:
    """The model's routing; None for a dense model."""
    if not args.n_experts:
        return None
    return Routing(args.n_experts, args.experts_per_token, args.expert_dim, args.router_norm_topk, args.moe_layers)


def _routed(args: "ModelArgs", i: int) -> bool:
    return args.is_moe_layer(i)


def _expert_in(w: str, part: str) -> Param:
    """An expert's input projection, (E, width, dim): w1 the gate, w3 the up rows of megatron's fused fc1."""
    return Param(
        f"moe.experts.{w}",
        lambda a: (a.n_experts, a.expert_dim, a.dim),
        "replicate",
        "layer",
        f"mlp.experts.{{e}}.{part}_proj.weight",
        f"moe.{w}",
        in_layer=_routed,
        expert=True,
        megatron=("mlp.experts.experts.linear_fc1.weight",),
        fused=("expert_fc1", part),
    )


# A routing layer's rows of the parameter list, in place of the dense feed-forward's: torchtitan's
# names (its MoE DCP checkpoints read one to one), Qwen3-MoE's Hugging Face names (Mixtral's:
# titan_pipe.model.names). Replicated under TP: expert parallelism is what splits experts.
# megatron-core (torch_dist) keeps a routing layer's SequentialMLP experts as one tensor per kind
# with the expert index as a leading axis ("experts.experts.*": (E, rows, cols)), fc1 fused
# [gate; up] on its rows as the dense MLP's.
PARAMS: tuple[Param, ...] = (
    Param(
        "moe.router.gate.weight",
        lambda a: (a.n_experts, a.dim),
        "replicate",
        "layer",
        "mlp.gate.weight",
        "moe.router",
        in_layer=_routed,
        megatron=("mlp.router.weight",),
    ),
    _expert_in("w1", "gate"),
    _expert_in("w3", "up"),
    Param(
        "moe.experts.w2",
        lambda a: (a.n_experts, a.dim, a.expert_dim),
        "replicate",
        "layer",
        "mlp.experts.{e}.down_proj.weight",
        "moe.w2",
        init="depth_scaled",
        in_layer=_routed,
        expert=True,
        megatron=("mlp.experts.experts.linear_fc2.weight",),
    ),
)


def _check(args: "ModelArgs") -> list[str]:
    """The rules: k of n experts with 1 <= k <= n, dense layers inside the model, some layer routes."""
    out = []
    if args.n_experts == 0:
        if args.experts_per_token:
            out.append(
                f"experts_per_token: {args.experts_per_token} without experts (n_experts: 0); set "
                "n_experts, or drop experts_per_token"
            )
        return out
    if not 1 <= args.experts_per_token <= args.n_experts:
        out.append(
            f"experts_per_token: {args.experts_per_token} must be 1..n_experts={args.n_experts} (each token "
            f"goes to that many of the {args.n_experts} experts); pick a top-k in 1..{args.n_experts}"
        )
    outside = [i for i in args.dense_layers if not 0 <= i < args.n_layers]
    if outside:
        out.append(
            f"dense_layers: {outside[0]} is not a layer of the model's {args.n_layers}; list layers in "
            f"0..{args.n_layers - 1}"
        )
    elif not args.moe_layers:
        out.append(
            f"n_experts: {args.n_experts} but no layer routes (moe_step {args.moe_step}, dense_layers "
            f"{list(args.dense_layers)}); set n_experts: 0 for a dense model"
        )
    return out


def split_problems(args: "ModelArgs", ep: int) -> list[str]:
    """Why ``parallel.ep`` cannot split this model's experts (none: it can)."""
    if ep == 1:
        return []
    if not args.n_experts:
        return [f"parallel.ep: {ep} splits a mixture of experts' experts; the model has none (n_experts: 0); use ep: 1"]
    if args.n_experts % ep:
        return [
            f"parallel.ep: {ep} does not divide the model's n_experts={args.n_experts} (each ep rank "
            f"holds as many experts); pick ep from the divisors of {args.n_experts}"
        ]
    return []


def _read_megatron(a, root: Path, arg) -> dict:
    """The fields from Megatron's MoE args ({} for a dense model); ``arg`` reads one typed.

    ``moe_layer_freq`` k routes layers 0, k, 2k, ... (a list: 1 routes, 0 keeps the dense MLP): the
    others are ``dense_layers``. ``moe_router_pre_softmax`` false (the default: softmax over the
    top-k logits) is the top-k renormalized; true is the softmax over all experts, not renormalized."""
    n = arg(a, "num_experts", INT, root, default=None, bound=limits.EXPERTS)
    if not n:
        return {}
    layers = arg(a, "num_layers", INT, root, bound=limits.LAYERS)
    freq = getattr(a, "moe_layer_freq", 1)
    if isinstance(freq, bool) or not (
        isinstance(freq, int) or (isinstance(freq, (list, tuple)) and all(x in (0, 1) for x in freq))
    ):
        raise UserError(
            f"{root}: Megatron args moe_layer_freq {freq!r} is neither a layer step nor a list of 0/1 "
            "per layer; re-save the checkpoint from Megatron-LM"
        )
    if isinstance(freq, int):
        routed = [i % freq == 0 for i in range(layers)] if freq >= 1 else [False] * layers
    else:
        routed = [bool(x) for x in freq]
        if len(routed) != layers:
            raise UserError(f"{root}: Megatron args moe_layer_freq lists {len(routed)} layers, num_layers is {layers}")
    return {
        "n_experts": n,
        "experts_per_token": arg(a, "moe_router_topk", INT, root, default=2, bound=limits.EXPERTS),
        "moe_hidden_dim": arg(a, "moe_ffn_hidden_size", INT, root, default=None, bound=limits.FFN),
        "dense_layers": tuple(i for i, r in enumerate(routed) if not r),
        "router_norm_topk": not arg(a, "moe_router_pre_softmax", BOOL, root, default=False),
        "router_aux_loss_coef": arg(a, "moe_aux_loss_coeff", FLOAT, root, default=0.0, bound=Bound(0.0, 1e3)),
    }


FEATURE = Feature(
    name="n_experts",
    label="mixture of experts",
    switch=False,  # a count; which families route is their record's (Family.moe)
    compared=(
        ("n_experts", "n_experts"),
        ("experts_per_token", "experts_per_token"),
        ("moe_hidden_dim", "expert_dim"),
        ("moe_step", "moe_layers"),
        ("dense_layers", "moe_layers"),
        ("router_norm_topk", "router_norm_topk"),
    ),
    bounds=(
        ("n_experts", Bound(0, limits.EXPERTS.hi, limits.EXPERTS.why)),
        ("experts_per_token", Bound(0, limits.EXPERTS.hi)),
        ("moe_hidden_dim", limits.FFN),
        ("moe_step", limits.LAYERS),
    ),
    shaped=("n_experts", "expert_dim", "moe_layers"),
    check=_check,
    read_megatron=_read_megatron,
    describe=lambda m: f"{m['n_experts']} experts, top-{m['experts_per_token']}",
)
