"""moe_router: a mixture of experts' routing, layer by layer: the share of tokens whose k chosen
experts (as a set) are the same in the PyTorch reference and in the exported prefill graph.

The graph's choices are those of each of its layer pieces run on the reference's input to that
layer (torch_vs_onnx runs them so, for each layer's own error), so a perturbed router weight in
layer k shows at layer k alone: a perturbed expert changes layer k's output, not the choices of
the layers after it. Judged by ``router_agree_min`` (titan_pipe.rules.thresholds).
"""

from __future__ import annotations

import torch

from titan_pipe.evaluate import compare as cmp
from titan_pipe.evaluate.comparisons.torch_vs_onnx import SIDE
from titan_pipe.evaluate.run import REF, Run
from titan_pipe.model import features

TITLE = "Mixture of experts: the experts each token is routed to, PyTorch vs ONNX Runtime, per routing layer"


def compare(run: Run) -> cmp.Comparison | None:
    routing = features.routing(run.sides.reference.args)
    if routing is None:
        return None
    ort = run.sides.prefill
    if ort is None:
        return cmp.skipped("moe_router", "Mixture-of-experts routing", "no --onnx given")
    parts = range(len(run.request.data.batches))
    agree, failures = {}, []
    dt = run.tdtype(ort.dtype)
    bound = run.limits(dt)["router_agree_min"]
    for i in routing.layers:
        ref = [run.store.get((REF, "router", i, b)) for b in parts]
        got = [run.store.get((SIDE, "router", i, b)) for b in parts]
        if any(x is None for x in ref + got):
            return cmp.skipped(
                "moe_router",
                "Mixture-of-experts routing",
                "the graph ran whole, not layer by layer (its pieces hold the choices)",
            )
        same = torch.cat([(r.sort(-1).values == g.sort(-1).values).all(-1) for r, g in zip(ref, got)])
        agree[i] = float(same.float().mean())
        if not agree[i] >= bound:
            failures.append(
                f"layer {i} router: {agree[i]:.1%} of {same.numel()} tokens chose the same "
                f"{routing.top_k} experts (< {bound:.0%}, router_agree_min)"
            )
    c = cmp.Comparison(
        "moe_router",
        TITLE,
        "fail" if failures else "pass",
        reference=run.sides.reference.label,
        candidate=ort.label,
        dtype=dt,
        failures=failures,
    )
    c.details = {
        "agreement": {str(i): round(a, 4) for i, a in agree.items()},
        "bound": bound,
        "experts": routing.experts,
        "top_k": routing.top_k,
    }
    return c
