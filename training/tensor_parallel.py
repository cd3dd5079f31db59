"""apply_tp: DTensor tensor parallelism built from the sharding table (titan_pipe.model.sharding TP_PLAN).

Without sequence parallel the residual stream between blocks is a plain, replicated (B, T, dim)
tensor on every tp rank; with it, each rank holds (B, T/tp, dim), Shard(1) on tp, and the norms run
on the sequence shard. Norm weights always become Replicate DTensors, so every parameter of a TP
model is a DTensor (AdamW's foreach path and grad clipping reject a mix of DTensor and Tensor).
"""

from __future__ import annotations

import fnmatch

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titan_pipe.model.sharding import TP_PLAN, TPRule


def _replicate_norm(module: nn.Module, mesh: DeviceMesh) -> None:
    """A Replicate weight on a replicated input (a norm; a LoRA adapter's A beside a column-split
    linear, whose input under sequence parallel is the Replicate DTensor the block's input plan
    made): weight as Replicate DTensor, input as it comes or made a Replicate DTensor, output a plain
    tensor. A's gradient needs no reduction: the split B after it (ColwiseParallel) all-reduces the
    gradient flowing back into it."""

    def to_dtensor(_mod, inputs, mesh_):
        return tuple(
            x if isinstance(x, DTensor) else DTensor.from_local(x, mesh_, [Replicate()], run_check=False)
            for x in inputs
        )

    def to_local(_mod, output, _mesh):
        return output.to_local()

    distribute_module(module, mesh, input_fn=to_dtensor, output_fn=to_local)


def _replicate_params(module: nn.Module, mesh: DeviceMesh) -> None:
    """A mixture of experts' stacked experts: Replicate DTensors, used as local tensors in forward
    (titan_pipe.model.transformer.Experts): every tp rank runs every expert on the same tokens."""
    distribute_module(module, mesh)


def _style(rule: TPRule, sequence_parallel: bool):
    """The DTensor ParallelStyle for one rule of the table, or None for a replicated norm."""
    seq = Shard(1) if sequence_parallel else Replicate()
    if rule.style == "vocab":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if rule.style == "colwise":
        if rule.module == "output":
            # Logits are gathered to full (B, T, vocab) so the loss is the ordinary cross entropy.
            return ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
        return ColwiseParallel()
    if rule.style == "rowwise":
        return RowwiseParallel(output_layouts=seq)
    if rule.style == "replicate":
        return SequenceParallel() if sequence_parallel else None
    if rule.style == "replicate_output":  # summed with a local tensor: a row-split base's output, the residual
        return SequenceParallel(use_local_output=True) if sequence_parallel else None
    if rule.style == "replicate_input":
        return _ON_INPUT
    if rule.style == "replicate_heads":
        # The q/k norms see (B, T, local heads, hd): their input is Shard(2) on tp whatever the
        # sequence layout, so the Replicate weight's gradient is a partial sum DTensor reduces.
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    raise ValueError(f"unknown TP style {rule.style!r} in titan_pipe.model.sharding")


_ON_INPUT = "replicate on the input"  # _style's answer for "replicate_input": _replicate_norm whatever the layout


def _matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False) -> None:
    """Parallelize ``model`` (a Transformer or a pipeline stage of it) over ``tp_mesh`` in place.

    Weights: colwise -> Shard(0) (their biases too), rowwise -> Shard(1), vocab embedding ->
    Shard(0), norms -> Replicate (q/k norms: Replicate over the heads' Shard(2)); all on the 1-D
    tp mesh. Modules absent from a stage (None) are skipped.
    """
    if tp_mesh.size() == 1:
        return
    present = {name for name, _ in model.named_modules() if name}
    plan = {}
    for rule in TP_PLAN:
        names = sorted(n for n in present if _matches(n, rule.module))
        style = _style(rule, sequence_parallel)
        for name in names:
            if style is None and name.endswith("moe.experts"):
                _replicate_params(model.get_submodule(name), tp_mesh)
            elif style is None or style is _ON_INPUT:
                _replicate_norm(model.get_submodule(name), tp_mesh)
            else:
                plan[name] = style
    if sequence_parallel:
        # Attention and FFN consume the full sequence: all-gather the Shard(1) input on entry.
        # Attention.forward(x, cos, sin, positions): only x is sharded; cos/sin (and the packed
        # documents' positions, or None) stay plain tensors.
        for name in present:
            if _matches(name, "layers.*.attention"):
                plan[name] = PrepareModuleInput(
                    input_layouts=(Shard(1), None, None, None), desired_input_layouts=(Replicate(), None, None, None)
                )
            elif _matches(name, "layers.*.feed_forward"):
                plan[name] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    parallelize_module(model, tp_mesh, plan)
    if sequence_parallel:
        model.seq_shards = tp_mesh.size()
