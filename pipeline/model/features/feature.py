"""What one architectural feature is, as data: the record every feature file fills in.

A feature owns everything about itself that a stage needs: the ModelArgs switch that turns it on
(``name``; flow.yaml's ``model.<name>``), its parameters (rows of the parameter list, with their
names in every format and their TP style), the Megatron-LM
argument that says it, its forward in the torch module, its ONNX node recipe, its operator
conformance rows, its planner memory terms, and how a checkpoint's tensors show it. The stages
iterate ``titan_pipe.model.features.FEATURES`` and call these; none tests the switch itself.

Pure data and plain functions: a hook gets what it computes with from its caller (a norm factory,
the ONNX node recipes, the kernels), so the model package stays free of torch and onnx at import.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING, Any, Callable

from titan_pipe.model.param_spec import Param
from titan_pipe.rules.limits import Bound

if TYPE_CHECKING:
    from titan_pipe.model.args import ModelArgs


@dataclass(frozen=True)
class Conformance:
    """One operator conformance row (titan_pipe.evaluate.operators runs it in every dtype and case).

    ``inputs(case, rng, scale)`` -> {name: float32 array}; ``torch_fn(kernels, eps, **tensors)`` -> the
    training kernel's output; ``graph(nodes, builder, names, eps)`` -> the ONNX output name, built with
    titan_pipe.graphs.onnx_nodes (passed in as ``nodes``)."""

    name: str
    description: str
    inputs: Callable[[str, Any, float], dict]
    torch_fn: Callable[..., Any]
    graph: Callable[..., str]
    norm: bool = False  # a norm row: a model with offset norms runs the offset row instead
    large: float = 300.0  # the input magnitude of the "large" case (inside float16's range for a correct kernel)
    tiny: float = 1e-4  # of the "tiny" case


@dataclass(frozen=True)
class RopeTable:
    """One RoPE table layers rotate with: ``name`` ("" the model's main table, rope_theta with the
    configured scaling), its base, and whether the configured scaling applies to it."""

    name: str
    theta: float
    scaled: bool

    @property
    def suffix(self) -> str:
        """What its buffers' and initializers' names end with (``rope_cos`` + suffix)."""
        return f"_{self.name}" if self.name else ""


def row_shape(case: str) -> tuple[int, int]:
    """(rows, row length) of a conformance row's 2-D inputs: long rows test reductions over many elements."""
    return (4, 8192) if case == "long" else (16, 64)


@dataclass(frozen=True)
class Feature:
    name: str  # the ModelArgs field that turns it on (a bool switch, or a value: 0 / None is off)
    label: str  # how a person is told (inspect, errors): "q/k norms"
    # True: a bool an architecture always has or never has (titan_pipe.model.families); False: a value
    # a family's config states (Gemma 3's layer pattern), not part of what tells families apart
    switch: bool = True
    # (ModelArgs field, the property two models are compared on) of each value it owns; empty: (name, name)
    compared: tuple[tuple[str, str], ...] = ()
    # (ModelArgs field, its bound) of each numeric value it owns: flow.yaml and every reader check them
    bounds: tuple[tuple[str, Bound], ...] = ()
    params: tuple[Param, ...] = ()  # per-layer rows of the parameter list, each ``when`` this is on
    megatron_arg: str | None = None  # the Megatron-LM argument that turns it on
    megatron_negated: bool = False  # ... or that turns it off (Megatron's untie_embeddings_and_output_weights)
    # the config.json key (a bool, false when absent) every family states it by (Hugging Face's tie_word_embeddings)
    hf_key: str | None = None
    # (parameter, the parameter it reads) while on: one tensor held and stored once under the second name
    shares: tuple[tuple[str, str], ...] = ()
    # of the properties it is compared on, those that size tensors (a feature with parameters or shared
    # tensors: its name); the others change the numerics only
    shaped: tuple[str, ...] = ()
    rotate_half_in_torchtitan: bool = False  # torchtitan's model with it stores q/k rows rotate-half
    biased_projections: tuple[str, ...] = ()  # of "q", "k", "v": the attention projections that get a bias
    adds_flops: bool = False  # each of its (matmul-free) parameters costs one add per token (a bias)
    # torch: (attention module, args, make_norm(width)) -> sets the module's parameters (their ``params`` names)
    build_attention: Callable[[Any, "ModelArgs", Callable], None] | None = None
    # torch: (attention module, "q" | "k" | "v", (B, T, heads, hd)) -> the same shape, before RoPE
    attention_heads: Callable[[Any, str, Any], Any] | None = None
    # ONNX: (nodes, graph, y, part, weight(native name) -> initializer, eps, prefix, offset) -> y
    onnx_heads: Callable[..., str] | None = None
    # torch: (transformer block, args, make_norm(width)) -> sets the block's own modules (``params``)
    build_block: Callable[[Any, "ModelArgs", Callable], None] | None = None
    # torch: (block, "attention" | "mlp", (B, T, dim) the sub-layer's output) -> what its residual add takes
    sublayer_output: Callable[[Any, str, Any], Any] | None = None
    # ONNX: (nodes, graph, y, part, weight(native name) -> initializer, eps, prefix, offset) -> y
    onnx_sublayer_output: Callable[..., str] | None = None
    # torch: ((B, T, dim) embedding rows, args) -> the rows the first layer takes
    embed: Callable[[Any, "ModelArgs"], Any] | None = None
    # ONNX: (graph, the embedding's output, args) -> the value the first layer takes
    onnx_embed: Callable[..., str] | None = None
    # its model's RMSNorm weights are offsets from 1 (multiplied as 1 + w, in float32; initialised at 0)
    offset_norms: bool = False
    # planner: (args, resid dtype bytes, tp, seq: tp under sequence parallel else 1) -> {term: bytes one
    # token keeps for backward, per layer}
    activation_terms: Callable[["ModelArgs", int, int, int], dict[str, float]] | None = None
    conformance: tuple[Conformance, ...] = ()
    # RoPE: (args) -> a table besides the main one, and (args, layer) -> the name of the table it rotates with
    rope_table: Callable[["ModelArgs"], RopeTable] | None = None
    layer_rope: Callable[["ModelArgs", int], str] | None = None
    # attention: (args) -> the factor on q.k in place of head_dim^-1/2
    attention_scale: Callable[["ModelArgs"], float] | None = None
    # (args) -> one line per value it cannot compute, each naming the fix (asked whether on or not)
    check: Callable[["ModelArgs"], list[str]] | None = None
    # planner: (args, seq_len, bytes per element) -> bytes of the attention mask it keeps for backward,
    # per layer and microbatch
    mask_bytes: Callable[["ModelArgs", int, float], float] | None = None
    # ONNX: (nodes, graph, args, allowed, decode=, attention_mask=, position_ids=) -> the keys each query
    # may see (bool) narrowed by it
    onnx_mask: Callable[..., str] | None = None
    # Megatron-LM: (its args namespace, the checkpoint dir, arg(a, name, kind, root, default=, bound=): one
    # argument read typed) -> {ModelArgs field: value} of the fields it owns
    read_megatron: Callable[[Any, Any, Callable], dict] | None = None
    # (a model dict: ModelArgs.to_dict) -> how inspect names it, when its label is not enough
    describe: Callable[[dict], str] | None = None

    def on(self, args: "ModelArgs") -> bool:
        return bool(getattr(args, self.name))

    def shape_keys(self) -> tuple[str, ...]:
        """The properties two models' tensors are sized by, of those it owns (ModelArgs.SHAPE_KEYS)."""
        return (self.name,) if self.params or self.shares else self.shaped

    def compared_fields(self) -> tuple[tuple[str, str], ...]:
        return self.compared or ((self.name, self.name),)

    def layer_params(self, args: "ModelArgs") -> int:
        """Parameters it adds to each layer (0 when off)."""
        return sum(prod(p.shape(args)) for p in self.params) if self.on(args) else 0

    def layer_matmul_free(self, args: "ModelArgs") -> int:
        """Of those, the ones no matmul multiplies (norm weights, biases): not in the 6N FLOPs."""
        return sum(prod(p.shape(args)) for p in self.params if not p.matmul) if self.on(args) else 0

    def layer_adds(self, args: "ModelArgs") -> int:
        """Forward FLOPs per token per layer besides the matmuls (a bias: one add per element)."""
        return self.layer_matmul_free(args) if self.adds_flops else 0

    def shown_in(self, shapes: dict[str, tuple[int, ...]]) -> bool | None:
        """Whether a checkpoint whose tensors are ``shapes`` (native names) has it: its layer-0
        parameters are there, or the tensors it shares are not; None where tensors do not show it
        (a value feature without parameters: a window, a scale)."""
        if self.shares:
            return not any(name in shapes for name, _ in self.shares)
        if not self.switch and not self.params:
            return None
        return any(f"layers.0.{p.name}" in shapes for p in self.params)
