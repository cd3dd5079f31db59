"""Architectural features, one file each (see feature.py for what a feature owns).

``FEATURES`` is the list the stages iterate; a model family (titan_pipe.model.families) names the
features its architecture always has. Migrated so far: q/k/v biases (qkv_bias.py), q/k norms
(qk_norm.py), scaled embeddings (embed_scale.py), sandwich norms (sandwich_norms.py) and offset
norms (norm_offset.py). The others (sliding windows, mixtures of experts, Gemma 3's GeGLU and layer
pattern, the tied head) are still tested as ModelArgs fields where they are used
(docs/architecture.md, "Features").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan_pipe.model.features import embed_scale, norm_offset, qk_norm, qkv_bias, sandwich_norms
from titan_pipe.model.features.feature import Conformance, Feature

if TYPE_CHECKING:
    from titan_pipe.model.args import ModelArgs

__all__ = ["Conformance", "FEATURES", "Feature", "active", "biased", "offset_norms", "problems", "switches"]

FEATURES: tuple[Feature, ...] = (
    qkv_bias.FEATURE,
    qk_norm.FEATURE,
    embed_scale.FEATURE,
    sandwich_norms.FEATURE,
    norm_offset.FEATURE,
)
# features no architecture has together, and why (a relation between two files, so kept in the list)
EXCLUSIVE: tuple[tuple[Feature, Feature, str], ...] = (
    (
        qk_norm.FEATURE,
        qkv_bias.FEATURE,
        "no Hugging Face architecture has both (Qwen2: q/k/v biases, Qwen3: q/k norms)",
    ),
)


def switches() -> tuple[str, ...]:
    """The ModelArgs switches the features own."""
    return tuple(f.name for f in FEATURES)


def active(args: "ModelArgs") -> tuple[Feature, ...]:
    return tuple(f for f in FEATURES if f.on(args))


def biased(args: "ModelArgs", part: str) -> bool:
    """Whether the attention projection w``part`` has a bias."""
    return any(part in f.biased_projections for f in active(args))


def offset_norms(args: "ModelArgs") -> bool:
    """Whether the model's RMSNorm weights are offsets from 1 (titan_pipe.model.kernels.norm_for)."""
    return any(f.offset_norms for f in active(args))


def problems(args: "ModelArgs") -> list[str]:
    """One line per pair of features set together that no architecture has (EXCLUSIVE)."""
    return [
        f"{a.name}: true together with {b.name}: {why}; drop one of {a.name} / {b.name}"
        for a, b, why in EXCLUSIVE
        if a.on(args) and b.on(args)
    ]
