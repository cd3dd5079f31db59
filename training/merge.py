"""``titan-pipe data merge DIR... -o OUT``: prepared data dirs joined into one, without tokenizing again.

The parts of a sharded prepare (``data prepare --shard I/N``, one command per host) merge into what
one unsharded prepare of the same sources writes, byte for byte (tokens.bin, tokens.idx and
data.json: the same key, sources, split): the documents in part order, the index rebuilt, the
split taken over the whole with the same rule. Any other prepared dirs merge too (one dataset of
their documents in the order given); what cannot be one dataset is refused in one line naming both
dirs: another tokenizer, another token dtype or text key, a source file two of them both hold
(overlapping documents), a part missing, given twice or of another sharding.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np

from titan_pipe.io.atomic import swap_dir, temp_dir
from titan_pipe.errors import UserError
from titan_pipe.tokens.dataset import val_start
from titan_pipe.tokens.indexed import IndexedTokens, IndexWriter
from titan_pipe.tokens.record import PREFIX, DataRecord, SourceInfo, Split, is_prepared
from titan_pipe.training.prepare import BAD_EXAMPLES, PrepareResult, Shard, prepare_key
from titan_pipe.training.prepare import check_out_dir

DOCS_PER_BLOCK = 1 << 16  # documents copied at once (their lengths and tokens)


def _load(path: Path) -> DataRecord:
    if not is_prepared(path):
        raise UserError(
            f"{path}: not a prepared data dir (no data.json); merge the outputs of `titan-pipe data "
            "prepare` (a bare Megatron prefix names no tokenizer to check)"
        )
    return DataRecord.load(path)


def _refuse_mixed(dirs: list[Path], recs: list[DataRecord]) -> None:
    first, a = recs[0], dirs[0]
    for b, rec in zip(dirs[1:], recs[1:]):
        for what, x, y in (
            (
                "tokenizers",
                first.tokenizer.describe() + f" ({first.tokenizer.vocab_size} ids)",
                rec.tokenizer.describe() + f" ({rec.tokenizer.vocab_size} ids)",
            ),
            ("token dtypes", first.dtype, rec.dtype),
            ("text keys", first.text_key, rec.text_key),
            ("record formats", first.records, rec.records),
            ("loss masks (one has answers marked, the other not)", first.loss_mask, rec.loss_mask),
            ("chat renderings (template, special tokens or --max-tokens; keys)", first.chat_key, rec.chat_key),
            ("validation fractions", first.split.val_fraction, rec.split.val_fraction),
        ):
            if x != y:
                raise UserError(f"{a} and {b} have different {what} ({x} vs {y}); merge data prepared alike")
        if first.tokenizer.fingerprint != rec.tokenizer.fingerprint:
            raise UserError(
                f"{a} and {b} have different tokenizers ({first.tokenizer.fingerprint} vs "
                f"{rec.tokenizer.fingerprint}); merge data prepared with one tokenizer"
            )


def _order_parts(dirs: list[Path], recs: list[DataRecord]) -> tuple[list[int], list[SourceInfo]]:
    """The parts of one sharded prepare in part order, and the full source list their records give."""
    shards = [Shard.parse(r.shard) for r in recs]
    count = shards[0].count
    by_index: dict[int, int] = {}
    for i, (d, s) in enumerate(zip(dirs, shards)):
        if s.count != count:
            raise UserError(
                f"{dirs[0]} and {d} are parts of different shardings ({shards[0]} vs {s}); merge the "
                "N parts of one `data prepare --shard I/N`"
            )
        if s.index in by_index:
            raise UserError(
                f"{dirs[by_index[s.index]]} and {d} are both part {s}: their documents overlap; give each part once"
            )
        by_index[s.index] = i
        listed = [(x.path, x.size, x.mtime_ns) for x in recs[i].sources]
        if listed != [(x.path, x.size, x.mtime_ns) for x in recs[0].sources]:
            raise UserError(
                f"{dirs[0]} and {d} were prepared from different sources (or the files changed "
                "between the parts); prepare every part from the same files"
            )
    missing = [str(Shard(k, count)) for k in range(1, count + 1) if k not in by_index]
    if missing:
        raise UserError(
            f"parts {', '.join(missing)} are missing from the {count} of {dirs[0]}'s sharding; give all {count} parts"
        )
    order = [by_index[k] for k in range(1, count + 1)]
    sources = []
    for j, src in enumerate(recs[0].sources):
        digests = {recs[i].sources[j].sha256 for i in order} - {""}
        if len(digests) > 1:
            raise UserError(
                f"{src.path}: the parts read it with different contents (sha256 differs); the file "
                "changed while the parts were prepared: prepare them again"
            )
        digest = (
            digests.pop()
            if digests
            else ("e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855" if src.size == 0 else "")
        )
        if not digest:
            raise UserError(f"{src.path}: no part read it ({src.size} bytes); the parts do not cover the sources")
        sources.append(SourceInfo(src.path, src.size, src.mtime_ns, digest))
    return order, sources


def _concat_sources(dirs: list[Path], recs: list[DataRecord]) -> list[SourceInfo]:
    seen: dict[tuple[str, str], Path] = {}
    out = []
    for d, rec in zip(dirs, recs):
        for s in rec.sources:
            key = (s.path, s.sha256)
            if key in seen:
                raise UserError(
                    f"{seen[key]} and {d} both hold the documents of {s.path}; merging them would "
                    "repeat those documents: leave one out"
                )
            seen[key] = d
            out.append(s)
    return out


def merge(*, inputs: list[Path], out_dir: Path, progress: bool = True) -> PrepareResult:
    """Join the prepared dirs ``inputs`` into ``out_dir`` (see the module doc)."""
    t0 = time.perf_counter()
    dirs = [Path(p) for p in inputs]
    if len(dirs) < 2:
        raise UserError("data merge: give two prepared data dirs or more")
    out_dir = Path(out_dir)
    check_out_dir(out_dir, dirs)  # prepare's rule: outside every input, new, empty or a prepared dir
    recs = [_load(d) for d in dirs]
    _refuse_mixed(dirs, recs)
    sharded = [r.shard is not None for r in recs]
    if any(sharded) and not all(sharded):
        a, b = dirs[sharded.index(True)], dirs[sharded.index(False)]
        raise UserError(
            f"{a} is a part of a sharded prepare and {b} is not; merge the parts of one prepare, or whole prepared dirs"
        )
    if all(sharded):
        order, sources = _order_parts(dirs, recs)
    else:
        order, sources = list(range(len(dirs))), _concat_sources(dirs, recs)
    first = recs[0]
    key = prepare_key(first.tokenizer, first.text_key, first.split.val_fraction, sources, chat=first.chat_key)
    tmp = temp_dir(out_dir)
    try:
        record = _write(tmp, [dirs[i] for i in order], [recs[i] for i in order], sources, key, progress=progress)
        swap_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PrepareResult(out_dir, record, False, time.perf_counter() - t0)


def _doc_starts(ds: IndexedTokens, lo: int, hi: int) -> np.ndarray:
    """Token offsets of documents lo..hi (hi: where document hi-1 ends), from one read of the index
    (the document index is non-decreasing: IndexedTokens.verify)."""
    seqs = np.asarray(ds.doc_index[lo : hi + 1]).astype(np.int64)
    s_count = ds.header.n_sequences
    first, last = int(seqs[0]), min(int(seqs[-1]), s_count - 1)
    pointers = np.asarray(ds.pointers[first : last + 1]).astype(np.int64) if last >= first else np.zeros(0, np.int64)
    inside = seqs < s_count
    starts = np.full(len(seqs), ds.n_tokens, dtype=np.int64)
    starts[inside] = pointers[seqs[inside] - first] // ds.dtype.itemsize
    return starts


def _write(
    tmp: Path, dirs: list[Path], recs: list[DataRecord], sources: list[SourceInfo], key: str, *, progress: bool
) -> DataRecord:
    from titan_pipe.training.prepare_progress import PrepareProgress

    from titan_pipe.tokens.loss_mask import MaskWriter, open_mask

    first = recs[0]
    dtype = np.dtype(first.dtype)
    writer = IndexWriter(tmp / PREFIX, dtype)
    masks = MaskWriter(tmp / PREFIX) if first.loss_mask else None  # chat data: the answers' mask follows
    with PrepareProgress(sum(r.n_tokens for r in recs), enabled=progress) as bar:
        try:
            for d, rec in zip(dirs, recs):
                ds = IndexedTokens(d / rec.prefix)
                ds.verify()
                mask = open_mask(ds.prefix, ds.n_tokens) if masks is not None else None
                for lo in range(0, ds.n_documents, DOCS_PER_BLOCK):
                    hi = min(ds.n_documents, lo + DOCS_PER_BLOCK)
                    starts = _doc_starts(ds, lo, hi)
                    writer.add_chunk(
                        np.asarray(ds.tokens[int(starts[0]) : int(starts[-1])]).astype(dtype, copy=False),
                        np.diff(starts),
                    )
                    if mask is not None:
                        masks.add(np.asarray(mask[int(starts[0]) : int(starts[-1])]))
                    bar.advance(0, int(starts[-1] - starts[0]))
            writer.finish()
        except BaseException:
            writer.abort()
            raise
        finally:
            if masks is not None:
                masks.close()
    ds = IndexedTokens(tmp / PREFIX)
    where = f"the merge of {dirs[0]} ... {dirs[-1]}"
    d = val_start(ds.doc_start, ds.n_documents, ds.n_tokens, first.split.val_fraction, where=where)
    cut = ds.doc_start(d)
    record = DataRecord(
        key=key,
        tokenizer=first.tokenizer,
        sources=sources,
        text_key=first.text_key,
        dtype=first.dtype,
        n_tokens=ds.n_tokens,
        n_documents=ds.n_documents,
        max_token_id=max(r.max_token_id for r in recs),
        split=Split(first.split.val_fraction, d, ds.n_documents - d, cut, ds.n_tokens - cut),
        skipped_empty=sum(r.skipped_empty for r in recs),
        **(
            {}
            if not first.loss_mask
            else dict(
                records=first.records,
                loss_mask=first.loss_mask,
                chat_template=first.chat_template,
                chat_key=first.chat_key,
                bad_records=sum(r.bad_records for r in recs),
                bad_examples=[e for r in recs for e in r.bad_examples][:BAD_EXAMPLES],
            )
        ),
    )
    record.save(tmp)
    return record
