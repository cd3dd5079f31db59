"""The export record: ``export.json``, written by `titan-pipe export` beside the graphs, read by evaluate and flows.

Typed and versioned like the checkpoint manifest (titan_pipe.records.checkpoint_format). ``load`` is the
one door: it checks the format, then every graph and file name the record gives through
titan_pipe.io.paths.resolve_inside (an export dir is someone else's data), then the fields. Names
of the graphs' files, inputs and outputs are titan_pipe.graphs.graph_io's.

Layout (format ``titan-pipe-export/3``; versions 1 and 2 load too: 1 without per-layer values, 1
and 2 with ``{bytes, sha256}`` file entries, read as algorithm sha256):
  source   {model_dir, config (ModelArgs.to_dict())}     options  the export options as planned
  exporter {onnx, path}                                   atc      {status, soc_version, ...}
  decode   null | {cache_len, cache_update, write_index, note}: the decode contract
  graphs   {file: {opset, inputs {name: dims}, outputs {name: dims}, n_nodes, operators [...],
                   embed_output, layer_outputs [...], attn_outputs [...], mlp_outputs [...]}}
  files    {relative path: {bytes, algorithm, digest | null}}   export_seconds, timings_seconds

``algorithm`` names the digest (titan_pipe.io.hashing.DIGESTS: xxh3_128 by default, sha256 on request);
``check_files`` re-computes each with it, so a corrupted or swapped data file is refused in one line.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from titan_pipe.rules import limits
from titan_pipe.records.checkpoint_format import FILE_BYTES
from titan_pipe.errors import UserError
from titan_pipe.graphs.graph_io import CACHE_UPDATE, PREFILL_FILE, WRITE_INDEX
from titan_pipe.io.hashing import DIGESTS, file_digest
from titan_pipe.rules.limits import Bound
from titan_pipe.io.paths import resolve_inside
from titan_pipe.rules.values import INT, read, read_json

RECORD_FILE = "export.json"
FORMAT_NAME = "titan-pipe-export"
FORMAT_VERSION = 3
_FIX = "re-export the graph with `titan-pipe export` (its external data stays beside the graph)"
DECODE_NOTE = (
    "decode.onnx writes the step's key/value into slot write_index (Where over a one-hot of the "
    "slots) and returns the whole cache; feed present.* back as past_key_values.*"
)


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
    outputs before their residual Add (None where the graph has none); ``embed_output``: the
    residual stream entering layer 0 (None in records written before it was recorded). Evaluate
    cuts a graph into per-layer pieces between these names (titan_pipe.evaluate.graph_pieces)."""

    opset: int | None = None
    inputs: dict[str, list] = field(default_factory=dict)
    outputs: dict[str, list] = field(default_factory=dict)
    n_nodes: int = 0
    operators: tuple[OperatorUse, ...] = ()
    layer_outputs: tuple[str, ...] = ()
    attn_outputs: tuple[str | None, ...] = ()
    mlp_outputs: tuple[str | None, ...] = ()
    embed_output: str | None = None

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
    digest: str | None  # hex; None: not hashed (export --no-hash-weights)
    algorithm: str = "sha256"  # of ``digest`` (titan_pipe.io.hashing.DIGESTS); records before version 3: sha256


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
        d = {
            "format": f"{FORMAT_NAME}/{self.format_version}",
            "source": self.source,
            "options": self.options,
            "exporter": self.exporter,
            "decode": None if self.decode is None else asdict(self.decode),
            "atc": self.atc,
            "graphs": {f: g.to_dict() for f, g in self.graphs.items()},
            "files": {f: asdict(e) for f, e in self.files.items()},
            "export_seconds": self.export_seconds,
            "timings_seconds": self.timings_seconds,
        }
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

    def check_files(self, export_dir: Path, *, only=None) -> None:
        """Every recorded file of ``export_dir`` (or those of ``only`` the record lists) has its recorded
        size and (where one was recorded) digest, re-computed with the recorded algorithm; UserError
        naming the first that does not."""
        record = Path(export_dir) / RECORD_FILE
        for name, entry in self.files.items():
            if only is not None and name not in only:
                continue
            path = Path(export_dir) / name
            size = path.stat().st_size if path.is_file() else None
            if size != entry.bytes:
                got = "is missing" if size is None else f"has {size} bytes"
                raise UserError(
                    f"{path}: {got} but {record} records {entry.bytes}; the export is incomplete or "
                    f"mixed with another one: {_FIX}"
                )
            if entry.digest is not None and file_digest(path, algorithm=entry.algorithm) != entry.digest:
                raise UserError(
                    f"{path}: its {entry.algorithm} digest does not match {record} "
                    f"({entry.digest[:16]}...); the file is corrupted or from another export: {_FIX}"
                )

    @classmethod
    def find(cls, export_dir: Path) -> "ExportRecord | None":
        """``load`` when ``export_dir`` has a record, else None (a graph exported elsewhere)."""
        return cls.load(export_dir) if (Path(export_dir) / RECORD_FILE).is_file() else None


def _version(fmt: object, path: Path) -> int:
    name, _, version = str(fmt).partition("/")
    if name != FORMAT_NAME or not version.isdigit():
        raise UserError(
            f"{path}: format {fmt!r} is not {FORMAT_NAME!r}/N; pass the export.json `titan-pipe export` writes"
        )
    if int(version) > FORMAT_VERSION:
        raise UserError(
            f"{path}: format {fmt!r} is newer than this titan-pipe reads "
            f"({FORMAT_NAME}/{FORMAT_VERSION}); upgrade titan-pipe"
        )
    return int(version)


def _names(values, *, optional: bool) -> tuple:
    if not isinstance(values, list) or not all(isinstance(v, str) or (optional and v is None) for v in values):
        raise ValueError(f"per-layer value names must be a list of strings, got {values!r:.80}")
    return tuple(values)


def _name(value) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"a value name must be a string, got {value!r:.80}")
    return value


# The record's numbers, typed strictly and bounded (titan_pipe.rules.values) like every number read from a file.
COUNT = Bound(0, 2**40, "nodes or operator uses of one graph")
_MALFORMED = "a malformed field; re-export with `titan-pipe export`"
OPSET = Bound(1, 1000, "an ONNX opset")


def _graph(g: dict, path: Path, file: str) -> GraphRecord:
    if not isinstance(g, dict):
        raise TypeError(f"a graph entry is a {type(g).__name__}, not an object")
    p = f"graphs.{file}."
    return GraphRecord(
        opset=read(g, "opset", INT, source=path, default=None, bound=OPSET, prefix=p, fix=_MALFORMED),
        inputs=dict(g.get("inputs") or {}),
        outputs=dict(g.get("outputs") or {}),
        n_nodes=read(g, "n_nodes", INT, source=path, default=0, bound=COUNT, prefix=p, fix=_MALFORMED),
        operators=tuple(
            OperatorUse(
                o.get("domain", ""),
                o["op_type"],
                read(o, "count", INT, source=path, default=0, bound=COUNT, prefix=p + "operators.", fix=_MALFORMED),
                read(
                    o,
                    "since_version",
                    INT,
                    source=path,
                    default=None,
                    bound=OPSET,
                    prefix=p + "operators.",
                    fix=_MALFORMED,
                ),
            )
            for o in g.get("operators") or ()
        ),
        layer_outputs=_names(g.get("layer_outputs") or [], optional=False),
        attn_outputs=_names(g.get("attn_outputs") or [], optional=True),
        mlp_outputs=_names(g.get("mlp_outputs") or [], optional=True),
        embed_output=_name(g.get("embed_output")),
    )


def _file(e: dict, path: Path, file: str, version: int) -> FileEntry:
    """One file entry; before version 3 ``{bytes, sha256}``, from 3 ``{bytes, algorithm, digest}``."""
    size = read(e, "bytes", INT, source=path, bound=FILE_BYTES, prefix=f"files.{file}.", fix=_MALFORMED)
    algorithm, digest = ("sha256", e.get("sha256")) if version < 3 else (e["algorithm"], e.get("digest"))
    if algorithm not in DIGESTS:
        raise ValueError(f"files.{file}.algorithm {algorithm!r} is not one of {', '.join(DIGESTS)}")
    if digest is not None and not isinstance(digest, str):
        raise ValueError(f"files.{file}: a digest must be a hex string or null, got {digest!r:.40}")
    return FileEntry(size, digest, algorithm)


def _parse(d: dict, version: int, path: Path) -> ExportRecord:
    dec = d.get("decode")
    return ExportRecord(
        graphs={f: _graph(g, path, f) for f, g in (d.get("graphs") or {}).items()},
        files={f: _file(e, path, f, version) for f, e in (d.get("files") or {}).items()},
        decode=None
        if not dec
        else DecodeContract(
            read(dec, "cache_len", INT, source=path, bound=limits.CACHE_LEN, prefix="decode.", fix=_MALFORMED),
            dec.get("cache_update", CACHE_UPDATE),
            dec.get("write_index", WRITE_INDEX),
            dec.get("note", DECODE_NOTE),
        ),
        source=dict(d.get("source") or {}),
        options=dict(d.get("options") or {}),
        exporter=dict(d.get("exporter") or {}),
        atc=dict(d.get("atc") or {}),
        export_seconds=d.get("export_seconds"),
        timings_seconds=dict(d.get("timings_seconds") or {}),
        format_version=version,
    )
