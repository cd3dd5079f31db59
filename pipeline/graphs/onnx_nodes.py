"""The ONNX node recipes of the deployed graphs: each operator of the model as the nodes the exporter emits.

The export graph builder (titan_pipe.convert.onnx.graphs) assembles its prefill and decode graphs
from these recipes, and evaluate's operator conformance (titan_pipe.evaluate.operators) runs each
recipe alone against the PyTorch operator, so the check exercises exactly what is deployed.
The math is titan_pipe.model.transformer's, op for op:

  embedding  Gather(table, ids, axis 0)
  linear     Gemm(x2d, W[, bias], transB=1) on the weight as stored (out, in): no transposed copy;
             a q/k/v bias (Qwen2) is Gemm's C input
  rms_norm   Cast(float32) -> Pow -> ReduceMean -> Add(eps) -> Sqrt -> Div [-> Cast back] -> Mul(weight),
             over the last axis: the hidden size, or each head's head_dim (Qwen3's q/k norms);
             ``offset`` (Gemma): Mul(1 + weight) in float32, then the cast back
  rotary     rotate-half, real-valued: x*cos + concat(-x[..., half:], x[..., :half])*sin (Slice/Neg/Concat)
  repeat_kv  each kv head repeated n_heads/n_kv_heads times (Unsqueeze -> Expand -> Reshape)
  attention  q*scale @ k^T -> Where(allowed, scores, finfo.min) -> Softmax -> @ v: a row with every
             key masked (a left padding query) gives a uniform row instead of NaN
  window     Mistral's sliding window: query position - key position (Sub) < window (Less), And'ed
             into the allowed keys
  silu       x * Sigmoid(x);  swiglu: silu(gate) * up
  gelu_tanh  0.5 x (1 + Tanh(sqrt(2/pi) (x + 0.044715 x^3)));  geglu: gelu_tanh(gate) * up (Gemma;
             ONNX's Gelu is opset 20, beyond ATC's 14/15)
  scale      the embeddings times sqrt(dim) in the graph dtype (Gemma)
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from titan_pipe.rules.dtypes import onnx_type

NP_DTYPES = {"float32": np.float32, "float16": np.float16}
_LOWEST = {
    "float32": float(np.finfo(np.float32).min),
    "float16": float(np.finfo(np.float16).min),
    "bfloat16": -3.3895313892515355e38,
}  # torch.finfo(torch.bfloat16).min, exact in float32


class NodeBuilder:
    """Nodes and small constants of one graph computing in ``dtype``; each node has one output,
    named after the node (``name``), or numbered when no name is given."""

    def __init__(self, dtype: str):
        self.nodes: list[onnx.NodeProto] = []
        self.consts: list[TensorProto] = []
        self.dtype = dtype
        self.elem = onnx_type(dtype)
        self._const_names: dict[tuple, str] = {}

    def op(self, op_type: str, inputs: list[str], name: str | None = None, **attrs) -> str:
        name = name or f"{op_type.lower()}.{len(self.nodes)}"
        self.nodes.append(helper.make_node(op_type, inputs, [name], name=name, **attrs))
        return name

    def ops(self, op_type: str, inputs: list[str], names: list[str], **attrs) -> list[str]:
        """A node with several outputs (TopK), named ``names``."""
        self.nodes.append(helper.make_node(op_type, inputs, names, name=names[0], **attrs))
        return names

    def const(self, value, dtype=np.int64) -> str:
        """A small constant initializer (shapes, axes, scalars, masks), shared by value."""
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._const_names:
            name = f"const.{len(self._const_names)}"
            self.consts.append(numpy_helper.from_array(arr, name))
            self._const_names[key] = name
        return self._const_names[key]

    def fconst(self, value) -> str:
        """A constant in the graph dtype (bfloat16, which numpy lacks: float32 cast in the graph)."""
        if self.dtype in NP_DTYPES:
            return self.const(value, NP_DTYPES[self.dtype])
        return self.op("Cast", [self.const(value, np.float32)], to=self.elem)

    @property
    def lowest(self) -> float:
        """The graph dtype's lowest finite value (what masked attention scores become)."""
        return _LOWEST[self.dtype]


def embedding(g: NodeBuilder, table: str, ids: str, name: str | None = None) -> str:
    """(vocab, dim) table, (B, T) ids -> (B, T, dim)."""
    return g.op("Gather", [table, ids], name, axis=0)


def linear(g: NodeBuilder, x2d: str, weight: str, name: str | None = None, bias: str | None = None) -> str:
    """(N, in) @ W^T (+ bias (out,), Gemm's C input) with W (out, in) as stored -> (N, out)."""
    return g.op("Gemm", [x2d, weight] + ([bias] if bias else []), name, transB=1)


def rms_norm(g: NodeBuilder, x: str, weight: str, eps: float, name: str, offset: bool = False) -> str:
    """Statistics in float32 whatever the graph dtype (as kernels.rms_norm_ref), then cast back;
    ``offset``: Gemma's norm, times (1 + weight) in float32 before the cast (kernels.rms_norm_offset)."""
    xf = g.op("Cast", [x], f"{name}.cast_in", to=TensorProto.FLOAT) if g.dtype != "float32" else x
    sq = g.op("Pow", [xf, g.const(2.0, np.float32)], f"{name}.pow")
    ms = g.op("ReduceMean", [sq], f"{name}.mean", axes=[-1], keepdims=1)
    den = g.op("Sqrt", [g.op("Add", [ms, g.const(eps, np.float32)], f"{name}.add_eps")], f"{name}.sqrt")
    n = g.op("Div", [xf, den], f"{name}.div")
    if offset:
        wf = g.op("Cast", [weight], f"{name}.weight_f32", to=TensorProto.FLOAT) if g.dtype != "float32" else weight
        out = g.op("Mul", [n, g.op("Add", [wf, g.const(1.0, np.float32)], f"{name}.one_plus_w")], f"{name}.scaled")
        return out if g.dtype == "float32" else g.op("Cast", [out], f"{name}.out", to=g.elem)
    if g.dtype != "float32":
        n = g.op("Cast", [n], f"{name}.cast_out", to=g.elem)
    return g.op("Mul", [weight, n], f"{name}.out")


def rotary(g: NodeBuilder, x: str, cos: str, sin: str, half: int, name: str) -> str:
    """x*cos + rotate_half(x)*sin, rotate_half(x) = concat(-x[..., half:], x[..., :half]);
    cos/sin broadcast against x (..., T, 2*half)."""
    axis = g.const([-1])
    lo = g.op("Slice", [x, g.const([0]), g.const([half]), axis], f"{name}.lo")
    hi = g.op("Slice", [x, g.const([half]), g.const([2 * half]), axis], f"{name}.hi")
    rot = g.op("Concat", [g.op("Neg", [hi], f"{name}.neg"), lo], f"{name}.rot", axis=-1)
    return g.op("Add", [g.op("Mul", [x, cos], f"{name}.xcos"), g.op("Mul", [rot, sin], f"{name}.rsin")], f"{name}.out")


def repeat_kv(g: NodeBuilder, x: str, n_rep: int, n_heads: int, hd: int, name: str) -> str:
    """(B, Hkv, S, hd) -> (B, Hkv*n_rep, S, hd): kv head j serves query heads j*n_rep .. j*n_rep+n_rep-1."""
    if n_rep == 1:
        return x
    u = g.op("Unsqueeze", [x, g.const([2])], f"{name}.unsqueeze")
    e = g.op("Expand", [u, g.const([1, 1, n_rep, 1, 1])], f"{name}.expand")
    return g.op("Reshape", [e, g.const([0, n_heads, -1, hd])], f"{name}.reshape")


def attention(
    g: NodeBuilder,
    q: str,
    k: str,
    v: str,
    allowed: str,
    *,
    n_heads: int,
    n_kv_heads: int,
    hd: int,
    name: str,
    scale: float | None = None,
) -> str:
    """q (B, H, T, hd), k/v (B, Hkv, S, hd), allowed (bool, broadcast to (B, H, T, S)) -> context
    (B, H, T, hd), q scaled by ``scale`` (None: hd^-1/2). Masked scores become the dtype's lowest
    finite value before Softmax."""
    n_rep = n_heads // n_kv_heads
    kr = repeat_kv(g, k, n_rep, n_heads, hd, f"{name}.repeat_k")
    vr = repeat_kv(g, v, n_rep, n_heads, hd, f"{name}.repeat_v")
    kt = g.op("Transpose", [kr], f"{name}.k_t", perm=[0, 1, 3, 2])
    scale = 1.0 / np.sqrt(hd) if scale is None else scale
    scores = g.op("MatMul", [g.op("Mul", [q, g.fconst(scale)], f"{name}.q_scaled"), kt], f"{name}.scores")
    masked = g.op("Where", [allowed, scores, g.fconst(g.lowest)], f"{name}.masked")
    probs = g.op("Softmax", [masked], f"{name}.probs", axis=-1)
    return g.op("MatMul", [probs, vr], f"{name}.context")


def within_window(g: NodeBuilder, allowed: str, gap: str, window: int, name: str) -> str:
    """``allowed`` And (``gap`` < ``window``): ``gap`` (int64) is query position - key position, so a
    query keeps its ``window`` newest positions, itself included (Mistral's sliding window)."""
    near = g.op("Less", [gap, g.const(window)], f"{name}.near")
    return g.op("And", [allowed, near], f"{name}.allowed")


def silu(g: NodeBuilder, x: str, name: str) -> str:
    return g.op("Mul", [x, g.op("Sigmoid", [x], f"{name}.sigmoid")], f"{name}.silu")


def swiglu(g: NodeBuilder, gate: str, up: str, name: str) -> str:
    """silu(gate) * up: the SwiGLU product before the down projection."""
    return g.op("Mul", [silu(g, gate, name), up], f"{name}.gated")


def gelu_tanh(g: NodeBuilder, x: str, name: str) -> str:
    """GELU's tanh approximation (F.gelu(x, approximate="tanh")) from Mul/Add/Tanh."""
    cube = g.op("Mul", [g.op("Mul", [x, x], f"{name}.x2"), x], f"{name}.x3")
    inner = g.op("Add", [x, g.op("Mul", [cube, g.fconst(0.044715)], f"{name}.cubic")], f"{name}.inner")
    t = g.op("Tanh", [g.op("Mul", [inner, g.fconst(float(np.sqrt(2.0 / np.pi)))], f"{name}.arg")], f"{name}.tanh")
    return g.op(
        "Mul",
        [g.op("Mul", [x, g.fconst(0.5)], f"{name}.half"), g.op("Add", [t, g.fconst(1.0)], f"{name}.one_plus")],
        f"{name}.gelu",
    )


def geglu(g: NodeBuilder, gate: str, up: str, name: str) -> str:
    """gelu_tanh(gate) * up: Gemma's gated product before the down projection."""
    return g.op("Mul", [gelu_tanh(g, gate, name), up], f"{name}.gated")


def route(g: NodeBuilder, x2d: str, router: str, *, top_k: int, norm_topk: bool, name: str) -> tuple[str, str]:
    """A mixture of experts' router (as titan_pipe.model.transformer.MoE.route): softmax over the
    experts in float32, the top k, renormalized to sum to 1 with ``norm_topk``. Returns (their
    weights (N, k) float32, the chosen experts (N, k) int64: ``{name}.topk``)."""
    logits = linear(g, x2d, router, f"{name}.router")
    if g.dtype != "float32":
        logits = g.op("Cast", [logits], f"{name}.router.cast", to=TensorProto.FLOAT)
    probs = g.op("Softmax", [logits], f"{name}.probs", axis=-1)
    top, chosen = g.ops(
        "TopK", [probs, g.const([top_k])], [f"{name}.topk.values", f"{name}.topk"], axis=-1, largest=1, sorted=1
    )
    if norm_topk:
        top = g.op(
            "Div", [top, g.op("ReduceSum", [top, g.const([-1])], f"{name}.topk.sum", keepdims=1)], f"{name}.topk.norm"
        )
    return top, chosen


def gates(g: NodeBuilder, top: str, chosen: str, *, experts: int, name: str) -> str:
    """The experts' gates (N, E) in the graph dtype: the top-k weights where chosen, 0 elsewhere; a
    one-hot of the chosen experts from Equal against Range (ScatterElements and OneHot are not on
    ATC's list)."""
    hot = g.op(
        "Equal",
        [g.op("Unsqueeze", [chosen, g.const([-1])], f"{name}.topk.col"), g.const(np.arange(experts))],
        f"{name}.onehot",
    )
    weighted = g.op(
        "Mul",
        [
            g.op("Cast", [hot], f"{name}.onehot.f", to=TensorProto.FLOAT),
            g.op("Unsqueeze", [top, g.const([-1])], f"{name}.topk.values.col"),
        ],
        f"{name}.onehot.w",
    )
    out = g.op("ReduceSum", [weighted, g.const([1])], f"{name}.gates", keepdims=0)
    if g.dtype != "float32":
        out = g.op("Cast", [out], f"{name}.gates.cast", to=g.elem)
    return out


def experts(g: NodeBuilder, x2d: str, gated: str, w1: str, w3: str, w2: str, name: str) -> str:
    """Every expert on every token, weighted by its gate in ``gated`` (N, E; 0 where not chosen) and summed: the
    dense-weighted form, for many tokens (prefill; docs/moe.md, "Export"). Weights
    stacked (E, out, in): x (N, d) @ W1^T (E, d, h) -> (E, N, h) ... -> (N, d)."""

    def t(w):  # (E, out, in) -> (E, in, out); a transpose of an initializer, folded by the runtimes
        return g.op("Transpose", [w], f"{w}.t", perm=[0, 2, 1])

    act = swiglu(g, g.op("MatMul", [x2d, t(w1)], f"{name}.w1"), g.op("MatMul", [x2d, t(w3)], f"{name}.w3"), name)
    y = g.op("MatMul", [act, t(w2)], f"{name}.w2")
    weight = g.op(
        "Unsqueeze", [g.op("Transpose", [gated], f"{name}.gates.t", perm=[1, 0]), g.const([-1])], f"{name}.gates.col"
    )
    return g.op("ReduceSum", [g.op("Mul", [y, weight], f"{name}.weighted"), g.const([0])], f"{name}.sum", keepdims=0)


def experts_gathered(
    g: NodeBuilder, x2d: str, top: str, chosen: str, w1: str, w3: str, w2: str, *, top_k: int, dim: int, name: str
) -> str:
    """Each token's k chosen experts only: their weights gathered from the stacks (Gather on dim 0 by
    the chosen ids: (N, k, out, in)), one small matmul per (token, slot), weighted by ``top`` (N, k)
    and summed: the form for few tokens (decode), whose work grows with k, not with E."""

    def picked(w):  # (E, out, in) -> (N, k, in, out)
        return g.op(
            "Transpose",
            [g.op("Gather", [w, chosen], f"{name}.{w.rsplit('.', 1)[-1]}.picked", axis=0)],
            f"{name}.{w.rsplit('.', 1)[-1]}.picked.t",
            perm=[0, 1, 3, 2],
        )

    x = g.op("Unsqueeze", [x2d, g.const([1, 2])], f"{name}.x")  # (N, 1, 1, d)
    act = swiglu(
        g, g.op("MatMul", [x, picked(w1)], f"{name}.w1"), g.op("MatMul", [x, picked(w3)], f"{name}.w3"), name
    )  # (N, k, 1, h)
    y = g.op(
        "Reshape", [g.op("MatMul", [act, picked(w2)], f"{name}.w2"), g.const([-1, top_k, dim])], f"{name}.y"
    )  # (N, k, d)
    weight = top if g.dtype == "float32" else g.op("Cast", [top], f"{name}.top.cast", to=g.elem)
    weight = g.op("Unsqueeze", [weight, g.const([-1])], f"{name}.top.col")
    return g.op("ReduceSum", [g.op("Mul", [y, weight], f"{name}.weighted"), g.const([1])], f"{name}.sum", keepdims=0)
