"""Token data on disk opened for reading: a prepared dir, a Megatron .bin/.idx prefix, or a blend of them.

``open_data`` opens the files and returns ``TokenData``: the training part as weighted spans of
the token stream and the validation part (held-out whole documents). Nothing proportional to the
corpus is read or allocated: the split is found by binary search over document starts, the vocab
check reads the record (or a fixed sample of the stream), the fingerprint reads the two ends.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from titan_pipe.errors import UserError
from titan_pipe.tokens.indexed import IndexedTokens, is_prefix, strip_suffix
from titan_pipe.tokens.identity import TokenizerRecord
from titan_pipe.tokens.record import PREFIX, DataRecord, is_prepared

FINGERPRINT_BYTES = 1 << 16  # bytes of each end of a span that go into its fingerprint
VOCAB_SAMPLES = 64  # spread reads of a dataset without a record, to check its ids against the vocab
VOCAB_SAMPLE_TOKENS = 4096


@dataclass(frozen=True)
class TokenSpan:
    """Tokens [start, stop) of a 1-D token array (a FileArray over a .bin, or an in-memory array)."""

    tokens: np.ndarray
    start: int
    stop: int
    name: str = "tokens"

    def __len__(self) -> int:
        return self.stop - self.start

    def read(self, lo: int, hi: int) -> np.ndarray:
        """Tokens [lo, hi) of the span, as int64 (a copy; only these pages are read)."""
        return np.asarray(self.tokens[self.start + lo : self.start + hi], dtype=np.int64)

    def fingerprint(self) -> int:
        """crc32 of the length and the first and last 64 KiB: a cheap identity, not a checksum."""
        n = FINGERPRINT_BYTES // max(1, self.tokens.dtype.itemsize)
        crc = zlib.crc32(str(len(self)).encode())
        for part in (
            self.tokens[self.start : min(self.stop, self.start + n)],
            self.tokens[max(self.start, self.stop - n) : self.stop],
        ):
            crc = zlib.crc32(np.ascontiguousarray(part).tobytes(), crc)
        return crc


def val_start(starts, n_docs: int, n_tokens: int, fraction: float, *, where: str) -> int:
    """The first validation document: the shortest tail of whole documents holding >= ``fraction``
    of the tokens (one document at least when fraction > 0), leaving one document at least to train.

    ``starts(d)``: token offset of document d. Binary search: O(log n_docs) lookups.
    """
    if not 0 <= fraction < 1:
        raise UserError(f"{where}: val_fraction {fraction} must be in [0, 1)")
    if fraction == 0 or n_docs == 0:
        return n_docs
    target = n_tokens * (1 - fraction)
    lo, hi = 0, n_docs - 1  # the largest d in [0, n_docs) with starts(d) <= target
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if starts(mid) <= target else (lo, mid - 1)
    if lo == 0:
        raise UserError(
            f"{where}: holding out {fraction:g} of its {n_tokens:,} tokens as whole documents leaves "
            f"none of its {n_docs} document(s) to train on; give more documents (several files, or "
            "a .jsonl of one document per line) or lower data.val_fraction (0: no validation)"
        )
    return lo


@dataclass(frozen=True)
class OpenedSource:
    """One dataset: its train and validation spans, its record (None for a bare prefix)."""

    path: Path
    train: TokenSpan
    val: TokenSpan
    record: DataRecord | None
    indexed: IndexedTokens


def open_prepared(path: Path, *, val_fraction: float | None = None) -> OpenedSource:
    """A dir made by ``titan-pipe data prepare``: its split is the record's (``val_fraction``, when
    given, must agree with it)."""
    rec = DataRecord.load(path)
    ds = IndexedTokens(Path(path) / rec.prefix)
    if (ds.n_tokens, ds.n_documents) != (rec.n_tokens, rec.n_documents):
        raise UserError(
            f"{path}: {rec.prefix}.bin/.idx hold {ds.n_tokens:,} tokens in {ds.n_documents:,} documents "
            f"but data.json records {rec.n_tokens:,} in {rec.n_documents:,}; prepare the data again"
        )
    if val_fraction is not None and val_fraction != rec.split.val_fraction:
        raise UserError(
            f"data.val_fraction: {val_fraction} but {path} was prepared with --val-fraction "
            f"{rec.split.val_fraction}; drop data.val_fraction (the prepared split is used) or "
            "prepare again with the fraction you want"
        )
    cut = ds.doc_start(rec.split.train_documents)
    return OpenedSource(
        Path(path),
        TokenSpan(ds.tokens, 0, cut, f"{path} (train)"),
        TokenSpan(ds.tokens, cut, ds.n_tokens, f"{path} (validation)"),
        rec,
        ds,
    )


def open_prefix(prefix: Path, *, val_fraction: float) -> OpenedSource:
    """A bare Megatron .bin/.idx pair: the validation split is cut here, by the same rule as prepare."""
    ds = IndexedTokens(prefix)
    if ds.n_tokens == 0:
        raise UserError(f"{ds.prefix}.bin: holds no tokens; give a dataset with documents in it")
    d = val_start(ds.doc_start, ds.n_documents, ds.n_tokens, val_fraction, where=f"{ds.prefix}.idx")
    cut = ds.doc_start(d)
    return OpenedSource(
        ds.prefix,
        TokenSpan(ds.tokens, 0, cut, f"{ds.prefix} (train)"),
        TokenSpan(ds.tokens, cut, ds.n_tokens, f"{ds.prefix} (validation)"),
        None,
        ds,
    )


def open_source(path: Path, *, val_fraction: float, fraction_given: bool = True) -> OpenedSource:
    """A prepared dir or a .bin/.idx prefix; ``fraction_given``: the flow set data.val_fraction itself."""
    path = Path(path)
    if is_prepared(path):
        return open_prepared(path, val_fraction=val_fraction if fraction_given else None)
    if is_prefix(path):
        return open_prefix(strip_suffix(path), val_fraction=val_fraction)
    if path.is_dir() and is_prefix(path / PREFIX):
        raise UserError(
            f"{path}: has {PREFIX}.bin/.idx but no data.json (an interrupted prepare?); run "
            "`titan-pipe data prepare` again, or give the prefix {path / PREFIX}"
        )
    raise UserError(
        f"{path}: neither a prepared data dir (data.json) nor a .bin/.idx prefix; prepare it with "
        "`titan-pipe data prepare SRC -o DIR --tokenizer T`"
    )


def check_tokenizer(src: OpenedSource, tok: TokenizerRecord, *, vocab_size: int) -> None:
    """The data's ids come from ``tok`` (when its record says which) and fit in ``vocab_size``."""
    rec = src.record
    if rec is not None:
        if rec.tokenizer.fingerprint != tok.fingerprint:
            raise UserError(
                f"{src.path}: prepared with tokenizer {rec.tokenizer.describe()} (vocab "
                f"{rec.tokenizer.vocab_size}, eos {rec.tokenizer.eos_id}), but data.tokenizer is "
                f"{tok.describe()} (vocab {tok.vocab_size}, eos {tok.eos_id}); set data.tokenizer to "
                "the one it was prepared with, or prepare it again"
            )
        largest, how = rec.max_token_id, "its largest token id"
    else:
        largest, how = sampled_max(src.indexed), "a sample of its token ids reaches"
    if largest >= vocab_size:
        raise UserError(
            f"{src.path}: {how} {largest} is >= model.vocab_size {vocab_size}; raise "
            f"model.vocab_size to at least {largest + 1} or use data made with the model's tokenizer"
        )


def sampled_max(ds: IndexedTokens) -> int:
    """The largest id in VOCAB_SAMPLES reads spread over the stream (the last tokens included)."""
    if ds.n_tokens == 0:
        return -1
    step = max(1, ds.n_tokens // VOCAB_SAMPLES)
    starts = list(range(0, ds.n_tokens, step))[:VOCAB_SAMPLES] + [max(0, ds.n_tokens - VOCAB_SAMPLE_TOKENS)]
    return max(int(np.max(ds.tokens[s : s + VOCAB_SAMPLE_TOKENS])) for s in starts)


@dataclass(frozen=True)
class TokenData:
    """What training and evaluation read: weighted training spans and the validation spans."""

    train: list[tuple[TokenSpan, float]]
    val: list[TokenSpan]
    sources: list[OpenedSource]

    def val_head(self, n: int) -> np.ndarray:
        """The first ``n`` validation tokens (int64), taken from the validation spans in order."""
        parts, left = [], n
        for span in self.val:
            take = min(left, len(span))
            parts.append(span.read(0, take))
            left -= take
            if not left:
                break
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    @property
    def n_val(self) -> int:
        return sum(len(s) for s in self.val)

    def describe(self) -> str:
        """One log line: the datasets, their weights and the split."""
        n_train = sum(len(s) for s, _ in self.train)
        parts = [
            f"{src.path}" + (f" x{w:.3g}" if len(self.train) > 1 else "")
            for src, (_, w) in zip(self.sources, self.train)
        ]
        return f"data: {', '.join(parts)}: train {n_train:,} tokens / val {self.n_val:,} tokens"


def open_data(
    paths: list[Path],
    weights: list[float] | None = None,
    *,
    val_fraction: float,
    fraction_given: bool = True,
    tokenizer: TokenizerRecord | None = None,
    vocab_size: int | None = None,
) -> TokenData:
    """Open one dataset or a blend; check the tokenizer (and that a blend shares one) and the vocab."""
    weights = weights or [1.0] * len(paths)
    sources = [open_source(p, val_fraction=val_fraction, fraction_given=fraction_given) for p in paths]
    recorded = [s for s in sources if s.record is not None]
    for s in recorded[1:]:
        if s.record.tokenizer.fingerprint != recorded[0].record.tokenizer.fingerprint:
            raise UserError(
                f"data.blend: {s.path} was prepared with tokenizer {s.record.tokenizer.describe()} but "
                f"{recorded[0].path} with {recorded[0].record.tokenizer.describe()}; a blend mixes "
                "data of one tokenizer, prepare them with the same one"
            )
    if tokenizer is not None and vocab_size is not None:
        for s in sources:
            check_tokenizer(s, tokenizer, vocab_size=vocab_size)
    total = float(sum(weights))
    return TokenData([(s.train, w / total) for s, w in zip(sources, weights)], [s.val for s in sources], sources)


def summarize(path: Path) -> list[tuple[str, str]]:
    """(field, value) rows describing a prepared dir or a .bin/.idx prefix, for ``titan-pipe data inspect``."""
    src = open_source(Path(path), val_fraction=0.0, fraction_given=False)
    ds, rec = src.indexed, src.record
    ds.verify()  # what inspect reports is what a reader would read: a damaged index is named, not summarized
    files = [f"{p.name} {p.stat().st_size:,} B" for p in (Path(f"{ds.prefix}.bin"), Path(f"{ds.prefix}.idx"))]
    rows = [
        ("path", str(src.path)),
        ("format", "Megatron indexed dataset (MMIDIDX v1)" + (" + data.json" if rec else ", no data.json")),
        ("files", ", ".join(files)),
        ("token dtype", ds.dtype.name),
        ("tokens", f"{ds.n_tokens:,}"),
        ("documents", f"{ds.n_documents:,}"),
        ("sequences", f"{ds.header.n_sequences:,}"),
    ]
    if rec is None:
        return rows + [("largest token id", f"{sampled_max(ds)} (sampled)")]
    s = rec.split
    return rows + [
        ("largest token id", str(rec.max_token_id)),
        (
            "tokenizer",
            f"{rec.tokenizer.describe()}, vocab {rec.tokenizer.vocab_size}, bos {rec.tokenizer.bos_id}, "
            f"eos {rec.tokenizer.eos_id}",
        ),
        (
            "split",
            f"train {s.train_documents:,} documents / {s.train_tokens:,} tokens, validation "
            f"{s.val_documents:,} documents / {s.val_tokens:,} tokens (val_fraction {s.val_fraction:g})",
        ),
        (
            "sources",
            f"{len(rec.sources)} file(s), {sum(x.size for x in rec.sources):,} B, text key {rec.text_key!r}"
            + (f", {rec.skipped_empty} empty document(s) left out" if rec.skipped_empty else ""),
        ),
        ("key", rec.key),
    ]
