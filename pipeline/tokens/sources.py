"""Raw text sources: which files a corpus path holds, and their documents, streamed block by block.

A ``.txt`` file is one document; a ``.jsonl`` / ``.jsonl.gz`` file is one document per non-blank
line (its ``text_key`` field); a ``.parquet`` file is one document per row (its ``text_key``
column; needs pyarrow, the ``parquet`` extra). A directory is every such file below it, in sorted
order of relative paths. Errors name the file and the line (or row) and say the fix.

Reading is split in two so data prepare can parallelise it: ``iter_blocks`` cuts a file into
blocks of whole lines (or rows) of about 1 MB, cheaply, in the reading process; ``documents``
parses a block (UTF-8, JSON, the text field) wherever it is sent.
"""

from __future__ import annotations

import gzip
import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import titan_pipe
from titan_pipe.errors import UserError
from titan_pipe.rules.limits import RECORD_BYTES

# The titan_pipe package dir (pipeline/ in the repo, site-packages/titan_pipe when installed).
CORPUS_DIR = Path(titan_pipe.__file__).resolve().parent / "data" / "corpus"
SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet")
KINDS = ", ".join(SUFFIXES)
PARQUET_ROWS = 1024  # rows per parquet batch read
BLOCK_BYTES = 1 << 20  # bytes of .jsonl lines per block


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
        raise UserError(f"data.path: {path} does not exist; fix the path or set it to null for the shipped corpus")
    if path.is_file():
        if kind_of(path) is None:
            raise UserError(
                f"data.path: {path} is not a {KINDS} file; convert it or point at a directory of such files"
            )
        return [path]
    files = sorted(
        (p for p in path.rglob("*") if p.is_file() and kind_of(p) is not None),
        key=lambda p: p.relative_to(path).as_posix(),
    )
    if not files:
        raise UserError(f"data.path: {path} holds no {KINDS} files; add some or fix the path")
    return files


@dataclass(frozen=True)
class Block:
    """A piece of one source file, cheap to cut and to send to a worker; ``documents`` parses it.

    payload: the raw bytes of whole .jsonl lines (``first_line`` is the first one's number), a
    .txt file's text, or a list of parquet values (``first_line`` is the first row's number).
    """

    path: Path
    kind: str
    first_line: int
    payload: bytes | str | list

    @property
    def size(self) -> int:
        """Bytes (or characters) of text it carries, roughly: what progress and chunking count."""
        return sum(map(len, self.payload)) if isinstance(self.payload, list) else len(self.payload)


def iter_blocks(
    path: Path, *, text_key: str = "text", block_bytes: int | None = None, byte_range: tuple[int, int] | None = None
) -> Iterator[Block]:
    """One source file cut into blocks of about ``block_bytes`` (default BLOCK_BYTES; whole lines;
    parquet: batches of ``text_key`` values). ``byte_range`` (lo, hi), plain .jsonl only: the lines
    that start at a byte in [lo, hi), numbered as in the whole file (a sharded prepare's part)."""
    kind, block_bytes = kind_of(path), block_bytes or BLOCK_BYTES
    if byte_range is not None:
        if kind != ".jsonl":
            raise ValueError(f"{path}: only plain .jsonl files are read by byte range")
        yield from _range_blocks(path, byte_range, block_bytes)
        return
    if kind == ".txt":
        yield Block(path, kind, 1, _read_txt(path))
    elif kind == ".parquet":
        yield from _parquet_blocks(path, text_key)
    else:
        opener = gzip.open if kind == ".jsonl.gz" else open
        try:
            with opener(path, "rb") as f:
                yield from _line_blocks(f, path, kind, block_bytes)
        except (OSError, EOFError, zlib.error) as e:  # a damaged gzip stream
            raise UserError(f"{path}: cannot be read ({e}); re-create or re-download the file") from None


def _line_blocks(f, path: Path, kind: str, block_bytes: int, *, first_line: int = 1) -> Iterator[Block]:
    line, rest = first_line, b""
    while chunk := f.read(block_bytes):
        data = rest + chunk
        cut = data.rfind(b"\n") + 1
        if cut == 0:  # one line longer than a block: keep reading, up to the record limit
            rest = data
            if len(rest) > RECORD_BYTES.hi:
                raise too_large(path, line, len(rest))
            continue
        yield Block(path, kind, line, data[:cut])
        line += data.count(b"\n", 0, cut)
        rest = data[cut:]
    if rest:
        yield Block(path, kind, line, rest)


def splittable(path: Path) -> bool:
    """Whether a sharded prepare may cut ``path`` by byte range (line boundaries found by seeking)."""
    return kind_of(path) == ".jsonl"


def _newlines_before(f, end: int) -> int:
    f.seek(0)
    n, left = 0, end
    while left > 0:
        chunk = f.read(min(left, 16 << 20))
        if not chunk:
            break
        n += chunk.count(b"\n")
        left -= len(chunk)
    return n


def _line_start_at_or_after(f, pos: int) -> int:
    """The first line start >= ``pos`` (``pos`` itself when a line starts there)."""
    if pos == 0:
        return 0
    f.seek(pos - 1)
    if f.read(1) == b"\n":
        return pos
    while chunk := f.read(1 << 16):
        i = chunk.find(b"\n")
        if i >= 0:
            return f.tell() - len(chunk) + i + 1
    return f.tell()


def _range_blocks(path: Path, byte_range: tuple[int, int], block_bytes: int) -> Iterator[Block]:
    lo, hi = byte_range
    try:
        with open(path, "rb") as f:
            start, end = _line_start_at_or_after(f, lo), _line_start_at_or_after(f, hi)
            if end <= start:
                return
            line = 1 + _newlines_before(f, start)
            f.seek(start)
            yield from _line_blocks(_Bounded(f, end - start), path, ".jsonl", block_bytes, first_line=line)
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e}); check the file") from None


class _Bounded:
    """At most ``left`` more bytes of ``f``."""

    def __init__(self, f, left: int):
        self.f, self.left = f, left

    def read(self, n: int) -> bytes:
        data = self.f.read(min(n, self.left)) if self.left > 0 else b""
        self.left -= len(data)
        return data


def documents(block: Block, *, text_key: str = "text") -> list[str]:
    """The documents of a block, with errors naming the file and the line (or row)."""
    if block.kind == ".txt":
        return [block.payload]
    if block.kind == ".parquet":
        return [_parquet_value(v, block.path, block.first_line + i, text_key) for i, v in enumerate(block.payload)]
    docs = []
    for lineno, line, record in _json_lines(block):
        if line.count(f'"{text_key}"') > 1:  # rare: only then is the record parsed again, slowly
            _refuse_duplicate_text(line, text_key, f"{block.path}:{lineno}")
        docs.append(_text_field(record, text_key, f"{block.path}:{lineno}"))
    return docs


def records(block: Block) -> list[tuple[str, object]]:
    """("file:line", parsed JSON value) of each non-blank line of a .jsonl block (chat and
    instruction data); a line that is not UTF-8 JSON is an error naming it."""
    if block.kind not in (".jsonl", ".jsonl.gz"):
        raise UserError(
            f"{block.path}: chat and instruction records are read from .jsonl / .jsonl.gz files, one "
            "JSON object per line; convert it"
        )
    return [(f"{block.path}:{lineno}", record) for lineno, _, record in _json_lines(block)]


def _json_lines(block: Block) -> Iterator[tuple[int, str, object]]:
    for lineno, raw in enumerate(block.payload.split(b"\n"), start=block.first_line):
        if len(raw) > RECORD_BYTES.hi:
            raise too_large(block.path, lineno, len(raw))
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
        except UnicodeDecodeError as e:
            raise UserError(
                f"{block.path}:{lineno}: not UTF-8 text (byte {e.start} of the line); re-encode the file as UTF-8"
            ) from None
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise UserError(f"{block.path}:{lineno}: not valid JSON ({e}); each line must be one JSON object") from None
        except RecursionError:
            raise UserError(
                f"{block.path}:{lineno}: JSON nested deeper than Python reads (a hostile or broken "
                "line); each line must be one flat JSON object"
            ) from None
        if "\\ud" in line.lower() and _has_lone_surrogate(record):
            raise UserError(
                f"{block.path}:{lineno}: a \\ud800-\\udfff escape that is not half of a surrogate pair "
                "(not a character: no text can hold it); fix the line's escapes"
            )
        yield lineno, line, record


def _has_lone_surrogate(value) -> bool:
    """Whether a parsed JSON value holds a string with a lone UTF-16 surrogate (JSON allows the
    escape; UTF-8 and every tokenizer refuse the character). Iterative: no recursion limit."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def iter_documents(path: Path, *, text_key: str = "text") -> Iterator[str]:
    """The documents of one source file, in order (memory: one block)."""
    for block in iter_blocks(path, text_key=text_key):
        yield from documents(block, text_key=text_key)


def too_large(path: Path, line: int | None, size: int) -> UserError:
    """A record (a .txt document, a .jsonl line, a parquet value) over titan_pipe.rules.limits.RECORD_BYTES."""
    limit = int(RECORD_BYTES.hi)
    where = f"{path}:{line}" if line is not None else str(path)
    return UserError(
        f"{where}: a record of at least {_size(size)}, over the limit of {_size(limit)} "
        f"({RECORD_BYTES.why}); split it into records of at most {_size(limit)} (.jsonl: one "
        "document per line; .txt: one document per file)"
    )


def _size(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n} bytes"


def check_records(path: Path, *, text_key: str = "text") -> None:
    """Refuse a source file holding a record over the limit, reading one block at a time."""
    for block in iter_blocks(path, text_key=text_key):
        if block.kind == ".parquet":
            documents(block, text_key=text_key)  # its values are checked one by one
        elif block.kind != ".txt":
            for lineno, raw in enumerate(block.payload.split(b"\n"), start=block.first_line):
                if len(raw) > RECORD_BYTES.hi:
                    raise too_large(block.path, lineno, len(raw))


def _read_txt(path: Path) -> str:
    size = path.stat().st_size
    if size > RECORD_BYTES.hi:  # one document: held whole while decoded and tokenized
        raise too_large(path, None, size)
    try:
        return path.read_bytes().decode("utf-8-sig")  # a leading byte-order mark is not text
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise UserError(f"{path}:{line}: not UTF-8 text (byte {e.start}); re-encode it as UTF-8") from None


def _refuse_duplicate_text(line: str, text_key: str, where: str) -> None:
    """A record naming its text field twice: JSON parsers keep the last silently, another reader may
    keep the first; which document it is must not depend on that."""

    def pairs(items):
        keys = [k for k, _ in items]
        if keys.count(text_key) > 1:
            raise UserError(
                f"{where}: the record has the field {text_key!r} {keys.count(text_key)} times; keep one "
                "(which one a reader takes differs from reader to reader)"
            )
        return dict(items)

    if line.lstrip().startswith("{"):  # an object: its top level's pairs, in order
        pairs(json.loads(line, object_pairs_hook=lambda items: items))


def _text_field(record, text_key: str, where: str) -> str:
    if not isinstance(record, dict) or text_key not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise UserError(
            f"{where}: no {text_key!r} field (found {keys}); set data.text_key (or --text-key) "
            "to the field that holds the text"
        )
    value = record[text_key]
    if not isinstance(value, str):
        raise UserError(f"{where}: field {text_key!r} is a {type(value).__name__}, not a string")
    return value


def _parquet_blocks(path: Path, text_key: str) -> Iterator[Block]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(
            f"{path}: reading .parquet needs pyarrow; pip install 'titan-pipe[parquet]' "
            "(or pyarrow), or convert the file to .jsonl"
        ) from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a file that is not parquet
        raise UserError(f"{path}: not a parquet file ({str(e).splitlines()[0]}); re-create it") from None
    names = pf.schema_arrow.names
    if text_key not in names:
        raise UserError(
            f"{path}: no {text_key!r} column (found {names}); set data.text_key (or --text-key) to "
            "the column that holds the text"
        )
    row = 1
    for batch in pf.iter_batches(batch_size=PARQUET_ROWS, columns=[text_key]):
        values = batch.column(0).to_pylist()
        yield Block(path, ".parquet", row, values)
        row += len(values)


def _parquet_value(value, path: Path, row: int, text_key: str) -> str:
    if not isinstance(value, str):
        raise UserError(
            f"{path}: row {row}: column {text_key!r} is "
            f"{'null' if value is None else type(value).__name__}, not a string"
        )
    if len(value) > RECORD_BYTES.hi:
        raise too_large(path, row, len(value))
    return value
