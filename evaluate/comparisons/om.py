"""om: the ATC .om on an Ascend runtime (ais_bench) vs the PyTorch reference, when there is one."""

from __future__ import annotations

from pathlib import Path

from titan_pipe.evaluate import compare as cmp
from titan_pipe.evaluate.comparisons.common import abs_errors
from titan_pipe.evaluate.run import REF, Run
from titan_pipe.evaluate.runners.om import OmRunner, ascend_runtime


def compare(run: Run) -> cmp.Comparison:
    run.steps.step("OM")
    runtime = ascend_runtime()
    if run.request.om is None:
        return cmp.skipped("om", "ATC .om model", "no Ascend runtime" if runtime is None else "no --om given")
    if runtime is None:
        return cmp.skipped("om", "ATC .om model", "no Ascend runtime (neither ais_bench nor acl is importable)")
    if runtime != "ais_bench":
        return cmp.skipped(
            "om", "ATC .om model", "pyACL found but titan-pipe drives .om files through ais_bench; install ais_bench"
        )
    # per-layer rows from the .om's operator dump, mapped through the ONNX graph it was built from
    prefill = run.sides.prefill
    omr = OmRunner(Path(run.request.om), graph=prefill.graph if prefill is not None else None, dim=run.args.dim)
    for b, batch in enumerate(run.request.data.batches):
        run.store.put_outputs("om", b, omr.run(batch))
    dt = run.tdtype(omr.dtype)
    c = cmp.compare_values(
        "om",
        "PyTorch vs the .om on the Ascend runtime",
        run.values(REF),
        run.values("om"),
        ref_label=run.sides.reference.label,
        cand_label=omr.label,
        dtype=dt,
        limits=run.limits(dt),
        dump=run.dump,
    )
    c.details["layers"] = (
        omr.layers_note
        or "per-layer rows need --onnx (the graph the .om was compiled from) to map the operator dump to layers"
    )
    run.judged(omr.label, dt, "om")
    run.ledger.hist[omr.label] = abs_errors(run.values(REF), run.values("om"))
    # no greedy generation on the .om: gear-compiled models take only their compiled lengths
    return c
