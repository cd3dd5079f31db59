"""inspect_checkpoint: what a checkpoint holds (format, layout, parameters, size) without its data.

Readers plan from metadata only (a manifest, safetensors headers, DCP's .metadata and each chunk's
zip directory, Megatron files memory-mapped), so this reads no tensor bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from titan_pipe.model import features
from titan_pipe.model.features import gates
from titan_pipe.weights.detect import open_source
from titan_pipe.weights.readers import lora
from titan_pipe.weights.source_plan import SourcePlan


@dataclass(frozen=True)
class InspectResult:
    format: str
    root: Path
    step: int | None
    layout: dict
    model: dict  # ModelArgs.to_dict()
    params: list[dict]  # name, shape, dtype, split, reads
    total_bytes: int


def inspect_checkpoint(
    *, src: Path, source_format: str = "auto", vocab_size: int | None = None, model_config: Path | None = None
) -> InspectResult:
    if source_format in ("auto", "titan") and lora.lora_step(Path(src)) is not None:
        plan, store, _ = lora.open_source(Path(src), mode="adapter")  # the adapters; the layout names the base
    else:
        plan, store = open_source(Path(src), source_format, vocab_size=vocab_size, model_config=model_config)
    store.close()
    return summarize(plan)


def summarize(plan: SourcePlan) -> InspectResult:
    params = [
        {"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "split": t.split, "reads": len(t.reads)}
        for t in plan.tensors.values()
    ]
    return InspectResult(plan.format, plan.root, plan.step, plan.layout, plan.args.to_dict(), params, plan.nbytes)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


def render(r: InspectResult, console: Console) -> None:
    """Print the summary and one table row per parameter."""
    m = r.model
    step = f"step {r.step}, " if r.step is not None else ""  # a released model or unified dir has none
    console.print(
        f"[bold]{escape(str(r.root))}[/bold]: format [bold]{r.format}[/bold], {step}layout {escape(str(r.layout))}"
    )
    variant = [f.label if f.describe is None else f.describe(m) for f in features.FEATURES if m.get(f.name)]
    gate = gates.GATES.get(m.get("activation") or gates.DEFAULT.name)
    if gate is not None and gate is not gates.DEFAULT:
        variant.append(gate.label)
    console.print(
        f"model: dim {m['dim']}, {m['n_layers']} layers, {m['n_heads']} heads "
        f"({m['n_kv_heads'] or m['n_heads']} kv) of {m.get('head_dim') or m['dim'] // m['n_heads']}, "
        f"vocab {m['vocab_size']}, ffn {m['ffn_hidden_dim']}" + "".join(f", {v}" for v in variant)
    )
    table = Table(show_edge=False, pad_edge=False)
    for col in ("parameter", "global shape", "dtype", "split", "reads"):
        table.add_column(col)
    for p in r.params:
        table.add_row(p["name"], "x".join(map(str, p["shape"])), p["dtype"], p["split"], str(p["reads"]))
    console.print(table)
    console.print(f"{len(r.params)} tensors, {_size(r.total_bytes)}")
