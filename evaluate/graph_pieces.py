"""A deployed ONNX graph cut into pieces between the value names its export record holds.

Pieces: the embedding (graph inputs -> the residual stream entering layer 0), each decoder layer
i (the stream entering it -> its attention / MLP block outputs and its output, plus every graph
output its nodes compute, e.g. ``present.{i}.*``), the head (the last layer's output -> logits).
A piece is the graph's own nodes between those names, found by walking back from its outputs
and stopping at its inputs, with the graph's own initializers: external ones keep pointing into
the same external-data file, so nothing is re-exported or copied, and a piece fed the previous
piece's output computes exactly what the whole graph computes there. What each layer contains
(which operators, which weights) is whatever the graph has between the names: no assumption
about the ops of a layer is made here.

The structure is read once (``load_external_data=False``); a piece's ModelProto holds only
nodes and initializer references, and ONNX Runtime reads its weights from the graph's directory
when its session opens (titan_pipe.graphs.generation.ort_session with ``external_dir``).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import helper

from titan_pipe.graphs.graph_io import LOGITS, PAST, router_name


@dataclass(frozen=True)
class Piece:
    """One piece: ``layer`` (None for the embedding and the head), the boundary values it takes
    (besides graph inputs), the values it returns in order, its model and its weight bytes."""

    name: str
    layer: int | None
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    model: onnx.ModelProto
    weight_bytes: int

    @property
    def graph_inputs(self) -> tuple[str, ...]:
        taken = set(self.inputs)
        return tuple(i.name for i in self.model.graph.input if i.name not in taken)


def _itemsize(t: onnx.TensorProto) -> int:
    return onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize


def tensor_bytes(t: onnx.TensorProto) -> int:
    n = 1
    for d in t.dims:
        n *= d
    return n * _itemsize(t)


def past_bytes(piece: Piece, *, rows: int, slots: int) -> int:
    """Bytes of the KV caches (``past_key_values.*`` inputs, (B, Hkv, C, hd)) a decode piece takes
    for one batch; a dimension the graph leaves open is ``rows`` (B), ``slots`` (C) or 1."""
    total = 0
    for v in piece.model.graph.input:
        if not v.name.startswith(PAST):
            continue
        n = 1
        for k, d in enumerate(v.type.tensor_type.shape.dim):
            n *= d.dim_value if d.HasField("dim_value") else rows if k == 0 else slots if k == 2 else 1
        total += n * helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).itemsize
    return total


class GraphCutter:
    """Index of one graph's structure (producers, value types) to cut pieces from."""

    def __init__(self, structure: onnx.ModelProto):
        self.structure = structure
        g = structure.graph
        self.producer = {o: n for n in g.node for o in n.output}
        self.order = {id(n): k for k, n in enumerate(g.node)}
        inferred = onnx.shape_inference.infer_shapes(structure)
        self.types = {v.name: v for v in (*inferred.graph.value_info, *g.input, *g.output)}

    def nodes_between(self, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> list[onnx.NodeProto]:
        """The nodes computing ``outputs`` from ``inputs`` (and graph inputs/initializers), in graph order."""
        stop, kept, todo = set(inputs), {}, list(outputs)
        while todo:
            v = todo.pop()
            n = self.producer.get(v)
            if v in stop or n is None or id(n) in kept:
                continue
            kept[id(n)] = n
            todo.extend(i for i in n.input if i)
        return sorted(kept.values(), key=lambda n: self.order[id(n)])

    def cut(
        self,
        name: str,
        layer: int | None,
        inputs: tuple[str, ...],
        outputs: tuple[str, ...],
        extra_outputs: bool = False,
    ) -> Piece:
        """The piece from ``inputs`` to ``outputs``; ``extra_outputs``: also every graph output (but
        the logits) its nodes compute."""
        g = self.structure.graph
        nodes = self.nodes_between(inputs, outputs)
        if extra_outputs:
            made = {o for n in nodes for o in n.output}
            outputs += tuple(o.name for o in g.output if o.name in made and o.name != LOGITS and o.name not in outputs)
        used = {i for n in nodes for i in n.input}
        inits = [t for t in g.initializer if t.name in used]
        ins = [v for v in g.input if v.name in used] + [self._typed(n) for n in inputs if n in used]
        graph = helper.make_graph(
            nodes, f"{g.name}.{name.replace(' ', '_')}", ins, [self._typed(n) for n in outputs], inits
        )
        model = helper.make_model(graph, opset_imports=self.structure.opset_import, producer_name="titan-pipe-evaluate")
        model.ir_version = self.structure.ir_version
        return Piece(
            name, layer, tuple(n for n in inputs if n in used), outputs, model, sum(tensor_bytes(t) for t in inits)
        )

    def _typed(self, name: str) -> onnx.ValueInfoProto:
        # untyped when inference could not type it: ORT accepts an untyped output and types it
        return self.types.get(name) or helper.make_empty_tensor_value_info(name)


def layer_pieces(
    structure: onnx.ModelProto,
    *,
    embed: str,
    layers: tuple[str, ...],
    attn: tuple[str | None, ...],
    mlp: tuple[str | None, ...],
) -> list[Piece]:
    """[embedding, layer 0 .. layer L-1, head] between the recorded names (``embed``: the stream
    entering layer 0; ``layers[i]``: layer i's output; ``attn`` / ``mlp``: its block outputs)."""
    cutter = GraphCutter(structure)
    pieces = [cutter.cut("embedding", None, (), (embed,))]
    stream = embed
    for i, out in enumerate(layers):
        wanted = tuple(n for n in (attn[i], mlp[i]) if n) + (out,)
        if router_name(i) in cutter.producer:  # a mixture of experts' choices, for the router row
            wanted += (router_name(i),)
        pieces.append(cutter.cut(f"layer {i}", i, (stream,), wanted, extra_outputs=True))
        stream = out
    pieces.append(cutter.cut("head", None, (stream,), (LOGITS,)))
    return pieces
