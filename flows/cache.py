"""Stage caching as pure logic: a stage's key is its config section plus the sha256 of every file it reads.

A finished stage leaves ``runs/<name>/.stages/<stage>.json`` (its key, its output files with their
sha256, its result). The next run computes the key again; the same key with the same outputs still on
disk means the stage is not run. Hashes are memoised by (size, mtime_ns) in ``.stages/hashes.json``,
so re-checking a 140 GB checkpoint costs a ``stat`` per file, not a re-read. No Prefect here.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from titan_pipe.io.atomic import write_text
from titan_pipe.config import FlowConfig
from titan_pipe.errors import UserError
from titan_pipe.io.hashing import sha256_file
from titan_pipe.tokens.spec import data_spec
from titan_pipe.flows.stage_files import files_under
from titan_pipe.flows.stages import STAGES as STAGE_RECORDS
from titan_pipe.flows.stages import StageInputs
from titan_pipe.flows.stages import stage as stage_record

# Runs before train when data.path is raw text (prepares it into the run dir); not selectable on its own.
DATA = "data"
STAGES = tuple(s.name for s in STAGE_RECORDS if s.name != DATA)  # what --from / --only / --stage select
SCHEMA = 1  # bump when the key recipe changes, so old records are not trusted


class FileHasher:
    """sha256 of files, memoised on (size, mtime_ns) in a JSON file so unchanged files are not re-read."""

    def __init__(self, memo_path: Path | None = None):
        self.memo_path = memo_path
        self._memo: dict[str, list] = {}
        if memo_path is not None and memo_path.is_file():
            try:
                self._memo = json.loads(memo_path.read_text())
            except (OSError, ValueError):
                self._memo = {}  # a damaged memo only costs re-hashing
        self.hashed = 0  # files actually read (tests assert the memo works)

    def sha256(self, path: Path) -> str:
        st = path.stat()
        key = str(path.resolve())
        hit = self._memo.get(key)
        if hit and hit[0] == st.st_size and hit[1] == st.st_mtime_ns:
            return hit[2]
        digest = sha256_file(path)
        self.hashed += 1
        self._memo[key] = [st.st_size, st.st_mtime_ns, digest]
        return digest

    def save(self) -> None:
        if self.memo_path is not None:
            write_json_atomic(self.memo_path, self._memo)


def write_json_atomic(path: Path, data: Any) -> None:
    write_text(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def needs_data_stage(cfg: FlowConfig, flow_dir: Path) -> bool:
    """data.path is raw text (or null, the shipped corpus): it is prepared before training."""
    return data_spec(cfg.data, base=flow_dir).text is not None


def with_data_stage(actions: dict[str, str], raw_text: bool) -> dict[str, str]:
    """``actions`` with the data stage first, as train's, when training runs on raw text."""
    if not raw_text or actions["train"] not in (RUN, AUTO):
        return dict(actions)
    return {DATA: actions["train"], **actions}


def stage_inputs(stage: str, cfg: FlowConfig, *, flow_dir: Path, upstream: dict) -> StageInputs:
    """The inputs of one stage (its record in titan_pipe.flows.stages). upstream: the earlier stages'
    outputs by stage (flows.tasks.StageOutput, whose typed paths name the checkpoint, model dir and ONNX dir)."""
    return stage_record(stage).inputs(cfg, flow_dir, upstream)


def _display(path: Path, run_dir: Path) -> str:
    """Paths inside the run dir are keyed relative to it, so a moved runs/ keeps its cache."""
    try:
        return str(path.resolve().relative_to(run_dir.resolve()))
    except ValueError:
        return str(path.resolve())


def stage_doc(inputs: StageInputs, hasher: FileHasher, run_dir: Path) -> dict:
    """The stage's inputs as canonical data: the stage, its section, {file: sha256}."""
    return {
        "schema": SCHEMA,
        "stage": inputs.stage,
        "section": inputs.section,
        "files": {_display(p, run_dir): hasher.sha256(p) for p in inputs.files},
    }


def doc_key(doc: dict) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def stage_key(inputs: StageInputs, hasher: FileHasher, run_dir: Path) -> str:
    """sha256 over the stage name, the section and {file: sha256} (canonical JSON)."""
    return doc_key(stage_doc(inputs, hasher, run_dir))


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def explain_change(old: dict | None, new: dict, *, limit: int = 5) -> list[str]:
    """Why a stage re-runs, for the log: the section values and the input files that changed."""
    if not old:
        return ["no earlier finished run"]
    reasons = []
    a, b = _flatten(old.get("section", {})), _flatten(new.get("section", {}))
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            reasons.append(f"{k}: {a.get(k)!r} -> {b.get(k)!r}")
    fa, fb = old.get("files", {}), new.get("files", {})
    for f in sorted(set(fa) | set(fb)):
        if f not in fa:
            reasons.append(f"new input {f}")
        elif f not in fb:
            reasons.append(f"input {f} is gone")
        elif fa[f] != fb[f]:
            reasons.append(f"input {f} changed")
    if not reasons and old.get("schema") != new.get("schema"):
        reasons.append("the cache recipe changed")
    more = len(reasons) - limit
    return reasons[:limit] + ([f"... and {more} more"] if more > 0 else [])


@dataclass(frozen=True)
class StageRecord:
    """What a finished stage leaves in .stages/<stage>.json."""

    stage: str
    key: str
    outputs: dict[str, str]  # file (relative to the run dir when inside it) -> sha256
    result: dict  # the stage's result: {"paths": {...}, "summary": {...}, "passed": bool|None}
    finished_at: float = field(default_factory=time.time)
    duration_s: float = 0.0
    inputs: dict = field(default_factory=dict)  # stage_doc: what the key was computed from


def record_path(run_dir: Path, stage: str) -> Path:
    return run_dir / ".stages" / f"{stage}.json"


def read_record(run_dir: Path, stage: str) -> StageRecord | None:
    """The stage's record, or None when there is none or it is unreadable (then the stage just re-runs)."""
    path = record_path(run_dir, stage)
    try:
        data = json.loads(path.read_text())
        if data.pop("schema", None) != SCHEMA:
            return None
        return StageRecord(**data)
    except (OSError, ValueError, TypeError):
        return None


def write_record(run_dir: Path, record: StageRecord) -> Path:
    path = record_path(run_dir, record.stage)
    write_json_atomic(path, {"schema": SCHEMA, **asdict(record)})
    return path


def clear_record(run_dir: Path, stage: str) -> None:
    """Forget a stage before it runs, so a crash half-way never leaves a 'finished' record behind."""
    record_path(run_dir, stage).unlink(missing_ok=True)


def hash_outputs(paths: Iterable[Path], hasher: FileHasher, run_dir: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for root in paths:
        for p in files_under(root):
            out[_display(p, run_dir)] = hasher.sha256(p)
    return out


def outputs_intact(record: StageRecord, hasher: FileHasher, run_dir: Path) -> bool:
    """True when every output file the record lists is still there with the same sha256."""
    for name, digest in record.outputs.items():
        p = Path(name) if Path(name).is_absolute() else run_dir / name
        if not p.is_file() or hasher.sha256(p) != digest:
            return False
    return bool(record.outputs)


def cache_hit(record: StageRecord | None, key: str, hasher: FileHasher, run_dir: Path) -> bool:
    return record is not None and record.key == key and outputs_intact(record, hasher, run_dir)


# --- which stages run: pure selection ---------------------------------------------------------

RUN = "run"  # run it, whatever the cache says
AUTO = "auto"  # run it unless its key is unchanged (cache hit)
REUSE = "reuse"  # not run; its recorded outputs feed the next stages (must exist)
SKIP = "skip"  # not run and not needed (after --only STAGE)


def plan_actions(
    *, from_stage: str | None = None, only: str | None = None, force: bool = False, cache: bool = True
) -> dict[str, str]:
    """{stage: action} for a run. --only and --from exclude each other; --force runs every selected stage."""
    for opt, value in (("--from", from_stage), ("--only", only)):
        if value is not None and value not in STAGES:
            raise UserError(f"{opt} {value!r} is not a stage; use one of {', '.join(STAGES)}")
    if from_stage is not None and only is not None:
        raise UserError(f"--from {from_stage} and --only {only} exclude each other; pass one of them")
    if only is not None:
        i = STAGES.index(only)
        return {s: REUSE if k < i else RUN if k == i else SKIP for k, s in enumerate(STAGES)}
    if from_stage is not None:
        i = STAGES.index(from_stage)
        return {s: REUSE if k < i else RUN for k, s in enumerate(STAGES)}
    return {s: RUN if force or not cache else AUTO for s in STAGES}


def check_reusable(actions: dict[str, str], run_dir: Path) -> dict[str, StageRecord]:
    """Records of the REUSE stages; a missing one is a UserError raised before anything runs."""
    records: dict[str, StageRecord] = {}
    for stage, action in actions.items():
        if action != REUSE:
            continue
        rec = read_record(run_dir, stage)
        if (
            rec is None
            or not rec.outputs
            or any(not (Path(n) if Path(n).is_absolute() else run_dir / n).is_file() for n in rec.outputs)
        ):
            raise UserError(
                f"{record_path(run_dir, stage)}: the {stage} stage has no finished outputs in "
                f"{run_dir}, but the selected stages need them; run it first (drop --from/--only)"
            )
        records[stage] = rec
    return records
