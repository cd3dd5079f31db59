"""RunDir: the typed paths of every artifact of a run; the contract between stages."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from titan_pipe.records.checkpoint_format import step_dir_name, step_dirs

RUN_NAME_MAX = 64
_RUN_NAME_CHARS = re.compile(r"^[A-Za-z0-9_.-]+$")


def run_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a run dir (runs_dir/<name>), or None when it can.

    One path component of letters, digits, '_', '-', '.'; not '.' or '..' (the run dir would be
    runs_dir itself or its parent, where stage outputs would land among the user's files); no
    leading dot (hidden, and how temp dirs are named); at most RUN_NAME_MAX characters.
    """
    if not name:
        return "is empty"
    if len(name) > RUN_NAME_MAX:
        return f"is {len(name)} characters long; at most {RUN_NAME_MAX} are allowed"
    if name in (".", ".."):
        return (
            "would make the run dir runs_dir itself" if name == "." else "would make the run dir the parent of runs_dir"
        ) + ", where stage outputs land among other files"
    if not _RUN_NAME_CHARS.match(name):
        bad = sorted({c for c in name if not _RUN_NAME_CHARS.match(c)})
        return f"holds {''.join(bad)!r}; a run name is one path component of letters, digits, '_', '-' and '.'"
    if name.startswith("."):
        return "starts with a dot (a hidden directory)"
    return None


def suggest_run_name(name: str) -> str:
    """A usable name close to ``name`` (for the error message): bad characters -> '-', no leading dots."""
    s = re.sub(r"[^A-Za-z0-9_.-]+", "-", name or "").lstrip(".-")[:RUN_NAME_MAX].rstrip(".-")
    return s if s and not run_name_problem(s) else "run"


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def flow_yaml(self) -> Path:
        return self.root / "flow.yaml"

    @property
    def data(self) -> Path:
        """Raw-text data.path prepared for this run (titan_pipe.tokens.spec)."""
        return self.root / "data"

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
