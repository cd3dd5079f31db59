"""The LLaMA prefill and fixed-capacity decode graphs, built node by node with onnx.helper.

No tracing: a decoder layer is the same dozen-odd nodes emitted once per layer under the names
``layers.{i}.…``, on initializers that point into the shared external-data file (see
convert/onnx/data_file.py). The math is titan_pipe.model.transformer's, op for op:

  RMSNorm   Cast(float32) -> Pow -> ReduceMean -> Add(eps) -> Sqrt -> Div [-> Cast back] -> Mul(weight)
  Linear    Gemm(x2d, W, transB=1) on the weight as stored (out, in): no transposed copy, no Transpose
  RoPE      rotate-half, real-valued: cos/sin rows Gathered by position_ids from tables computed by
            titan_pipe.model.rope (the module's frequencies, Llama-3.1 scaling included)
  GQA       each kv head repeated n_heads/n_kv_heads times (Unsqueeze -> Expand -> Reshape)
  SwiGLU    Gemm(w1) -> x*Sigmoid(x) -> Mul(Gemm(w3)) -> Gemm(w2)
  mask      Where(allowed, scores, finfo.min) before Softmax: a row with every key masked (a left
            padding query) gives a uniform row instead of NaN; causal from Range + LessOrEqual

Operators: Add, And, Cast, Concat, Equal, Expand, Gather, Gemm, Identity, LessOrEqual, MatMul,
Mul, Neg, Pow, Range, ReduceMean, Reshape, Shape, Sigmoid, Slice, Softmax, Sqrt, Transpose,
Unsqueeze, Where — all on ATC's list at opsets 14/15 (checked again by convert/onnx/atc_ops.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from titan_pipe.convert.onnx.weights import DataEntry
from titan_pipe.dtypes import onnx_type
from titan_pipe.model.args import ModelArgs

NP_DTYPES = {"float32": np.float32, "float16": np.float16}

# Initializer name in the graph -> native parameter name (the weight as stored, (out, in) for linears).
_LAYER_WEIGHTS = {"wq": "attention.wq.weight", "wk": "attention.wk.weight", "wv": "attention.wv.weight",
                  "wo": "attention.wo.weight", "w1": "feed_forward.w1.weight", "w2": "feed_forward.w2.weight",
                  "w3": "feed_forward.w3.weight", "attention_norm.weight": "attention_norm.weight",
                  "ffn_norm.weight": "ffn_norm.weight"}


def initializer_names(args: ModelArgs) -> dict[str, str]:
    """Graph initializer name -> native parameter name, in the order they are written to the data file."""
    out = {"tok_embeddings.weight": "tok_embeddings.weight"}
    for i in range(args.n_layers):
        out.update({f"layers.{i}.{k}": f"layers.{i}.{v}" for k, v in _LAYER_WEIGHTS.items()})
    out["norm.weight"] = "norm.weight"
    if not args.tie_embeddings:
        out["output.weight"] = "output.weight"
    return out


@dataclass(frozen=True)
class GraphSpec:
    """One graph: prefill (decode=False) or decode; dims are ints (static) or None (dynamic)."""

    decode: bool
    kv_cache: bool
    expose_hidden: bool
    batch: int | None
    seq: int | None  # prefill: new tokens T; decode: always 1
    cache: int | None  # decode: cache slots C
    dtype: str
    opset: int

    @property
    def file(self) -> str:
        return "decode.onnx" if self.decode else "model.onnx"


@dataclass
class LayerValues:
    """Names of the per-layer values of a built graph (the contract export.json carries)."""

    layer_outputs: list[str] = field(default_factory=list)
    attn_outputs: list[str] = field(default_factory=list)
    mlp_outputs: list[str] = field(default_factory=list)


def io_names(n_layers: int, *, decode: bool, kv_cache: bool, expose_hidden: bool) -> tuple[list[str], list[str]]:
    """(input names, output names) of a graph, in graph order."""
    if decode:
        inputs = ["input_ids", "position_ids", "attention_mask", "write_index"]
        for i in range(n_layers):
            inputs += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
    else:
        inputs = ["input_ids", "attention_mask", "position_ids"]
    outputs = ["logits"]
    if kv_cache or decode:
        for i in range(n_layers):
            outputs += [f"present.{i}.key", f"present.{i}.value"]
    if expose_hidden:
        outputs += [f"hidden.{i}" for i in range(n_layers)]
    return inputs, outputs


def io_dims(args: ModelArgs, spec: GraphSpec) -> dict[str, list]:
    """Each graph input/output's dims: ints, or the names batch / seq / cache where dynamic."""
    b = spec.batch or "batch"
    t = 1 if spec.decode else (spec.seq or "seq")
    c = spec.cache or "cache"
    hkv, hd = args.kv_heads, args.head_dim
    ins, outs = io_names(args.n_layers, decode=spec.decode, kv_cache=spec.kv_cache, expose_hidden=spec.expose_hidden)
    dims: dict[str, list] = {}
    for name in ins + outs:
        if name in ("input_ids", "position_ids"):
            dims[name] = [b, t]
        elif name == "attention_mask":
            dims[name] = [b, c] if spec.decode else [b, t]
        elif name == "write_index":
            dims[name] = [b]
        elif name.startswith("past_key_values."):
            dims[name] = [b, hkv, c, hd]
        elif name.startswith("present."):
            dims[name] = [b, hkv, c, hd] if spec.decode else [b, hkv, t, hd]
        elif name == "logits":
            dims[name] = [b, t, args.vocab_size]
        elif name.startswith("hidden."):
            dims[name] = [b, t, args.dim]
    return dims


class _Builder:
    """Nodes, small constants and value names for one graph; every node's output is named after it."""

    def __init__(self, dtype: str):
        self.nodes: list[onnx.NodeProto] = []
        self.consts: list[TensorProto] = []
        self.dtype = dtype
        self._const_names: dict[tuple, str] = {}

    def op(self, op_type: str, inputs: list[str], name: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [name], name=name, **attrs))
        return name

    def const(self, value, dtype=np.int64) -> str:
        """A small constant initializer (shapes, axes, scalars), shared by value."""
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._const_names:
            name = f"const.{len(self._const_names)}"
            self.consts.append(numpy_helper.from_array(arr, name))
            self._const_names[key] = name
        return self._const_names[key]

    def fconst(self, value) -> str:
        return self.const(value, NP_DTYPES[self.dtype])


def _rms_norm(g: _Builder, x: str, weight: str, eps: float, name: str) -> str:
    """float32 whatever the graph dtype (as titan_pipe.model.kernels's rms_norm_ref), then cast back."""
    xf = g.op("Cast", [x], f"{name}.cast_in", to=TensorProto.FLOAT) if g.dtype != "float32" else x
    sq = g.op("Pow", [xf, g.const(2.0, np.float32)], f"{name}.pow")
    ms = g.op("ReduceMean", [sq], f"{name}.mean", axes=[-1], keepdims=1)
    den = g.op("Sqrt", [g.op("Add", [ms, g.const(eps, np.float32)], f"{name}.add_eps")], f"{name}.sqrt")
    n = g.op("Div", [xf, den], f"{name}.div")
    if g.dtype != "float32":
        n = g.op("Cast", [n], f"{name}.cast_out", to=onnx_type(g.dtype))
    return g.op("Mul", [weight, n], f"{name}.out")


def _rotary(g: _Builder, x: str, cos: str, sin: str, half: int, name: str) -> str:
    """x*cos + rotate_half(x)*sin, rotate_half(x) = concat(-x[..., half:], x[..., :half])."""
    axis = g.const([-1])
    lo = g.op("Slice", [x, g.const([0]), g.const([half]), axis], f"{name}.lo")
    hi = g.op("Slice", [x, g.const([half]), g.const([2 * half]), axis], f"{name}.hi")
    rot = g.op("Concat", [g.op("Neg", [hi], f"{name}.neg"), lo], f"{name}.rot", axis=-1)
    return g.op("Add", [g.op("Mul", [x, cos], f"{name}.xcos"), g.op("Mul", [rot, sin], f"{name}.rsin")],
                f"{name}.out")


def _repeat_kv(g: _Builder, x: str, n_rep: int, n_heads: int, hd: int, name: str) -> str:
    """(B, Hkv, S, hd) -> (B, Hkv*n_rep, S, hd): kv head j serves query heads j*n_rep .. j*n_rep+n_rep-1."""
    if n_rep == 1:
        return x
    u = g.op("Unsqueeze", [x, g.const([2])], f"{name}.unsqueeze")
    e = g.op("Expand", [u, g.const([1, 1, n_rep, 1, 1])], f"{name}.expand")
    return g.op("Reshape", [e, g.const([0, n_heads, -1, hd])], f"{name}.reshape")


def build_graph(args: ModelArgs, spec: GraphSpec, weights: dict[str, DataEntry], *,
                data_file: str) -> tuple[onnx.ModelProto, LayerValues]:
    """The ModelProto of one graph (weights as external references into ``data_file``) and the
    names of its per-layer values. ``weights``: initializer name -> its place in the data file,
    including ``rope_cos`` / ``rope_sin``. See docs/export.md for the inputs and outputs."""
    g = _Builder(spec.dtype)
    dt = onnx_type(spec.dtype)
    n_heads, hkv, hd, dim = args.n_heads, args.kv_heads, args.head_dim, args.dim
    n_rep = n_heads // hkv
    emb_out = "tok_embeddings.weight" if args.tie_embeddings else "output.weight"

    # Shapes used by the Reshapes: (B, T) from input_ids when dynamic, constants when static.
    static = spec.batch is not None and (spec.decode or spec.seq is not None)
    if static:
        t = 1 if spec.decode else spec.seq
        bt = g.const([spec.batch, t])
    else:
        bt = g.op("Shape", ["input_ids"], "shape.input_ids")

    def shape_with(tail: list[int], name: str) -> str:
        return g.op("Concat", [bt, g.const(tail)], name, axis=0)

    shape_q, shape_kv = shape_with([n_heads, hd], "shape.q"), shape_with([hkv, hd], "shape.kv")
    shape_h, shape_v = shape_with([dim], "shape.hidden"), shape_with([args.vocab_size], "shape.logits")
    flat_dim = g.const([-1, dim])

    # RoPE rows for each token's position: (B, T, hd) -> (B, 1, T, hd), in the graph dtype.
    cos = g.op("Unsqueeze", [g.op("Gather", ["rope_cos", "position_ids"], "rope.cos_rows", axis=0), g.const([1])],
               "rope.cos")
    sin = g.op("Unsqueeze", [g.op("Gather", ["rope_sin", "position_ids"], "rope.sin_rows", axis=0), g.const([1])],
               "rope.sin")

    # Which keys each query may see: (B, 1, T, S) bool (decode: (B, 1, 1, C)).
    key_ok = g.op("Unsqueeze", [g.op("Cast", ["attention_mask"], "mask.bool", to=TensorProto.BOOL),
                                g.const([1, 2])], "mask.keys")
    if spec.decode:
        allowed = key_ok
        # One-hot of the slot this step writes: (B, 1, C, 1), from Equal(Range(C), write_index).
        n_slots = g.op("Gather", [g.op("Shape", ["attention_mask"], "shape.mask"), g.const(1)], "mask.slots", axis=0)
        slots = g.op("Range", [g.const(0), n_slots, g.const(1)], "cache.slots")
        hit = g.op("Equal", [g.op("Unsqueeze", [slots, g.const([0])], "cache.slots_row"),
                             g.op("Unsqueeze", ["write_index", g.const([1])], "cache.write_col")], "cache.hit")
        write_at = g.op("Unsqueeze", [hit, g.const([1, 3])], "cache.write_at")
    else:
        n_tok = g.op("Gather", [bt, g.const(1)], "mask.len", axis=0)
        pos = g.op("Range", [g.const(0), n_tok, g.const(1)], "mask.pos")
        causal = g.op("LessOrEqual", [g.op("Unsqueeze", [pos, g.const([0])], "mask.key_pos"),
                                      g.op("Unsqueeze", [pos, g.const([1])], "mask.query_pos")], "mask.causal")
        allowed = g.op("And", [key_ok, causal], "mask.allowed")
    neg = g.fconst(float(np.finfo(NP_DTYPES[spec.dtype]).min))
    scale = g.fconst(1.0 / np.sqrt(hd))

    h = g.op("Gather", ["tok_embeddings.weight", "input_ids"], "embed", axis=0)
    values = LayerValues()
    outputs: dict[str, str] = {}
    for i in range(args.n_layers):
        p = f"layers.{i}"
        x = g.op("Reshape", [_rms_norm(g, h, f"{p}.attention_norm.weight", args.norm_eps, f"{p}.attention_norm"),
                             flat_dim], f"{p}.attn.x2d")

        def heads(w: str, shape: str) -> str:  # (B*T, dim) -> (B, heads, T, hd)
            y = g.op("Gemm", [x, f"{p}.{w}"], f"{p}.attn.{w}", transB=1)
            return g.op("Transpose", [g.op("Reshape", [y, shape], f"{p}.attn.{w}.split")],
                        f"{p}.attn.{w}.heads", perm=[0, 2, 1, 3])

        q = _rotary(g, heads("wq", shape_q), cos, sin, hd // 2, f"{p}.attn.rope_q")
        k = _rotary(g, heads("wk", shape_kv), cos, sin, hd // 2, f"{p}.attn.rope_k")
        v = heads("wv", shape_kv)
        if spec.decode:  # write this step's key/value into its slot of the fixed-capacity cache
            k = g.op("Where", [write_at, k, f"past_key_values.{i}.key"], f"present.{i}.key")
            v = g.op("Where", [write_at, v, f"past_key_values.{i}.value"], f"present.{i}.value")
        elif spec.kv_cache:
            k = g.op("Identity", [k], f"present.{i}.key")
            v = g.op("Identity", [v], f"present.{i}.value")
        if spec.kv_cache or spec.decode:
            outputs[f"present.{i}.key"], outputs[f"present.{i}.value"] = k, v
        kr = _repeat_kv(g, k, n_rep, n_heads, hd, f"{p}.attn.repeat_k")
        vr = _repeat_kv(g, v, n_rep, n_heads, hd, f"{p}.attn.repeat_v")
        kt = g.op("Transpose", [kr], f"{p}.attn.k_t", perm=[0, 1, 3, 2])
        scores = g.op("MatMul", [g.op("Mul", [q, scale], f"{p}.attn.q_scaled"), kt], f"{p}.attn.scores")
        scores = g.op("Where", [allowed, scores, neg], f"{p}.attn.masked")
        probs = g.op("Softmax", [scores], f"{p}.attn.probs", axis=-1)
        ctx = g.op("Transpose", [g.op("MatMul", [probs, vr], f"{p}.attn.context")], f"{p}.attn.context_t",
                   perm=[0, 2, 1, 3])
        ctx = g.op("Reshape", [ctx, g.const([-1, n_heads * hd])], f"{p}.attn.context2d")
        attn = g.op("Reshape", [g.op("Gemm", [ctx, f"{p}.wo"], f"{p}.attn.wo", transB=1), shape_h], f"{p}.attn.output")
        h = g.op("Add", [h, attn], f"{p}.attn.residual")

        x = g.op("Reshape", [_rms_norm(g, h, f"{p}.ffn_norm.weight", args.norm_eps, f"{p}.ffn_norm"), flat_dim],
                 f"{p}.mlp.x2d")
        gate = g.op("Gemm", [x, f"{p}.w1"], f"{p}.mlp.w1", transB=1)
        act = g.op("Mul", [gate, g.op("Sigmoid", [gate], f"{p}.mlp.sigmoid")], f"{p}.mlp.silu")
        up = g.op("Gemm", [x, f"{p}.w3"], f"{p}.mlp.w3", transB=1)
        down = g.op("Gemm", [g.op("Mul", [act, up], f"{p}.mlp.gated"), f"{p}.w2"], f"{p}.mlp.w2", transB=1)
        mlp = g.op("Reshape", [down, shape_h], f"{p}.mlp.output")
        h = g.op("Add", [h, mlp], f"{p}.output")
        values.layer_outputs.append(h)
        values.attn_outputs.append(attn)
        values.mlp_outputs.append(mlp)
        if spec.expose_hidden:
            outputs[f"hidden.{i}"] = g.op("Identity", [h], f"hidden.{i}")

    x = g.op("Reshape", [_rms_norm(g, h, "norm.weight", args.norm_eps, "norm"), flat_dim], "norm.x2d")
    outputs["logits"] = g.op("Reshape", [g.op("Gemm", [x, emb_out], "lm_head", transB=1), shape_v], "logits")

    ins, outs = io_names(args.n_layers, decode=spec.decode, kv_cache=spec.kv_cache, expose_hidden=spec.expose_hidden)
    dims = io_dims(args, spec)
    int_inputs = {"input_ids", "position_ids", "attention_mask", "write_index"}
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64 if n in int_inputs else dt, dims[n]) for n in ins]
    graph_outputs = [helper.make_tensor_value_info(n, dt, dims[n]) for n in outs]
    assert [outputs[n] for n in outs] == outs  # every output is a node named after it
    used = {name for node in g.nodes for name in node.input}
    inits = [_external(name, e, dt, data_file) for name, e in weights.items() if name in used]
    graph = helper.make_graph(g.nodes, f"titan_pipe_{'decode' if spec.decode else 'prefill'}", inputs,
                              graph_outputs, inits + g.consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", spec.opset)],
                              producer_name="titan-pipe")
    model.ir_version = 8  # ONNX 1.10+; readable by the ONNX Runtime/CANN versions of the ATC list
    return model, values


def _external(name: str, entry: DataEntry, dtype: int, location: str) -> TensorProto:
    t = TensorProto()
    t.name, t.data_type = name, dtype
    t.dims.extend(entry.dims)
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", str(entry.offset)), ("length", str(entry.length))):
        item = t.external_data.add()
        item.key, item.value = k, v
    return t
