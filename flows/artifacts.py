"""Prefect artifacts of each stage: tables and markdown built as pure data, then published to the run."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from titan_pipe.errors import UserError
from titan_pipe.export_record import ExportRecord
from titan_pipe.flows.tasks import StageOutput


def artifact_key(run_name: str, stage: str, what: str) -> str:
    """Prefect keys allow lowercase letters, digits and dashes only; the same key versions across runs."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{run_name}-{stage}-{what}".lower()).strip("-")


def _fmt(value: Any) -> Any:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (dict, list, tuple)):
        text = json.dumps(value, default=str)
        return text if len(text) <= 200 else text[:197] + "..."
    return value


def train_table(summary: dict) -> list[dict]:
    """Rows: final loss, tokens/s, MFU (as %), steps, plus any other scalar the trainer reported."""
    mfu = summary.get("mfu")
    rows = [
        {"metric": "final loss", "value": _fmt(summary.get("final_loss"))},
        {"metric": "tokens/s", "value": _fmt(summary.get("tokens_per_s"))},
        {"metric": "MFU", "value": "n/a" if mfu is None else f"{100 * float(mfu):.2f}%"},
        {"metric": "steps", "value": _fmt(summary.get("steps"))},
    ]
    known = {"final_loss", "tokens_per_s", "mfu", "steps"}
    rows += [{"metric": k, "value": _fmt(v)} for k, v in summary.items() if k not in known]
    return rows


def key_value_table(summary: dict) -> list[dict]:
    return [{"key": k, "value": _fmt(v)} for k, v in summary.items()]


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


def _export_record(export_json: str | None) -> ExportRecord | None:
    """The export stage's record, or None (no table) when it is gone or unusable."""
    try:
        return ExportRecord.find(Path(export_json).parent) if export_json else None
    except UserError:
        return None


def evaluate_markdown(output: StageOutput, report_md: str | None) -> str:
    verdict = "PASS" if output.passed else "FAIL"
    head = [f"# Evaluation verdict: **{verdict}**", ""]
    for k, v in output.summary.items():
        if not isinstance(v, (dict, list)):
            head.append(f"- {k}: {_fmt(v)}")
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


def publish(output: StageOutput, *, run_name: str, cached: bool) -> list[str]:
    """Create this stage's artifacts in the current Prefect run; returns their keys."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    note = " (cached: inputs unchanged since the last run)" if cached else ""
    keys: list[str] = []

    def table(what: str, rows: list[dict], description: str) -> None:
        if rows:
            key = artifact_key(run_name, output.stage, what)
            create_table_artifact(rows, key=key, description=description + note)
            keys.append(key)

    if output.stage == "train":
        table("metrics", train_table(output.summary), "Training: final loss, tokens/s, MFU")
    elif output.stage == "convert":
        table("summary", key_value_table(output.summary), "Conversion summary")
    elif output.stage == "export":
        table(
            "operators",
            operator_table(_export_record(output.paths.export_json)),
            "ONNX operators of the exported graphs (all on the ATC list: export checks it)",
        )
        table("summary", key_value_table(output.summary), f"Export; ATC status: {output.summary.get('atc_status')}")
    elif output.stage == "evaluate":
        md_path = output.paths.report_md
        report_md = Path(md_path).read_text() if md_path and Path(md_path).is_file() else None
        key = artifact_key(run_name, output.stage, "report")
        create_markdown_artifact(
            evaluate_markdown(output, report_md),
            key=key,
            description=f"Evaluation report: {'PASS' if output.passed else 'FAIL'}{note}",
        )
        keys.append(key)
    found = links(output)
    if found:
        key = artifact_key(run_name, output.stage, "files")
        create_markdown_artifact(
            files_markdown(output.stage, found), key=key, description=f"Files written by {output.stage}"
        )
        keys.append(key)
    return keys
