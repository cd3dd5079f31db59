"""RunDir: the typed paths of every artifact of a run; the contract between stages."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from titan_pipe.checkpoint_format import step_dir_name, step_dirs


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def flow_yaml(self) -> Path:
        return self.root / "flow.yaml"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / step_dir_name(step)

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def train_log(self) -> Path:
        return self.root / "train.log"

    @property
    def model(self) -> Path:
        return self.root / "model"

    @property
    def onnx(self) -> Path:
        return self.root / "onnx"

    @property
    def report(self) -> Path:
        return self.root / "report"

    def step_dirs(self) -> list[tuple[int, Path]]:
        """All step-XXXXXX directories (complete or not), oldest first."""
        return step_dirs(self.checkpoints)
