"""What `titan-pipe plan` is asked: its options as one section (titan_pipe.commands.options makes the
flags from these fields: each flag, default, bound and help written here once, a bad value one line
naming the flag)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from titan_pipe.rules import limits
from titan_pipe.config import Section, bounded

CALIBRATE_PHASES = ("trainer", "trainer_compiled", "trainer_float8")


class PlanRequest(Section):
    model: str = Field(description="Flavour (llama2_13b, ...) or a flow.yaml whose model section to use")
    devices: int = bounded(..., limits.DEVICES, description="Number of accelerators")
    device: str = Field(description="Device profile: ascend910a, ascend910b (= b3), ascend910b1-b4, a100, h100")
    device_memory: str | None = Field(None, description="Override memory per device, e.g. 32GB")
    nodes: int | None = bounded(
        None, limits.DEVICES, description="Servers the devices are spread over (default: full servers)"
    )
    seq_len: int = bounded(4096, limits.SEQ_LEN, description="Tokens per sequence")
    global_batch: int | None = bounded(
        None, limits.BATCH, description="Sequences per optimizer step (default 4 per device)"
    )
    top: int = bounded(10, limits.TOP_ROWS, description="Rows of the ranked table")
    dp: int | None = bounded(None, limits.PARALLEL, description="Only layouts with this dp")
    tp: int | None = bounded(None, limits.PARALLEL, description="Only layouts with this tp")
    pp: int | None = bounded(None, limits.PARALLEL, description="Only layouts with this pp")
    efficiency: float = Field(0.5, ge=0.01, le=1.0, description="Achieved fraction of peak FLOPs")
    comm_efficiency: float = Field(0.7, ge=0.01, le=1.0, description="Achieved fraction of link bandwidth")
    write: Path | None = Field(None, description="Write the best layout as this flow.yaml")
    force: bool = Field(False, description="Overwrite the --write file", json_schema_extra={"flag": "--force"})
    plot: Path | None = Field(None, description="Save a memory-per-device chart (PNG)")
    calibrate: Path | None = Field(
        None,
        description="device_check.json or a run's metrics.jsonl: set --efficiency to what reproduces its "
        "tokens/s, and show its peak memory against the model's",
    )
    calibrate_phase: Literal[CALIBRATE_PHASES] = Field("trainer", description="device_check.json phase")
    lora: int | None = bounded(
        None,
        limits.LORA_RANK,
        description="LoRA of this rank on every attention and MLP linear: the base frozen, only the adapters "
        "with gradients and AdamW states",
    )

    @property
    def batch(self) -> int:
        """Sequences per optimizer step: --global-batch, else 4 per device."""
        return self.global_batch if self.global_batch is not None else 4 * self.devices
