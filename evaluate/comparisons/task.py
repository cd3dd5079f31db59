"""task: perplexity of every candidate on the held-out batches (reduced batch by batch) and greedy
generations token for token, on the prompts every generation shares."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from titan_pipe.evaluate import compare as cmp
from titan_pipe.evaluate.comparisons.kv_decode import free_tokens
from titan_pipe.evaluate.metrics import nll_sum
from titan_pipe.evaluate.run import REF, Run, forced_sequences
from titan_pipe.evaluate.runners.pytorch import LayeredModel
from titan_pipe.model.weights import open_weights


def compare(run: Run) -> cmp.Comparison:
    run.steps.step("perplexity and greedy generation")
    ref = run.sides.reference
    ppl = {ref.label: _perplexity(run, REF)}
    ppl.update({label: _perplexity(run, side) for label, side in run.ledger.logits_of.items()})
    generations = dict(run.ledger.generations)
    if run.prefill_generates:
        generations[run.sides.prefill.label] = _prefill_generation(run)
        run.close_graphs()
    if generations:
        generations = {ref.label: run.prompts.reference, **generations}
    task = cmp.task_comparison(ppl, ref.label, generations, run.ledger.limits_of)
    task.details["prompt_lengths"] = [len(q) for q in run.prompts.prompts]
    before = _base_perplexity(run)
    if before is not None:  # LoRA: the frozen base on the same tokens, what the fine-tune started from
        task.details["before_finetune"] = {"label": before[0], "perplexity": before[1], "after": ppl[ref.label]}
    prefill = run.sides.prefill
    if prefill is not None and prefill.info.fixed_shape:
        task.details["generation_note"] = (
            "prefill re-run skipped for the static ONNX graph (its generation is the KV-cache loop's)"
        )
    return task


def _perplexity(run: Run, side: str) -> float:
    """Over every next token, or for chat data over the answer tokens only."""
    total = count = 0
    answers = run.request.data.answers
    for b, tokens in enumerate(run.request.data.batches):
        keep = answers[b][:, 1:] if answers is not None else None
        s, n = nll_sum(run.store.get((side, "logits", None, b))[:, :-1], tokens[:, 1:], keep)
        total, count = total + s, count + n
    return math.exp(total / count) if count else float("nan")


def _base_perplexity(run: Run) -> tuple[str, float] | None:
    """(label, perplexity) of a LoRA reference's frozen base without its adapters (the model before
    the fine-tune), over the same tokens (the answers only on chat data); None for any other reference."""
    ckpt = run.request.checkpoint
    source = open_weights(Path(ckpt), adapters_apart=True) if ckpt is not None else None
    if getattr(source, "base", None) is None:
        return None
    ref = run.sides.reference
    # streamed (a layer at a time): the resident reference is still held, and the base is another whole model
    base = LayeredModel(
        source.base,
        device=ref.device,
        keep=False,
        label=f"torch float32 (the base {Path(source.base.dir).name}, no adapters)",
    )
    total = count = 0
    answers = run.request.data.answers
    for b, tokens in enumerate(run.request.data.batches):
        keep = answers[b][:, 1:] if answers is not None else None
        s, n = nll_sum(base.run(tokens).logits[:, :-1], tokens[:, 1:], keep)
        total, count = total + s, count + n
    return base.label, (math.exp(total / count) if count else float("nan"))


def _prefill_generation(run: Run) -> torch.Tensor:
    """The prefill graph's greedy tokens (N, n_new) for each prompt alone, from teacher-forced
    forwards of prompt + tokens (kv_decode.free_tokens): whole, or piece by piece."""
    prompts, n_new = run.prompts.prompts, run.prompts.n_new

    def cut(logits: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([lg[0, len(q) - 1 : len(q) - 1 + n_new].float() for lg, q in zip(logits, prompts)])

    def score(tokens: torch.Tensor) -> torch.Tensor:
        return cut(_logits(run, forced_sequences(prompts, tokens)))

    ref, done = run.prompts.reference, run.ledger.forced_logits  # torch_vs_onnx's pass ran the first one
    return free_tokens(score, ref, cut(done) if done is not None else score(ref))


def _logits(run: Run, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    prefill, chain = run.sides.prefill, run.sides.prefill_chain
    if chain is None:
        return [prefill.run(x).logits for x in seqs]
    return chain.logits([prefill.feeds(x) for x in seqs])
