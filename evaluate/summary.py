"""What report.json holds about a run (inputs, data, model, settings, memory mode, environment), and
the short summary evaluate_model returns."""

from __future__ import annotations

import datetime as _dt

import torch

from titan_pipe.evaluate import compare as cmp
from titan_pipe.evaluate.report import SCHEMA, SCHEMA_VERSION, sharded_line
from titan_pipe.evaluate.run import Run
from titan_pipe.evaluate.runners.om import ascend_runtime
from titan_pipe.records.stage_summaries import EvaluateSummary


def report_dict(run: Run, comparisons: list[cmp.Comparison], verdict: cmp.Verdict) -> dict:
    args, q = run.args, run.request
    ev, s = q.data, q.settings
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "passed": verdict.passed,
        "verdict": verdict.to_dict(),
        "inputs": {
            "checkpoint": _s(q.checkpoint),
            "model_dir": _s(q.model_dir),
            "onnx": _s(q.onnx),
            "om": _s(q.om),
            "data": ev.source,
        },
        "data": {
            "source": ev.source,
            "tokenizer": ev.tokenizer,
            "batches": len(ev.batches),
            "batch_size": q.batch_size,
            "seq_len": q.seq_len,
            "prompts": int(ev.prompts.shape[0]),
            "prompt_len": int(ev.prompts.shape[1]),
            "new_tokens": s.new_tokens,
        },
        "model": args.to_dict() | {"rope_scaling": None if args.rope_scaling is None else vars(args.rope_scaling)},
        "settings": s.model_dump(),
        "thresholds": run.ledger.thresholds_used,
        "memory": run.memory.to_dict() | {"sharded": sharded_memory(run)},
        "environment": environment(),
        "seconds": {k: round(v, 3) for k, v in run.ledger.seconds.items()},
        "comparisons": [c.to_dict() for c in comparisons],
        "operators": [r.to_dict() for r in run.ledger.op_rows],
    }


def sharded_memory(run: Run) -> dict | None:
    """How the sharded forward's ranks held the model (``mode``: "streamed", one decoder layer at a
    time, or "whole") and each rank's peak RSS in bytes; None without a sharded side or before it ran."""
    ran = run.sides.sharded.ran if run.sides.sharded is not None else None
    if ran is None:
        return None
    return {
        "mode": "streamed" if ran["streamed"] else "whole",
        "ranks": len(ran["peak_rss"]),
        "peak_rss_per_rank": ran["peak_rss"],
    }


def memory_line(mode: str, sharded: dict | None) -> str:
    """One line for the console: the mode, and how the sharded forward's ranks held the model."""
    what = "one decoder layer at a time" if mode == "streamed" else "whole graphs"
    ranks = sharded_line(sharded)
    return f"memory: {mode} ({what})" + (f"; {ranks}" if ranks else "")


def _s(p) -> str | None:
    return None if p is None else str(p)


def environment() -> dict:
    import onnxruntime

    return {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__, "ascend_runtime": ascend_runtime()}


def summary(
    verdict: cmp.Verdict, comparisons: list[cmp.Comparison], mode: str, sharded: dict | None = None
) -> EvaluateSummary:
    logits, perplexity, before = {}, None, None
    for c in comparisons:
        for r in c.rows:
            if r.tensor == "logits":
                m = r.metrics
                logits[c.id] = {"cosine": m.cosine, "max_abs": m.max_abs, "kl": m.kl, "top1": m.top1}
        if c.id == "task":
            perplexity = c.details.get("perplexity")
            if c.details.get("before_finetune"):  # LoRA: the frozen base's perplexity on the same tokens
                before = c.details["before_finetune"]["perplexity"]
    return EvaluateSummary(
        passed=verdict.passed,
        verdict=verdict.text,
        memory_mode=mode,
        sharded_memory=sharded,
        memory_line=memory_line(mode, sharded),
        first_failing_layer=verdict.first_failing_layer,
        first_failing_operator=verdict.first_failing_operator,
        comparisons={c.id: c.status for c in comparisons},
        logits=logits,
        perplexity=perplexity,
        perplexity_before_finetune=before,
    )
