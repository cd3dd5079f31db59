"""Where a deployed ONNX graph holds each decoder layer's values: the names evaluate cuts it at.

The exporter records in export.json (titan_pipe.records.export_record), per graph, the value name holding
each decoder layer's output (``GraphRecord.layer_outputs``, and ``attn_outputs`` / ``mlp_outputs``),
and the stream entering layer 0 (``embed_output``). Evaluate reads them against the candidate's
structure (``load_external_data=False``) and cuts the graph into pieces between them
(evaluate/graph_pieces.py): every number comes from the candidate's own nodes and weights.

A graph without export.json (or not listed in it) falls back to its structure: the residual
stream is the longest chain of ``Add`` nodes each taking the previous one's output; in a LLaMA
block it has 2 links per layer (after attention, after the MLP), so layer i's output is link 2i+1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import onnx

from titan_pipe.errors import UserError
from titan_pipe.records.export_record import RECORD_FILE, ExportRecord, GraphRecord

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
    embed: str | None = None  # the residual stream entering layer 0 (None: not known)

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
    order = {o: i for i, n in enumerate(model.graph.node) for o in n.output}  # producer's place in the graph
    entry, note = _graph_record(graph_path)
    if entry is not None:
        taps, note = _from_record(entry, graph_path.name, produced, n_layers, order)
        if taps is not None and taps.embed is None:
            taps = replace(taps, embed=_stream_into(model, taps.attn[0]))
        if taps is not None:
            return taps, f"per-layer values named in {RECORD_FILE} (graphs[{graph_path.name!r}].layer_outputs)"
    taps, why = _from_structure(model, n_layers)
    if taps is not None:
        prefix = f"{note}; " if note else f"no {RECORD_FILE} beside {graph_path.name}; "
        return taps, prefix + why
    prefix = f"{note}; " if note else f"no {RECORD_FILE} beside {graph_path.name} (not a titan-pipe export); "
    return None, prefix + why


def _from_record(
    entry: GraphRecord, file: str, produced: set[str], n_layers: int, order: dict[str, int] | None = None
) -> tuple[LayerTaps | None, str]:
    lists = {}
    for short, key in TAP_KEYS:
        names = getattr(entry, key) or (None,) * n_layers
        if len(names) != n_layers:
            return None, (
                f"{RECORD_FILE} graphs[{file!r}].{key} has {len(names)} entries but the model has {n_layers} layers"
            )
        missing = [n for n in names if n is not None and n not in produced]
        if short == "layer" and missing:
            return None, (
                f"{RECORD_FILE} graphs[{file!r}].layer_outputs names {missing[0]!r}, which {file} does "
                "not compute (the graph was changed after export)"
            )
        if short == "layer" and order:
            places = [order.get(n, -1) for n in names]
            wrong = next((i for i in range(1, len(places)) if places[i] <= places[i - 1]), None)
            if wrong is not None:  # layer k's output computed before layer k-1's: not this graph's layers
                return None, (
                    f"{RECORD_FILE} graphs[{file!r}].layer_outputs lists {names[wrong]!r} as layer {wrong}, "
                    f"but {file} computes it before layer {wrong - 1}'s {names[wrong - 1]!r} (the record "
                    "was edited or belongs to another export)"
                )
        lists[short] = tuple(n if n in produced else None for n in names)
    embed = entry.embed_output if entry.embed_output in produced else None
    return LayerTaps(lists["layer"], lists["attn"], lists["mlp"], RECORD_FILE, embed), ""


def _stream_into(model: onnx.ModelProto, block: str | None) -> str | None:
    """The residual stream a block output is added to: the other input of the one node taking it
    (records written before ``embed_output`` was: the stream entering layer 0 from layer 0's
    attention output)."""
    users = [n for n in model.graph.node if block and block in n.input]
    if len(users) != 1 or len(users[0].input) != 2:
        return None
    return next((i for i in users[0].input if i != block), None)


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
        return None, (
            f"its longest residual Add chain has {len(chain)} links, not 2 x {n_layers} layers, so the "
            "layers cannot be told apart; no per-layer rows"
        )

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
    first = chain[0][0]  # layer 0's first residual Add: the stream entering it is its other input
    embed = next((i for i in first.input if i != attn[0]), None) if attn[0] else None
    return (
        LayerTaps(tuple(layer), tuple(attn), tuple(mlp), "residual Add chain", embed),
        f"per-layer values found by structure: the residual stream's {len(chain)} Add nodes in order, "
        "layer i = the output of Add 2i+1",
    )
