"""A finished stage's summary, typed: the figures a flow, its cache record and `titan-pipe run` show.

One class per stage, what its library function returns (the trainer's launcher, convert_checkpoint,
export_model, evaluate_model) and what the flow's tasks hand on. Each names its fields, read as
attributes (never a string key), says its one line (``figures``) and its table rows (``rows``).
``of`` reads a stored record back (the flow cache), tolerating a field an older version did not
write and dropping one it no longer has.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar


def cell(value: Any) -> Any:
    """A value as a table cell: a float to 6 significant digits, a structure as short JSON, None as
    n/a, anything else as it is (a count stays a number)."""
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (dict, list, tuple)):
        text = json.dumps(value, default=str)
        return text if len(text) <= 200 else text[:197] + "..."
    return value


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class Summary:
    stage: ClassVar[str] = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, d: dict | None) -> "Summary":
        """The summary stored as ``d`` (a flow cache record): known fields only, absent ones their
        default; a tuple field stored as a JSON list read back as a tuple."""
        d = d if isinstance(d, dict) else {}
        return cls(
            **{
                f.name: tuple(d[f.name] or ()) if isinstance(f.default, tuple) else d[f.name]
                for f in fields(cls)
                if f.name in d
            }
        )

    def figures(self) -> list[str | None]:
        return []

    def rows(self) -> list[dict]:
        return [{"key": k, "value": cell(v)} for k, v in self.to_dict().items()]

    def line(self) -> str:
        """The one-line summary of the finished stage (run's live output and its final table)."""
        return ", ".join(p for p in self.figures() if p)


@dataclass(frozen=True)
class DataSummary(Summary):
    stage: ClassVar[str] = "data"
    tokens: int | None = None
    documents: int | None = None
    val_documents: int | None = None
    reused: bool = False

    def figures(self):
        return [
            f"{self.tokens:,} tokens" if _count(self.tokens) is not None else None,
            f"{self.documents:,} documents" if _count(self.documents) is not None else None,
            "already prepared" if self.reused else None,
        ]


@dataclass(frozen=True)
class TrainSummary(Summary):
    """final_loss (the last logged step's), tokens_per_s (mean over logged steps after the first,
    which carries warm-up), mfu (same mean; None when the peak is unknown), steps (the last logged),
    and what the trainer and launcher add: start_step, peak_flops_source, plot (metrics.png)."""

    stage: ClassVar[str] = "train"
    final_loss: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    steps: int = 0
    start_step: int | None = None
    peak_flops_source: str | None = None
    plot: str | None = None

    def figures(self):
        mfu = _number(self.mfu)
        return [
            f"loss {self.final_loss:.4f}" if _number(self.final_loss) is not None else None,
            f"{self.tokens_per_s:,.0f} tok/s" if _number(self.tokens_per_s) is not None else None,
            f"MFU {100 * mfu:.2f}%" if mfu is not None else None,
            f"{self.steps} steps" if self.steps else None,
        ]

    def rows(self) -> list[dict]:
        mfu = _number(self.mfu)
        rows = [
            {"metric": "final loss", "value": cell(self.final_loss)},
            {"metric": "tokens/s", "value": cell(self.tokens_per_s)},
            {"metric": "MFU", "value": "n/a" if mfu is None else f"{100 * mfu:.2f}%"},
            {"metric": "steps", "value": cell(self.steps)},
        ]
        extra = {"start_step": self.start_step, "peak_flops_source": self.peak_flops_source, "plot": self.plot}
        return rows + [{"metric": k, "value": cell(v)} for k, v in extra.items() if v is not None]


@dataclass(frozen=True)
class ConvertSummary(Summary):
    """What convert_checkpoint did: the source (format, path, step, its layout), the output (kind, tp,
    pp), the tensors, bytes and files written and how fast, the tokenizer and stop ids it carries, and
    the tensors holding NaN/Inf (checked on every tensor, or on the assembled ones only)."""

    stage: ClassVar[str] = "convert"
    format: str = ""
    src: str = ""
    step: int | None = None
    layout: Any = None  # the source's layout record (dp/tp/pp...) or its name
    output: str = ""
    tp: int | None = None
    pp: int | None = None
    tensors: int | None = None
    bytes: int | None = None
    files: int | None = None
    wall_s: float | None = None
    gb_per_s: float | None = None
    tokenizer: str | None = None
    stop_ids: Any = None  # an id or a list of ids; None: the source names none
    nonfinite: tuple[str, ...] = ()
    nonfinite_checked: str = ""

    def figures(self):
        return [
            f"{self.tensors} tensors" if self.tensors is not None else None,
            f"{self.bytes / 1e6:.1f} MB" if self.bytes is not None else None,
            f"{self.files} file(s)" if self.files is not None else None,
        ]


@dataclass(frozen=True)
class ExportSummary(Summary):
    """What export_model wrote: opset, dtype, shapes, the decode cache, the parameters and weight bytes,
    each graph's nodes and bytes, the external-data files, ATC's status and the seconds it took."""

    stage: ClassVar[str] = "export"
    opset: int | None = None
    dtype: str | None = None
    dynamic: bool = False
    kv_cache: bool = False
    cache_len: int | None = None
    params: int | None = None
    weight_bytes: int | None = None
    graphs: dict = field(default_factory=dict)  # file -> {nodes, bytes}
    data_files: tuple[str, ...] = ()
    data_bytes: int | None = None
    atc_status: str = "n/a"
    export_seconds: float | None = None
    timings_seconds: dict = field(default_factory=dict)

    def figures(self):
        return [f"ATC: {self.atc_status}"]


@dataclass(frozen=True)
class EvaluateSummary(Summary):
    """The verdict of evaluate_model and what a person reads first: each comparison's status, the
    first failing layer and operator, the sharded forward's memory, each comparison's logits metrics
    (``logits``: id -> cosine, max_abs, kl, top1), the perplexities (and, for a LoRA checkpoint, the
    base's before the fine-tune)."""

    stage: ClassVar[str] = "evaluate"
    passed: bool = False
    verdict: str = ""
    memory_mode: str = ""
    sharded_memory: dict | None = None
    memory_line: str = ""
    first_failing_layer: dict | None = None
    first_failing_operator: dict | None = None
    comparisons: dict = field(default_factory=dict)  # id -> status
    logits: dict = field(default_factory=dict)  # id -> {cosine, max_abs, kl, top1}
    perplexity: dict | None = None
    perplexity_before_finetune: float | None = None

    def figures(self):
        return ["verdict PASS" if self.passed else "verdict FAIL"]


SUMMARIES: dict[str, type[Summary]] = {
    c.stage: c for c in (DataSummary, TrainSummary, ConvertSummary, ExportSummary, EvaluateSummary)
}
