"""npu_fused: the fused NPU training kernels against the reference operators, on NPU hosts only."""

from __future__ import annotations

from pathlib import Path

from titan_pipe.evaluate import compare as cmp
from titan_pipe.evaluate.run import Run

TITLE = "fused NPU training kernels (npu_rms_norm, npu_rotary_mul, npu_fusion_attention) vs reference ops"


def compare(run: Run) -> cmp.Comparison:
    from titan_pipe.rules.devices import npu_available

    if not npu_available():
        return cmp.skipped("npu_fused", TITLE, "no NPU")
    if run.request.model_dir is None:
        return cmp.skipped("npu_fused", TITLE, "needs --model-dir")
    from titan_pipe.evaluate.runners.outputs import OutputsSink
    from titan_pipe.evaluate.runners.pytorch import LayeredModel
    from titan_pipe.model.kernels import npu_fused_kernels, reference_kernels
    from titan_pipe.model.weights import open_weights
    from titan_pipe.evaluate.runners.outputs import concat_outputs

    # Both on the NPU, so the row measures the kernels and not the device's arithmetic.
    outs = []
    for kernels, label in (
        (reference_kernels(), "torch float32 reference ops (npu)"),
        (npu_fused_kernels(), "torch float32 npu_fused (npu)"),
    ):
        model = LayeredModel(
            open_weights(Path(run.request.model_dir)),
            device="npu",
            kernels=kernels,
            keep=run.memory.mode == "whole",
            label=label,
        )
        sink = OutputsSink(len(run.request.data.batches), run.args.n_layers)
        model.forward(list(run.request.data.batches), sink)
        outs.append((label, concat_outputs(sink.outputs)))
    dt = run.tdtype("float32")
    (plain_label, plain), (fused_label, fused) = outs
    return cmp.compare_outputs(
        "npu_fused", TITLE, plain, fused, ref_label=plain_label, cand_label=fused_label, dtype=dt, limits=run.limits(dt)
    )
