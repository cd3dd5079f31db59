"""The files each stage reads, found from the flow and the earlier stages' outputs (pure: no Prefect).

A stage's cache key hashes these (titan_pipe.flows.cache); the stage records (titan_pipe.flows.stages)
say which of them each stage reads.
"""

from __future__ import annotations

from pathlib import Path

from titan_pipe.records.checkpoint_format import MANIFEST_NAME, Manifest
from titan_pipe.config import FlowConfig
from titan_pipe.errors import UserError
from titan_pipe.records.export_record import RECORD_FILE
from titan_pipe.records.provenance import PROVENANCE_FILE
from titan_pipe.tokens.spec import data_spec

# Files in a stage's output directory that the next stage does not read (they hold timestamps).
_NOT_READ = {PROVENANCE_FILE, RECORD_FILE}
_NOT_READ_SUFFIXES = (".log", ".sh", ".md", ".html", ".png", ".tmp")


def files_under(root: Path) -> list[Path]:
    """Every regular file under root (or root itself), sorted, minus the ones no stage reads."""
    if root.is_file():
        return [root]
    if not root.is_dir():
        return []
    out = []
    for p in sorted(root.rglob("*")):
        if (
            p.is_file()
            and p.name not in _NOT_READ
            and not p.name.endswith(_NOT_READ_SUFFIXES)
            and not p.name.startswith(".")
        ):
            out.append(p)
    return out


def checkpoint_files(ckpt: Path) -> list[Path]:
    """What convert and evaluate read of a checkpoint: manifest.json and the weight files it lists.

    Not the optimizer state beside them (its torch DCP files differ between identical runs), so a
    retrain that reproduces the weights bit for bit leaves the later stages cached.
    """
    try:
        m = Manifest.load(ckpt)
    except (UserError, OSError):  # a LayoutError (a UserError): not our format
        return files_under(ckpt)  # not our format: everything in it
    attached = m.extra.attached
    return [ckpt / MANIFEST_NAME] + [ckpt / name for name in sorted({*m.files, *attached})]


def resolve(path: str, base: Path) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else base / p


def data_files(cfg: FlowConfig, flow_dir: Path) -> list[Path]:
    """The text (or token data) and tokenizer files training and evaluation on the held-out split read."""
    return data_spec(cfg.data, base=flow_dir).input_files()
