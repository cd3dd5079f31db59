"""Megatron-LM checkpoints (``--source-format megatron``): which of the two formats a path holds, and its reader.

  legacy      iter_*/mp_rank_TT[_PPP]/model_optim_rng.pt, one pickle per (tp, pp) rank (legacy.py)
  torch_dist  an iteration dir whose metadata.json names ``"sharded_backend": "torch_dist"``: a torch
              DCP checkpoint of megatron.core.dist_checkpointing plus common.pt (torch_dist.py)

What both share (the allow-listed unpickler, the tracker, the model from the saved args, the
de-fusion of QKV and fc1, the plan builder) is common.py; imports go one way: this module ->
legacy / torch_dist -> common.
"""

from __future__ import annotations

from pathlib import Path

from titan_pipe.weights.readers.megatron import legacy, torch_dist
from titan_pipe.weights.readers.megatron.common import FORMAT, iter_dir
from titan_pipe.weights.source_plan import SourcePlan
from titan_pipe.errors import UserError

__all__ = ["FORMAT", "looks_like", "open_source"]


def looks_like(path: Path) -> bool:
    if torch_dist.looks_like(path):
        return True
    try:
        return iter_dir(path) is not None
    except UserError:  # a Megatron tree with a bad tracker or iteration dir: open_source says which
        return True


def open_source(
    path: Path, *, vocab_size: int | None = None, model_config: Path | None = None, read_headers: bool = True
) -> tuple[SourcePlan, object]:
    """(SourcePlan, Store) of a Megatron checkpoint in either format."""
    reader = torch_dist if torch_dist.looks_like(path) else legacy
    return reader.open_source(path, vocab_size=vocab_size, model_config=model_config, read_headers=read_headers)
