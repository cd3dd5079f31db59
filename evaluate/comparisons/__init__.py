"""The comparisons, one module each, all ``compare(run) -> Comparison | None`` (None: no row for
these inputs); each reads the Run (evaluate/run.py) and returns its judged rows (evaluate/compare.py).

  sharded        training checkpoint under torchrun vs the unified model (comparison 1)
  torch_vs_onnx  the PyTorch reference vs the exported prefill graph, per layer and logits
  router         a mixture of experts' choices per routing layer, reference vs the prefill graph
  kv_decode      the generation loop on prefill + decode.onnx, teacher-forced, per layer and logits
  npu_fused      fused NPU training kernels vs the reference operators (NPU hosts)
  operators      per-operator conformance
  om             the ATC .om on an Ascend runtime
  task           perplexity and greedy generations of every candidate
"""

from __future__ import annotations

from titan_pipe.evaluate.comparisons import kv_decode, npu_fused, om, operators, router, sharded, task, torch_vs_onnx

# report order; the task row last: it reads what the others recorded
COMPARISONS = (
    sharded.compare,
    torch_vs_onnx.compare,
    router.compare,
    kv_decode.compare,
    npu_fused.compare,
    operators.compare,
    om.compare,
    task.compare,
)
