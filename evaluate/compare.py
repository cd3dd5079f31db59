"""The evaluation's comparisons as pure data: outputs in, judged rows and a verdict out (no I/O).

  1 sharded_vs_unified  training checkpoint under torchrun (reference) vs the unified model
  2 torch_vs_onnx       unified model in PyTorch (reference) vs the exported graph in ONNX Runtime,
                        per decoder layer (hidden.{i}) and on the logits; npu_fused: fused NPU kernels;
                        onnx_kv_decode: prefill + decode.onnx with the KV cache, teacher-forced
  3 operators           per-operator conformance table (operators.py)
  4 om                  the .om through an Ascend runtime
  5 task                perplexity on held-out text, greedy generations token for token

The verdict names the first layer whose error breaks a bound (in the first comparison where one
does) and the first failing operator; when all pass it still names the biggest jump in relative
Euclidean distance between consecutive layers, the place to look first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from titan_pipe.evaluate.metrics import TensorMetrics, compare_parts, compare_tensors
from titan_pipe.evaluate.operators import OperatorRow
from titan_pipe.evaluate.runners.outputs import Outputs
from titan_pipe.rules.thresholds import check_metrics, check_task

ORDER = ("sharded_vs_unified", "torch_vs_onnx", "onnx_kv_decode", "npu_fused", "operators", "om", "task")


@dataclass(frozen=True)
class TensorRow:
    """One compared tensor: 'hidden.{i}' (layer i's output), 'attn_out.{i}' / 'mlp_out.{i}' (its
    attention / MLP block output before the residual Add), or 'logits' (layer None)."""

    comparison: str
    candidate: str
    tensor: str
    layer: int | None
    dtype: str  # threshold dtype it was judged with
    shape: tuple[int, ...]
    metrics: TensorMetrics
    failures: tuple[str, ...] = ()

    @property
    def status(self) -> str:
        return "fail" if self.failures else "pass"

    def to_dict(self) -> dict:
        return {
            "comparison": self.comparison,
            "candidate": self.candidate,
            "tensor": self.tensor,
            "layer": self.layer,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "status": self.status,
            "metrics": self.metrics.to_dict(),
            "failures": list(self.failures),
        }


@dataclass
class Comparison:
    """One comparison. status: 'pass', 'fail' or 'skipped: <reason>'."""

    id: str
    title: str
    status: str
    reference: str = ""
    candidate: str = ""
    dtype: str = ""
    rows: list[TensorRow] = field(default_factory=list)
    details: dict = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def first_failing_layer(self) -> int | None:
        for r in self.rows:  # rows are in computation order
            if r.layer is not None and r.failures:
                return r.layer
        return None

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "title": self.title,
            "status": self.status,
            "reference": self.reference,
            "candidate": self.candidate,
            "dtype": self.dtype,
            "rows": [r.to_dict() for r in self.rows],
            "first_failing_layer": self.first_failing_layer,
            "biggest_jump": biggest_jump(self.rows),
            "details": self.details,
            "failures": self.failures,
        }


def skipped(cid: str, title: str, reason: str) -> Comparison:
    return Comparison(cid, title, f"skipped: {reason}")


class OutputsValues:
    """Values (evaluate/store.py) over one Outputs: every layer's tensors and the logits as one part."""

    def __init__(self, out: Outputs):
        self.out, self.parts, self.n_layers = out, 1, len(out.hidden)
        self.has_layers = bool(out.hidden)

    def layer(self, kind: str, i: int):
        values = {"attn": self.out.attn, "mlp": self.out.mlp, "hidden": self.out.hidden}[kind]
        return values[i] if i < len(values) else None

    def logits(self, part: int):
        return self.out.logits


_ROW = {"attn": ("attn_out", "block"), "mlp": ("mlp_out", "block"), "hidden": ("hidden", "tensor")}


def _row(
    cid: str, cand_label: str, tensor: str, layer: int | None, dtype: str, limits: dict, scope: str, shape: tuple, m
) -> TensorRow:
    fails = check_metrics(m, limits, scope)
    return TensorRow(cid, cand_label, tensor, layer, dtype, shape, m, tuple(f.text for f in fails))


def layer_rows(cid: str, ref, cand, *, cand_label: str, dtype: str, limits: dict, dump=None) -> list[TensorRow]:
    """Per decoder layer i, in computation order: attention block, MLP block, the layer's output;
    the blocks (outputs before the residual Add) are judged on scale-free measures only."""
    rows = []
    for i in range(ref.n_layers):
        for kind in ("attn", "mlp", "hidden"):
            r, c = ref.layer(kind, i), cand.layer(kind, i)
            if r is None or c is None:
                continue
            name, scope = _ROW[kind]
            if dump is not None:
                dump.put(cid, f"{name}.{i}", r, c)
            rows.append(
                _row(cid, cand_label, f"{name}.{i}", i, dtype, limits, scope, tuple(r.shape), compare_tensors(r, c))
            )
    return rows


def logits_row(
    cid: str, ref, cand, *, cand_label: str, dtype: str, limits: dict, scope: str = "logits", dump=None
) -> TensorRow:
    """The logits over every part (batch), reduced part by part: no part stays in memory after."""
    pairs = lambda: ((ref.logits(p), cand.logits(p)) for p in range(ref.parts))  # noqa: E731
    shapes = [tuple(ref.logits(p).shape) for p in range(ref.parts)]
    shape = (sum(s[0] for s in shapes), *shapes[0][1:])
    if dump is not None:
        dump.put(cid, "logits", torch.cat([a for a, _ in pairs()]), torch.cat([b for _, b in pairs()]))
    return _row(cid, cand_label, "logits", None, dtype, limits, scope, shape, compare_parts(pairs))


def compare_values(
    cid: str,
    title: str,
    ref,
    cand,
    *,
    ref_label: str,
    cand_label: str,
    dtype: str,
    limits: dict[str, float],
    logits_scope: str = "logits",
    dump=None,
) -> Comparison:
    """Per-layer rows (when both sides have per-layer values) and the logits row, each judged by
    ``limits``. ``ref`` / ``cand``: Values (evaluate/store.py) or OutputsValues. Without per-layer
    values on one side, only the logits row is made and ``details['layers']`` says why. ``dump``:
    a TensorDump (evaluate/report.py) every compared pair is written to."""
    details: dict = {}
    rows: list[TensorRow] = []
    if ref.has_layers and cand.has_layers:
        if ref.n_layers != cand.n_layers:
            raise ValueError(f"{cand_label} exposes {cand.n_layers} layers, {ref_label} has {ref.n_layers}")
        rows = layer_rows(cid, ref, cand, cand_label=cand_label, dtype=dtype, limits=limits, dump=dump)
    else:
        details["layers"] = f"no per-layer values from {cand_label if not cand.has_layers else ref_label}"
    rows.append(
        logits_row(cid, ref, cand, cand_label=cand_label, dtype=dtype, limits=limits, scope=logits_scope, dump=dump)
    )
    status = "fail" if any(r.failures for r in rows) else "pass"
    return Comparison(cid, title, status, ref_label, cand_label, dtype, rows, details)


def compare_outputs(
    cid: str,
    title: str,
    ref: Outputs,
    cand: Outputs,
    *,
    ref_label: str,
    cand_label: str,
    dtype: str,
    limits: dict[str, float],
    logits_scope: str = "logits",
    dump=None,
) -> Comparison:
    """compare_values on two whole Outputs (every layer and the logits of all batches at hand)."""
    return compare_values(
        cid,
        title,
        OutputsValues(ref),
        OutputsValues(cand),
        ref_label=ref_label,
        cand_label=cand_label,
        dtype=dtype,
        limits=limits,
        logits_scope=logits_scope,
        dump=dump,
    )


def operator_comparison(rows: list[OperatorRow], dtypes: tuple[str, ...]) -> Comparison:
    """The conformance table as one comparison; only rows of ``dtypes`` (those evaluated) count."""
    judged = [r for r in rows if r.dtype in dtypes]
    failed = [r for r in judged if r.status == "fail"]
    counts = {s: sum(1 for r in rows if r.status.startswith(s)) for s in ("pass", "fail", "skipped")}
    status = (
        "fail"
        if failed
        else ("pass" if any(r.status == "pass" for r in judged) else "skipped: no operator ran in " + "/".join(dtypes))
    )
    return Comparison(
        "operators",
        "operator conformance: PyTorch training operators vs ONNX Runtime",
        status,
        "torch (training operators)",
        "onnxruntime (one-node graphs)",
        "/".join(dtypes),
        details={"counts": counts},
        failures=[f"{r.op} {r.dtype} {r.case}: {r.failures[0]}" for r in failed],
    )


def generation_agreement(ref: torch.Tensor, cand: torch.Tensor, n_prompt: int) -> dict:
    """Position-by-position agreement of the generated part, and the first position that differs."""
    r, c = ref[:, n_prompt:], cand[:, n_prompt:]
    same = r == c
    first = []
    for row in same:
        bad = (~row).nonzero()
        first.append(int(bad[0]) if len(bad) else None)
    return {"agreement": float(same.float().mean()), "first_mismatch": first, "identical": bool(same.all())}


def task_comparison(
    perplexity: dict[str, float],
    reference: str,
    generations: dict[str, torch.Tensor],
    limits_of: dict[str, tuple[str, dict[str, float]]],
) -> Comparison:
    """Perplexity of every model on the held-out batches and greedy agreement with the reference.

    perplexity: label -> perplexity (reduced batch by batch); generations: label -> (N, n_new) new
    tokens of the same prompts; limits_of: candidate label -> (threshold dtype, limits).
    """
    details: dict = {"perplexity": perplexity, "reference": reference, "generation": {}}
    failures: list[str] = []
    ref_gen = generations.get(reference)
    for label in dict.fromkeys([*perplexity, *generations]):
        if label == reference:
            continue
        agree = None
        if ref_gen is not None and label in generations:
            g = generation_agreement(ref_gen, generations[label], 0)
            details["generation"][label] = g
            agree = g["agreement"]
        dtype, limits = limits_of[label]
        # a generation-only candidate (the KV-cache decode path) has no perplexity of its own
        p_cand = perplexity.get(label, perplexity[reference])
        for f in check_task(ppl_ref=perplexity[reference], ppl_cand=p_cand, agreement=agree, limits=limits):
            failures.append(f"{label} ({dtype}): {f.text}")
    if ref_gen is not None:
        details["generated_tokens"] = {k: v.tolist() for k, v in generations.items()}
    status = (
        "fail"
        if failures
        else ("pass" if len(set(perplexity) | set(generations)) > 1 else "skipped: no candidate to compare")
    )
    return Comparison(
        "task",
        "task level: perplexity and greedy generation",
        status,
        reference,
        ", ".join(k for k in perplexity if k != reference),
        details=details,
        failures=failures,
    )


JUMP_FLOOR = 1e-4  # relative Euclidean distance below which a layer's error is float rounding, not a headline


def biggest_jump(rows: list[TensorRow]) -> dict | None:
    """The layer whose output's relative Euclidean distance grew most over the previous layer's."""
    layers = [r for r in rows if r.layer is not None and r.tensor.startswith("hidden.")]
    best = None
    prev = None
    for r in layers:
        red = r.metrics.rel_euclidean
        if prev is not None and math.isfinite(red):
            ratio = red / max(prev, 1e-12)
            if best is None or ratio > best["ratio"]:
                best = {"layer": r.layer, "ratio": ratio, "rel_euclidean": red, "previous": prev}
        prev = red if math.isfinite(red) else prev
    return best


@dataclass(frozen=True)
class Verdict:
    passed: bool
    first_failing_layer: dict | None  # {"comparison", "candidate", "layer", "failure"}
    first_failing_operator: dict | None  # {"op", "dtype", "case", "failure"}
    failed: tuple[str, ...]  # ids of failed comparisons
    text: str

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "first_failing_layer": self.first_failing_layer,
            "first_failing_operator": self.first_failing_operator,
            "failed": list(self.failed),
            "text": self.text,
        }


def decide(
    comparisons: list[Comparison], operator_rows: list[OperatorRow], operator_dtypes: tuple[str, ...]
) -> Verdict:
    """Pass only when no comparison failed; name where the error starts."""
    failed = tuple(c.id for c in comparisons if c.status == "fail")
    layer = None
    for c in sorted(comparisons, key=lambda c: ORDER.index(c.id) if c.id in ORDER else 99):
        for r in c.rows:
            if r.failures:
                layer = {
                    "comparison": c.id,
                    "candidate": c.candidate,
                    "layer": r.layer,
                    "tensor": r.tensor,
                    "failure": r.failures[0],
                }
                break
        if layer:
            break
    op = None
    for r in operator_rows:
        if r.status == "fail" and r.dtype in operator_dtypes:
            op = {"op": r.op, "dtype": r.dtype, "case": r.case, "failure": r.failures[0]}
            break
    parts = []
    ran = [c for c in comparisons if c.status in ("pass", "fail")]
    if not ran:  # all skipped is no evidence either way, so it must not read as a pass
        return Verdict(
            False,
            None,
            None,
            (),
            "FAIL: nothing was compared (every comparison was skipped); give "
            "--onnx, --checkpoint or --om, or enable evaluate.operators",
        )
    if not failed:
        parts.append("PASS: every comparison that ran is within its bounds")
    else:
        parts.append("FAIL: " + ", ".join(failed))
    if layer:
        where = f"layer {layer['layer']}" if layer["layer"] is not None else layer["tensor"]
        parts.append(f"first divergence at {where} ({layer['comparison']}, {layer['candidate']}): {layer['failure']}")
    else:
        jumps = [(c, biggest_jump(c.rows)) for c in comparisons if c.rows]
        jumps = [(c, j) for c, j in jumps if j and j["rel_euclidean"] >= JUMP_FLOOR]
        if jumps:  # a jump among errors at float rounding (1e-8 -> 1e-7) is noise, not news
            c, j = max(jumps, key=lambda cj: cj[1]["ratio"])
            parts.append(
                f"largest error jump: layer {j['layer']} in {c.id} "
                f"(relative Euclidean {j['previous']:.3g} -> {j['rel_euclidean']:.3g})"
            )
    if op:
        parts.append(f"first failing operator: {op['op']} ({op['dtype']}, {op['case']} inputs): {op['failure']}")
    else:
        ran = [
            r
            for r in operator_rows
            if r.metrics is not None and r.dtype in operator_dtypes and math.isfinite(r.metrics.rel_euclidean)
        ]
        if ran:
            w = max(ran, key=lambda r: r.metrics.rel_euclidean)
            parts.append(
                f"largest operator error: {w.op} ({w.dtype}, {w.case} inputs, relative Euclidean "
                f"{w.metrics.rel_euclidean:.3g})"
            )
    for c in comparisons:
        if c.failures and c.id != "operators":
            parts.append(f"{c.id}: {c.failures[0]}")
    return Verdict(not failed, layer, op, failed, "; ".join(parts))
