"""The arithmetic of a dp x tp x pp layout, spelled once: flow.yaml's parallel section, the
checkpoint's recorded layout, the planner's candidates and the trainer's mesh all count with it."""

from __future__ import annotations


def world_size(dp: int, tp: int, pp: int) -> int:
    """Ranks a layout runs on: one per (dp, tp, pp) coordinate."""
    return dp * tp * pp


def n_microbatches(pp: int, microbatches: int | None) -> int:
    """Microbatches per step: as given, else one per pipeline rank (a pipeline needs >= pp to fill;
    without one, a single microbatch)."""
    return microbatches or (pp if pp > 1 else 1)
