"""RunDir: the typed paths of every artifact of a run; the contract between stages."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

STEP_DIR = re.compile(r"^step-(\d{6,})$")


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
        return self.checkpoints / f"step-{step:06d}"

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
        if not self.checkpoints.is_dir():
            return []
        found = []
        for p in self.checkpoints.iterdir():
            m = STEP_DIR.match(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
        return sorted(found)
