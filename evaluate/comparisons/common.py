"""What several comparisons share: the logits error sample for the histogram."""

from __future__ import annotations

import numpy as np

MAX_HIST = 2_000_000  # logits error values kept for the histogram


def abs_errors(ref, cand) -> np.ndarray:
    """|candidate - reference| over the logits of every part (Values), thinned to ~MAX_HIST values."""
    total = sum(ref.logits(p).numel() for p in range(ref.parts))
    stride = max(1, total // MAX_HIST)
    out = [(cand.logits(p).double() - ref.logits(p).double()).abs().numpy().ravel()[::stride] for p in range(ref.parts)]
    return np.concatenate(out)
