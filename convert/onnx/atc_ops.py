"""The ATC-supported ONNX operator list (convert/onnx/data/atc_onnx_ops.json) and the per-graph operator report.

The report is pure data from a loaded ModelProto (no weights needed): every (domain, op type) with
its count, the operator version the declared opset resolves to, and whether ATC's list allows
it. ``find_problems`` returns the first offending node of each kind, so the error can name it.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import onnx

OPS_FILE = Path(__file__).parent / "data" / "atc_onnx_ops.json"


@dataclass(frozen=True)
class OpUse:
    """One operator type in a graph."""

    domain: str
    op_type: str
    count: int
    since_version: int | None  # the ONNX schema version the declared opset selects
    first_node: str
    allowed: bool


@dataclass(frozen=True)
class Problem:
    """Something ATC will not take: names the node (or tensor) and what to do."""

    where: str
    what: str
    fix: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}; {self.fix}"


@lru_cache(maxsize=1)
def load_atc_ops() -> dict:
    """The operator list with its source and version (see the file's 'sources')."""
    return json.loads(OPS_FILE.read_text())


def declared_opset(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return imp.version
    raise ValueError("the model imports no default-domain (ai.onnx) opset")


def _since_version(op_type: str, opset: int, domain: str) -> int | None:
    try:
        return onnx.defs.get_schema(op_type, opset, domain).since_version
    except Exception:  # unknown op or domain: not an ONNX standard operator at this opset
        return None


def _op_allowed(op_type: str, domain: str, opset: int, ops: dict) -> bool:
    entry = ops["operators"].get(op_type)
    if domain not in ("", "ai.onnx") or entry is None:
        return False
    return entry["min_opset"] <= opset <= entry["max_opset"]


def operator_report(model: onnx.ModelProto) -> list[OpUse]:
    """Every operator type in the main graph, sorted by count (descending) then name."""
    ops, opset = load_atc_ops(), declared_opset(model)
    counts: Counter = Counter()
    first: dict[tuple[str, str], str] = {}
    for i, node in enumerate(model.graph.node):
        key = (node.domain or "ai.onnx", node.op_type)
        counts[key] += 1
        first.setdefault(key, node.name or f"#{i}")
    report = [
        OpUse(
            d, t, n, _since_version(t, opset, "" if d == "ai.onnx" else d), first[(d, t)], _op_allowed(t, d, opset, ops)
        )
        for (d, t), n in counts.items()
    ]
    return sorted(report, key=lambda u: (-u.count, u.op_type))


def _tensor_dtypes(model: onnx.ModelProto):
    """(where, dtype name) for every typed tensor: initializers, graph I/O, value_info, Constant and Cast."""
    g = model.graph
    for t in g.initializer:
        yield f"initializer {t.name}", t.data_type
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.type.HasField("tensor_type"):
            yield f"tensor {vi.name}", vi.type.tensor_type.elem_type
    for node in g.node:
        for a in node.attribute:
            if node.op_type == "Cast" and a.name == "to":
                yield f"node {node.name} (Cast)", a.i
            if a.type == onnx.AttributeProto.TENSOR:
                yield f"node {node.name} ({node.op_type})", a.t.data_type


def find_problems(model: onnx.ModelProto, report: list[OpUse] | None = None) -> list[Problem]:
    """What ATC would reject, most fundamental first: opset window, operators, dtypes."""
    ops = load_atc_ops()
    lo, hi = ops["atc_opset_window"]
    opset = declared_opset(model)
    problems: list[Problem] = []
    if not lo <= opset <= hi:
        problems.append(
            Problem("model", f"declares ONNX opset {opset}, outside ATC's {lo}..{hi}", "export with --opset 14 (or 15)")
        )
    for imp in model.opset_import:
        if imp.domain not in ("", "ai.onnx"):
            problems.append(
                Problem(
                    "model",
                    f"imports custom domain {imp.domain!r}",
                    "ATC's ONNX parser takes standard ai.onnx operators only",
                )
            )
    for use in report if report is not None else operator_report(model):
        if use.since_version is None and use.domain == "ai.onnx":
            problems.append(
                Problem(
                    f"node {use.first_node} ({use.op_type}, {use.count}x)",
                    f"operator {use.op_type} does not exist at the declared opset {opset}",
                    "export at the opset the operator needs, or replace it",
                )
            )
            continue
        if use.allowed:
            continue
        entry = ops["operators"].get(use.op_type)
        if entry is None:
            hint = ops.get("not_listed_on_purpose", {}).get(use.op_type, "it is not on ATC's ONNX operator list")
            problems.append(
                Problem(
                    f"node {use.first_node} ({use.op_type}, {use.count}x)",
                    f"operator {use.op_type} is not supported by ATC ({hint})",
                    "decompose it into listed operators (see docs/export.md), "
                    "or try --static / a different attention form",
                )
            )
        else:
            problems.append(
                Problem(
                    f"node {use.first_node} ({use.op_type}, {use.count}x)",
                    f"ATC lists {use.op_type} only for opsets {entry['min_opset']}..{entry['max_opset']}, "
                    f"the graph declares {opset}",
                    f"export at an opset in {max(lo, entry['min_opset'])}..{min(hi, entry['max_opset'])} "
                    "or replace the operator",
                )
            )
    banned = {getattr(onnx.TensorProto, n) for n in ops["dtypes_not_allowed"]}
    for where, dt in _tensor_dtypes(model):
        if dt in banned:
            problems.append(
                Problem(
                    where,
                    f"has dtype {onnx.TensorProto.DataType.Name(dt)}",
                    "export with --dtype float32 or float16 (ATC graphs carry no bf16/complex)",
                )
            )
            break
    return problems
