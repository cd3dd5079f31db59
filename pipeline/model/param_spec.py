"""One parameter's record (``Param``) and the closed sets its fields take: what the parameter list
(titan_pipe.model.params) and each feature's own parameters (titan_pipe.model.features) are made of.
Pure data, no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from titan_pipe.model.args import ModelArgs

# The TP style of the module that owns a parameter (training/tensor_parallel.py builds the DTensor
# plan from it) and the dim of the parameter it splits (None: replicated).
# "replicate_heads": a replicated weight applied per attention head to the column-split heads (the
# q/k norms), so its input is split over tp on the heads dim and its gradient sums over tp.
# "replicate_input": a replicated weight applied to the replicated, whole-sequence input of a
# column-split linear (a LoRA adapter's A beside it), whatever the sequence layout between blocks.
# "replicate_output": a replicated weight whose output joins a row-split linear's output or the residual
# stream as a plain tensor, sequence-split under sequence parallel (a LoRA adapter's B beside a row-split
# base; Gemma 3's norms on a sub-layer's output).
TP_STYLES = ("colwise", "rowwise", "vocab", "replicate", "replicate_heads", "replicate_input", "replicate_output")
_WEIGHT_SPLIT = {
    "colwise": 0,
    "rowwise": 1,
    "vocab": 0,
    "replicate": None,
    "replicate_heads": None,
    "replicate_input": None,
    "replicate_output": None,
}
# Initial values (transformer.init_param): ones; zeros (biases); N(0, 0.02); N(0, 0.02 / sqrt(2
# n_layers)) for the projections back into the residual stream; N(0, dim^-0.5) for the output projection.
INITS = ("ones", "zeros", "normal", "depth_scaled", "fan_in")
# Pipeline owner: the first stage, the stage holding the layer, the last stage.
SCOPES = ("first", "layer", "last")


def _always(_args: ModelArgs) -> bool:
    return True


def _every_layer(_args: ModelArgs, _i: int) -> bool:
    return True


@dataclass(frozen=True)
class Param:
    """One parameter.

    ``name``, ``hf``, ``onnx`` and ``megatron`` of a per-layer parameter are relative to its layer
    (``layers.{i}.``, ``model.layers.{i}.``, ``layers.{i}.`` and ``decoder.layers.{i}.``).
    ``shape(args)``: the global shape. ``fused``: (Megatron's fused tensor, this parameter's part
    in it), e.g. ("qkv", "q"); the Megatron readers de-fuse it. ``rope``: rows in rotate-half RoPE
    order, which readers of interleaved-pair checkpoints (torchtitan/Meta, Megatron with
    rotary_interleaved) permute. ``vocab_rows``: dim 0 is the vocabulary (Megatron pads it).
    ``matmul``: the weight of a Linear (what autocast casts; the planner counts it).
    ``tp_dim``: the split dim under TP when it is not the style's weight dim (a rowwise bias: None).
    """

    name: str
    shape: Callable[[ModelArgs], tuple[int, ...]]
    tp: str
    scope: str
    hf: str
    onnx: str
    init: str = "normal"
    matmul: bool = True
    megatron: tuple[str, ...] = ()
    fused: tuple[str, str] | None = None
    rope: bool = False
    vocab_rows: bool = False
    when: Callable[[ModelArgs], bool] = _always
    tp_dim: int | None | str = "style"
    in_layer: Callable[[ModelArgs, int], bool] = _every_layer  # per-layer entries: does layer i hold it
    expert: bool = False  # dim 0 indexes the experts (one Hugging Face tensor per expert)

    def __post_init__(self):
        if self.tp not in TP_STYLES or self.init not in INITS or self.scope not in SCOPES:
            raise ValueError(
                f"parameter {self.name!r}: tp {self.tp!r}, init {self.init!r} or scope "
                f"{self.scope!r} is not one of {TP_STYLES}, {INITS}, {SCOPES}"
            )
        if self.tp_dim == "style":
            object.__setattr__(self, "tp_dim", _WEIGHT_SPLIT[self.tp])

    @property
    def module(self) -> str:
        """The owning module (``attention.wq``), relative to the layer for per-layer parameters."""
        return self.name.rsplit(".", 1)[0]
