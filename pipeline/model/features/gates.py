"""The gated MLP's gate (``model.activation``): w2(gate(w1 x) * w3 x). Each kind is one record: its
name in flow.yaml and ModelArgs, how a person is told, its torch gate, its ONNX product and its
operator conformance rows. A model has exactly one (the default SwiGLU's silu; Gemma 3's GeGLU).

Hooks get what they compute with from their caller (torch.nn.functional, the ONNX node recipes), so
the model package stays free of torch and onnx at import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from titan_pipe.model.features.feature import Conformance, row_shape

if TYPE_CHECKING:
    from titan_pipe.model.args import ModelArgs


@dataclass(frozen=True)
class Gate:
    name: str  # ModelArgs.activation's value
    label: str  # "SwiGLU"
    product: str  # what the gated product is called in the operator table and the docs
    # torch: (torch.nn.functional, x) -> gate(x)
    torch_gate: Callable[[Any, Any], Any]
    # ONNX: (nodes, graph, gate input, up input, name) -> the gated product's name
    onnx_product: Callable[..., str]
    conformance: tuple[Conformance, ...] = ()


def _x(case: str, rng, scale: float) -> dict:
    return {"x": (rng.standard_normal(row_shape(case)) * scale).astype("float32")}


def _ab(case: str, rng, scale: float) -> dict:
    shape = row_shape(case)
    return {k: (rng.standard_normal(shape) * scale).astype("float32") for k in ("a", "b")}


def _torch(fn):
    """A conformance row's torch side: (kernels, eps, **tensors) with F imported when it runs."""

    def run(kernels, eps, **tensors):
        import torch.nn.functional as F

        return fn(F, **tensors)

    return run


SILU = Gate(
    name="silu",
    label="SwiGLU",
    product="swiglu",
    torch_gate=lambda F, x: F.silu(x),
    onnx_product=lambda nodes, g, gate, up, name: nodes.swiglu(g, gate, up, name),
    conformance=(
        Conformance(
            "silu",
            "SiLU x * sigmoid(x)",
            _x,
            _torch(lambda F, x: F.silu(x)),
            lambda nodes, b, n, eps: nodes.silu(b, n["x"], "silu"),
        ),
        # tiny 1e-2: the product of two 1e-4 values is below float16's subnormals, which would test
        # underflow, not the kernel.
        Conformance(
            "swiglu",
            "SwiGLU silu(a) * b",
            _ab,
            _torch(lambda F, a, b: F.silu(a) * b),
            lambda nodes, b, n, eps: nodes.swiglu(b, n["a"], n["b"], "swiglu"),
            large=100.0,
            tiny=1e-2,
        ),
    ),
)

GELU_TANH = Gate(
    name="gelu_tanh",
    label="GeGLU",
    product="geglu",
    torch_gate=lambda F, x: F.gelu(x, approximate="tanh"),
    onnx_product=lambda nodes, g, gate, up, name: nodes.geglu(g, gate, up, name),
    conformance=(
        # large 30: the cube inside the tanh approximation stays inside float16's range (30^3 = 27,000)
        Conformance(
            "geglu",
            "GeGLU gelu_tanh(a) * b (Gemma; F.gelu approximate='tanh')",
            _ab,
            _torch(lambda F, a, b: F.gelu(a, approximate="tanh") * b),
            lambda nodes, b, n, eps: nodes.geglu(b, n["a"], n["b"], "geglu"),
            large=30.0,
            tiny=1e-2,
        ),
    ),
)

GATES: dict[str, Gate] = {g.name: g for g in (SILU, GELU_TANH)}
DEFAULT = SILU


def gate_of(args: "ModelArgs") -> Gate:
    """The model's gate (validate_args has refused an unknown name)."""
    return GATES[args.activation]


def choices() -> str:
    """'silu (SwiGLU) or gelu_tanh (GeGLU)': the kinds, for an error's fix."""
    return " or ".join(f"{g.name} ({g.label})" for g in GATES.values())
