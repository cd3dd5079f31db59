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


def _product_row(name: str, description: str, gate, onnx_product, *, large: float, tiny: float) -> Conformance:
    """The gated product gate(a) * b as the model runs it: the kind's own torch gate and ONNX product."""
    return Conformance(
        name,
        description,
        _ab,
        _torch(lambda F, a, b: gate(F, a) * b),
        lambda nodes, g, n, eps: onnx_product(nodes, g, n["a"], n["b"], name),
        large=large,
        tiny=tiny,
    )


def _silu(F, x):
    return F.silu(x)


def _swiglu(nodes, g, gate, up, name):
    return nodes.swiglu(g, gate, up, name)


def _gelu_tanh(F, x):
    return F.gelu(x, approximate="tanh")


def _geglu(nodes, g, gate, up, name):
    return nodes.geglu(g, gate, up, name)


SILU = Gate(
    name="silu",
    label="SwiGLU",
    torch_gate=_silu,
    onnx_product=_swiglu,
    conformance=(
        Conformance(
            "silu",
            "SiLU x * sigmoid(x)",
            _x,
            _torch(_silu),
            lambda nodes, b, n, eps: nodes.silu(b, n["x"], "silu"),
        ),
        # tiny 1e-2: the product of two 1e-4 values is below float16's subnormals, which would test
        # underflow, not the kernel.
        _product_row("swiglu", "SwiGLU silu(a) * b", _silu, _swiglu, large=100.0, tiny=1e-2),
    ),
)

GELU_TANH = Gate(
    name="gelu_tanh",
    label="GeGLU",
    torch_gate=_gelu_tanh,
    onnx_product=_geglu,
    # large 30: the cube inside the tanh approximation stays inside float16's range (30^3 = 27,000)
    conformance=(
        _product_row(
            "geglu",
            "GeGLU gelu_tanh(a) * b (Gemma; F.gelu approximate='tanh')",
            _gelu_tanh,
            _geglu,
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
