"""One evaluation as data: what was asked, who is compared, the memory mode, what comparisons leave.

``prepare`` checks that the artifacts are one model, loads the held-out data, plans the memory
mode (evaluate/memory.py), opens the reference and the candidates (no weights of a candidate are
loaded yet), runs the reference over every token sequence the comparisons need (layer-major:
each reference layer read once), and returns the Run every comparison reads.

  Request  frozen: artifacts, settings, held-out data, batch shape
  Sides    frozen: the reference and the candidates (whole graphs and their layer chains)
  Prompts  frozen: the generations' prompts, new tokens per prompt, the reference's greedy tokens
  Ledger   what the comparisons record for later ones and for the report (the one mutable part)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from titan_pipe.config import EvaluateConfig
from titan_pipe.evaluate.batches import EvalData
from titan_pipe.evaluate.memory import MemoryPlan
from titan_pipe.evaluate.report import TensorDump
from titan_pipe.evaluate.runners.ort import OnnxDecodeRunner, OnnxRuntimeRunner
from titan_pipe.evaluate.runners.ort_layers import LayerChain
from titan_pipe.evaluate.runners.pytorch import LayeredModel
from titan_pipe.evaluate.runners.sharded import DistributedRunner
from titan_pipe.evaluate.store import Values, ValueStore
from titan_pipe.graphs.generation import PaddedBatch, plan_batches
from titan_pipe.model.args import ModelArgs
from titan_pipe.rules.thresholds import resolve_thresholds

REF = "ref"  # the reference's values over the held-out batches, in the store
REF_GEN = "ref_gen"  # its greedy steps over the prompts: the logits and layer values the KV loop is held to


@dataclass(frozen=True)
class Request:
    settings: EvaluateConfig
    checkpoint: Path | None
    model_dir: Path | None
    onnx: Path | None
    om: Path | None
    data: EvalData
    batch_size: int
    seq_len: int


@dataclass(frozen=True)
class Sides:
    reference: LayeredModel
    reference_source: str  # the file its model config came from
    sharded: DistributedRunner | None
    prefill: OnnxRuntimeRunner | None
    prefill_chain: LayerChain | None  # None: its per-layer values are unknown (logits from the whole graph)
    decode: OnnxDecodeRunner | None
    decode_chain: LayerChain | None
    decode_skip: str | None  # why the KV-cache loop cannot run on these graphs


@dataclass(frozen=True)
class Prompts:
    """Prompts of mixed lengths (P down to P - P//2, cut to a static graph's T), ``n_new`` tokens
    each (capped by a static cache), the reference's greedy tokens (N, n_new) or None."""

    prompts: list[list[int]]
    n_new: int
    reference: torch.Tensor | None


@dataclass
class Ledger:
    thresholds_used: dict[str, dict] = field(default_factory=dict)
    judged_dtypes: list[str] = field(default_factory=list)
    limits_of: dict[str, tuple[str, dict]] = field(default_factory=dict)  # candidate -> (dtype, limits)
    logits_of: dict[str, str] = field(default_factory=dict)  # candidate -> its side in the store (perplexity)
    generations: dict[str, torch.Tensor] = field(default_factory=dict)  # label -> (N, n_new) greedy tokens
    hist: dict[str, np.ndarray] = field(default_factory=dict)  # label -> |cand - ref| logits sample
    op_rows: list = field(default_factory=list)
    op_dtypes: tuple[str, ...] = ()
    prefilled: object = None  # ort_layers.Prefilled: the prefill pieces over the loop's prompts (torch_vs_onnx)
    forced_logits: list | None = None  # the prefill pieces' logits over forced_sequences(reference) (torch_vs_onnx)
    seconds: dict[str, float] = field(default_factory=dict)  # what each step took (the report's timing)


@dataclass(frozen=True)
class Run:
    request: Request
    sides: Sides
    prompts: Prompts
    memory: MemoryPlan
    store: ValueStore
    ledger: Ledger
    steps: object  # progress (api.Steps)
    dump: TensorDump | None

    @property
    def args(self) -> ModelArgs:
        return self.sides.reference.args

    @property
    def settings(self) -> EvaluateConfig:
        return self.request.settings

    @property
    def prefill_generates(self) -> bool:
        """Whether the prefill graph generates on its own in the task row (it takes any length)."""
        pre = self.sides.prefill
        return pre is not None and not pre.info.fixed_shape and self.prompts.reference is not None

    @property
    def kv_chained(self) -> bool:
        """Whether the KV row runs the graphs piece by piece: then the torch_vs_onnx row's pass over
        the prefill pieces also prefills the loop's prompts, and those pieces open once for both."""
        s = self.sides
        return (
            s.decode is not None
            and bool(self.settings.prompts)
            and bool(self.prompts.prompts)
            and s.prefill_chain is not None
            and s.decode_chain is not None
        )

    def loop_plan(self, forced: np.ndarray | None = None) -> list[PaddedBatch]:
        """The generation loop's left-padded batches of the prompts (``forced``: the tokens fed after them)."""
        s, p = self.sides, self.prompts
        return plan_batches(
            prefill=s.prefill.graph.io,
            decode=s.decode.graph.io,
            prompts=p.prompts,
            max_new_tokens=p.n_new,
            forced=forced,
        )

    def tdtype(self, cand_dtype: str) -> str:
        """The threshold set: the candidate's dtype, unless evaluate.dtype names one."""
        return cand_dtype if self.settings.dtype == "auto" else self.settings.dtype

    def limits(self, dt: str) -> dict:
        self.ledger.thresholds_used[dt] = resolve_thresholds(dt, self.settings.thresholds)
        if dt not in self.ledger.judged_dtypes:
            self.ledger.judged_dtypes.append(dt)
        return self.ledger.thresholds_used[dt]

    def judged(self, label: str, dt: str, side: str | None) -> None:
        """Record a candidate for the task row: its threshold set, its logits' side in the store."""
        self.ledger.limits_of[label] = (dt, self.limits(dt))
        if side is not None:
            self.ledger.logits_of[label] = side

    def values(self, side: str, parts: int | None = None, n_layers: int | None = None, dim: int = 0) -> Values:
        n = len(self.request.data.batches) if parts is None else parts
        return Values(self.store, side, self.args.n_layers if n_layers is None else n_layers, n, dim)

    def close_graphs(self, *, prefill: bool = True, decode: bool = True) -> None:
        """Close the graphs' sessions a comparison was the last to need (they reopen if asked again)."""
        s = self.sides
        for wanted, graph in (
            (prefill, s.prefill_chain),
            (prefill, s.prefill),
            (decode, s.decode_chain),
            (decode, s.decode),
        ):
            if wanted and graph is not None:
                graph.close()

    def close(self) -> None:
        self.close_graphs()
        self.store.close()
        if self.dump is not None:
            self.dump.close()


def ragged_prompts(prompts: torch.Tensor) -> list[list[int]]:
    """(N, P) -> N prompts of lengths P down to P - P//2 (the last N-1 cut from the left), so the
    KV-cache loop runs a left-padded batch of mixed lengths."""
    n, p = prompts.shape
    lengths = [p - (j * (p // 2)) // max(1, n - 1) for j in range(n)]
    return [row[p - k :].tolist() for row, k in zip(prompts, lengths)]


def forced_sequences(prompts: list[list[int]], tokens: torch.Tensor) -> list[torch.Tensor]:
    """Each prompt + new tokens 0..n-2 as a (1, len) sequence: its logits at positions len(q)-1 onwards
    are the ones choosing each new token when the model is fed ``tokens`` (teacher forcing)."""
    return [torch.tensor([q + tokens[j, :-1].tolist()]) for j, q in enumerate(prompts)]
