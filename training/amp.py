"""Mixed precision: autocast for the forward, and fp16 dynamic loss scaling (bf16 needs none).

The scaler works on local shards (``DTensor.to_local()``), so it is the same for plain, TP and
FSDP gradients; an overflow anywhere in the world skips the step on every rank.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from titan_pipe.rules.dtypes import TORCH_BY_NAME

DEFAULT_INIT_SCALE = 2.0**16


def autocast(device_type: str, *, enabled: bool, dtype: str):
    """torch.autocast in ``dtype`` for the forward, or nothing (fp32)."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=TORCH_BY_NAME[dtype])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class LossScaler:
    """Dynamic loss scaling (fp16): multiply the loss by ``scale`` before backward; after it,
    unscale; on inf/nan anywhere skip the step and halve the scale (not below ``min_scale``);
    after ``window`` clean steps in a row double it. ``enabled=False`` is the identity (scale 1)."""

    def __init__(
        self, *, enabled: bool, init_scale: float = DEFAULT_INIT_SCALE, window: int = 2000, min_scale: float = 1.0
    ):
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.window = window
        self.min_scale = float(min_scale)
        self.good_steps = 0
        self.skipped = 0

    @classmethod
    def from_config(cls, precision) -> "LossScaler":
        """precision: the PrecisionConfig of flow.yaml (loss_scale: number | dynamic | None)."""
        enabled = precision.amp and precision.amp_dtype == "float16" and precision.loss_scale is not None
        init = DEFAULT_INIT_SCALE if precision.loss_scale in (None, "dynamic") else float(precision.loss_scale)
        return cls(
            enabled=enabled, init_scale=init, window=precision.loss_scale_window, min_scale=precision.min_loss_scale
        )

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    @torch.no_grad()
    def unscale_(self, params: list[nn.Parameter]) -> bool:
        """Divide gradients by the scale in place; True when any rank saw inf/nan (skip the step)."""
        if not self.enabled:
            return False
        grads = [_local(p.grad) for p in params if p.grad is not None]
        bad = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
        for g in grads:
            bad = torch.maximum(bad, (~torch.isfinite(g)).any().float())
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        found_inf = bool(bad.item())
        if not found_inf:
            inv = 1.0 / self.scale
            for g in grads:
                g.mul_(inv)
        return found_inf

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step (``found_inf``: the step was skipped)."""
        if not self.enabled:
            return
        if found_inf:
            self.scale = max(self.scale / 2.0, self.min_scale)
            self.good_steps = 0
            self.skipped += 1
        else:
            self.good_steps += 1
            if self.good_steps >= self.window:
                self.scale *= 2.0
                self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, d: dict) -> None:
        self.scale, self.good_steps, self.skipped = float(d["scale"]), int(d["good_steps"]), int(d["skipped"])
