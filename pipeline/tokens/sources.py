"""Raw text sources: which files a corpus path holds, and their documents, streamed one at a time.

A ``.txt`` file is one document; a ``.jsonl`` / ``.jsonl.gz`` file is one document per non-blank
line (its ``text_key`` field); a ``.parquet`` file is one document per row (its ``text_key``
column; needs pyarrow, the ``parquet`` extra). A directory is every such file below it, in sorted
order of relative paths. Errors name the file and the line (or row) and say the fix.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Iterator

import titan_pipe
from titan_pipe.errors import UserError

# The titan_pipe package dir (pipeline/ in the repo, site-packages/titan_pipe when installed).
CORPUS_DIR = Path(titan_pipe.__file__).resolve().parent / "data" / "corpus"
SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet")
KINDS = ", ".join(SUFFIXES)
PARQUET_ROWS = 1024  # rows per parquet batch read


def default_corpus() -> Path:
    """The directory of public-domain texts shipped with titan-pipe (see docs/data.md)."""
    return CORPUS_DIR


def kind_of(path: Path) -> str | None:
    """The source suffix of ``path`` (".jsonl.gz" counts as one), or None for other files."""
    name = path.name
    return next((s for s in sorted(SUFFIXES, key=len, reverse=True) if name.endswith(s)), None)


def corpus_files(path: Path) -> list[Path]:
    """The source files of ``path`` (a file, or a directory searched recursively), sorted."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"data.path: {path} does not exist; fix the path or set it to null for the "
                        "shipped corpus")
    if path.is_file():
        if kind_of(path) is None:
            raise UserError(f"data.path: {path} is not a {KINDS} file; convert it or point at a "
                            f"directory of such files")
        return [path]
    files = sorted((p for p in path.rglob("*") if p.is_file() and kind_of(p) is not None),
                   key=lambda p: p.relative_to(path).as_posix())
    if not files:
        raise UserError(f"data.path: {path} holds no {KINDS} files; add some or fix the path")
    return files


def iter_documents(path: Path, *, text_key: str = "text") -> Iterator[str]:
    """The documents of one source file, in order (memory: one document, or one parquet batch)."""
    kind = kind_of(path)
    if kind == ".txt":
        yield _read_txt(path)
    elif kind == ".parquet":
        yield from _parquet_documents(path, text_key)
    else:
        opener = gzip.open if kind == ".jsonl.gz" else open
        try:
            with opener(path, "rb") as f:
                yield from _jsonl_documents(f, path, text_key)
        except (OSError, EOFError) as e:  # a damaged gzip stream
            raise UserError(f"{path}: cannot be read ({e}); re-create or re-download the file") from None


def _read_txt(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8-sig")  # a leading byte-order mark is not text
    except UnicodeDecodeError as e:
        line = path.read_bytes()[:e.start].count(b"\n") + 1
        raise UserError(f"{path}:{line}: not UTF-8 text (byte {e.start}); re-encode it as UTF-8") from None


def _jsonl_documents(f, path: Path, text_key: str) -> Iterator[str]:
    for lineno, raw in enumerate(f, start=1):
        try:
            line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{path}:{lineno}: not UTF-8 text (byte {e.start} of the line); re-encode the "
                            "file as UTF-8") from None
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise UserError(f"{path}:{lineno}: not valid JSON ({e}); each line must be one JSON object") from None
        yield _text_field(record, text_key, f"{path}:{lineno}")


def _text_field(record, text_key: str, where: str) -> str:
    if not isinstance(record, dict) or text_key not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise UserError(f"{where}: no {text_key!r} field (found {keys}); set data.text_key (or --text-key) "
                        "to the field that holds the text")
    value = record[text_key]
    if not isinstance(value, str):
        raise UserError(f"{where}: field {text_key!r} is a {type(value).__name__}, not a string")
    return value


def _parquet_documents(path: Path, text_key: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{path}: reading .parquet needs pyarrow; pip install 'titan-pipe[parquet]' "
                        "(or pyarrow), or convert the file to .jsonl") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a file that is not parquet
        raise UserError(f"{path}: not a parquet file ({str(e).splitlines()[0]}); re-create it") from None
    names = pf.schema_arrow.names
    if text_key not in names:
        raise UserError(f"{path}: no {text_key!r} column (found {names}); set data.text_key (or --text-key) to "
                        "the column that holds the text")
    row = 0
    for batch in pf.iter_batches(batch_size=PARQUET_ROWS, columns=[text_key]):
        for value in batch.column(0).to_pylist():
            row += 1
            if not isinstance(value, str):
                raise UserError(f"{path}: row {row}: column {text_key!r} is "
                                f"{'null' if value is None else type(value).__name__}, not a string")
            yield value
