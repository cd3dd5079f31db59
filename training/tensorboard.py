"""Training curves for TensorBoard (``metrics.tensorboard: true`` in flow.yaml, the ``tensorboard``
extra): rank 0 writes the scalars of each logged step as TensorBoard event files under
``<run dir>/tensorboard``, beside metrics.jsonl, which stays the record of the run.

``tensorboard --logdir runs`` then shows every run's loss, learning rate, gradient norm, tokens/s,
MFU and peak memory; the package is imported only when the flow asks for it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

# metrics.jsonl key -> TensorBoard tag
SCALARS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "mfu": "perf/mfu",
    "step_time_s": "perf/step_time_s",
    "peak_mem_mb": "memory/peak_mem_mb",
    "loss_scale": "train/loss_scale",
}
DIR_NAME = "tensorboard"
INSTALL = "pip install tensorboard (titan-pipe's tensorboard extra)"


def tensorboard_missing() -> str | None:
    """Why TensorBoard event files cannot be written here (None: they can)."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        return f"the tensorboard package is not installed; {INSTALL}, or set metrics.tensorboard: false"
    return None


class TensorBoardWriter:
    """Scalars of each logged record into event files (rank 0); disabled: writes nothing."""

    def __init__(self, run_dir: Path, *, enabled: bool):
        self._writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(Path(run_dir) / DIR_NAME))

    def log(self, record: dict[str, Any]) -> None:
        if self._writer is None:
            return
        step = int(record["step"])
        for key, tag in SCALARS.items():
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self._writer.add_scalar(tag, float(value), step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> "TensorBoardWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
