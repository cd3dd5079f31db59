"""The provenance record of a unified model dir: ``provenance.json``, written by `titan-pipe convert`.

It says where the weights came from (source format, path, step, layout and a digest of every
source file), which tokenizer the model dir carries, and what was written. Evaluate reads the
tokenizer from it; flows do not key their cache on it (it holds a timestamp).

Layout (``format: titan-pipe-provenance/2``): source {format, path, step, layout, algorithm
("sha256" | "xxh3_128", titan_pipe.io.hashing.DIGESTS), digests {file: hex digest}, verified},
converter, tokenizer null | {tokenizer: "byte" | "tokenizer.json" | null, files {name: sha256}},
output {kind, naming, dtype, tp, pp, files [...]}, created (UTC, ISO 8601). Version 1 (and records
from before the format field) named the source digests ``sha256`` and ``sha256_verified``; they load
as algorithm "sha256".
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from titan_pipe.errors import UserError
from titan_pipe.io.hashing import DIGESTS
from titan_pipe.tokens.identity import TokenizerRecord

PROVENANCE_FILE = "provenance.json"
FORMAT_NAME = "titan-pipe-provenance"
FORMAT_VERSION = 2
_FIX = "re-run `titan-pipe convert` to write it again"


@dataclass(frozen=True)
class SourceInfo:
    format: str
    path: str
    step: int | None = None
    layout: dict = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)  # source file -> hex digest
    algorithm: str = "sha256"  # of ``digests``: one of titan_pipe.io.hashing.DIGESTS
    verified: bool = True  # False: the source's own recorded digests, not re-computed

    @classmethod
    def from_dict(cls, d: dict, version: int) -> "SourceInfo":
        """The record's ``source`` object; version 1 named the digests ``sha256``/``sha256_verified``."""
        if not isinstance(d, dict):
            raise TypeError(f"source is {type(d).__name__}, not an object")
        if version < 2:
            d = dict(d)
            d["digests"], d["verified"] = d.pop("sha256", {}), d.pop("sha256_verified", True)
        return cls(**d)


@dataclass(frozen=True)
class Provenance:
    source: SourceInfo | None  # None only in records written by hand
    converter: str = ""
    output: dict = field(default_factory=dict)  # kind, naming, dtype, tp, pp, files (relative paths written)
    created: str = ""
    tokenizer: TokenizerRecord | None = None  # what the dir carries (provenance_fields)
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        d = {
            "format": f"{FORMAT_NAME}/{self.format_version}",
            "source": None if self.source is None else asdict(self.source),
            "converter": self.converter,
            "tokenizer": None if self.tokenizer is None else self.tokenizer.provenance_fields(),
            "output": self.output,
            "created": self.created,
        }
        return json.dumps(d, indent=2) + "\n"

    @classmethod
    def load(cls, model_dir: Path) -> "Provenance":
        """``model_dir/provenance.json``; UserError (the file, the problem, the fix) if unusable."""
        path = Path(model_dir) / PROVENANCE_FILE
        try:
            d = json.loads(path.read_bytes())
        except FileNotFoundError:
            raise UserError(f"{path}: missing; {_FIX}") from None
        except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:
            raise UserError(f"{path}: not readable JSON ({e}); {_FIX}") from None
        if not isinstance(d, dict):
            raise UserError(f"{path}: expected a JSON object, got {type(d).__name__}; {_FIX}")
        name, _, version = str(d.get("format", f"{FORMAT_NAME}/1")).partition("/")
        if name != FORMAT_NAME or not version.isdigit() or int(version) > FORMAT_VERSION:
            raise UserError(
                f"{path}: format {d.get('format')!r} is not {FORMAT_NAME}/1..{FORMAT_VERSION}; "
                "upgrade titan-pipe or re-run `titan-pipe convert`"
            )
        try:
            tok, src = d.get("tokenizer"), d.get("source")
            got = cls(
                source=None if src is None else SourceInfo.from_dict(src, int(version)),
                converter=str(d.get("converter", "")),
                output=dict(d.get("output") or {}),
                created=str(d.get("created", "")),
                tokenizer=None if tok is None else TokenizerRecord.from_provenance_fields(tok),
                format_version=int(version),
            )
            problem = _field_problem(got)
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise UserError(
                f"{path}: missing or malformed field ({type(e).__name__}: {str(e)[:200]}); {_FIX}"
            ) from None
        if problem:
            raise UserError(f"{path}: {problem}; {_FIX}")
        if got.source is not None and got.source.algorithm not in DIGESTS:
            raise UserError(
                f"{path}: source.algorithm {got.source.algorithm!r} is not one of {', '.join(DIGESTS)}; {_FIX}"
            )
        return got

    @classmethod
    def find(cls, model_dir: Path) -> "Provenance | None":
        """``load`` when ``model_dir`` has a provenance record, else None (a model dir from elsewhere)."""
        return cls.load(model_dir) if (Path(model_dir) / PROVENANCE_FILE).is_file() else None


def _strings(d: object) -> bool:
    return isinstance(d, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in d.items())


def _field_problem(p: Provenance) -> str | None:
    """A field whose JSON type is not the one written (a tampered or hand-edited record), or None:
    checked here so every reader of the record meets only the types it expects."""
    s, t = p.source, p.tokenizer
    if s is not None:
        for name, value, ok in (
            ("source.format", s.format, isinstance(s.format, str)),
            ("source.path", s.path, isinstance(s.path, str)),
            ("source.step", s.step, s.step is None or (isinstance(s.step, int) and not isinstance(s.step, bool))),
            ("source.layout", s.layout, isinstance(s.layout, dict)),
            ("source.digests", s.digests, _strings(s.digests)),
            ("source.algorithm", s.algorithm, isinstance(s.algorithm, str)),
            ("source.verified", s.verified, isinstance(s.verified, bool)),
        ):
            if not ok:
                return f"{name} is {str(value)[:80]!r}, not of the type convert writes"
    if t is not None:
        if t.kind not in ("tokenizer.json", "byte", None):
            return f"tokenizer.tokenizer is {str(t.kind)[:80]!r}, not tokenizer.json, byte or null"
        if not _strings(t.files):
            return "tokenizer.files is not an object of file name -> sha256"
    files = p.output.get("files", [])
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return "output.files is not a list of file names"
    for key in ("tp", "pp"):
        v = p.output.get(key, 1)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            return f"output.{key} is {v!r}, not a positive integer"
    for key in ("dtype", "kind", "naming"):
        if not isinstance(p.output.get(key, ""), (str, type(None))):
            return f"output.{key} is {p.output.get(key)!r}, not a string"
    return None
