"""Which source format a checkpoint path holds, from its files alone; one registry of readers."""

from __future__ import annotations

from pathlib import Path

from titan_pipe.weights.readers import dcp, hf, megatron, titan
from titan_pipe.rules.choices import SOURCE_FORMATS
from titan_pipe.errors import UserError

# Order matters only for directories that match several: a titan run dir with a config.json, a
# Megatron torch_dist iteration dir (which is also a DCP checkpoint: megatron before dcp).
READERS = {"titan": titan, "megatron": megatron, "dcp": dcp, "hf": hf}
FORMATS = SOURCE_FORMATS  # the core's list (flow.yaml and the CLI check against it); one reader each past "auto"


def other_format(path: Path) -> bool:
    """A torch DCP / torchtitan or Megatron-LM checkpoint (by its files, as detect_format tells them):
    the formats read only through their plans, neither our manifest nor a safetensors model dir."""
    return Path(path).is_dir() and any(READERS[f].looks_like(Path(path)) for f in ("megatron", "dcp"))


def detect_format(src: Path) -> str:
    """'titan' | 'dcp' | 'megatron' | 'hf'; UserError naming the path and what was found otherwise."""
    if not src.exists():
        raise UserError(f"{src}: does not exist")
    if not src.is_dir():
        raise UserError(f"{src}: is a file; pass the checkpoint directory that holds it")
    entries = sorted(p.name for p in src.iterdir())
    if not entries:
        raise UserError(f"{src}: the directory is empty; nothing to convert")
    for name, reader in READERS.items():
        if reader.looks_like(src):
            return name
    shown = ", ".join(entries[:8]) + (" ..." if len(entries) > 8 else "")
    raise UserError(
        f"{src}: unknown checkpoint format (found {shown}). Expected a titan-pipe "
        "manifest.json, a DCP .metadata + *.distcp, a Megatron iter_*/mp_rank_* tree, or "
        "a Hugging Face config.json + *.safetensors"
    )


def open_source(src: Path, source_format: str = "auto", **opts):
    """(SourcePlan, Store) for ``src``; an explicit format that does not match is refused clearly."""
    if source_format not in FORMATS:
        raise UserError(f"--source-format {source_format!r} is not one of {', '.join(FORMATS)}")
    found = detect_format(src)
    if source_format != "auto" and source_format != found:
        if not READERS[source_format].looks_like(src):
            raise UserError(
                f"{src}: --source-format {source_format} given, but this looks like a {found} "
                f"checkpoint; pass --source-format {found} or --source-format auto"
            )
        found = source_format
    return READERS[found].open_source(src, **opts)
