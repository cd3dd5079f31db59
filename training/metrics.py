"""Training metrics: JSONL logging, device peak FLOPs and MFU, and the live progress display.

Metric keys the trainer logs (one JSON object per step in runs/<name>/metrics.jsonl), and that
the progress display and the launcher's summary read:
  step (int, 1-based), loss (float), lr, grad_norm, tokens_per_s (global, all dp ranks),
  mfu (fraction of peak, or null when the peak is unknown), peak_memory_bytes or peak_mem_mb
  (max over ranks), step_time_s. Any other key is kept in the JSONL and ignored by the display.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import IO, Any

import torch

from titan_pipe.io.atomic import atomic_file
from titan_pipe.rules.device_profiles import get_profile, match_device_name
from titan_pipe.rules.devices import Device
from titan_pipe.rules.dtypes import name_of
from titan_pipe.training.rank_records import progress_line, records_dir


class MetricsLogger:
    """Appends one JSON line per ``log`` call and flushes it, so a crash loses at most the line
    being written. Disabled (non-zero ranks) it writes nothing and creates no file."""

    def __init__(self, path: Path, *, enabled: bool):
        self.path = Path(path)
        self.enabled = enabled
        self._fh: IO[str] | None = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            from titan_pipe.io.atomic import open_append

            self._fh = open_append(self.path)

    def log(self, record: dict[str, Any]) -> None:
        if self._fh is None:
            return
        clean = {str(k): _jsonable(v) for k, v in record.items()}
        self._fh.write(json.dumps(clean, allow_nan=False) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _jsonable(value: Any) -> Any:
    """Tensors and numpy scalars as plain numbers; NaN/inf as strings (JSON has no NaN)."""
    if isinstance(value, torch.Tensor):
        value = value.item()
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


def read_metrics(path: Path) -> list[dict]:
    """All complete records of a metrics.jsonl (a torn last line from a killed run is skipped)."""
    records = []
    if not Path(path).is_file():
        return records
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            records.append(rec)
    return records


def step_records(path: Path) -> list[dict]:
    """One record per step, ordered by step; where a resumed run logged a step again (it restarted
    from an older checkpoint), the later record wins."""
    by_step: dict[int, dict] = {}
    for rec in read_metrics(path):
        if isinstance(rec.get("step"), int):
            by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]


# --- peak FLOPs and MFU ---------------------------------------------------------------------------


def accelerator_name(device: Device) -> str:
    """The runtime's name of the local accelerator (e.g. 'NVIDIA H100 80GB HBM3', 'Ascend910B3')."""
    if device.type == "cuda":
        return torch.cuda.get_device_name()
    if device.type == "npu":
        return torch.npu.get_device_name()  # type: ignore[attr-defined]
    raise ValueError(f"{device.type} is not an accelerator")


def profile_peak(name: str, dtype: torch.dtype) -> tuple[float | None, str]:
    """Peak FLOP/s of a named accelerator for ``dtype`` from pipeline/data/device_profiles.json."""
    key = match_device_name(name)
    if key is None:
        return None, f"unknown device {name}: MFU not reported"
    dname = name_of(dtype)
    tflops = get_profile(key)["peak_tflops"].get(dname)
    if tflops is None:
        return None, f"{name} ({key}) has no {dname} peak in device_profiles.json: MFU not reported"
    return tflops * 1e12, f"{key} {dname} peak {tflops:g} TFLOPS (device_profiles.json)"


def measure_cpu_peak(dtype: torch.dtype = torch.float32, *, n: int = 512, seconds: float = 0.3) -> float:
    """Best FLOP/s of an n x n x n matmul on this process's CPU threads over ~``seconds``.

    Measured rather than looked up because a CPU's usable peak depends on its vector units, the
    thread count torchrun gave us and what else shares the cores; it is an empirical ceiling
    for this run, not a datasheet figure.
    """
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.mm(a, b)  # warm-up: thread pool and kernel selection
    best = math.inf
    deadline = time.perf_counter() + seconds
    reps = 0
    while reps < 3 or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
        reps += 1
    return 2 * n**3 / best


def peak_flops(device: Device, dtype: torch.dtype) -> tuple[float | None, str]:
    """(peak FLOP/s of one device for ``dtype`` or None, where the figure comes from).

    Accelerators: the runtime's device name looked up in the profile table; an unknown one is
    reported as such (None), never guessed. CPU: a matmul peak measured now.
    """
    if device.type == "cpu":
        flops = measure_cpu_peak(dtype)
        dname = name_of(dtype)
        return flops, (
            f"CPU {dname} matmul peak measured at start-up: {flops / 1e9:.1f} GFLOP/s "
            f"on {torch.get_num_threads()} thread(s)"
        )
    try:
        name = accelerator_name(device)
    except Exception as e:  # a runtime that cannot name its device is an unknown device
        return None, f"unknown device {device.type} ({e}): MFU not reported"
    return profile_peak(name, dtype)


def measured_loss(device: Device) -> str | None:
    """The loss form the device check measured faster on this accelerator (``faster_loss`` in its
    profile: "full" or "chunked"), or None where none was measured (CPU, an unknown device, a
    profile without the figure): what ``train.loss: auto`` follows."""
    if device.type == "cpu":
        return None
    try:
        key = match_device_name(accelerator_name(device))
    except Exception:  # a runtime that cannot name its device: nothing measured for it
        return None
    return get_profile(key).get("faster_loss") if key else None


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over peak (a fraction, not a percentage).

    Pass matching scopes: global tokens/s with the peak of all devices (peak * world size), or
    per-device tokens/s with one device's peak. None when the peak is unknown.
    """
    if peak_flops is None or peak_flops <= 0 or not math.isfinite(tokens_per_s):
        return None
    return tokens_per_s * flops_per_token / peak_flops


# --- progress display ------------------------------------------------------------------------------


def format_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def format_progress_line(step: int, total: int, metrics: dict[str, Any]) -> str:
    """The plain log line for one step (a person reads it: the launcher reads rank_records' progress records)."""
    parts = [f"step {step}/{total}"]
    if metrics.get("loss") is not None:
        parts.append(f"loss {float(metrics['loss']):.4f}")
    if metrics.get("lr") is not None:
        parts.append(f"lr {float(metrics['lr']):.3e}")
    if metrics.get("tokens_per_s") is not None:
        parts.append(f"{float(metrics['tokens_per_s']):.0f} tok/s")
    m = metrics.get("mfu")
    parts.append(f"MFU {100 * float(m):.2f}%" if m is not None else "MFU n/a")
    mem = metrics.get("peak_memory_bytes")
    if mem is None and metrics.get("peak_mem_mb") is not None:
        mem = float(metrics["peak_mem_mb"]) * 2**20
    if mem is not None:
        parts.append(f"peak mem {format_bytes(float(mem))}")
    return " | ".join(parts)


def bar_info(metrics: dict[str, Any]) -> str:
    """The short text beside the bar (loss, tok/s, MFU, memory), sized to fit 80 columns."""
    line = format_progress_line(0, 0, {k: v for k, v in metrics.items() if k != "lr"})
    parts = line.split(" | ")[1:]
    return "  ".join(p.replace("peak mem ", "mem ") for p in parts)


def new_progress_bar(stream: IO[str]):
    """The rich Progress both the trainer (on a terminal) and the launcher draw."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[bold]train"),
        BarColumn(bar_width=12),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
        console=Console(file=stream),
    )


class TrainProgress:
    """Live progress of a training run: a rich bar on a terminal, plain lines otherwise.

    ``with TrainProgress(steps, enabled=rank == 0) as p: p.update(step, metrics)``. Under torchrun
    stdout is a pipe, so it prints one line per ``log_every`` steps (and the last), flushed: a
    progress record (rank_records.progress_line) when a launcher reads them (``records``; by
    default when the launcher named a record dir), which it renders as a bar or as
    ``format_progress_line``; otherwise that plain line itself. Disabled: silent.
    """

    def __init__(
        self,
        total_steps: int,
        *,
        enabled: bool,
        log_every: int = 1,
        stream: IO[str] | None = None,
        live: bool | None = None,
        initial_step: int = 0,
        records: bool | None = None,
    ):
        self.total = total_steps
        self.enabled = enabled
        self.log_every = max(1, log_every)
        self.stream = stream or sys.stdout
        self.live = (self.stream.isatty() if live is None else live) and enabled
        self.initial_step = initial_step
        self.records = records_dir() is not None if records is None else records
        self._progress = None
        self._task = None

    def __enter__(self) -> "TrainProgress":
        if self.live:
            self._progress = new_progress_bar(self.stream)
            self._progress.start()
            self._task = self._progress.add_task("train", total=self.total, completed=self.initial_step, info="")
        return self

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.update(self._task, completed=step, info=bar_info(metrics))
        elif step % self.log_every == 0 or step == self.total:
            line = (progress_line if self.records else format_progress_line)(step, self.total, metrics)
            print(line, file=self.stream, flush=True)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


# --- picture ---------------------------------------------------------------------------------------


def plot_metrics(metrics_path: Path, out_png: Path) -> Path | None:
    """Loss, tokens/s and MFU against step from a metrics.jsonl as one PNG (written atomically).

    None when there is nothing to plot or matplotlib (the ``report`` extra) is not installed.
    """
    recs = step_records(metrics_path)
    if not recs:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = [r["step"] for r in recs]

    def series(key: str) -> list[float]:
        return [r[key] if isinstance(r.get(key), (int, float)) else math.nan for r in recs]

    mfu_pct = [100 * v for v in series("mfu")]
    panels = [("loss", series("loss")), ("tokens/s", series("tokens_per_s"))]
    if any(math.isfinite(v) for v in mfu_pct):
        panels.append(("MFU (%)", mfu_pct))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (label, ys) in zip(axes, panels):
        ax.plot(steps, ys, marker="o" if len(steps) <= 30 else None, markersize=3)
        ax.set_xlabel("step")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{Path(metrics_path).parent.name}: {len(steps)} steps logged")
    fig.tight_layout()
    out_png = Path(out_png)
    try:
        with atomic_file(out_png) as tmp:
            fig.savefig(tmp, format="png", dpi=100)
    finally:
        plt.close(fig)
    return out_png
