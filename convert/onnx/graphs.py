"""The LLaMA prefill and fixed-capacity decode graphs, built node by node with onnx.helper.

No tracing: a decoder layer is the same dozen-odd nodes emitted once per layer under the names
``layers.{i}.…``, on initializers that point into the shared external-data file (see
convert/onnx/data_file.py). Each operator is a recipe of titan_pipe.graphs.onnx_nodes (the ones operator
conformance checks); the inputs and outputs are titan_pipe.graphs.graph_io's. Besides the recipes:

  RoPE      cos/sin rows Gathered by position_ids from tables computed by titan_pipe.model.rope
            (the module's frequencies, Llama-3.1 scaling included)
  mask      causal from Range + LessOrEqual (prefill); the decode graph's attention_mask covers the
            cache slots, and a one-hot of write_index (Equal over Range) picks the slot it writes
  window    (a sliding window shorter than the positions a graph can see) compares positions, not
            slots: prefill subtracts position_ids pairwise; decode counts the real tokens after
            each slot (CumSum, exclusive, reverse, over attention_mask, which marks the slot being
            written), which is the query's position minus that key's

Operators: Add, And, Cast, Concat, Equal, Expand, Gather, Gemm, Identity, LessOrEqual, MatMul,
Mul, Neg, Pow, Range, ReduceMean, Reshape, Shape, Sigmoid, Slice, Softmax, Sqrt, Transpose,
Unsqueeze, Where; with a sliding window also CumSum, Less, Sub; with GeGLU (Gemma 3) Tanh — all on ATC's list at opsets 14/15
(checked again by convert/onnx/atc_ops.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx
from onnx import TensorProto, helper

from titan_pipe.convert.onnx.weights import DataEntry
from titan_pipe.rules.dtypes import onnx_type
from titan_pipe.graphs.graph_io import (
    ATTENTION_MASK,
    DECODE_FILE,
    HIDDEN,
    INPUT_IDS,
    INT_INPUTS,
    LOGITS,
    PAST,
    POSITION_IDS,
    PREFILL_FILE,
    PRESENT,
    WRITE_INDEX,
    hidden_name,
    io_names,
    router_name,
)
from titan_pipe.model.args import ModelArgs
from titan_pipe.graphs import onnx_nodes
from titan_pipe.model import features
from titan_pipe.model.features import gates as gate_kinds
from titan_pipe.model.params import LAYER_PARAMS
from titan_pipe.graphs.onnx_nodes import (
    NodeBuilder,
    attention,
    embedding,
    experts,
    experts_gathered,
    gates,
    linear,
    rms_norm,
    rotary,
    route,
)

_LAYER_INIT = {p.name: p.onnx for p in LAYER_PARAMS}  # native name within a layer -> initializer name


def _w(i: int, native: str) -> str:
    """Layer i's initializer of per-layer parameter ``native`` (``attention.wq.weight``)."""
    return f"layers.{i}.{_LAYER_INIT[native]}"


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
        return DECODE_FILE if self.decode else PREFILL_FILE

    def io_names(self, n_layers: int) -> tuple[list[str], list[str]]:
        return io_names(n_layers, decode=self.decode, kv_cache=self.kv_cache, expose_hidden=self.expose_hidden)


@dataclass
class LayerValues:
    """Names of the per-layer values of a built graph (the contract the export record carries)."""

    layer_outputs: list[str] = field(default_factory=list)
    attn_outputs: list[str] = field(default_factory=list)
    mlp_outputs: list[str] = field(default_factory=list)
    embed_output: str | None = None  # the residual stream entering layer 0


def io_dims(args: ModelArgs, spec: GraphSpec) -> dict[str, list]:
    """Each graph input/output's dims: ints, or the names batch / seq / cache where dynamic."""
    b = spec.batch or "batch"
    t = 1 if spec.decode else (spec.seq or "seq")
    c = spec.cache or "cache"
    hkv, hd = args.kv_heads, args.head_dim
    ins, outs = spec.io_names(args.n_layers)
    dims: dict[str, list] = {}
    for name in ins + outs:
        if name in (INPUT_IDS, POSITION_IDS):
            dims[name] = [b, t]
        elif name == ATTENTION_MASK:
            dims[name] = [b, c] if spec.decode else [b, t]
        elif name == WRITE_INDEX:
            dims[name] = [b]
        elif name.startswith(PAST):
            dims[name] = [b, hkv, c, hd]
        elif name.startswith(PRESENT):
            dims[name] = [b, hkv, c, hd] if spec.decode else [b, hkv, t, hd]
        elif name == LOGITS:
            dims[name] = [b, t, args.vocab_size]
        elif name.startswith(HIDDEN):
            dims[name] = [b, t, args.dim]
    return dims


def _window(g: NodeBuilder, args: ModelArgs, spec: GraphSpec, allowed: str) -> str:
    """``allowed`` narrowed by the features' mask terms (a sliding window: titan_pipe.model.features)."""
    return features.onnx_mask(
        onnx_nodes, g, args, allowed, decode=spec.decode, attention_mask=ATTENTION_MASK, position_ids=POSITION_IDS
    )


@dataclass(frozen=True)
class _Positions:
    """What every layer reads of the positions: (cos, sin) rows (B, 1, T, hd) of the global and the
    local RoPE tables (the same where the model has one), the keys each query may see with and
    without the sliding window (bool (B, 1, T, S); decode (B, 1, 1, C)), and in decode the one-hot
    (B, 1, C, 1) of the slot it writes."""

    rope: dict[str, tuple[str, str]]  # table name (features.rope_tables) -> (cos, sin)
    allowed: dict[bool, str]  # windowed? -> mask
    write_at: str | None

    def of_layer(self, args: ModelArgs, i: int) -> tuple[str, str, str, str | None]:
        cos, sin = self.rope[features.layer_rope(args, i)]
        return cos, sin, self.allowed[args.layer_window(i) is not None], self.write_at


def _rope_rows(g: NodeBuilder, table: str) -> str:
    return g.op(
        "Unsqueeze",
        [g.op("Gather", [table, POSITION_IDS], f"rope.{table[5:]}_rows", axis=0), g.const([1])],
        f"rope.{table[5:]}",
    )


def _positions(g: NodeBuilder, args: ModelArgs, spec: GraphSpec, bt: str) -> _Positions:
    """The position-derived values of the graph (_Positions)."""
    rope = {
        t.name: (_rope_rows(g, f"rope_cos{t.suffix}"), _rope_rows(g, f"rope_sin{t.suffix}"))
        for t in features.rope_tables(args)
    }
    key_ok = g.op(
        "Unsqueeze", [g.op("Cast", [ATTENTION_MASK], "mask.bool", to=TensorProto.BOOL), g.const([1, 2])], "mask.keys"
    )
    if spec.decode:
        n_slots = g.op("Gather", [g.op("Shape", [ATTENTION_MASK], "shape.mask"), g.const(1)], "mask.slots", axis=0)
        slots = g.op("Range", [g.const(0), n_slots, g.const(1)], "cache.slots")
        hit = g.op(
            "Equal",
            [
                g.op("Unsqueeze", [slots, g.const([0])], "cache.slots_row"),
                g.op("Unsqueeze", [WRITE_INDEX, g.const([1])], "cache.write_col"),
            ],
            "cache.hit",
        )
        return _Positions(
            rope,
            {False: key_ok, True: _window(g, args, spec, key_ok)},
            g.op("Unsqueeze", [hit, g.const([1, 3])], "cache.write_at"),
        )
    n_tok = g.op("Gather", [bt, g.const(1)], "mask.len", axis=0)
    pos = g.op("Range", [g.const(0), n_tok, g.const(1)], "mask.pos")
    causal = g.op(
        "LessOrEqual",
        [
            g.op("Unsqueeze", [pos, g.const([0])], "mask.key_pos"),
            g.op("Unsqueeze", [pos, g.const([1])], "mask.query_pos"),
        ],
        "mask.causal",
    )
    allowed = g.op("And", [key_ok, causal], "mask.allowed")
    return _Positions(rope, {False: allowed, True: _window(g, args, spec, allowed)}, None)


@dataclass(frozen=True)
class _Shapes:
    """Reshape targets: (B, T, H, hd), (B, T, Hkv, hd), (B, T, dim), (B, T, vocab), (B*T, dim)."""

    q: str
    kv: str
    hidden: str
    logits: str
    flat: str


def _shapes(g: NodeBuilder, args: ModelArgs, bt: str) -> _Shapes:
    def with_tail(tail: list[int], name: str) -> str:
        return g.op("Concat", [bt, g.const(tail)], name, axis=0)

    return _Shapes(
        with_tail([args.n_heads, args.head_dim], "shape.q"),
        with_tail([args.kv_heads, args.head_dim], "shape.kv"),
        with_tail([args.dim], "shape.hidden"),
        with_tail([args.vocab_size], "shape.logits"),
        g.const([-1, args.dim]),
    )


def _layer(
    g: NodeBuilder, args: ModelArgs, spec: GraphSpec, i: int, h: str, sh: _Shapes, rope: tuple, outputs: dict[str, str]
) -> tuple[str, str, str]:
    """Decoder layer i on the residual stream ``h``: (layer output, attention output, MLP output)."""
    p, hd, off = f"layers.{i}", args.head_dim, features.offset_norms(args)
    cos, sin, allowed, write_at = rope.of_layer(args, i)
    x = g.op(
        "Reshape",
        [rms_norm(g, h, _w(i, "attention_norm.weight"), args.norm_eps, f"{p}.attention_norm", off), sh.flat],
        f"{p}.attn.x2d",
    )

    def heads(part: str, shape: str) -> str:  # (B*T, dim) -> (B, heads, T, hd)
        w = _LAYER_INIT[f"attention.w{part}.weight"]
        bias = _w(i, f"attention.w{part}.bias") if features.biased(args, part) else None
        y = g.op(
            "Reshape",
            [linear(g, x, _w(i, f"attention.w{part}.weight"), f"{p}.attn.{w}", bias), shape],
            f"{p}.attn.{w}.split",
        )
        for f in head_features:  # (B, T, heads, hd), before RoPE (titan_pipe.model.features)
            y = f.onnx_heads(
                onnx_nodes, g, y, part=part, weight=lambda n: _w(i, n), eps=args.norm_eps, prefix=p, offset=off
            )
        return g.op("Transpose", [y], f"{p}.attn.{w}.heads", perm=[0, 2, 1, 3])

    head_features = [f for f in features.active(args) if f.onnx_heads is not None]
    q = rotary(g, heads("q", sh.q), cos, sin, hd // 2, f"{p}.attn.rope_q")
    k = rotary(g, heads("k", sh.kv), cos, sin, hd // 2, f"{p}.attn.rope_k")
    v = heads("v", sh.kv)
    if spec.decode:  # write this step's key/value into its slot of the fixed-capacity cache
        k = g.op("Where", [write_at, k, f"{PAST}{i}.key"], f"{PRESENT}{i}.key")
        v = g.op("Where", [write_at, v, f"{PAST}{i}.value"], f"{PRESENT}{i}.value")
    elif spec.kv_cache:
        k = g.op("Identity", [k], f"{PRESENT}{i}.key")
        v = g.op("Identity", [v], f"{PRESENT}{i}.value")
    if spec.kv_cache or spec.decode:
        outputs[f"{PRESENT}{i}.key"], outputs[f"{PRESENT}{i}.value"] = k, v
    ctx = attention(
        g,
        q,
        k,
        v,
        allowed,
        n_heads=args.n_heads,
        n_kv_heads=args.kv_heads,
        hd=hd,
        name=f"{p}.attn",
        scale=args.attn_scale,
    )
    ctx = g.op("Transpose", [ctx], f"{p}.attn.context_t", perm=[0, 2, 1, 3])
    ctx = g.op("Reshape", [ctx, g.const([-1, args.q_dim])], f"{p}.attn.context2d")
    attn = g.op(
        "Reshape", [linear(g, ctx, _w(i, "attention.wo.weight"), f"{p}.attn.wo"), sh.hidden], f"{p}.attn.output"
    )
    h = g.op("Add", [h, _sublayer_output(g, args, i, "attention", attn, off)], f"{p}.attn.residual")

    x = g.op(
        "Reshape",
        [rms_norm(g, h, _w(i, "ffn_norm.weight"), args.norm_eps, f"{p}.ffn_norm", off), sh.flat],
        f"{p}.mlp.x2d",
    )
    if args.is_moe_layer(i):
        routing = features.routing(args)
        top, chosen = route(
            g,
            x,
            _w(i, "moe.router.gate.weight"),
            top_k=routing.top_k,
            norm_topk=routing.renormalize,
            name=f"{p}.route",
        )
        assert chosen == router_name(i)  # the value evaluate's router row reads
        w = [_w(i, f"moe.experts.{n}") for n in ("w1", "w3", "w2")]
        if spec.decode:  # a token a row: gather the k chosen experts (docs/moe.md, "Export")
            out = experts_gathered(g, x, top, chosen, *w, top_k=routing.top_k, dim=args.dim, name=f"{p}.moe.experts")
        else:  # many tokens: every expert, weighted by its gate
            out = experts(
                g, x, gates(g, top, chosen, experts=routing.experts, name=f"{p}.route"), *w, f"{p}.moe.experts"
            )
    else:
        gated = gate_kinds.gate_of(args).onnx_product(
            onnx_nodes,
            g,
            linear(g, x, _w(i, "feed_forward.w1.weight"), f"{p}.mlp.w1"),
            linear(g, x, _w(i, "feed_forward.w3.weight"), f"{p}.mlp.w3"),
            f"{p}.mlp",
        )
        out = linear(g, gated, _w(i, "feed_forward.w2.weight"), f"{p}.mlp.w2")
    mlp = g.op("Reshape", [out, sh.hidden], f"{p}.mlp.output")
    return g.op("Add", [h, _sublayer_output(g, args, i, "mlp", mlp, off)], f"{p}.output"), attn, mlp


def _sublayer_output(g: NodeBuilder, args: ModelArgs, i: int, part: str, x: str, off: bool) -> str:
    """Sub-layer ``part``'s (attention, mlp) output as its residual add takes it: each feature's
    ``onnx_sublayer_output``, as the module's TransformerBlock.sublayer_output (``off``: the
    model's norms are offsets from 1)."""
    for f in features.active(args):
        if f.onnx_sublayer_output is not None:
            x = f.onnx_sublayer_output(
                onnx_nodes,
                g,
                x,
                part=part,
                weight=lambda n: _w(i, n),
                eps=args.norm_eps,
                prefix=f"layers.{i}",
                offset=off,
            )
    return x


def build_graph(args: ModelArgs, spec: GraphSpec, weights: dict[str, DataEntry]) -> tuple[onnx.ModelProto, LayerValues]:
    """The ModelProto of one graph (weights as external references into their data files) and the
    names of its per-layer values. ``weights``: initializer name -> its file and place there,
    including ``rope_cos`` / ``rope_sin``. See docs/export.md for the inputs and outputs."""
    g = NodeBuilder(spec.dtype)
    # Shapes used by the Reshapes: (B, T) from input_ids when dynamic, constants when static.
    if spec.batch is not None and (spec.decode or spec.seq is not None):
        bt = g.const([spec.batch, 1 if spec.decode else spec.seq])
    else:
        bt = g.op("Shape", [INPUT_IDS], "shape.input_ids")
    sh = _shapes(g, args, bt)
    rope = _positions(g, args, spec, bt)
    h = embedding(g, "tok_embeddings.weight", INPUT_IDS, "embed")
    for f in features.active(args):  # as the module's scale_embeddings (titan_pipe.model.features)
        if f.onnx_embed is not None:
            h = f.onnx_embed(g, h, args)
    values = LayerValues(embed_output=h)
    outputs: dict[str, str] = {}
    for i in range(args.n_layers):
        h, attn, mlp = _layer(g, args, spec, i, h, sh, rope, outputs)
        values.layer_outputs.append(h)
        values.attn_outputs.append(attn)
        values.mlp_outputs.append(mlp)
        if spec.expose_hidden:
            outputs[hidden_name(i)] = g.op("Identity", [h], hidden_name(i))
    x = g.op(
        "Reshape",
        [rms_norm(g, h, "norm.weight", args.norm_eps, "norm", features.offset_norms(args)), sh.flat],
        "norm.x2d",
    )
    emb_out = features.read_from(args, "output.weight")  # a tied head reads the embedding
    outputs[LOGITS] = g.op("Reshape", [linear(g, x, emb_out, "lm_head"), sh.logits], LOGITS)
    return _model(g, args, spec, weights, outputs), values


def _model(
    g: NodeBuilder, args: ModelArgs, spec: GraphSpec, weights: dict[str, DataEntry], outputs: dict[str, str]
) -> onnx.ModelProto:
    """The graph's nodes with its declared inputs/outputs and the initializers its nodes use."""
    dt = onnx_type(spec.dtype)
    ins, outs = spec.io_names(args.n_layers)
    dims = io_dims(args, spec)
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64 if n in INT_INPUTS else dt, dims[n]) for n in ins]
    graph_outputs = [helper.make_tensor_value_info(n, dt, dims[n]) for n in outs]
    assert [outputs[n] for n in outs] == outs  # every output is a node named after it
    used = {name for node in g.nodes for name in node.input}
    inits = [_external(name, e, dt) for name, e in weights.items() if name in used]
    graph = helper.make_graph(
        g.nodes, f"titan_pipe_{'decode' if spec.decode else 'prefill'}", inputs, graph_outputs, inits + g.consts
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", spec.opset)], producer_name="titan-pipe")
    model.ir_version = 8  # ONNX 1.10+; readable by the ONNX Runtime/CANN versions of the ATC list
    return model


def _external(name: str, entry: DataEntry, dtype: int) -> TensorProto:
    t = TensorProto()
    t.name, t.data_type = name, dtype
    t.dims.extend(entry.dims)
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", entry.file), ("offset", str(entry.offset)), ("length", str(entry.length))):
        item = t.external_data.add()
        item.key, item.value = k, v
    return t
