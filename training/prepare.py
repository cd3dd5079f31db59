"""``titan-pipe data prepare``: raw text -> a prepared data dir, tokenized once in worker processes.

The dir holds ``tokens.bin`` + ``tokens.idx`` (a Megatron-LM indexed dataset, one sequence per
document, each ending with eos) and ``data.json`` (titan_pipe.tokens.record). Plan first (files,
checks, the key of the inputs), then write into a temp dir beside the output and swap it in when
complete: an interrupted prepare leaves nothing under the final name. Same key as the dir
already there: nothing is done.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from titan_pipe.rules import limits
from titan_pipe.io.atomic import swap_dir, temp_dir
from titan_pipe.errors import UserError
from titan_pipe.io.hashing import sha256_file
from titan_pipe.tokens.dataset import val_start
from titan_pipe.tokens.indexed import IndexedTokens, IndexWriter, token_dtype
from titan_pipe.tokens.identity import TokenizerRecord
from titan_pipe.tokens.record import PREFIX, DataRecord, SourceInfo, Split, is_prepared
from titan_pipe.tokens.sources import corpus_files, iter_blocks
from titan_pipe.tokens.tokenizer import build_tokenizer, tokenizer_info
from titan_pipe.training.tokenize_pool import ChatSpec, chunk_blocks, encode_stream

SMALL_CORPUS = 8 << 20  # bytes of sources below which worker processes cost more than they save
MAX_WORKERS = 8
MAX_BAD_FRACTION = limits.MAX_BAD_FRACTION  # chat / instruction records that may be left out before prepare fails
BAD_EXAMPLES = 10  # of them named in data.json


@dataclass(frozen=True)
class Shard:
    """Part ``index`` (1-based) of ``count`` of a corpus (``--shard I/N``)."""

    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    @classmethod
    def parse(cls, text: str) -> "Shard":
        import re

        m = re.fullmatch(r"\s*(\d{1,6})\s*/\s*(\d{1,6})\s*", str(text))
        if m is None or not 1 <= int(m.group(1)) <= int(m.group(2)):
            raise UserError(f"--shard {text!r}: give I/N with 1 <= I <= N, e.g. 2/8 for the second of 8 parts")
        return cls(int(m.group(1)), int(m.group(2)))


# one source file's part of a prepare: the whole file (None) or the lines starting in a byte range
Piece = tuple[Path, "tuple[int, int] | None"]


def shard_pieces(files: list[Path], sizes: list[int], shard: Shard | None) -> list[Piece]:
    """What part ``shard`` of the sources reads, as pure data: the corpus's bytes (files in order) cut
    into ``count`` equal ranges; a plain .jsonl is cut at line starts (a line goes with the range its
    first byte lies in), any other file goes whole with the range its first byte lies in (an empty file
    at the very end with the last part). The parts read every document exactly once, in order."""
    from titan_pipe.tokens.sources import splittable

    if shard is None:
        return [(f, None) for f in files]
    total = sum(sizes)
    lo, hi = (shard.index - 1) * total // shard.count, shard.index * total // shard.count
    last = shard.index == shard.count
    out: list[Piece] = []
    at = 0
    for f, size in zip(files, sizes):
        if splittable(f):
            a, b = max(lo - at, 0), min(hi - at, size)
            if a < b:
                out.append((f, (a, b)))
        elif lo <= at < hi or (last and at == total):
            out.append((f, None))
        at += size
    return out


def prepare_key(
    info: TokenizerRecord,
    text_key: str,
    val_fraction: float,
    sources: list[SourceInfo],
    shard: Shard | None = None,
    chat: str | None = None,
) -> str:
    """The sha256 of everything a prepared dir depends on: the same inputs, the same key (a merge of
    all N parts gets the key of the unsharded prepare)."""
    key_doc = {
        "schema": 1,
        "tokenizer": info.fingerprint,
        "text_key": text_key,
        "val_fraction": val_fraction,
        "sources": [[s.path, s.size, s.sha256] for s in sources],
    }
    if shard is not None:
        key_doc["shard"] = str(shard)
    if chat is not None:  # ChatSpec.key of chat / instruction data; plain text keeps the key it always had
        key_doc["chat"] = chat
    return hashlib.sha256(json.dumps(key_doc, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class PreparePlan:
    """Everything the output depends on, resolved and checked; ``key`` is its sha256."""

    files: list[Path]
    sources: list[SourceInfo]
    tokenizer: str  # "byte" or an absolute tokenizer.json path
    info: TokenizerRecord
    text_key: str
    val_fraction: float
    out_dir: Path
    key: str
    pieces: list[Piece] = ()  # what this prepare reads (a shard: its part; else every file whole)
    shard: Shard | None = None
    chat: ChatSpec | None = None  # chat / instruction records (None: plain text)
    max_bad: float = MAX_BAD_FRACTION


@dataclass(frozen=True)
class PrepareResult:
    out_dir: Path
    record: DataRecord
    reused: bool  # the dir was already prepared from the same inputs: nothing was written
    seconds: float


def default_workers() -> int:
    return max(
        1, min(MAX_WORKERS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    )


def check_out_dir(out_dir: Path, roots: list[Path]) -> None:
    out = out_dir.resolve()
    for root in roots:
        r = root.resolve()
        if out == r or r in out.parents:
            raise UserError(
                f"-o {out_dir}: inside the source {root}; write the prepared data outside the "
                "sources (they are only read)"
            )
        if out in r.parents:
            raise UserError(
                f"-o {out_dir}: contains the source {root}; it would be replaced, pick another output directory"
            )
    if out_dir.exists() and not (out_dir.is_dir() and (is_prepared(out_dir) or not any(out_dir.iterdir()))):
        raise UserError(
            f"-o {out_dir}: exists and is not a prepared data dir (no data.json); give a new or empty directory"
        )


def _source_infos(files: list[Path], out_dir: Path, read: set[Path] | None = None) -> list[SourceInfo]:
    """size, mtime and sha256 of each source; a sha256 in the existing record is reused when the
    file's size and mtime still match it (a re-run then reads no source twice). ``read``: a shard's
    files; the others are listed with no sha256 (that host never reads them)."""
    known = {}
    if is_prepared(out_dir):
        try:
            known = {s.path: s for s in DataRecord.load(out_dir).sources}
        except UserError:
            known = {}
    infos = []
    for f in files:
        st, path = f.stat(), str(f.resolve())
        old = known.get(path)
        if read is not None and f not in read:
            digest = ""
        elif old and old.sha256 and (old.size, old.mtime_ns) == (st.st_size, st.st_mtime_ns):
            digest = old.sha256
        else:
            digest = sha256_file(f)
        infos.append(SourceInfo(path, st.st_size, st.st_mtime_ns, digest))
    return infos


def chat_spec(records: str, *, tok, chat_template: str, max_tokens: int | None) -> ChatSpec | None:
    """How chat / instruction records are rendered (None for plain text); checked before any work."""
    from titan_pipe.rules.choices import RECORD_FORMATS
    from titan_pipe.tokens.chat import load_chat_template
    from titan_pipe.tokens.tokenizer import HFTokenizer

    if records not in RECORD_FORMATS:
        raise UserError(f"--format {records!r}: not one of {', '.join(RECORD_FORMATS)}")
    if records == "text":
        return None
    if not isinstance(tok, HFTokenizer):
        raise UserError(
            f"--format {records}: needs the model's tokenizer (--tokenizer MODEL_DIR or its "
            "tokenizer.json); the byte tokenizer has no chat markers"
        )
    if max_tokens is not None and max_tokens < 2:
        raise UserError(f"--max-tokens {max_tokens}: give the training window (train.seq_len) or leave it out")
    template = load_chat_template(chat_template, tokenizer_dir=Path(tok.path).parent)
    return ChatSpec(records, template, max_tokens)


def plan_prepare(
    *,
    sources: list[Path],
    out_dir: Path,
    tokenizer: str,
    val_fraction: float = 0.05,
    text_key: str = "text",
    shard: Shard | None = None,
    records: str = "text",
    chat_template: str = "model",
    max_tokens: int | None = None,
    max_bad: float = MAX_BAD_FRACTION,
) -> PreparePlan:
    """Resolve and check the inputs of a prepare; no output is touched."""
    if not sources:
        raise UserError("data prepare: no source given; name .txt/.jsonl/.jsonl.gz/.parquet files or directories")
    if not 0 <= val_fraction < 1:
        raise UserError(f"--val-fraction {val_fraction}: must be in [0, 1)")
    out_dir = Path(out_dir)
    roots = [Path(s) for s in sources]
    files = [f for root in roots for f in corpus_files(root)]
    check_out_dir(out_dir, roots)
    tok = build_tokenizer(tokenizer)
    info = tokenizer_info(tok)
    chat = chat_spec(records, tok=tok, chat_template=chat_template, max_tokens=max_tokens)
    if not 0 <= max_bad < 1:
        raise UserError(f"--max-bad-fraction {max_bad}: must be in [0, 1)")
    if chat is not None:
        from titan_pipe.tokens.sources import kind_of

        other = [f for f in files if kind_of(f) not in (".jsonl", ".jsonl.gz")]
        if other:
            raise UserError(
                f"{other[0]}: --format {records} reads .jsonl / .jsonl.gz records (one JSON object a "
                "line); convert it or leave it out"
            )
    spec = str(Path(tok.path).resolve()) if info.kind != "byte" else "byte"
    pieces = shard_pieces(files, [f.stat().st_size for f in files], shard)
    infos = _source_infos(files, out_dir, read={f for f, _ in pieces} if shard is not None else None)
    key = prepare_key(info, text_key, val_fraction, infos, shard, chat.key if chat is not None else None)
    return PreparePlan(files, infos, spec, info, text_key, val_fraction, out_dir, key, pieces, shard, chat, max_bad)


def is_current(plan: PreparePlan) -> DataRecord | None:
    """The existing record when the out dir was prepared from exactly these inputs and is intact."""
    if not is_prepared(plan.out_dir):
        return None
    try:
        rec = DataRecord.load(plan.out_dir)
        ds = IndexedTokens(plan.out_dir / rec.prefix)
    except UserError:
        return None
    if rec.loss_mask:  # a mask that is missing or of another length is not current: prepared again
        from titan_pipe.tokens.loss_mask import mask_path

        mask = mask_path(plan.out_dir / rec.prefix)
        if not mask.is_file() or mask.stat().st_size != rec.n_tokens:
            return None
    return rec if rec.key == plan.key and (ds.n_tokens, ds.n_documents) == (rec.n_tokens, rec.n_documents) else None


def prepare(
    *,
    sources: list[Path],
    out_dir: Path,
    tokenizer: str,
    workers: int | None = None,
    val_fraction: float = 0.05,
    text_key: str = "text",
    progress: bool = True,
    shard: Shard | None = None,
    records: str = "text",
    chat_template: str = "model",
    max_tokens: int | None = None,
    max_bad: float = MAX_BAD_FRACTION,
) -> PrepareResult:
    """Tokenize ``sources`` into ``out_dir`` (see the module doc); a no-op when already current.
    ``shard``: only part I of N of the sources (``data merge`` joins the N parts). ``records``:
    text, or chat / instruction records rendered with ``chat_template`` and masked to their answers
    (titan_pipe.tokens.chat), conversations over ``max_tokens`` and other bad records left out up to
    ``max_bad`` of them."""
    t0 = time.perf_counter()
    plan = plan_prepare(
        sources=sources,
        out_dir=out_dir,
        tokenizer=tokenizer,
        val_fraction=val_fraction,
        text_key=text_key,
        shard=shard,
        records=records,
        chat_template=chat_template,
        max_tokens=max_tokens,
        max_bad=max_bad,
    )
    existing = is_current(plan)
    if existing is not None:
        return PrepareResult(plan.out_dir, existing, True, time.perf_counter() - t0)
    if workers is None:
        workers = 1 if sum(s.size for s in plan.sources) < SMALL_CORPUS else default_workers()
    tmp = temp_dir(plan.out_dir)
    try:
        record = _write(plan, tmp, workers=workers, progress=progress)
        swap_dir(tmp, plan.out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PrepareResult(plan.out_dir, record, False, time.perf_counter() - t0)


def _write(plan: PreparePlan, tmp: Path, *, workers: int, progress: bool) -> DataRecord:
    """tokens.bin/.idx, then data.json (last: a dir with data.json is complete)."""
    from titan_pipe.training.prepare_progress import PrepareProgress

    from titan_pipe.tokens.loss_mask import MaskWriter

    dtype = token_dtype(plan.info.vocab_size)
    writer = IndexWriter(tmp / PREFIX, dtype)
    masks = MaskWriter(tmp / PREFIX) if plan.chat is not None else None
    bad: list[str] = []
    n_bad = 0
    pieces = plan.pieces or [(f, None) for f in plan.files]
    blocks = (b for f, rng in pieces for b in iter_blocks(f, text_key=plan.text_key, byte_range=rng))
    n_in, largest = 0, -1
    sizes = {Path(s.path): s.size for s in plan.sources}
    work = sum(rng[1] - rng[0] if rng else sizes.get(f.resolve(), f.stat().st_size) for f, rng in pieces)
    with PrepareProgress(work, enabled=progress) as bar:
        try:
            for enc in encode_stream(
                chunk_blocks(blocks),
                spec=plan.tokenizer,
                dtype=dtype,
                text_key=plan.text_key,
                workers=workers,
                chat=plan.chat,
            ):
                writer.add_chunk(enc.ids, enc.lengths)
                if masks is not None:
                    masks.add(enc.mask)
                    n_bad += len(enc.bad)
                    bad.extend(enc.bad[: BAD_EXAMPLES - len(bad)])
                largest = max(largest, int(enc.ids.max()) if len(enc.ids) else -1)
                n_in += enc.docs_in
                bar.advance(enc.chars, len(enc.ids))
            writer.finish()
        except BaseException:
            writer.abort()
            raise
        finally:
            if masks is not None:
                masks.close()
        if n_bad > plan.max_bad * n_in:
            raise UserError(
                f"{plan.files[0]}{' ...' if len(plan.files) > 1 else ''}: {n_bad} of {n_in} records cannot be "
                f"trained on, over the bound of {plan.max_bad:g} (--max-bad-fraction); the first: "
                f"{bad[0]}; fix them or raise the bound"
            )
        record = _record(
            plan,
            IndexedTokens(tmp / PREFIX),
            largest,
            dtype.name,
            skipped=0 if masks is not None else n_in - writer.n_documents,
            bad=(n_bad, bad),
        )
        return record


def chat_fields(plan: PreparePlan, bad: tuple[int, list[str]]) -> dict:
    """The record fields of chat / instruction data ({} for plain text)."""
    if plan.chat is None:
        return {}
    from titan_pipe.tokens.loss_mask import SUFFIX

    t = plan.chat.template
    return dict(
        records=plan.chat.fmt,
        loss_mask=f"{PREFIX}{SUFFIX}",
        chat_template=f"{t.origin} sha256:{t.sha256}",
        chat_key=plan.chat.key,
        bad_records=bad[0],
        bad_examples=list(bad[1]),
    )


def _record(
    plan: PreparePlan,
    ds: IndexedTokens,
    largest: int,
    dtype: str,
    *,
    skipped: int,
    bad: tuple[int, list[str]] = (0, []),
) -> DataRecord:
    where = ", ".join(str(f) for f in plan.files[:3]) + (" ..." if len(plan.files) > 3 else "")
    if plan.shard is not None:
        where = f"part {plan.shard} of {where}"
    if ds.n_documents == 0 and plan.shard is not None:  # a part may hold no document (a tiny corpus, many parts)
        split = Split(plan.val_fraction, 0, 0, 0, 0)
        record = DataRecord(
            key=plan.key,
            tokenizer=plan.info,
            sources=plan.sources,
            text_key=plan.text_key,
            dtype=dtype,
            n_tokens=0,
            n_documents=0,
            max_token_id=largest,
            split=split,
            skipped_empty=skipped,
            shard=str(plan.shard),
            **chat_fields(plan, bad),
        )
        record.save(ds.prefix.parent)
        return record
    if ds.n_documents == 0:
        raise UserError(
            f"{where}: holds no text (every document is empty); add text or fix the text key "
            f"(--text-key / data.text_key, now {plan.text_key!r})"
        )
    if plan.shard is not None:  # a part's own split is of no use: the merge splits the whole
        split = Split(plan.val_fraction, ds.n_documents, 0, ds.n_tokens, 0)
    else:
        d = val_start(ds.doc_start, ds.n_documents, ds.n_tokens, plan.val_fraction, where=where)
        cut = ds.doc_start(d)
        split = Split(plan.val_fraction, d, ds.n_documents - d, cut, ds.n_tokens - cut)
    chat = chat_fields(plan, bad)
    record = DataRecord(
        key=plan.key,
        tokenizer=plan.info,
        sources=plan.sources,
        text_key=plan.text_key,
        dtype=dtype,
        n_tokens=ds.n_tokens,
        n_documents=ds.n_documents,
        max_token_id=largest,
        split=split,
        skipped_empty=skipped,
        shard=str(plan.shard) if plan.shard else None,
        **chat,
    )
    record.save(ds.prefix.parent)
    return record


# prepare's options as the flow.yaml keys that set them, for errors met preparing a flow's data
FLOW_KEYS = {
    "--chat-template": "data.chat_template",
    "--format": "data.format",
    "--tokenizer": "data.tokenizer",
    "--val-fraction": "data.val_fraction",
    "--text-key": "data.text_key",
    "--max-tokens": "data.max_tokens",
    "--max-bad-fraction": "data.max_bad_fraction",
}


def in_flow_terms(message: str) -> str:
    """``message`` with each of prepare's flags named as the flow.yaml key the user wrote: "pass
    --chat-template chatml" becomes "set data.chat_template: chatml"."""
    message = message.replace(" (or --text-key)", "").replace("(--text-key / data.text_key", "(data.text_key")
    for flag, key in FLOW_KEYS.items():
        message = re.sub(rf"\b(?:pass|use) {flag} ", f"set {key}: ", message)
        message = re.sub(rf"(?<![\w-]){flag} (?=\S)", f"{key}: ", message)
        message = re.sub(rf"(?<![\w-]){flag}\b", key, message)
    return message


def prepare_spec(spec, out_dir: Path, *, progress: bool = True) -> PrepareResult:
    """The raw text of a flow's resolved data section (titan_pipe.tokens.spec.DataSpec) prepared into
    ``out_dir`` (the run's data dir); a no-op when it is current. Errors name flow.yaml's keys."""
    try:
        return prepare(
            sources=[spec.text],
            out_dir=out_dir,
            tokenizer=spec.tokenizer,
            val_fraction=spec.val_fraction,
            text_key=spec.text_key,
            progress=progress,
            records=spec.records,
            chat_template=spec.chat_template,
            max_tokens=spec.max_tokens,
            max_bad=spec.max_bad_fraction,
        )
    except UserError as e:
        translated = in_flow_terms(str(e))
        if translated == str(e):
            raise
        raise type(e)(translated) from None
