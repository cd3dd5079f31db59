"""Per-layer tensors of a deployed ONNX graph itself: its own inner values exposed as outputs of a copy.

The exporter records in export.json (titan_pipe.export_record), per graph, the value name holding
each decoder layer's output (``GraphRecord.layer_outputs``, and ``attn_outputs`` / ``mlp_outputs``). Evaluate
loads the candidate's structure (``load_external_data=False``: weights stay where the candidate
keeps them), appends those names to the graph outputs and hands the bytes to ONNX Runtime with the
candidate's own directory as the external-data folder. Nothing is re-exported and nothing is
written: every number comes from the candidate's nodes and weights.

A graph without export.json (or not listed in it) falls back to its structure: the residual
stream is the longest chain of ``Add`` nodes each taking the previous one's output; in a LLaMA
block it has 2 links per layer (after attention, after the MLP), so layer i's output is link 2i+1.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx

from titan_pipe.errors import UserError
from titan_pipe.export_record import RECORD_FILE, ExportRecord, GraphRecord

TAP_KEYS = (("layer", "layer_outputs"), ("attn", "attn_outputs"), ("mlp", "mlp_outputs"))


@dataclass(frozen=True)
class LayerTaps:
    """Value names inside one graph, per decoder layer i (None where the graph has none).

    layer[i]: residual stream after layer i, (B, T, dim); attn[i] / mlp[i]: the attention / MLP
    block output before its residual Add, (B, T, dim).
    """

    layer: tuple[str, ...]
    attn: tuple[str | None, ...]
    mlp: tuple[str | None, ...]
    source: str  # where the names come from, for the report

    def names(self) -> list[str]:
        """Every value to expose, in (layer i, attn i, mlp i) order, without Nones."""
        return [n for i in range(len(self.layer)) for n in (self.attn[i], self.mlp[i], self.layer[i]) if n]


def _graph_record(graph_path: Path) -> tuple[GraphRecord | None, str]:
    """(the export record's entry for ``graph_path``, why there is none)."""
    graph_path = Path(graph_path)
    try:
        record = ExportRecord.find(graph_path.parent)
    except UserError as e:
        return None, str(e)
    if record is None:
        return None, ""
    entry = record.graph(graph_path.name)
    if entry is None or not entry.layer_outputs:
        return None, f"{RECORD_FILE} has no layer_outputs for {graph_path.name} (exported before they were recorded)"
    return entry, ""


def recorded_layer_count(graph_path: Path) -> int | None:
    """How many layers export.json beside ``graph_path`` records for it (None: no such record)."""
    entry, _ = _graph_record(graph_path)
    return None if entry is None else len(entry.layer_outputs)


def find_layer_taps(graph_path: Path, model: onnx.ModelProto, n_layers: int) -> tuple[LayerTaps | None, str]:
    """(taps, note): from export.json beside ``graph_path`` when it lists this graph, else from the
    graph's residual Add chain. ``taps`` is None when neither gives ``n_layers`` values; ``note``
    says why (or where the names came from)."""
    graph_path = Path(graph_path)
    produced = {o for n in model.graph.node for o in n.output} | {o.name for o in model.graph.output}
    entry, note = _graph_record(graph_path)
    if entry is not None:
        taps, note = _from_record(entry, graph_path.name, produced, n_layers)
        if taps is not None:
            return taps, f"per-layer values named in {RECORD_FILE} (graphs[{graph_path.name!r}].layer_outputs)"
    taps, why = _from_structure(model, n_layers)
    if taps is not None:
        prefix = f"{note}; " if note else f"no {RECORD_FILE} beside {graph_path.name}; "
        return taps, prefix + why
    prefix = f"{note}; " if note else f"no {RECORD_FILE} beside {graph_path.name} (not a titan-pipe export); "
    return None, prefix + why


def _from_record(entry: GraphRecord, file: str, produced: set[str], n_layers: int) -> tuple[LayerTaps | None, str]:
    lists = {}
    for short, key in TAP_KEYS:
        names = getattr(entry, key) or (None,) * n_layers
        if len(names) != n_layers:
            return None, (f"{RECORD_FILE} graphs[{file!r}].{key} has {len(names)} entries but the model has "
                          f"{n_layers} layers")
        missing = [n for n in names if n is not None and n not in produced]
        if short == "layer" and missing:
            return None, (f"{RECORD_FILE} graphs[{file!r}].layer_outputs names {missing[0]!r}, which {file} does "
                          "not compute (the graph was changed after export)")
        lists[short] = tuple(n if n in produced else None for n in names)
    return LayerTaps(lists["layer"], lists["attn"], lists["mlp"], RECORD_FILE), ""


_PASS_THROUGH = ("Cast", "Identity")  # a float32 graph casts the stream to float32 (a no-op) for each norm


def _from_structure(model: onnx.ModelProto, n_layers: int) -> tuple[LayerTaps | None, str]:
    """The residual stream: the longest chain of Add nodes where each takes the previous one's output
    (directly or through Cast/Identity nodes)."""
    producer = {o: n for n in model.graph.node for o in n.output}

    def source(value: str) -> str:
        """``value`` traced back through pass-through nodes."""
        seen = 0
        while value in producer and producer[value].op_type in _PASS_THROUGH and seen < 8:
            value, seen = producer[value].input[0], seen + 1
        return value

    adds = [n for n in model.graph.node if n.op_type == "Add"]
    length: dict[str, int] = {}
    prev_of: dict[str, tuple[onnx.NodeProto, str] | None] = {}  # (previous Add, the input it feeds)
    best: onnx.NodeProto | None = None
    for n in adds:  # nodes are topologically sorted in a valid graph
        links = [(producer[source(i)], i) for i in n.input if source(i) in length]
        p = max(links, key=lambda link: length[link[0].output[0]], default=None)
        length[n.output[0]] = (length[p[0].output[0]] + 1) if p is not None else 1
        prev_of[n.output[0]] = p
        if best is None or length[n.output[0]] > length[best.output[0]]:
            best = n
    if best is None:
        return None, "the graph has no Add nodes, so no residual stream to read per-layer values from"
    chain: list[tuple[onnx.NodeProto, str | None]] = []  # (Add, its stream input from the previous Add)
    node: onnx.NodeProto | None = best
    while node is not None:
        link = prev_of[node.output[0]]
        chain.append((node, link[1] if link else None))
        node = link[0] if link else None
    chain.reverse()
    if len(chain) != 2 * n_layers:
        return None, (f"its longest residual Add chain has {len(chain)} links, not 2 x {n_layers} layers, so the "
                      "layers cannot be told apart; no per-layer rows")

    def block(add: onnx.NodeProto, stream: str | None) -> str | None:
        if stream is None:  # layer 0: the stream comes from the embedding (a Gather)
            other = [i for i in add.input if getattr(producer.get(source(i)), "op_type", "") != "Gather"]
        else:
            other = [i for i in add.input if i != stream]
        return other[0] if len(other) == 1 else None

    layer, attn, mlp = [], [], []
    for i in range(n_layers):
        (a, a_in), (m, m_in) = chain[2 * i], chain[2 * i + 1]
        attn.append(block(a, a_in))
        mlp.append(block(m, m_in))
        layer.append(m.output[0])
    return (LayerTaps(tuple(layer), tuple(attn), tuple(mlp), "residual Add chain"),
            f"per-layer values found by structure: the residual stream's {len(chain)} Add nodes in order, "
            "layer i = the output of Add 2i+1")


def expose(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """A copy of ``model`` (structure; external weights stay referenced) returning ``names`` as well.

    Types come from the graph's value_info, else from ONNX shape inference on the copy.
    """
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    have = {o.name for o in copy.graph.output}
    todo = [n for n in names if n not in have]
    if not todo:
        return copy
    info = {v.name: v for v in copy.graph.value_info}
    if any(n not in info for n in todo):
        inferred = onnx.shape_inference.infer_shapes(copy)
        info.update({v.name: v for v in inferred.graph.value_info})
    for n in todo:
        if n in info:
            copy.graph.output.append(info[n])
        else:  # no type known: ORT accepts an untyped output and reports what it computes
            copy.graph.output.append(onnx.helper.make_empty_tensor_value_info(n))
    return copy


def tapped_session(graph_path: Path, model: onnx.ModelProto, names: list[str], opts):
    """An ONNX Runtime session of ``expose(model, names)`` that reads the candidate's own external
    data (``graph_path``'s directory); nothing is written to disk."""
    import onnxruntime as ort

    copy = expose(model, names)
    opts.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                  str(Path(graph_path).resolve().parent))
    return ort.InferenceSession(copy.SerializeToString(), opts, providers=["CPUExecutionProvider"])
