"""Which tokenizer: the one record (``TokenizerRecord``) that every file naming a tokenizer holds a
part of, and the one way a model's tokenizer is found.

- a prepared data dir's ``data.json`` holds ``data_fields()``: kind, the tokenizer.json's sha256,
  vocab size, bos and eos (its ``fingerprint`` says whether data and a model share the tokenizer);
- a unified dir's ``provenance.json`` holds ``provenance_fields()``: kind and the files carried with
  their sha256s;
- a checkpoint's manifest holds the kind (``extra.tokenizer``) and the files attached beside it
  (``extra.attached``): ``of_checkpoint``.
Each file keeps the fields it always had; what reads them gets this record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("byte", "tokenizer.json")
TOKENIZER_JSON = "tokenizer.json"


@dataclass(frozen=True)
class TokenizerRecord:
    kind: str | None  # "byte" | "tokenizer.json" | None (the source named none)
    sha256: str | None = None  # of the tokenizer.json
    vocab_size: int | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    files: dict[str, str] = field(default_factory=dict)  # the files carried with it: name -> sha256

    @property
    def fingerprint(self) -> str:
        return f"{self.kind}:{self.sha256 or '-'}:{self.vocab_size}:{self.eos_id}"

    def describe(self) -> str:
        if self.kind == TOKENIZER_JSON and self.sha256:
            return f"tokenizer.json sha256 {self.sha256[:12]}"
        return str(self.kind or "none")

    def data_fields(self) -> dict:
        """What data.json holds of it."""
        return {
            "kind": self.kind,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
        }

    def provenance_fields(self) -> dict:
        """What provenance.json holds of it."""
        return {"tokenizer": self.kind, "files": dict(self.files)}

    @classmethod
    def from_data_fields(cls, d: object) -> "TokenizerRecord":
        """data.json's tokenizer object, every field's JSON type checked (TypeError/ValueError naming it)."""
        if not isinstance(d, dict):
            raise TypeError(f"tokenizer is a JSON {type(d).__name__}, not an object")
        unknown = set(d) - {"kind", "sha256", "vocab_size", "bos_id", "eos_id"}
        if unknown:
            raise TypeError(f"tokenizer has unknown field(s) {sorted(unknown)}")
        if d.get("kind") not in KINDS:
            raise ValueError(f"tokenizer.kind is {d.get('kind')!r}, not one of {KINDS}")
        for name, optional in (("sha256", True), ("vocab_size", False), ("bos_id", True), ("eos_id", False)):
            v = d.get(name)
            want = str if name == "sha256" else int
            if (v is None and optional) or (isinstance(v, want) and not isinstance(v, bool)):
                if isinstance(v, int) and not isinstance(v, bool) and v < 0:
                    raise ValueError(f"tokenizer.{name} is {v}, below 0")
                continue
            raise TypeError(f"tokenizer.{name} is {v!r}, not {want.__name__}{' or null' if optional else ''}")
        return cls(**d)

    @classmethod
    def from_provenance_fields(cls, d: object) -> "TokenizerRecord":
        """provenance.json's tokenizer object (its types are checked by the provenance record)."""
        if not isinstance(d, dict):
            raise TypeError(f"tokenizer is a JSON {type(d).__name__}, not an object")
        return cls(d.get("tokenizer"), files=dict(d.get("files") or {}))

    @classmethod
    def of_checkpoint(cls, extra) -> "TokenizerRecord":
        """A checkpoint manifest's ``extra`` (titan_pipe.records.checkpoint_format.CheckpointExtra)."""
        files = {name: info.sha256 for name, info in extra.attached.items()}
        return cls(extra.tokenizer, sha256=files.get(TOKENIZER_JSON), files=files)

    def path_in(self, root: Path) -> str | None:
        """How a tokenizer is built for this record in ``root`` (titan_pipe.tokens.tokenizer.build_tokenizer):
        the tokenizer.json there, "byte", or None (none named)."""
        if self.kind == TOKENIZER_JSON:
            return str(Path(root) / TOKENIZER_JSON)
        return "byte" if self.kind == "byte" else None
