"""onnx_kv_decode: the deployed generation loop (left-padded prompts of mixed lengths, prefill, then
decode.onnx one token a step against the fixed cache) vs the PyTorch model run on each prompt alone.

Teacher-forced onto the reference's greedy tokens: the logits predicting each new token, and
decode.onnx's own per-layer values at each decode step against the reference's at the same
position. The candidate's own greedy tokens follow from teacher-forced runs (``free_tokens``), so
they equal the free-running loop's exactly without running it when it agrees with the reference.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from titan_pipe.evaluate import compare as cmp
from titan_pipe.evaluate.run import REF_GEN, Run
from titan_pipe.evaluate.runners.ort_layers import forced_steps, prefill
from titan_pipe.evaluate.store import KINDS
from titan_pipe.rules.thresholds import check_task

SIDE = "kv"  # its reference side is REF_GEN: the reference's own greedy steps (evaluate/prepare.py)
TITLE = "KV-cache decode loop (left-padded batch, prefill + decode.onnx against the fixed cache) vs PyTorch on each prompt alone"


def compare(run: Run) -> cmp.Comparison | None:
    s = run.sides
    if s.decode is not None and run.settings.prompts:
        run.steps.step("KV-cache decode loop")
        return _row(run)
    if s.prefill is None:
        return None
    why = s.decode_skip or (
        "evaluate.prompts is 0"
        if not run.settings.prompts
        else f"no decode.onnx beside {Path(run.request.onnx).name} exported with the KV cache"
    )
    return cmp.skipped("onnx_kv_decode", "KV-cache decode graph", why)


def _row(run: Run) -> cmp.Comparison:
    dec, p = run.sides.decode, run.prompts
    layered = run.sides.prefill_chain is not None and run.sides.decode_chain is not None
    logits = _forced(run, p.reference, record=layered)
    run.store.put((SIDE, "logits", None, 0), logits)
    dt = run.tdtype(dec.prefill.dtype)
    lim = run.limits(dt)
    c = cmp.compare_values(
        "onnx_kv_decode",
        TITLE,
        run.values(REF_GEN, parts=1),
        run.values(SIDE, parts=1),
        ref_label=run.sides.reference.label,
        cand_label=dec.label,
        dtype=dt,
        limits=lim,
        dump=run.dump,
    )
    free = free_tokens(lambda tokens: _forced(run, tokens, record=False), p.reference, logits)
    run.ledger.generations[dec.label] = free
    run.judged(dec.label, dt, None)
    agree = cmp.generation_agreement(p.reference, free, 0)
    for f in check_task(ppl_ref=1.0, ppl_cand=1.0, agreement=agree["agreement"], limits=lim):
        c.failures.append(f"{dec.label} ({dt}): {f.text}")
        c.status = "fail"
    c.details = _details(run, agree, layered)
    run.close_graphs(prefill=not run.prefill_generates)  # the last row to run them but the task row's
    return c


def _forced(run: Run, tokens: torch.Tensor, *, record: bool) -> torch.Tensor:
    """Teacher-forced logits (N, n_new, vocab) of the loop fed ``tokens``; with ``record``, decode.onnx's
    per-layer values of every step go to the store (layer i: (N, n_new - 1, dim))."""
    s, p = run.sides, run.prompts
    forced = tokens.numpy()
    if s.prefill_chain is None or s.decode_chain is None:
        return torch.from_numpy(s.decode.generate(p.prompts, p.n_new, forced=forced).logits)
    plan = run.loop_plan(forced)
    sink = _StepSink(len(plan), p.n_new - 1) if record else None
    if run.ledger.prefilled is None:  # torch_vs_onnx's pass did not run the prompts: prefill them here, once
        run.ledger.prefilled = prefill(s.prefill_chain, plan)
    per_batch = forced_steps(run.ledger.prefilled, s.decode_chain, plan, p.n_new, sink)
    if sink is not None:
        sink.store(run, [pb.n_real for pb in plan])
    return torch.from_numpy(np.concatenate([lg[: pb.n_real] for lg, pb in zip(per_batch, plan)]))


class _StepSink:
    """decode.onnx's values per (batch, step, layer), joined into (N, steps, dim) per layer."""

    def __init__(self, n_batches: int, n_steps: int):
        self.got: dict[tuple, torch.Tensor] = {}
        self.n_batches, self.n_steps = n_batches, n_steps

    def step(self, b: int, k: int, i: int, attn, mlp, hidden) -> None:
        for kind, v in zip(KINDS, (attn, mlp, hidden)):
            if v is not None:
                self.got[b, k, i, kind] = v

    def store(self, run: Run, n_real: list[int]) -> None:
        if not self.n_steps:
            return
        for i in range(run.args.n_layers):
            for kind in KINDS:
                if (0, 0, i, kind) not in self.got:
                    continue
                rows = [
                    torch.cat([self.got[b, k, i, kind] for k in range(self.n_steps)], dim=1)[: n_real[b]]
                    for b in range(self.n_batches)
                ]
                run.store.put((SIDE, kind, i, 0), torch.cat(rows))
        self.got.clear()


def free_tokens(score, tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The candidate's own greedy tokens (N, n) from teacher-forced runs: ``logits`` = score(tokens)
    (N, n, vocab), the logits predicting each token when the loop is fed ``tokens``. Where the argmax
    disagrees first in a row, the row continues with the argmax and runs again (what a row's argmax
    depends on is fixed once the tokens before it are), until every argmax is the token fed: that
    is the free-running loop's output, exactly. Agreeing from the start costs no further run."""
    for _ in range(tokens.shape[1] + 1):
        choice = logits.argmax(-1)
        wrong = choice != tokens
        if not wrong.any():
            return tokens
        nxt = tokens.clone()
        for r in range(tokens.shape[0]):
            if wrong[r].any():
                j = int(wrong[r].nonzero()[0])
                nxt[r, j:] = choice[r, j:]
        tokens, logits = nxt, score(nxt)
    raise RuntimeError("teacher-forced greedy decoding did not settle")  # cannot happen: one token fixed per run


def _details(run: Run, agree: dict, layered: bool) -> dict:
    dec, p = run.sides.decode, run.prompts
    lengths = [len(q) for q in p.prompts]
    if layered:
        layers = (
            f"{dec.path.name}: {dec.graph.layers_note}; per-layer rows are its {p.n_new - 1} teacher-forced "
            "decode steps of each prompt, the graphs run piece by piece (embedding, each layer with its cache "
            "slice, head)"
        )
    else:
        layers = f"{dec.path.name}: {dec.graph.layers_note or 'no per-layer values'}; the graphs run whole"
    return {
        "positions": f"{p.n_new} generated positions of {len(p.prompts)} prompt(s), left-padded, lengths {lengths}",
        "graphs": "static" if dec.cache_len is not None else "dynamic",
        "cache_len": dec.cache_len or max(lengths) + p.n_new - 1,
        "generation": agree,
        "logits": "teacher-forced onto the reference's greedy tokens",
        "layers": layers,
    }
