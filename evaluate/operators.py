"""Per-operator conformance: each operator the model uses, alone, in PyTorch and in ONNX Runtime.

For every (operator, dtype, input case) the same float32 inputs are rounded to the dtype on both
sides; PyTorch runs the training operator (titan_pipe.model.kernels's reference kernels, torch.nn.functional
otherwise) and ONNX Runtime runs a small opset-14 graph of the very nodes the exporter emits: the
recipes of titan_pipe.graphs.onnx_nodes (e.g. RMSNorm as Cast/Pow/ReduceMean/Add/Sqrt/Div in float32), so
the check cannot drift from what is deployed. Graph inputs are float32 and cast to the dtype inside
the graph, the output is cast back to float32 (exact), so bfloat16 needs no numpy bfloat16 type.

Where ONNX Runtime has no kernel for an operator in a dtype the row says so ("skipped: ORT has no
bfloat16 Softmax kernel"), never a pass. Note: for float16, ONNX Runtime's CPU provider inserts
Casts around operators it only has in float32, so some float16 rows measure float32 arithmetic
with float16 rounding at the boundaries; that is what ORT on CPU really executes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from titan_pipe.graphs import onnx_nodes as nodes
from titan_pipe.rules.dtypes import FLOAT_NAMES, TORCH_BY_NAME
from titan_pipe.errors import UserError
from titan_pipe.evaluate.metrics import TensorMetrics, compare_tensors
from titan_pipe.graphs.generation import ort_session
from titan_pipe.model import features, kernels
from titan_pipe.model.features import gates
from titan_pipe.model.features.feature import row_shape
from titan_pipe.model.kernels import apply_rotary_ref, attention_ref, rms_norm_ref
from titan_pipe.rules.thresholds import check_metrics, resolve_thresholds

PROBE_OPSET = 14  # the opset of the one-operator probe graphs built here (the export's is export.opset)
CASES = ("normal", "large", "tiny", "long")


class OpGraph(nodes.NodeBuilder):
    """One small ONNX graph computing in ``dtype`` with float32 inputs and output."""

    def __init__(self, dtype: str):
        super().__init__(dtype)
        self.inputs = []

    def input(self, name: str, array: np.ndarray) -> str:
        """A graph input; float inputs come in as float32 and are cast to the working dtype."""
        from onnx import TensorProto, helper

        if array.dtype == np.int64:
            self.inputs.append(helper.make_tensor_value_info(name, TensorProto.INT64, array.shape))
            return name
        self.inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, array.shape))
        return name if self.elem == TensorProto.FLOAT else self.op("Cast", [name], f"{name}.in", to=self.elem)

    def model(self, out: str):
        from onnx import TensorProto, helper

        final = out if self.elem == TensorProto.FLOAT else self.op("Cast", [out], to=TensorProto.FLOAT)
        self.nodes.append(helper.make_node("Identity", [final], ["y"]))
        graph = helper.make_graph(
            self.nodes,
            "op",
            self.inputs,
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
            initializer=self.consts,
        )
        return helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", PROBE_OPSET)], producer_name="titan-pipe-evaluate"
        )


@dataclass(frozen=True)
class OpSpec:
    """One operator family: its inputs per case, its PyTorch form and its ONNX graph.

    inputs(case, rng) -> {name: float32 or int64 array}; torch_fn(dict of tensors in dtype) -> tensor;
    graph(OpGraph, dict of graph names, arrays) -> output name, built from titan_pipe.graphs.onnx_nodes. ``large``/``tiny`` are the input
    magnitudes of those cases, chosen to stay inside float16's range for a correct kernel.
    """

    name: str
    description: str
    inputs: Callable
    torch_fn: Callable
    graph: Callable
    large: float = 300.0
    tiny: float = 1e-4
    dtypes: tuple[str, ...] = FLOAT_NAMES
    # the ModelArgs switch whose models use it, or a test of ModelArgs (None: every model)
    family: str | Callable | None = None


def _scale(case: str, spec) -> float:
    return {"normal": 1.0, "large": spec.large, "tiny": spec.tiny, "long": 1.0}[case]


_rows = row_shape  # (rows, row length), as the features' own rows


def _randn(rng, shape, scale):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# -- embedding gather ------------------------------------------------------------------------


def _emb_inputs(case, rng, spec):
    vocab = 4096 if case == "long" else 320
    return {
        "weight": _randn(rng, (vocab, 64), _scale(case, spec)),
        "ids": rng.integers(0, vocab, size=(2, 16)).astype(np.int64),
    }


def _emb_graph(b, n, a):
    return nodes.embedding(b, n["weight"], n["ids"])


# -- linear / matmul -------------------------------------------------------------------------


def _linear_inputs(case, rng, spec):
    rows, k = _rows(case)
    n_out = 256 if case == "long" else 96
    return {"x": _randn(rng, (rows, k), _scale(case, spec)), "w": _randn(rng, (n_out, k), 1.0 / math.sqrt(k))}


def _linear_graph(b, n, a):
    return nodes.linear(b, n["x"], n["w"])


# -- RMSNorm ---------------------------------------------------------------------------------

EPS = 1e-5


def _norm_inputs(case, rng, spec):
    rows, d = _rows(case)
    return {
        "x": _randn(rng, (rows, d), _scale(case, spec)),
        "weight": (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32),
    }


def _norm_graph(b, n, a):
    return nodes.rms_norm(b, n["x"], n["weight"], EPS, "norm")


# -- RoPE (rotate-half) ----------------------------------------------------------------------


def _rope_inputs(case, rng, spec):
    from titan_pipe.model.args import ModelArgs
    from titan_pipe.model.transformer import rope_cos_sin

    t = 256 if case == "long" else 16
    cos, sin = rope_cos_sin(ModelArgs(dim=64, n_heads=4, max_seq_len=t), t)
    return {"q": _randn(rng, (2, 4, t, 16), _scale(case, spec)), "cos": cos.numpy(), "sin": sin.numpy()}


def _rope_torch(q, cos, sin):
    return apply_rotary_ref(q, q, cos, sin)[0]


def _rope_graph(b, n, a):
    return nodes.rotary(b, n["q"], n["cos"], n["sin"], a["q"].shape[-1] // 2, "rope")


# -- attention with causal mask and GQA ------------------------------------------------------

N_HEADS, N_KV = 4, 2


def _attn_inputs(case, rng, spec):
    t = 256 if case == "long" else 16
    s = _scale(case, spec)
    return {k: _randn(rng, (2, N_HEADS if k == "q" else N_KV, t, 16), s) for k in ("q", "k", "v")}


def _attn_torch(q, k, v):
    return attention_ref(q, k, v, n_rep=N_HEADS // N_KV, causal=True)


def _attn_graph(b, n, a):
    _, _, t, hd = a["q"].shape
    causal = b.const(np.tril(np.ones((t, t), dtype=bool)), dtype=bool)  # key <= query, as the prefill mask
    return nodes.attention(b, n["q"], n["k"], n["v"], causal, n_heads=N_HEADS, n_kv_heads=N_KV, hd=hd, name="attn")


WINDOW = 5  # shorter than every case's sequence, so the band cuts every row past the fifth


def _window_torch(q, k, v):
    return attention_ref(q, k, v, n_rep=N_HEADS // N_KV, causal=True, window=WINDOW)


def _window_graph(b, n, a):
    """The exported prefill's window term: position gaps (query - key) < WINDOW, And'ed in."""
    _, _, t, hd = a["q"].shape
    pos = np.arange(t)
    causal = b.const(pos[None, :] <= pos[:, None], dtype=bool)
    allowed = nodes.within_window(b, causal, b.const(pos[:, None] - pos[None, :]), WINDOW, "window")
    return nodes.attention(b, n["q"], n["k"], n["v"], allowed, n_heads=N_HEADS, n_kv_heads=N_KV, hd=hd, name="attn")


# -- softmax, SiLU/SwiGLU, residual add, cast ------------------------------------------------


def _x_inputs(case, rng, spec):
    return {"x": _randn(rng, _rows(case), _scale(case, spec))}


def _xy_inputs(case, rng, spec):
    shape = _rows(case)
    return {"a": _randn(rng, shape, _scale(case, spec)), "b": _randn(rng, shape, _scale(case, spec))}


def _plain_norms(args) -> bool:
    return not features.offset_norms(args)


def _cast_torch(x):
    # Round trip through the other precision: float32 rows go through float16 (the fp16 export's
    # casts), float16/bfloat16 rows up to float32 and back (RMSNorm's statistics).
    low = torch.float16 if x.dtype == torch.float32 else torch.float32
    return x.to(low).to(x.dtype)


def _cast_graph(b, n, a):
    from onnx import TensorProto

    low = TensorProto.FLOAT16 if b.elem == TensorProto.FLOAT else TensorProto.FLOAT
    return b.op("Cast", [b.op("Cast", [n["x"]], to=low)], to=b.elem)


def _row(row, family: Callable) -> OpSpec:
    """A conformance row of titan_pipe.model.features (a feature's, a gate kind's) as an OpSpec, run
    for the models ``family(args)`` says."""
    return OpSpec(
        row.name,
        row.description,
        lambda case, rng, spec: row.inputs(case, rng, _scale(case, spec)),
        lambda **tensors: row.torch_fn(kernels, EPS, **tensors),
        lambda b, n, a: row.graph(nodes, b, n, EPS),
        large=row.large,
        tiny=row.tiny,
        family=family,
    )


def _feature_row(feature, row) -> OpSpec:
    """A feature's own row: run for the models that have the feature; a norm row only where the
    model's norms are plain (an offset model's norms are the rms_norm_offset row)."""
    return _row(row, lambda args: feature.on(args) and not (row.norm and features.offset_norms(args)))


OPERATORS: tuple[OpSpec, ...] = (
    OpSpec(
        "embedding",
        "embedding gather (Gather axis 0)",
        _emb_inputs,
        lambda weight, ids: F.embedding(ids, weight),
        _emb_graph,
    ),
    OpSpec(
        "linear",
        "linear x @ W^T (Gemm transB=1 on W as stored)",
        _linear_inputs,
        lambda x, w: F.linear(x, w),
        _linear_graph,
    ),
    OpSpec(
        "rms_norm",
        "RMSNorm, statistics in float32 (rms_norm_ref)",
        _norm_inputs,
        lambda x, weight: rms_norm_ref(x, weight, EPS),
        _norm_graph,
        family=_plain_norms,
    ),
    *(_feature_row(f, c) for f in features.FEATURES for c in f.conformance),
    OpSpec("rope", "RoPE rotate-half (apply_rotary_ref)", _rope_inputs, _rope_torch, _rope_graph),
    OpSpec(
        "attention",
        "causal GQA attention, 4 query / 2 kv heads (attention_ref)",
        _attn_inputs,
        _attn_torch,
        _attn_graph,
        large=8.0,
    ),
    OpSpec(
        "attention_window",
        f"sliding-window GQA attention, window {WINDOW} (Mistral; attention_ref)",
        _attn_inputs,
        _window_torch,
        _window_graph,
        large=8.0,
        family=features.windowed,
    ),
    OpSpec(
        "softmax",
        "softmax over the last axis",
        _x_inputs,
        lambda x: torch.softmax(x, dim=-1),
        lambda b, n, a: b.op("Softmax", [n["x"]], axis=-1),
        large=30.0,
    ),
    *(_row(c, lambda args, g=g: gates.gate_of(args) is g) for g in gates.GATES.values() for c in g.conformance),
    OpSpec(
        "residual_add",
        "residual add a + b",
        _xy_inputs,
        lambda a, b: a + b,
        lambda b, n, a: b.op("Add", [n["a"], n["b"]]),
    ),
    OpSpec(
        "cast",
        "cast round trip (float32 -> float16 -> float32; low -> float32 -> low)",
        _x_inputs,
        _cast_torch,
        _cast_graph,
    ),
)


@dataclass(frozen=True)
class OperatorRow:
    """One (operator, dtype, case) result. status: "pass", "fail" or "skipped: <reason>"."""

    op: str
    dtype: str
    case: str
    status: str
    shape: tuple[int, ...] = ()
    metrics: TensorMetrics | None = None
    failures: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict:
        return {
            "op": self.op,
            "dtype": self.dtype,
            "case": self.case,
            "status": self.status,
            "shape": list(self.shape),
            "metrics": self.metrics.to_dict() if self.metrics else None,
            "failures": list(self.failures),
        }


_MISSING_KERNEL = re.compile(r"implementation for (\w+)\((\d+)\)")
# An operator whose schema at this opset takes no such type (Where takes no bfloat16 before opset 16)
_UNTYPED = re.compile(r"Type 'tensor\((\w+)\)' of input parameter \(.*?\) of operator \((\w+)\)")


def model_operators(args) -> tuple[str, ...]:
    """The operators a model of ``args`` (ModelArgs) runs, in model order: the family's own (a q/k/v
    bias, q/k norms, a sliding window) only where its switch is on."""
    return tuple(
        s.name
        for s in OPERATORS
        if s.family is None or (s.family(args) if callable(s.family) else getattr(args, s.family))
    )


def run_operator(
    spec: OpSpec, dtype: str, case: str, *, seed: int = 0, limits: dict[str, float] | None = None
) -> OperatorRow:
    """Run one operator in both runtimes and judge it with the dtype's ``operator`` bounds."""
    if dtype not in spec.dtypes:
        return OperatorRow(spec.name, dtype, case, f"skipped: {spec.name} is not used in {dtype}")
    rng = np.random.default_rng(seed + 7919 * CASES.index(case))
    arrays = spec.inputs(case, rng, spec)
    tdt = TORCH_BY_NAME[dtype]
    with torch.no_grad():
        tensors = {
            k: torch.from_numpy(v) if v.dtype == np.int64 else torch.from_numpy(v).to(tdt) for k, v in arrays.items()
        }
        ref = spec.torch_fn(**tensors)
    b = OpGraph(dtype)
    names = {k: b.input(k, v) for k, v in arrays.items()}
    model = b.model(spec.graph(b, names, arrays))
    try:
        sess = ort_session(model, threads=1)
    except UserError as e:  # ORT's NotImplemented for a missing kernel, its type check for a schema
        m = _MISSING_KERNEL.search(str(e))
        if m:
            return OperatorRow(
                spec.name, dtype, case, f"skipped: ORT has no {dtype} {m.group(1)} kernel (opset {m.group(2)}, CPU)"
            )
        m = _UNTYPED.search(str(e))
        if m:
            return OperatorRow(
                spec.name,
                dtype,
                case,
                f"skipped: ORT has no {dtype} {m.group(2)} kernel (opset "
                f"{PROBE_OPSET}: the operator's schema takes no tensor({m.group(1)}))",
            )
        return OperatorRow(
            spec.name, dtype, case, f"skipped: ORT could not load the graph: {str(e).splitlines()[0][:160]}"
        )
    try:
        (cand,) = sess.run(["y"], {k: v for k, v in arrays.items()})
    except Exception as e:
        m = _MISSING_KERNEL.search(str(e))
        reason = (
            f"ORT has no {dtype} {m.group(1)} kernel" if m else f"ORT failed to run: {str(e).splitlines()[0][:160]}"
        )
        return OperatorRow(spec.name, dtype, case, f"skipped: {reason}")
    metrics = compare_tensors(ref, cand)
    fails = check_metrics(metrics, limits or resolve_thresholds(dtype), "operator")
    return OperatorRow(
        spec.name, dtype, case, "fail" if fails else "pass", tuple(ref.shape), metrics, tuple(f.text for f in fails)
    )


def run_conformance(
    *,
    dtypes: tuple[str, ...] = FLOAT_NAMES,
    ops: tuple[str, ...] | None = None,
    cases: tuple[str, ...] = CASES,
    thresholds: dict | None = None,
    seed: int = 0,
    progress=None,
) -> list[OperatorRow]:
    """The whole table: every operator x dtype x case, in OPERATORS order (the model's order).

    ``thresholds`` are flow.yaml-style overrides ``{dtype: {key: value}}``; ``progress`` is called
    with each finished row (the CLI advances a rich progress bar with it).
    """
    specs = [s for s in OPERATORS if ops is None or s.name in ops]
    unknown = set(ops or ()) - {s.name for s in OPERATORS}
    if unknown:
        raise ValueError(f"unknown operator(s) {sorted(unknown)}; known: {[s.name for s in OPERATORS]}")
    rows = []
    for dtype in dtypes:
        limits = resolve_thresholds(dtype, thresholds)
        for spec in specs:
            for case in cases:
                row = run_operator(spec, dtype, case, seed=seed, limits=limits)
                rows.append(row)
                if progress is not None:
                    progress(row)
    return rows


def first_failing_operator(rows: list[OperatorRow], dtype: str | None = None) -> OperatorRow | None:
    """The first failing row in model order (optionally of one dtype), or None."""
    for row in rows:
        if row.status == "fail" and (dtype is None or row.dtype == dtype):
            return row
    return None
