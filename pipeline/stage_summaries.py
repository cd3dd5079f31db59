"""A finished stage's summary, typed: the figures a flow, its cache record and `titan-pipe run` show.

One class per stage. Each names the fields the code reads as attributes (never a string key), says
its one line (``figures``) and its table rows (``rows``), and keeps the library's whole record as
``details`` where it has one (convert's, export's and evaluate's summaries: shown as they are, never
picked apart). ``of`` reads a stored record back (the flow cache), tolerating a field an older
version did not write.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
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
        """The summary stored as ``d`` (a flow cache record): known fields only, absent ones as None."""
        d = d if isinstance(d, dict) else {}
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    def figures(self, passed: bool | None) -> list[str | None]:
        return []

    def rows(self) -> list[dict]:
        return [{"key": k, "value": cell(v)} for k, v in self.to_dict().items()]

    def line(self, passed: bool | None) -> str:
        """The one-line summary of the finished stage (run's live output and its final table)."""
        return ", ".join(p for p in self.figures(passed) if p)


@dataclass(frozen=True)
class DataSummary(Summary):
    stage: ClassVar[str] = "data"
    tokens: int | None = None
    documents: int | None = None
    val_documents: int | None = None
    reused: bool = False

    def figures(self, passed):
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

    def figures(self, passed):
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
    stage: ClassVar[str] = "convert"
    tensors: int | None = None
    bytes: int | None = None
    files: int | None = None
    nonfinite: tuple[str, ...] = ()
    details: dict = field(default_factory=dict)  # convert_checkpoint's whole summary

    @classmethod
    def from_result(cls, summary: dict) -> "ConvertSummary":
        return cls(
            tensors=_count(summary.get("tensors")),
            bytes=_count(summary.get("bytes")),
            files=_count(summary.get("files")),
            nonfinite=tuple(summary.get("nonfinite") or ()),
            details=dict(summary),
        )

    @classmethod
    def of(cls, d):
        s = super().of(d)
        return replace(s, nonfinite=tuple(s.nonfinite or ()))  # a stored record holds a list

    def figures(self, passed):
        return [
            f"{self.tensors} tensors" if self.tensors is not None else None,
            f"{self.bytes / 1e6:.1f} MB" if self.bytes is not None else None,
            f"{self.files} file(s)" if self.files is not None else None,
        ]

    def rows(self) -> list[dict]:
        return [{"key": k, "value": cell(v)} for k, v in self.details.items()]


@dataclass(frozen=True)
class ExportSummary(Summary):
    stage: ClassVar[str] = "export"
    atc_status: str = "n/a"
    details: dict = field(default_factory=dict)  # export_model's whole summary

    def figures(self, passed):
        return [f"ATC: {self.atc_status}"]

    def rows(self) -> list[dict]:
        return [{"key": k, "value": cell(v)} for k, v in self.details.items()]


@dataclass(frozen=True)
class EvaluateSummary(Summary):
    stage: ClassVar[str] = "evaluate"
    details: dict = field(default_factory=dict)  # evaluate_model's whole summary

    def figures(self, passed):
        return ["verdict PASS" if passed else "verdict FAIL"]


SUMMARIES: dict[str, type[Summary]] = {
    c.stage: c for c in (DataSummary, TrainSummary, ConvertSummary, ExportSummary, EvaluateSummary)
}
