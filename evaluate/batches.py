"""Held-out token batches and generation prompts for evaluation, from training's own data code.

Two sources of held-out text: a ``--data`` file, held out by the user and used whole; or a
``ValidationSplit`` of a corpus: the last ``val_fraction`` of its token stream, which is exactly
what training left out of the same corpus, so evaluation never scores text the model trained on.
The default is the split of the shipped corpus; a flow passes its own ``data`` section. The
tokenizer is the model directory's ``tokenizer.json`` (or "byte" as its provenance.json records),
else the one the checkpoint names (manifest ``extra.tokenizer``). A model with no tokenizer and no
``--data`` file is evaluated on seeded random token ids inside its vocabulary (labelled so).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from titan_pipe.checkpoint_format import is_complete
from titan_pipe.config import FlowConfig
from titan_pipe.errors import UserError
from titan_pipe.provenance import Provenance


@dataclass(frozen=True)
class EvalData:
    batches: list[torch.Tensor]  # each (B, T) int64
    prompts: torch.Tensor  # (N, P) int64, the first P tokens of N held-out rows
    source: str  # what the text was, for the report
    tokenizer: str


@dataclass(frozen=True)
class ValidationSplit:
    """Held-out text = the validation split training cut from ``corpus`` (flow.yaml's data section)."""

    corpus: Path | None = None  # a .txt/.jsonl file or a directory of them; None: the shipped corpus
    val_fraction: float = 0.05
    text_key: str = "text"

    @classmethod
    def of_flow(cls, data, flow_dir: Path) -> "ValidationSplit":
        """flow.yaml's ``data`` section (DataConfig) as held-out text; data.path is relative to ``flow_dir``."""
        corpus = None
        if data.path is not None:
            corpus = Path(data.path).expanduser()
            corpus = corpus if corpus.is_absolute() else Path(flow_dir) / corpus
        return cls(corpus=corpus, val_fraction=data.val_fraction, text_key=data.text_key)


def held_out_text(*, data: Path | None, flow: FlowConfig | None, flow_dir: Path | None
                  ) -> tuple[Path | None, ValidationSplit | None]:
    """What an evaluation reads as held-out text: (a file used whole, or the split of a corpus).

    ``data`` (--data) wins; else flow.yaml's evaluate.data (relative to ``flow_dir``); else the
    validation split of the flow's own training data, as training cut it. (None, None) without a
    flow: evaluate_model then takes the shipped corpus's split.
    """
    if data is not None:
        return Path(data), None
    if flow is None:
        return None, None
    if flow.evaluate.data is not None:
        path = Path(flow.evaluate.data)
        return (path if path.is_absolute() else Path(flow_dir) / path), None
    return None, ValidationSplit.of_flow(flow.data, Path(flow_dir))


RANDOM_SEED = 0  # seed of the random token ids used when the model has no tokenizer


def pick_tokenizer(model_dir: Path | None, checkpoint: Path | None = None) -> str | None:
    """The tokenizer the model was trained with: a tokenizer.json path, "byte", or None (unknown).

    Model dir: its tokenizer.json, else its provenance.json's ``tokenizer`` ("byte" when convert
    recorded that training used the byte tokenizer). Checkpoint: manifest ``extra.tokenizer``.
    """
    if model_dir is not None:
        if (Path(model_dir) / "tokenizer.json").is_file():
            return str(Path(model_dir) / "tokenizer.json")
        prov = Provenance.find(model_dir)
        if prov is not None and prov.tokenizer is not None and prov.tokenizer.tokenizer == "byte":
            return "byte"
    if checkpoint is not None and is_complete(Path(checkpoint)):
        from titan_pipe.checkpoint_format import Manifest

        kind = Manifest.load(checkpoint).extra.get("tokenizer")
        if kind == "tokenizer.json":
            return str(Path(checkpoint) / "tokenizer.json")
        if kind == "byte":
            return "byte"
    return None


def random_eval_data(*, vocab_size: int, n_batches: int, batch_size: int, seq_len: int, n_prompts: int,
                     prompt_len: int, why: str) -> EvalData:
    """Seeded uniform token ids in [0, vocab_size): numerics need no text, only valid ids."""
    g = torch.Generator().manual_seed(RANDOM_SEED)
    rows = torch.randint(0, vocab_size, (n_batches * batch_size, seq_len), generator=g, dtype=torch.int64)
    prompts = rows[:n_prompts, :min(prompt_len, seq_len)].clone()
    source = f"random token ids (seed {RANDOM_SEED}, uniform in [0, {vocab_size})): {why}"
    return EvalData(list(rows.split(batch_size)), prompts, source, "none (random token ids)")


def load_eval_data(*, data: Path | None, model_dir: Path | None, vocab_size: int, n_batches: int,
                   batch_size: int, seq_len: int, n_prompts: int, prompt_len: int,
                   split: ValidationSplit | None = None, checkpoint: Path | None = None) -> EvalData:
    """``n_batches`` (batch_size, seq_len) batches cut from held-out text, and the prompts.

    ``data``: a file used whole; else ``split`` (default: the shipped corpus's validation split).
    """
    from titan_pipe.tokens.corpus import load_tokens, split_train_val
    from titan_pipe.tokens.tokenizer import build_tokenizer

    if data is not None and split is not None:
        raise UserError(f"--data {data} and a validation split of {split.corpus or 'the shipped corpus'} "
                        "were both given; pass one")
    spec = pick_tokenizer(model_dir, checkpoint)
    if spec is None and data is None:
        where = " and ".join(str(p) for p in (model_dir, checkpoint) if p is not None)
        return random_eval_data(vocab_size=vocab_size, n_batches=n_batches, batch_size=batch_size,
                                seq_len=seq_len, n_prompts=n_prompts, prompt_len=prompt_len,
                                why=f"{where} carries no tokenizer (no tokenizer.json, no provenance naming one)")
    spec = spec or "byte"  # --data given for a model without a tokenizer: bytes, checked against the vocab
    tok = build_tokenizer(spec)
    if data is not None:
        data = Path(data)
        if not data.exists():
            raise UserError(f"--data {data}: file not found; give a .txt/.jsonl file of held-out text, or "
                            "leave it out to use the validation split of the shipped corpus")
        stream = load_tokens(path=data, tokenizer=tok)
        source = str(data)
    else:
        split = split or ValidationSplit()
        if split.corpus is not None and not Path(split.corpus).exists():
            raise UserError(f"data.path {split.corpus}: does not exist; its validation split is the held-out "
                            "text. Fix data.path or give evaluate.data / --data")
        tokens = load_tokens(path=split.corpus, tokenizer=tok, text_key=split.text_key)
        _, stream = split_train_val(tokens, split.val_fraction)
        where = split.corpus if split.corpus is not None else "shipped corpus"
        source = f"{where}, validation split (last {split.val_fraction:.0%})"
    need = n_batches * batch_size * seq_len
    if len(stream) < need:
        raise UserError(f"{source}: {len(stream)} held-out tokens, but {n_batches} batches x {batch_size} x "
                        f"{seq_len} need {need}; give more text (--data) or lower evaluate.batches/"
                        "batch_size/seq_len")
    if int(stream.max()) >= vocab_size:
        raise UserError(f"tokenizer {spec} produced id {int(stream.max())}, but the model's vocab_size is "
                        f"{vocab_size}; evaluate with the tokenizer the model was trained with")
    rows = stream[:need].view(n_batches * batch_size, seq_len)
    batches = list(rows.split(batch_size))
    p = min(prompt_len, seq_len)
    prompts = rows[:n_prompts, :p].clone()
    return EvalData(batches, prompts, source, spec)
