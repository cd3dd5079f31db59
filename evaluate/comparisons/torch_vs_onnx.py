"""torch_vs_onnx: training operators (the PyTorch reference) vs the exported prefill graph in ONNX
Runtime, per decoder layer (the graph's own values, its pieces chained) and on the logits."""

from __future__ import annotations

from titan_pipe.evaluate import compare as cmp
from titan_pipe.evaluate.comparisons.common import abs_errors
from titan_pipe.evaluate.metrics import compare_tensors
from titan_pipe.evaluate.run import REF, Run, forced_sequences
from titan_pipe.evaluate.runners.ort_layers import JoinedSink, LogitsSink, PrefillSink
from titan_pipe.evaluate.store import StoreSink
from titan_pipe.graphs.generation import prefill_feeds

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
    c = cmp.compare_values(
        "torch_vs_onnx",
        TITLE,
        run.values(REF),
        run.values(SIDE),
        ref_label=run.sides.reference.label,
        cand_label=ort.label,
        dtype=dt,
        limits=run.limits(dt),
        dump=run.dump,
    )
    c.details["layers"] = layers
    if run.sides.prefill_chain is not None:
        c.details["own_error"] = own_errors(run)
    run.judged(ort.label, dt, SIDE)
    run.ledger.hist[ort.label] = abs_errors(run.values(REF), run.values(SIDE))
    if not run.prefill_generates and (run.sides.decode is None or run.kv_chained):  # no later row runs it
        run.close_graphs(decode=False)  # (the KV row's prefill ran above): its memory is free for decode.onnx
    return c


def _run_chain(run: Run) -> str:
    """The graph's pieces over every batch (each layer also on the reference's input to it) and,
    when the KV row runs piece by piece, over the loop's prompts (its prefill) in the same pass."""
    ort, chain = run.sides.prefill, run.sides.prefill_chain
    batches = run.request.data.batches
    store = run.store

    def inherited(i: int, b: int):
        if b >= len(batches):  # the loop's prompts: no reference input
            return None
        return store.get((REF, "embed", None, b) if i == 0 else (REF, "hidden", i - 1, b))

    # one pass of the pieces for every row's sequences through this graph: each piece opens once
    feeds = [ort.feeds(x) for x in batches]
    groups = [(StoreSink(store, [(SIDE, b) for b in range(len(batches))]), len(batches))]
    if run.kv_chained:  # the KV row's prefill of its prompts
        plan = run.loop_plan()
        loop = PrefillSink(plan, run.args.n_layers)
        feeds += [prefill_feeds(pb) for pb in plan]
        groups.append((loop, len(plan)))
    if run.prefill_generates:  # the task row's first teacher-forced pass of this graph's own generation
        seqs = forced_sequences(run.prompts.prompts, run.prompts.reference)
        forced = LogitsSink()
        feeds += [ort.feeds(x) for x in seqs]
        groups.append((forced, len(seqs)))
    chain.forward(feeds, JoinedSink(groups), inherited=inherited)
    if run.kv_chained:
        run.ledger.prefilled = loop.result()
    if run.prefill_generates:
        run.ledger.forced_logits = [forced.got[j] for j in range(len(seqs))]
    return f"{ort.graph.layers_note}; {chain_note(chain)}"


def chain_note(chain) -> str:
    """How the per-layer values were computed."""
    return (
        f"the graph run as {len(chain.pieces)} pieces cut between those values (embedding, each layer, head; "
        "its own nodes and weights), layer by layer, each value rounded to the graph's dtype between pieces "
        "(ONNX Runtime running the graph whole may keep some of them in float32 on the CPU; tests check that "
        "the chain returns the whole graph's logits, bit for bit in float32)"
    )


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
