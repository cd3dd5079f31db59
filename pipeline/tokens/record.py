"""The prepared-data sidecar ``data.json``: which tokenizer, which sources, how many tokens, the split.

A prepared data dir is ``tokens.bin`` + ``tokens.idx`` (a Megatron indexed dataset, one sequence
per document, each ending with the tokenizer's eos) and this record. The record is written last,
so a dir with a readable ``data.json`` is complete. ``key`` is the sha256 of everything the
output depends on (tokenizer, sources, text key, validation fraction): the same inputs give the
same key, and ``titan-pipe data prepare`` with an unchanged key does nothing.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from titan_pipe.errors import UserError
from titan_pipe.tokens.identity import TokenizerRecord

DATA_JSON = "data.json"
PREFIX = "tokens"  # tokens.bin / tokens.idx inside a prepared dir
SCHEMA = 1


@dataclass(frozen=True)
class SourceInfo:
    path: str  # as given (absolute)
    size: int
    mtime_ns: int  # with size: lets a re-run trust sha256 without re-reading the file
    sha256: str  # "" in a shard's record for a file that shard does not read (data merge fills it in)


@dataclass(frozen=True)
class Split:
    """Documents [0, train_documents) train, the rest validation; token counts of each."""

    val_fraction: float
    train_documents: int
    val_documents: int
    train_tokens: int
    val_tokens: int


@dataclass(frozen=True)
class DataRecord:
    key: str
    tokenizer: TokenizerRecord  # data.json holds its data_fields()
    sources: list[SourceInfo]
    text_key: str
    dtype: str  # numpy name of the .bin ids: uint16 | int32
    n_tokens: int
    n_documents: int
    max_token_id: int
    split: Split
    skipped_empty: int = 0  # documents with no text, left out
    shard: str | None = None  # "I/N": part I of N of the sources (data prepare --shard); None: all of them
    records: str = "text"  # text | chat | instruction (titan_pipe.tokens.chat)
    loss_mask: str | None = None  # chat/instruction: the mask file beside the tokens (titan_pipe.tokens.loss_mask)
    chat_template: str | None = None  # "ORIGIN sha256:HEX" of the template the records were rendered with
    chat_key: str | None = None  # sha256 of the rendering settings (format, template, special tokens, max tokens)
    bad_records: int = 0  # records left out (chat/instruction), at most the bound prepare was given
    bad_examples: list = field(default_factory=list)  # the first of them: "file:line: why"
    prefix: str = PREFIX
    schema: int = SCHEMA
    format: str = field(default="megatron-indexed-dataset")

    def to_json(self) -> dict:
        return {**asdict(self), "tokenizer": self.tokenizer.data_fields()}

    def save(self, out_dir: Path) -> Path:
        from titan_pipe.io.atomic import write_text

        return write_text(Path(out_dir) / DATA_JSON, json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, data_dir: Path) -> "DataRecord":
        path = Path(data_dir) / DATA_JSON
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            if raw.get("schema") != SCHEMA:
                raise UserError(
                    f"{path}: schema {raw.get('schema')!r}, this titan-pipe reads {SCHEMA}; prepare "
                    "the data again with `titan-pipe data prepare`"
                )
            rec = cls(
                **{
                    **raw,
                    "tokenizer": TokenizerRecord.from_data_fields(raw["tokenizer"]),
                    "sources": [_typed(SourceInfo, s) for s in raw["sources"]],
                    "split": _typed(Split, raw["split"]),
                }
            )
            _typed(cls, {k: v for k, v in raw.items() if k not in ("tokenizer", "sources", "split")})
            if not isinstance(rec.prefix, str) or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]*", rec.prefix):
                raise ValueError(f"prefix {rec.prefix!r} is not a file name inside the data dir")
            if rec.loss_mask not in (None, rec.prefix + ".lossmask"):
                raise ValueError(f"loss_mask {rec.loss_mask!r} is not {rec.prefix + '.lossmask'!r}")
            return rec
        except UserError:
            raise
        except OSError as e:
            raise UserError(
                f"{path}: cannot be read ({e.strerror}); prepare the data with `titan-pipe data prepare`"
            ) from None
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
            raise UserError(
                f"{path}: not a titan-pipe data record ({type(e).__name__}: {e}); prepare the data "
                "again with `titan-pipe data prepare`"
            ) from None


_KINDS = {
    "int": (int,),
    "str": (str,),
    "float": (int, float),
    "str | None": (str, type(None)),
    "int | None": (int, type(None)),
    "list": (list,),
}


def _typed(cls, values):
    """``cls(**values)`` with each plain field's JSON type checked (a bool is not an int): a
    tampered value is refused here, in the record's one-line error, not deep in a reader."""
    import dataclasses

    if not isinstance(values, dict):
        raise TypeError(f"{cls.__name__} is a JSON {type(values).__name__}, not an object")
    for f in dataclasses.fields(cls):
        kinds = _KINDS.get(str(f.type))
        if kinds is None or f.name not in values:
            continue
        v = values[f.name]
        if isinstance(v, bool) or not isinstance(v, kinds):
            raise TypeError(f"{f.name} is {v!r}, not {f.type}")
        if isinstance(v, int) and not isinstance(v, bool) and v < 0 and f.name not in ("mtime_ns",):
            raise ValueError(f"{f.name} is {v}, below 0")
    return cls(**values) if cls is not DataRecord else None


def is_prepared(path: Path) -> bool:
    return (Path(path) / DATA_JSON).is_file()


def prepared_from(
    rec: DataRecord, files: list[Path], *, text_key: str, val_fraction: float, tokenizer: TokenizerRecord
) -> bool:
    """True when ``rec`` was prepared from exactly ``files`` as they are now (paths, sizes, mtimes),
    with this text key, validation fraction and tokenizer: its tokens are what they would give."""
    now = [(str(Path(f).resolve()), Path(f).stat().st_size, Path(f).stat().st_mtime_ns) for f in files]
    then = [(s.path, s.size, s.mtime_ns) for s in rec.sources]
    return (
        now == then
        and rec.text_key == text_key
        and rec.split.val_fraction == val_fraction
        and rec.tokenizer.fingerprint == tokenizer.fingerprint
    )
