"""Held-out token batches and generation prompts for evaluation, from training's own data code.

Without ``--data`` the text is the validation split (the last ``val_fraction`` of the stream) of
the shipped corpus, so evaluation never scores text the model trained on; a ``--data`` file is
held out by the user and used whole. The tokenizer is the model directory's ``tokenizer.json``
when it has one, else the byte tokenizer training used.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from titan_pipe.errors import UserError


@dataclass(frozen=True)
class EvalData:
    batches: list[torch.Tensor]  # each (B, T) int64
    prompts: torch.Tensor  # (N, P) int64, the first P tokens of N held-out rows
    source: str  # what the text was, for the report
    tokenizer: str


def pick_tokenizer(model_dir: Path | None) -> str:
    if model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
        return str(Path(model_dir) / "tokenizer.json")
    return "byte"


def load_eval_data(*, data: Path | None, model_dir: Path | None, vocab_size: int, n_batches: int,
                   batch_size: int, seq_len: int, n_prompts: int, prompt_len: int,
                   val_fraction: float = 0.05) -> EvalData:
    """``n_batches`` (batch_size, seq_len) batches cut from held-out text, and the prompts."""
    from titan_pipe.training.data import build_tokenizer, load_tokens, split_train_val

    spec = pick_tokenizer(model_dir)
    tok = build_tokenizer(spec)
    if data is not None:
        data = Path(data)
        if not data.exists():
            raise UserError(f"--data {data}: file not found; give a .txt/.jsonl file of held-out text, or "
                            "leave it out to use the validation split of the shipped corpus")
        stream = load_tokens(path=data, tokenizer=tok)
        source = str(data)
    else:
        _, stream = split_train_val(load_tokens(path=None, tokenizer=tok), val_fraction)
        source = f"shipped corpus, validation split (last {val_fraction:.0%})"
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
