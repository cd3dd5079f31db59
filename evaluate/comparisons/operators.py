"""operators: per-operator conformance, judged in the dtypes the model comparisons used."""

from __future__ import annotations

from titan_pipe.evaluate import compare as cmp
from titan_pipe.evaluate.operators import model_operators, run_conformance
from titan_pipe.evaluate.run import Run


def compare(run: Run) -> cmp.Comparison:
    run.steps.step("operator conformance")
    if not run.settings.operators:
        return cmp.skipped("operators", "operator conformance", "evaluate.operators is false")
    run.ledger.op_dtypes = tuple(run.ledger.judged_dtypes) or (run.tdtype("float32"),)
    run.ledger.op_rows = run_conformance(thresholds=run.settings.thresholds, ops=model_operators(run.args))
    return cmp.operator_comparison(run.ledger.op_rows, run.ledger.op_dtypes)
