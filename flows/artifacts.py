"""Prefect artifacts of each stage as pure data: tables and markdown (titan_pipe.flows.stages says which
stage publishes which, and publishes them)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from titan_pipe.errors import UserError
from titan_pipe.records.export_record import ExportRecord
from titan_pipe.records.stage_summaries import cell

if TYPE_CHECKING:  # the stage records' output type; its module imports Prefect
    from titan_pipe.flows.tasks import StageOutput


def artifact_key(run_name: str, stage: str, what: str) -> str:
    """Prefect keys allow lowercase letters, digits and dashes only; the same key versions across runs."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{run_name}-{stage}-{what}".lower()).strip("-")


def operator_table(record: ExportRecord | None) -> list[dict]:
    """Rows {graph, domain, operator, count, since opset} from the export record's per-graph operator report."""
    rows = []
    for graph, report in sorted((record.graphs if record else {}).items()):
        for op in report.operators:
            rows.append(
                {
                    "graph": graph,
                    "domain": op.domain or "ai.onnx",
                    "operator": op.op_type,
                    "count": op.count,
                    "since opset": op.since_version,
                }
            )
    return rows


def export_record(export_json: str | None) -> ExportRecord | None:
    """The export stage's record, or None (no table) when it is gone or unusable."""
    try:
        return ExportRecord.find(Path(export_json).parent) if export_json else None
    except UserError:
        return None


def evaluate_markdown(output: StageOutput, report_md: str | None) -> str:
    verdict = "PASS" if output.passed else "FAIL"
    head = [f"# Evaluation verdict: **{verdict}**", ""]
    for k, v in output.summary.to_dict().items():
        if not isinstance(v, (dict, list)):
            head.append(f"- {k}: {cell(v)}")
    head += ["", f"Report: `{output.paths.report_json}`", ""]
    return "\n".join(head) + ("\n---\n\n" + report_md if report_md else "")


def links(output: StageOutput) -> list[tuple[str, str]]:
    """(file URI, text) for every named path the stage produced."""
    return [
        (Path(p).resolve().as_uri(), f"{output.stage}: {name}")
        for name, p in output.paths.named().items()
        if Path(p).exists()
    ]


def files_markdown(stage: str, found: list[tuple[str, str]]) -> str:
    return f"## Files of {stage}\n\n" + "\n".join(f"- [{text}]({uri})" for uri, text in found) + "\n"
