"""A query scale of its own (Gemma 3's query_pre_attn_scalar): attention scores are q.k times
``attn_scalar``^-1/2 in place of head_dim^-1/2. Field ``model.attn_scalar`` (None: head_dim's)."""

from __future__ import annotations

from titan_pipe.model.features.feature import Feature
from titan_pipe.rules.limits import Bound


def _scale(args) -> float:
    return args.attn_scalar**-0.5


FEATURE = Feature(
    name="attn_scalar",
    label="query scale",
    switch=False,
    # compared by the scale it gives: None and head_dim's own value are the same model
    compared=(("attn_scalar", "attn_scale"),),
    bounds=(("attn_scalar", Bound(1.0, 1e6, "a query_pre_attn_scalar")),),
    attention_scale=_scale,
    describe=lambda m: f"scores x {m['attn_scalar']:g}^-1/2",
)
