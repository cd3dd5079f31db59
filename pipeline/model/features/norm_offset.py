"""Offset norms (Gemma 3): every RMSNorm weight is stored as an offset from 1, the norm multiplying
by (1 + w) in float32 before the cast back, whichever kernels the rest of the model runs. It changes
no shape: the norms' weights start at 0 instead of 1, and the model's norm rows (the plain RMSNorm,
q/k norms) are this one row in the conformance table. Switch ``model.norm_offset``."""

from __future__ import annotations

from titan_pipe.model.features.feature import Conformance, Feature, row_shape


def _inputs(case: str, rng, scale: float) -> dict:
    """(rows, width) as a model's norm sees them; the weights small values around 0 (offsets from 1)."""
    rows, width = row_shape(case)
    return {
        "x": (rng.standard_normal((rows, width)) * scale).astype("float32"),
        "weight": (0.1 * rng.standard_normal(width)).astype("float32"),
    }


FEATURE = Feature(
    name="norm_offset",
    label="norm weights offset from 1",
    offset_norms=True,
    conformance=(
        Conformance(
            "rms_norm_offset",
            "RMSNorm times (1 + weight) in float32 (Gemma; rms_norm_offset)",
            _inputs,
            lambda kernels, eps, x, weight: kernels.rms_norm_offset(x, weight, eps),
            lambda nodes, b, n, eps: nodes.rms_norm(b, n["x"], n["weight"], eps, "norm", offset=True),
        ),
    ),
)
