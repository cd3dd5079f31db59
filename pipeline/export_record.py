"""The export record: ``export.json``, written by `titan-pipe export` beside the graphs, read by evaluate and flows.

Typed and versioned like the checkpoint manifest (titan_pipe.checkpoint_format). ``load`` is the
one door: it checks the format, then every graph and file name the record gives through
titan_pipe.paths.resolve_inside (an export dir is someone else's data), then the fields. Names
of the graphs' files, inputs and outputs are titan_pipe.graph_io's.

Layout (format ``titan-pipe-export/2``; version 1 records load too, without per-layer values):
  source   {model_dir, config (ModelArgs.to_dict())}     options  the export options as planned
  exporter {onnx, path}                                   atc      {status, soc_version, ...}
  decode   null | {cache_len, cache_update, write_index, note}: the decode contract
  graphs   {file: {opset, inputs {name: dims}, outputs {name: dims}, n_nodes, operators [...],
                   layer_outputs [...], attn_outputs [...], mlp_outputs [...]}}
  files    {relative path: {bytes, sha256 | null}}        export_seconds, timings_seconds
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from titan_pipe import limits
from titan_pipe.checkpoint_format import FILE_BYTES
from titan_pipe.errors import UserError
from titan_pipe.graph_io import CACHE_UPDATE, PREFILL_FILE, WRITE_INDEX
from titan_pipe.limits import Bound
from titan_pipe.paths import resolve_inside
from titan_pipe.values import INT, read, read_json

RECORD_FILE = "export.json"
FORMAT_NAME = "titan-pipe-export"
FORMAT_VERSION = 2
_FIX = "re-export the graph with `titan-pipe export` (its external data stays beside the graph)"
DECODE_NOTE = ("decode.onnx writes the step's key/value into slot write_index (Where over a one-hot of the "
               "slots) and returns the whole cache; feed present.* back as past_key_values.*")


@dataclass(frozen=True)
class OperatorUse:
    """One operator of a graph: how often it occurs and the opset its schema dates from."""

    domain: str
    op_type: str
    count: int
    since_version: int | None


@dataclass(frozen=True)
class GraphRecord:
    """One exported graph: I/O dims (ints, or names where dynamic), nodes, operators, and the value
    names of each decoder layer i: output (residual stream, (B, T, dim)), attention and MLP block
    outputs before their residual Add (None where the graph has none)."""

    opset: int | None = None
    inputs: dict[str, list] = field(default_factory=dict)
    outputs: dict[str, list] = field(default_factory=dict)
    n_nodes: int = 0
    operators: tuple[OperatorUse, ...] = ()
    layer_outputs: tuple[str, ...] = ()
    attn_outputs: tuple[str | None, ...] = ()
    mlp_outputs: tuple[str | None, ...] = ()

    def to_dict(self) -> dict:
        d = asdict(self)
        d["operators"] = [asdict(o) for o in self.operators]
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


@dataclass(frozen=True)
class DecodeContract:
    """How the decode graph is driven (docs/export.md): C cache slots, the whole cache returned."""

    cache_len: int
    cache_update: str = CACHE_UPDATE
    write_index: str = WRITE_INDEX
    note: str = DECODE_NOTE


@dataclass(frozen=True)
class FileEntry:
    bytes: int
    sha256: str | None  # None: not hashed (export --no-hash-weights)


@dataclass(frozen=True)
class ExportRecord:
    graphs: dict[str, GraphRecord]
    files: dict[str, FileEntry]
    decode: DecodeContract | None = None
    source: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)
    exporter: dict = field(default_factory=dict)
    atc: dict = field(default_factory=dict)
    export_seconds: float | None = None
    timings_seconds: dict = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def graph(self, file: str = PREFILL_FILE) -> GraphRecord | None:
        return self.graphs.get(file)

    def to_json(self) -> str:
        d = {"format": f"{FORMAT_NAME}/{self.format_version}", "source": self.source, "options": self.options,
             "exporter": self.exporter, "decode": None if self.decode is None else asdict(self.decode),
             "atc": self.atc, "graphs": {f: g.to_dict() for f, g in self.graphs.items()},
             "files": {f: asdict(e) for f, e in self.files.items()},
             "export_seconds": self.export_seconds, "timings_seconds": self.timings_seconds}
        return json.dumps(d, indent=1) + "\n"

    @classmethod
    def load(cls, export_dir: Path) -> "ExportRecord":
        """``export_dir/export.json``, every name in it checked to lie inside ``export_dir``;
        UserError (one line: the file, the value, the fix) for anything else."""
        path = Path(export_dir) / RECORD_FILE
        if not path.is_file():
            raise UserError(f"{path}: missing; pass the output directory of `titan-pipe export`")
        d = read_json(path, what="the record `titan-pipe export` writes", fix="re-export or delete it")
        version = _version(d.get("format"), path)
        for section in ("graphs", "files"):
            names = d.get(section) or {}
            if not isinstance(names, dict):
                raise UserError(f"{path}: {section!r} must be an object keyed by file name, got {type(names).__name__}")
            for name in names:
                resolve_inside(export_dir, name, source=path, what=f"{section} entry", fix=_FIX)
        try:
            return _parse(d, version, path)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise UserError(f"{path}: malformed field ({e!r}); re-export with `titan-pipe export`") from None

    @classmethod
    def find(cls, export_dir: Path) -> "ExportRecord | None":
        """``load`` when ``export_dir`` has a record, else None (a graph exported elsewhere)."""
        return cls.load(export_dir) if (Path(export_dir) / RECORD_FILE).is_file() else None


def _version(fmt: object, path: Path) -> int:
    name, _, version = str(fmt).partition("/")
    if name != FORMAT_NAME or not version.isdigit():
        raise UserError(f"{path}: format {fmt!r} is not {FORMAT_NAME!r}/N; pass the export.json "
                        "`titan-pipe export` writes")
    if int(version) > FORMAT_VERSION:
        raise UserError(f"{path}: format {fmt!r} is newer than this titan-pipe reads "
                        f"({FORMAT_NAME}/{FORMAT_VERSION}); upgrade titan-pipe")
    return int(version)


def _names(values, *, optional: bool) -> tuple:
    if not isinstance(values, list) or not all(isinstance(v, str) or (optional and v is None) for v in values):
        raise ValueError(f"per-layer value names must be a list of strings, got {values!r:.80}")
    return tuple(values)


# The record's numbers, typed strictly and bounded (titan_pipe.values) like every number read from a file.
COUNT = Bound(0, 2**40, "nodes or operator uses of one graph")
_MALFORMED = "a malformed field; re-export with `titan-pipe export`"
OPSET = Bound(1, 1000, "an ONNX opset")


def _graph(g: dict, path: Path, file: str) -> GraphRecord:
    if not isinstance(g, dict):
        raise TypeError(f"a graph entry is a {type(g).__name__}, not an object")
    p = f"graphs.{file}."
    return GraphRecord(
        opset=read(g, "opset", INT, source=path, default=None, bound=OPSET, prefix=p, fix=_MALFORMED),
        inputs=dict(g.get("inputs") or {}), outputs=dict(g.get("outputs") or {}),
        n_nodes=read(g, "n_nodes", INT, source=path, default=0, bound=COUNT, prefix=p, fix=_MALFORMED),
        operators=tuple(OperatorUse(o.get("domain", ""), o["op_type"],
                                    read(o, "count", INT, source=path, default=0, bound=COUNT, prefix=p + "operators.", fix=_MALFORMED),
                                    read(o, "since_version", INT, source=path, default=None, bound=OPSET,
                                         prefix=p + "operators.", fix=_MALFORMED))
                        for o in g.get("operators") or ()),
        layer_outputs=_names(g.get("layer_outputs") or [], optional=False),
        attn_outputs=_names(g.get("attn_outputs") or [], optional=True),
        mlp_outputs=_names(g.get("mlp_outputs") or [], optional=True))


def _parse(d: dict, version: int, path: Path) -> ExportRecord:
    dec = d.get("decode")
    return ExportRecord(
        graphs={f: _graph(g, path, f) for f, g in (d.get("graphs") or {}).items()},
        files={f: FileEntry(read(e, "bytes", INT, source=path, bound=FILE_BYTES, prefix=f"files.{f}.", fix=_MALFORMED), e.get("sha256"))
               for f, e in (d.get("files") or {}).items()},
        decode=None if not dec else DecodeContract(read(dec, "cache_len", INT, source=path, bound=limits.CACHE_LEN,
                                                        prefix="decode.", fix=_MALFORMED), dec.get("cache_update", CACHE_UPDATE),
                                                   dec.get("write_index", WRITE_INDEX), dec.get("note", DECODE_NOTE)),
        source=dict(d.get("source") or {}), options=dict(d.get("options") or {}),
        exporter=dict(d.get("exporter") or {}), atc=dict(d.get("atc") or {}),
        export_seconds=d.get("export_seconds"), timings_seconds=dict(d.get("timings_seconds") or {}),
        format_version=version)
