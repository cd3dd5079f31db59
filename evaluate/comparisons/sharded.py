"""sharded_vs_unified: the training checkpoint under its own TP/PP layout (torchrun) vs the unified model."""

from __future__ import annotations

from pathlib import Path

from titan_pipe.records.checkpoint_format import Manifest, complete_step
from titan_pipe.evaluate import compare as cmp
from titan_pipe.evaluate.comparisons.common import abs_errors
from titan_pipe.evaluate.run import REF, Run

TITLE = "training checkpoint under its TP/PP layout vs the unified model"


def compare(run: Run) -> cmp.Comparison:
    run.steps.step("sharded checkpoint under torchrun")
    dist, ref = run.sides.sharded, run.sides.reference
    if dist is None:
        why = (
            "no --checkpoint given"
            if run.request.checkpoint is None
            else ("the --checkpoint is not in titan-pipe's layout (a DCP / Megatron one is the reference itself)")
        )
        return cmp.skipped("sharded_vs_unified", TITLE, why)
    for b, out in enumerate(dist.run_all(run.request.data.batches)):
        run.store.put_outputs("sharded", b, out)
    dt = run.tdtype(dist.dtype)
    merged = run.request.model_dir is not None and _lora(run.request.checkpoint)
    c = cmp.compare_values(
        "sharded_vs_unified",
        TITLE,
        run.values("sharded"),
        run.values(REF),
        ref_label=dist.label,
        cand_label=ref.label,
        dtype=dt,
        limits=run.limits(dt),
        logits_scope="sharded_merged" if merged else "sharded",
        dump=run.dump,
    )
    if merged:
        c.title += (
            " (LoRA: the adapters applied beside the base vs merged into the weights; the merge's rounding is "
            "judged on the relative bounds, not the reduction-order max abs)"
        )
    run.judged(dist.label, dt, "sharded")
    run.ledger.hist[f"{ref.label} vs {dist.label}"] = abs_errors(run.values("sharded"), run.values(REF))
    if run.request.model_dir is None:
        c.title = (
            "training checkpoint under its TP/PP layout vs its own weights in one "
            "process (no --model-dir: the converter is not covered)"
        )
    return c


def _lora(checkpoint) -> bool:
    """Whether the checkpoint step holds LoRA adapters (its manifest's extra.lora)."""
    step = complete_step(Path(checkpoint))
    return step is not None and Manifest.load(step).extra.other.get("lora") is not None
