"""Parallelize a model: TP -> activation checkpointing -> FSDP/DDP in one fixed order, and
build_parallel_model, which builds this rank's pipeline-stage modules with their local shards.

For a forward-only runner (evaluation) under any layout::

    mesh = ParallelDims(dp, tp, pp).build_mesh("cpu")
    pm = build_parallel_model(args, mesh, weights=open_weights(step_dir))   # titan_pipe.model.weights
    logits = forward_logits(pm.modules, pm.stage_plan, tokens, pp_mesh=mesh["pp"], args=args)

``stream_layers=True`` keeps the decoder layers on meta and materialises each one from ``weights``
for its own forward only (training/layer_stream.py): a rank then holds one layer at a time.

``forward_logits`` is in training/pipeline_parallel.py; every rank gets the full (B, T, vocab).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_pipe.model import features
from titan_pipe.model.args import ModelArgs
from titan_pipe.training.activation_checkpoint import apply_ac
from titan_pipe.training.compile import apply_compile
from titan_pipe.training.data_parallel import DPPlan, apply_dp, unwrap
from titan_pipe.training.layer_stream import fill_local, hand_back
from titan_pipe.training.layer_stream import stream_layers as hook_layer_stream
from titan_pipe.model.kernels import Kernels
from titan_pipe.model.lora import LoRASpec, is_adapter
from titan_pipe.model.transformer import init_param
from titan_pipe.training.pipeline_parallel import StagePlan, build_stage_module, plan_stages
from titan_pipe.model.sharding import stage_ranks
from titan_pipe.training.tensor_parallel import apply_tp
from titan_pipe.training.tied import TiedGrads, needs_copy, source_name

if TYPE_CHECKING:
    from titan_pipe.model.weights import WeightSource


@dataclass
class ParallelModel:
    """This rank's share of the model.

    parts: what to run (stage modules, possibly DDP-wrapped), one per local virtual stage.
    modules: the stage modules themselves (``Transformer`` with global parameter names).
    """

    args: ModelArgs
    mesh: DeviceMesh
    stage_plan: StagePlan
    dp_plan: DPPlan
    parts: list[nn.Module] = field(default_factory=list)
    tied: TiedGrads | None = None  # tied embeddings under tp/pp: the output is a synced copy (training/tied.py)

    @property
    def modules(self) -> list[nn.Module]:
        return [unwrap(p) for p in self.parts]

    def named_parameters(self) -> Iterator[tuple[int, str, nn.Parameter]]:
        """(virtual stage, global parameter name, parameter) of every local parameter."""
        for stage, module in zip(self.stage_plan.local, self.modules):
            for name, p in module.named_parameters():
                yield stage, name, p

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, _, p in self.named_parameters()]

    def trainable(self) -> list[nn.Parameter]:
        """The parameters the optimizer steps (with LoRA the adapters only)."""
        return [p for p in self.parameters() if p.requires_grad]


def parallelize(
    part: nn.Module,
    mesh: DeviceMesh,
    dp_plan: DPPlan,
    *,
    sequence_parallel: bool = False,
    ac_every: int | None = None,
    compile_backend=None,
    materialize: Callable[[nn.Module], None],
    float8: str = "none",
    lora: bool = False,
    base_dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """TP, then activation checkpointing, then torch.compile per block, then data parallelism,
    always in this order (torchtitan's). ``lora``: only the adapters train (freeze_base, after TP,
    whose styles make every parameter anew, and before DP, which registers what needs gradients).

    TP first because FSDP/replicate shard the TP-local DTensors further over dp; AC before DP so
    the recomputed block's all-gathers are FSDP's own; compile (``compile_backend`` not None) after
    TP and AC so it traces the TP-local block, and before DP so FSDP's gathers stay outside the
    compiled graphs (titan_pipe.training.compile). ``materialize`` (allocate + fill the
    local shards) runs before classic DDP, which broadcasts real weights when it is built, and
    after FSDP otherwise, so each rank only ever allocates its own shard.
    """
    if float8 != "none":  # torchao swaps the Linear layers first (training/float8.py)
        from titan_pipe.training.float8 import apply_float8

        part = apply_float8(part, float8)
    apply_tp(part, mesh["tp"], sequence_parallel=sequence_parallel)
    if "ep" in (mesh.mesh_dim_names or ()):
        from titan_pipe.training.expert_parallel import shard_experts

        shard_experts(part, mesh["ep"])
    if lora:
        freeze_base(part, base_dtype)
    if ac_every is not None:
        apply_ac(part, ac_every)
    if compile_backend is not None:
        apply_compile(part, compile_backend, split_blocks=mesh["tp"].size() > 1)
    if dp_plan.kind == "ddp" or dp_plan.kind == "none":
        materialize(part)
        return apply_dp(part, mesh["dp"], dp_plan)
    part = apply_dp(part, mesh["dp"], dp_plan)
    materialize(part)
    return part


def freeze_base(part: nn.Module, dtype: torch.dtype = torch.float32) -> None:
    """LoRA: every parameter but the adapters' stops taking gradients (so no optimizer state, no
    gradient sync, no gradient memory for the base) and is held in ``dtype`` (before it is
    allocated: a bfloat16 base takes half the memory of a float32 one)."""
    for name, p in list(part.named_parameters()):
        if is_adapter(name):
            continue
        owner, _, leaf = name.rpartition(".")
        module = part.get_submodule(owner) if owner else part
        setattr(module, leaf, nn.Parameter(p.detach().to(dtype), requires_grad=False))


def local_shard(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's piece of the global tensor ``full`` in the placement of parameter ``like``.

    No communication: every rank holds ``full`` (src_data_rank=None) and keeps its own slice.
    """
    if isinstance(like, DTensor):
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()
    return full


@torch.no_grad()
def fill_parameters(
    module: nn.Module,
    args: ModelArgs,
    *,
    device: torch.device,
    seed: int,
    weights: WeightSource | None = None,
    dtype: torch.dtype = torch.float32,
    param_device: torch.device | str | None = None,
    layers: bool = True,
) -> None:
    """Allocate ``module``'s parameters on ``param_device`` (default ``device``; the CPU under
    FSDP offload) and fill each with its global value (``weights.full(name)`` or the
    layout-independent ``init_param``) cut to this rank's shard. RoPE buffers go to ``device``.
    ``layers=False``: the decoder layers stay on meta (materialised later, training/layer_stream.py)."""
    ties = shared_parameters(module)
    if layers:
        module.to_empty(device=param_device or device)  # allocates each registration anew: ties break here
    else:
        module.to_empty(device=param_device or device, recurse=False)
        for name, child in module.named_children():
            if name != "layers":
                child.to_empty(device=param_device or device)
    retie(ties)
    if layers:
        copy_global_values(module, args, seed=seed, weights=weights, dtype=dtype)
    else:  # streamed (forward only, no dp wrapper): the ends read as the layers will be, this rank's box only
        fill_local(
            ((n, p) for n, p in module.named_parameters() if not n.startswith("layers.")),
            weights=weights,
            source=lambda name: source_name(name, args),
        )
        hand_back(weights)
    module.init_rope(device)


def shared_parameters(module: nn.Module) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """Parameters registered under more than one name (tied embeddings): (module, attr, module, attr
    of the first registration), so the tie can be restored after ``to_empty``."""
    first: dict[int, tuple[nn.Module, str]] = {}
    ties = []
    for mod in module.modules():
        for attr, p in mod.named_parameters(recurse=False, remove_duplicate=False):
            if id(p) in first:
                ties.append((mod, attr, *first[id(p)]))
            else:
                first[id(p)] = (mod, attr)
    return ties


def retie(ties: list[tuple[nn.Module, str, nn.Module, str]]) -> None:
    """Point every later registration of a shared parameter back at the first (see shared_parameters)."""
    for owner, attr, first, first_attr in ties:
        setattr(owner, attr, getattr(first, first_attr))


@torch.no_grad()
def copy_global_values(
    module: nn.Module,
    args: ModelArgs,
    *,
    seed: int,
    weights: WeightSource | None = None,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Overwrite every (already allocated) parameter's local shard with its global value cut to
    its placement; FSDP/DDP wrappers keep working since no parameter object is replaced."""
    for name, p in module.named_parameters():
        shape = tuple(p.shape)  # global shape, also for DTensors
        src = source_name(name, args)  # a tied output copy starts as the embedding
        full = weights.full(src) if weights is not None else init_param(src, shape, args, seed, dtype)
        if tuple(full.shape) != shape:
            raise ValueError(f"weights for {name}: shape {tuple(full.shape)} but the model expects {shape}")
        local = local_shard(full.to(p.dtype), p)
        target = p.to_local() if isinstance(p, DTensor) else p
        target.copy_(local)


def build_parallel_model(
    args: ModelArgs,
    mesh: DeviceMesh,
    *,
    device: torch.device | None = None,
    schedule: str = "1f1b",
    virtual_stages: int = 2,
    sequence_parallel: bool = False,
    ac_every: int | None = None,
    dp_plan: DPPlan | None = None,
    kernels: Kernels | None = None,
    seed: int = 0,
    weights: WeightSource | None = None,
    compile_backend=None,
    stream_layers: bool = False,
    float8: str = "none",
    lora: LoRASpec | None = None,
    base_dtype: torch.dtype = torch.float32,
) -> ParallelModel:
    """This rank's stage modules of ``args`` on the (dp, pp, tp) ``mesh``, parallelized and filled.

    weights: None = layout-independent random init from ``seed`` (the same values a single-process
    ``build_model(args, seed=seed)`` holds); otherwise anything with ``full(name) -> Tensor``
    (titan_pipe.model.weights: our checkpoint, a unified safetensors dir, a Hugging Face dir).
    dp_plan: None = no data parallel wrapper (forward-only use; dp ranks then run independently).
    compile_backend: None = eager; else a torch.compile backend for every block (training.compile).
    stream_layers: forward only (no dp wrapper, no compile, ``weights`` given): each decoder layer
    stays on meta and is read from ``weights`` for its own forward, then freed (training.layer_stream).
    """
    device = device or torch.device("cpu")
    dp_plan = dp_plan or DPPlan("none")
    if stream_layers and (weights is None or dp_plan.kind != "none" or compile_backend is not None):
        raise ValueError("stream_layers is for forward-only runs from stored weights: no dp wrapper, no compile")
    pp = mesh["pp"].size()
    plan = plan_stages(args.n_layers, pp, mesh["pp"].get_local_rank(), schedule, virtual_stages)
    model = ParallelModel(args, mesh, plan, dp_plan)
    stage_args = args
    if needs_copy(args, mesh):  # the output projection as a synced copy of the embedding
        stage_args = features.unshared(args)
        model.tied = TiedGrads(mesh, last_pp_rank=stage_ranks(plan.n_stages, pp)[-1])

    def materialize(part: nn.Module) -> None:
        fill_parameters(
            unwrap(part),
            args,
            device=device,
            seed=seed,
            weights=weights,
            param_device="cpu" if dp_plan.cpu_offload else device,
            layers=not stream_layers,
        )
        if stream_layers:
            hook_layer_stream(unwrap(part), weights=weights, device=device)

    for s in plan.local:
        part = build_stage_module(
            stage_args,
            plan.stages[s],
            first=plan.is_first(s),
            last=plan.is_last(s),
            kernels=kernels,
            device="meta",
            lora=lora,
        )
        model.parts.append(
            parallelize(
                part,
                mesh,
                dp_plan,
                sequence_parallel=sequence_parallel,
                ac_every=ac_every,
                compile_backend=compile_backend,
                materialize=materialize,
                float8=float8,
                lora=lora is not None,
                base_dtype=base_dtype,
            )
        )
    return model
