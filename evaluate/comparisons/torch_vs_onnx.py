"""torch_vs_onnx: training operators (the PyTorch reference) vs the exported prefill graph in ONNX
Runtime, per decoder layer (the graph's own values, its pieces chained) and on the logits."""
from __future__ import annotations

import numpy as np

from titan_pipe.evaluate import compare as cmp
from titan_pipe.evaluate.comparisons.common import abs_errors
from titan_pipe.evaluate.metrics import compare_tensors
from titan_pipe.evaluate.run import REF, Run
from titan_pipe.evaluate.store import StoreSink

SIDE = "onnx"
TITLE = "PyTorch (training operators) vs ONNX Runtime, per decoder layer and logits"


def compare(run: Run) -> cmp.Comparison:
    run.steps.step("ONNX Runtime")
    ort = run.sides.prefill
    if ort is None:
        return cmp.skipped("torch_vs_onnx", "PyTorch vs ONNX Runtime", "no --onnx given")
    if run.sides.prefill_chain is None:
        for b, batch in enumerate(run.request.data.batches):  # the whole graph: logits only
            run.store.put((SIDE, "logits", None, b), ort.run(batch).logits)
        ort.close()
        layers = ort.graph.layers_note
    else:
        layers = _run_chain(run)
    dt = run.tdtype(ort.dtype)
    c = cmp.compare_values("torch_vs_onnx", TITLE, run.values(REF), run.values(SIDE), ref_label=run.sides.reference.label,
                           cand_label=ort.label, dtype=dt, limits=run.limits(dt), dump=run.dump)
    c.details["layers"] = layers
    if run.sides.prefill_chain is not None:
        c.details["own_error"] = own_errors(run)
    run.judged(ort.label, dt, SIDE)
    run.ledger.hist[ort.label] = abs_errors(run.values(REF), run.values(SIDE))
    if run.sides.decode is None and not run.prefill_generates:  # no later row runs this graph
        run.close_graphs()
    return c


def _run_chain(run: Run) -> str:
    """The graph's pieces over every batch (each layer also on the reference's input to it); in
    whole mode first the whole graph on the first batch, to check the chain returns its logits."""
    ort, chain = run.sides.prefill, run.sides.prefill_chain
    batches = run.request.data.batches
    whole = None
    if run.memory.mode == "whole":  # before the pieces load: the two are never held together
        whole = ort.run(batches[0]).logits
        ort.close()
    store = run.store

    def inherited(i: int, b: int):
        return store.get((REF, "embed", None, b) if i == 0 else (REF, "hidden", i - 1, b))

    chain.forward([ort.feeds(x) for x in batches], StoreSink(store, [(SIDE, b) for b in range(len(batches))]),
                  inherited=inherited)
    return f"{ort.graph.layers_note}; {chain_note(chain, whole, store.get((SIDE, 'logits', None, 0)))}"


def chain_note(chain, whole, chained) -> str:
    """How the per-layer values were computed, and whether the chain returns the graph's own logits."""
    note = (f"the graph run as {len(chain.pieces)} pieces cut between those values (embedding, each layer, head; "
            "its own nodes and weights), layer by layer")
    if whole is None:
        return note + ("; the whole graph did not fit in --max-memory, so the chain was not checked against it "
                       "here (tests check chain == whole graph)")
    gap = float(np.abs(whole.double().numpy() - chained.double().numpy()).max())
    if gap == 0.0:
        return note + "; the chain returns the graph's own logits bit for bit (first batch, graph run whole)"
    return note + (f"; the chain's logits differ from the graph run whole by max abs {gap:.3g} on the first batch "
                   "(ONNX Runtime's CPU provider elides the float16 rounding of values between the pieces when "
                   "it runs the graph whole; the chain keeps every value in the graph's dtype)")


def own_errors(run: Run) -> list[dict]:
    """Per layer: the piece run on the reference's own input to it vs the reference's output, i.e.
    the layer's own error without what it inherited from the layers before."""
    out = []
    ref, own = run.values(REF), run.values(SIDE)
    for i in range(run.args.n_layers):
        r, c = ref.layer("hidden", i), own.layer("own", i)
        if r is None or c is None:
            continue
        m = compare_tensors(r, c)
        out.append({"layer": i, "rel_euclidean": m.rel_euclidean, "cosine": m.cosine, "max_abs": m.max_abs})
    return out
