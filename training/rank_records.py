"""What a rank tells the launcher that started it: records, not text to pick apart.

The launcher names a directory for this launch in ``RECORDS_ENV`` (one per node and launch, under
run_dir/logs). A rank that reads it:
  - on an error it can name, writes ``rank-<R>.json`` there before it exits: a ``RankFailure``
    (``kind`` "error" for what the user can fix, "fault" for an operating-system fault such as a
    full disk, the one-line message, the torchrun attempt, the time). The launcher reads these
    files to say why the launch failed (training/failure.py).
  - prints each logged step as one ``PROGRESS_TAG`` line of JSON (rank 0): the launcher renders it,
    as a bar on a terminal and as metrics.format_progress_line in train.log and off a terminal.
Without the variable (a launch torchrun or srun started without us) the rank prints plain lines for
a person, as it always does, and writes no file.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from titan_pipe.io.atomic import write_text

RECORDS_ENV = "TITAN_PIPE_RANK_RECORDS"
PROGRESS_TAG = "titan-pipe-progress "
KINDS = ("error", "fault")
_PROGRESS_KEYS = ("loss", "lr", "tokens_per_s", "mfu", "peak_memory_bytes", "peak_mem_mb")


def records_dir(environ=None) -> Path | None:
    """The launch's record dir, when a launcher asked for records."""
    value = (os.environ if environ is None else environ).get(RECORDS_ENV, "")
    return Path(value) if value else None


@dataclass(frozen=True)
class RankFailure:
    rank: int
    kind: str  # one of KINDS
    message: str
    attempt: int = 0  # torchrun's restart count (TORCHELASTIC_RESTART_COUNT)
    time: float = 0.0

    @classmethod
    def from_dict(cls, d: Any) -> "RankFailure | None":
        """The record, or None when ``d`` is not one (a half-read or foreign file is no failure)."""
        if not isinstance(d, dict):
            return None
        rank, kind, message = d.get("rank"), d.get("kind"), d.get("message")
        attempt, when = d.get("attempt", 0), d.get("time", 0.0)
        if type(rank) is not int or kind not in KINDS or not isinstance(message, str) or type(attempt) is not int:
            return None
        if not isinstance(when, (int, float)) or isinstance(when, bool):
            return None
        return cls(rank=rank, kind=kind, message=message, attempt=attempt, time=float(when))


def write_failure(kind: str, message: str, environ=None) -> Path | None:
    """This rank's failure record in the launch's record dir (atomic); None when no launcher asked."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: expected one of {KINDS}")
    env = os.environ if environ is None else environ
    where = records_dir(env)
    if where is None:
        return None
    record = RankFailure(
        rank=int(env.get("RANK", "0")),
        kind=kind,
        message=message,
        attempt=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        time=time.time(),
    )
    where.mkdir(parents=True, exist_ok=True)
    return write_text(where / f"rank-{record.rank}.json", json.dumps(asdict(record)), fsync=True)


def read_failures(where: Path | None) -> list[RankFailure]:
    """The failure records of a launch's last attempt, first written first."""
    if where is None or not Path(where).is_dir():
        return []
    found = []
    for path in sorted(Path(where).glob("rank-*.json")):
        try:
            record = RankFailure.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, RecursionError):
            record = None
        if record is not None:
            found.append(record)
    if not found:
        return []
    last = max(r.attempt for r in found)
    return sorted((r for r in found if r.attempt == last), key=lambda r: (r.time, r.rank))


def progress_line(step: int, total: int, metrics: dict[str, Any]) -> str:
    """One step's progress as the record line the launcher reads (see read_progress)."""
    shown = {k: _number(metrics.get(k)) for k in _PROGRESS_KEYS if metrics.get(k) is not None}
    return PROGRESS_TAG + json.dumps({"step": int(step), "total": int(total), **shown}, allow_nan=False)


def read_progress(line: str) -> tuple[int, int, dict[str, float | None]] | None:
    """(step, total, metrics) of a progress record line, or None for any other line. torchrun's
    ``[default0]:`` prefix is allowed before the tag and nothing else is."""
    head, tag, body = line.rstrip("\n").partition(PROGRESS_TAG)
    if not tag or (head and not (head.startswith("[") and head.endswith("]:"))):
        return None
    try:
        d = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(d, dict) or type(d.get("step")) is not int or type(d.get("total")) is not int:
        return None
    metrics: dict[str, float | None] = {}
    for k in _PROGRESS_KEYS:
        if k in d and (d[k] is None or (isinstance(d[k], (int, float)) and not isinstance(d[k], bool))):
            metrics[k] = d[k]
    return d["step"], d["total"], metrics


def _number(v: Any) -> float | None:
    """A metric as JSON can hold it (a non-finite value is null: the display says n/a)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None
