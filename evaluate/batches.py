"""Held-out token batches and generation prompts for evaluation, read with the core's token data code.

Two sources of held-out text: a ``--data`` path, held out by the user: a text file used whole, a
prepared data dir (its validation documents) or a .bin/.idx prefix (used whole); or a
``ValidationSplit`` of the training data: the documents training held out of it (the same
rule, titan_pipe.tokens.dataset.val_start), so evaluation never scores text the model trained
on. Raw text is read from the run's prepared copy when that is current, else tokenized here. The
default is the split of the shipped corpus; a flow passes its own ``data`` section. The
tokenizer is the model directory's ``tokenizer.json`` (or "byte" as its provenance.json records),
else the one the checkpoint names (manifest ``extra.tokenizer``). A model with no tokenizer and no
``--data`` is evaluated on seeded random token ids inside its vocabulary (labelled so).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from titan_pipe.records.checkpoint_format import is_complete
from titan_pipe.config import FlowConfig
from titan_pipe.errors import UserError
from titan_pipe.records.provenance import Provenance
from titan_pipe.tokens.identity import TokenizerRecord


@dataclass(frozen=True)
class EvalData:
    batches: list[torch.Tensor]  # each (B, T) int64
    prompts: torch.Tensor  # (N, P) int64, the first P tokens of N held-out rows
    source: str  # what the text was, for the report
    tokenizer: str
    # chat / instruction data: per batch (B, T) bool, token t is an answer token (perplexity is then
    # over the answers only, as fine-tuning's loss); None: every token counts
    answers: list[torch.Tensor] | None = None


@dataclass(frozen=True)
class ValidationSplit:
    """Held-out text = the validation split training cut from its data (flow.yaml's data section).

    corpus: raw text, a prepared dir or a .bin/.idx prefix (None: the shipped corpus); blend: the
    datasets of a data.blend instead; prepared: where the run prepared raw text (read when current).
    """

    corpus: Path | None = None
    val_fraction: float = 0.05
    text_key: str = "text"
    blend: tuple[Path, ...] = ()
    prepared: Path | None = field(default=None, compare=False)  # a cache of corpus, not another split
    records: str = "text"  # chat / instruction data is read from its prepared copy only (rendered, masked)

    @classmethod
    def of_flow(cls, data, flow_dir: Path, run_dir: Path | None = None) -> "ValidationSplit":
        """flow.yaml's ``data`` section (DataConfig) as held-out text; paths are relative to ``flow_dir``."""
        from titan_pipe.run_dir import RunDir
        from titan_pipe.tokens.spec import data_spec

        spec = data_spec(data, base=Path(flow_dir))
        corpus = spec.text if data.path is not None and spec.text is not None else None
        if spec.text is None and len(spec.paths) == 1 and not data.blend:
            corpus = spec.paths[0]
        blend = spec.paths if data.blend else ()
        prepared = RunDir(Path(run_dir)).data if run_dir is not None and spec.text is not None else None
        return cls(
            corpus=corpus,
            val_fraction=data.val_fraction,
            text_key=data.text_key,
            blend=blend,
            prepared=prepared,
            records=getattr(data, "format", "text"),
        )


def held_out_text(
    *, data: Path | None, flow: FlowConfig | None, flow_dir: Path | None, run_dir: Path | None = None
) -> tuple[Path | None, ValidationSplit | None]:
    """What an evaluation reads as held-out text: (a path used as given, or the split of the data).

    ``data`` (--data) wins; else flow.yaml's evaluate.data (relative to ``flow_dir``); else the
    validation split of the flow's own training data, as training cut it (``run_dir``: the run
    whose prepared copy of raw text may be read). (None, None) without a flow: evaluate_model then
    takes the shipped corpus's split.
    """
    if data is not None:
        from titan_pipe.tokens.sources import check_records, kind_of

        if Path(data).is_file() and kind_of(Path(data)) is not None:
            check_records(Path(data))  # before any model is loaded: an enormous record is one line
        return Path(data), None
    if flow is None:
        return None, None
    if flow.evaluate.data is not None:
        path = Path(flow.evaluate.data)
        return (path if path.is_absolute() else Path(flow_dir) / path), None
    return None, ValidationSplit.of_flow(flow.data, Path(flow_dir), run_dir)


RANDOM_SEED = 0  # seed of the random token ids used when the model has no tokenizer


def pick_tokenizer(model_dir: Path | None, checkpoint: Path | None = None) -> str | None:
    """The tokenizer the model was trained with: a tokenizer.json path, "byte", or None (unknown).

    Model dir: "byte" when its provenance.json records that training used the byte tokenizer (the
    tokenizer.json convert writes beside such a model is its Hugging Face form, for AutoTokenizer),
    else its tokenizer.json. Checkpoint: manifest ``extra.tokenizer``.
    """
    if model_dir is not None:
        prov = Provenance.find(model_dir)
        record = prov.tokenizer if prov is not None else None
        if record is not None and record.kind == "byte":
            _check_byte_form(Path(model_dir))
            return "byte"
        if (Path(model_dir) / "tokenizer.json").is_file():  # a record's or a released model's own
            return str(Path(model_dir) / "tokenizer.json")
    if checkpoint is not None and is_complete(Path(checkpoint)):
        from titan_pipe.records.checkpoint_format import Manifest

        return TokenizerRecord.of_checkpoint(Manifest.load(checkpoint).extra).path_in(Path(checkpoint))
    return None


def _check_byte_form(model_dir: Path) -> None:
    """provenance.json says the model trained on bytes: the tokenizer.json beside it must be the byte
    tokenizer's form convert writes (258 ids), not another tokenizer a record edit would hide."""
    from titan_pipe.tokens.tokenizer import ByteTokenizer, HFTokenizer

    path = model_dir / "tokenizer.json"
    if path.is_file():
        n = HFTokenizer(path).vocab_size
        if n != ByteTokenizer.vocab_size:
            raise UserError(
                f"{model_dir / 'provenance.json'}: tokenizer is 'byte', but {path} has {n:,} ids, not the "
                f"byte tokenizer's {ByteTokenizer.vocab_size}; the two files disagree: convert the "
                "checkpoint again"
            )


def random_eval_data(
    *, vocab_size: int, n_batches: int, batch_size: int, seq_len: int, n_prompts: int, prompt_len: int, why: str
) -> EvalData:
    """Seeded uniform token ids in [0, vocab_size): numerics need no text, only valid ids."""
    g = torch.Generator().manual_seed(RANDOM_SEED)
    rows = torch.randint(0, vocab_size, (n_batches * batch_size, seq_len), generator=g, dtype=torch.int64)
    prompts = rows[:n_prompts, : min(prompt_len, seq_len)].clone()
    source = f"random token ids (seed {RANDOM_SEED}, uniform in [0, {vocab_size})): {why}"
    return EvalData(list(rows.split(batch_size)), prompts, source, "none (random token ids)")


def _answers(src, lo: int, n: int) -> np.ndarray | None:
    """The loss mask of tokens [lo, lo + n) of a chat / instruction dataset (None for plain text)."""
    if src.record is None or not src.record.loss_mask:
        return None
    from titan_pipe.tokens.loss_mask import open_mask

    return np.asarray(open_mask(src.indexed.prefix, src.indexed.n_tokens)[lo : lo + n]).astype(bool)


def _given_stream(data: Path, tok, vocab_size: int) -> tuple[np.ndarray, str, np.ndarray | None]:
    """--data: a text file (whole), a prepared dir (its validation documents) or a prefix (whole)."""
    from titan_pipe.tokens.corpus import load_corpus
    from titan_pipe.tokens.dataset import check_tokenizer, open_source
    from titan_pipe.tokens.spec import is_token_data
    from titan_pipe.tokens.tokenizer import tokenizer_info

    if not data.exists() and not is_token_data(data):
        raise UserError(
            f"--data {data}: file not found; give held-out text (.txt/.jsonl/...), a prepared data "
            "dir or a .bin/.idx prefix, or leave it out to use the validation split of the shipped corpus"
        )
    if not is_token_data(data):
        return load_corpus(path=data, tokenizer=tok).tokens, str(data), None
    src = open_source(data, val_fraction=0.0, fraction_given=False)
    src.indexed.verify()  # the rows scored are the documents the index describes
    check_tokenizer(src, tokenizer_info(tok), vocab_size=vocab_size)
    if src.record is None:
        return src.train.read(0, len(src.train)), f"{src.path} (whole)", None
    if not len(src.val):
        raise UserError(
            f"--data {data}: prepared with --val-fraction 0, so it holds no held-out documents; "
            "prepare held-out text with a validation fraction, or pass a text file"
        )
    return (
        src.val.read(0, len(src.val)),
        f"{src.path}, validation documents",
        _answers(src, src.val.start, len(src.val)),
    )


def _split_stream(split: ValidationSplit, tok, vocab_size: int, need: int) -> tuple[np.ndarray, str, np.ndarray | None]:
    """The first ``need`` tokens of the validation documents of ``split``."""
    from titan_pipe.tokens.corpus import load_corpus
    from titan_pipe.tokens.dataset import open_data
    from titan_pipe.tokens.record import DataRecord, is_prepared, prepared_from
    from titan_pipe.tokens.sources import corpus_files, default_corpus
    from titan_pipe.tokens.spec import is_token_data
    from titan_pipe.tokens.tokenizer import tokenizer_info

    info = tokenizer_info(tok)
    paths = list(split.blend) or ([split.corpus] if split.corpus is not None and is_token_data(split.corpus) else [])
    where = ", ".join(map(str, paths)) if paths else (split.corpus or "shipped corpus")
    source = f"{where}, validation split (the held-out documents, last {split.val_fraction:.0%} or more)"
    if not paths and split.prepared is not None and is_prepared(split.prepared):
        files = corpus_files(split.corpus or default_corpus())
        rec = DataRecord.load(split.prepared)
        if rec.records == split.records and prepared_from(
            rec, files, text_key=split.text_key, val_fraction=split.val_fraction, tokenizer=info
        ):
            paths = [split.prepared]
    if paths:
        data = open_data(
            paths, val_fraction=split.val_fraction, fraction_given=False, tokenizer=info, vocab_size=vocab_size
        )
        head = data.val_head(need)
        only = data.sources[0] if len(data.sources) == 1 else None
        return head, source, _answers(only, only.val.start, len(head)) if only is not None else None
    if split.corpus is not None and not Path(split.corpus).exists():
        raise UserError(
            f"data.path {split.corpus}: does not exist; its validation split is the held-out "
            "text. Fix data.path or give evaluate.data / --data"
        )
    if split.records != "text":
        raise UserError(
            f"data.path {split.corpus}: {split.records} records are read from their prepared copy "
            f"({split.prepared}), which is missing or older than the records; run the flow's data "
            "stage (or train) first, or give --data a dir made by `data prepare --format`"
        )
    corpus = load_corpus(path=split.corpus, tokenizer=tok, text_key=split.text_key)
    val = corpus.split(split.val_fraction)[1]
    return val.read(0, min(need, len(val))), source, None


def load_eval_data(
    *,
    data: Path | None,
    model_dir: Path | None,
    vocab_size: int,
    n_batches: int,
    batch_size: int,
    seq_len: int,
    n_prompts: int,
    prompt_len: int,
    split: ValidationSplit | None = None,
    checkpoint: Path | None = None,
) -> EvalData:
    """``n_batches`` (batch_size, seq_len) batches cut from held-out text, and the prompts.

    ``data``: a path used as given (see _given_stream); else ``split`` (default: the shipped
    corpus's validation split).
    """
    from titan_pipe.tokens.tokenizer import build_tokenizer

    if data is not None and split is not None:
        raise UserError(
            f"--data {data} and a validation split of {split.corpus or 'the shipped corpus'} were both given; pass one"
        )
    spec = pick_tokenizer(model_dir, checkpoint)
    if spec is None and data is None:
        where = " and ".join(str(p) for p in (model_dir, checkpoint) if p is not None)
        return random_eval_data(
            vocab_size=vocab_size,
            n_batches=n_batches,
            batch_size=batch_size,
            seq_len=seq_len,
            n_prompts=n_prompts,
            prompt_len=prompt_len,
            why=f"{where} carries no tokenizer (no tokenizer.json, no provenance naming one)",
        )
    spec = spec or "byte"  # --data given for a model without a tokenizer: bytes, checked against the vocab
    tok = build_tokenizer(spec)
    need = n_batches * batch_size * seq_len
    if data is not None:
        stream, source, answers = _given_stream(Path(data), tok, vocab_size)
    else:
        stream, source, answers = _split_stream(split or ValidationSplit(), tok, vocab_size, need)
    if len(stream) < need:
        raise UserError(
            f"{source}: {len(stream)} held-out tokens, but {n_batches} batches x {batch_size} x "
            f"{seq_len} need {need}; give more text (--data) or lower evaluate.batches/"
            "batch_size/seq_len"
        )
    if int(stream[:need].max()) >= vocab_size:
        raise UserError(
            f"tokenizer {spec} produced id {int(stream[:need].max())}, but the model's vocab_size is "
            f"{vocab_size}; evaluate with the tokenizer the model was trained with"
        )
    rows = torch.from_numpy(np.ascontiguousarray(stream[:need], dtype=np.int64)).view(n_batches * batch_size, seq_len)
    batches = list(rows.split(batch_size))
    p = min(prompt_len, seq_len)
    prompts = rows[:n_prompts, :p].clone()
    marked = None
    if answers is not None:  # chat data: perplexity over the answer tokens
        scored = np.ascontiguousarray(answers[:need]).reshape(-1, seq_len)
        if not scored[:, 1:].any():  # perplexity would be 0/0: refused, not reported as a NaN that fails
            raise UserError(
                f"{source}: the {n_batches} x {batch_size} held-out rows of {seq_len} tokens hold no "
                "answer token to score; raise evaluate.batches / seq_len or give more held-out data"
            )
        marked = list(torch.from_numpy(scored).split(batch_size))
        source += " (answer tokens scored)"
    return EvalData(batches, prompts, source, spec, marked)
