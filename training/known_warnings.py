"""Two torch warnings every parallel run used to open with, silenced by their exact text (each is
harmless here, and docs/training.md "Warnings" says why); any other warning still shows.

- DTensor's "While redistributing from (_NormPartial(2.0), _NormPartial(2.0)) to (Replicate(),
  Replicate()), 2 sequential all_reduce operations will be performed": the gradient norm over a
  dp x tp mesh is one scalar; two all-reduces of 8 bytes each cost microseconds per step, and every
  rank reduces in the same order (the same value everywhere: the clip is rank-consistent).
- FSDP2's "FSDP2-wrapped module (...) returned a view tensor": the stage's output (a TP DTensor's
  local view) is only read by the loss or sent to the next stage, never modified in place, so the
  pre-backward hook the warning is about always runs.
"""

from __future__ import annotations

import logging
import warnings

NORM_PARTIAL = "2 sequential all_reduce operations will be performed"
FSDP_VIEW = r"FSDP2-wrapped module \(\w+\) returned a view tensor"


class _DropNormPartial(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (NORM_PARTIAL in msg and "_NormPartial" in msg)


def silence_known_warnings() -> None:
    warnings.filterwarnings("ignore", message=FSDP_VIEW, category=UserWarning)
    logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_DropNormPartial())
