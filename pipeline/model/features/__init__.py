"""Architectural features, one file each (see feature.py for what a feature owns).

``FEATURES`` is the list the stages iterate; a model family (titan_pipe.model.families) names the
features its architecture always has. Migrated so far: q/k norms (qk_norm.py). The others (q/k/v
biases, sliding windows, mixtures of experts, Gemma 3's switches) are still tested as ModelArgs
switches where they are used (docs/architecture.md, "Features").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan_pipe.model.features import qk_norm
from titan_pipe.model.features.feature import Conformance, Feature

if TYPE_CHECKING:
    from titan_pipe.model.args import ModelArgs

__all__ = ["Conformance", "FEATURES", "Feature", "active", "problems", "switches"]

FEATURES: tuple[Feature, ...] = (qk_norm.FEATURE,)
BY_NAME: dict[str, Feature] = {f.name: f for f in FEATURES}


def switches() -> tuple[str, ...]:
    """The ModelArgs switches the features own."""
    return tuple(f.name for f in FEATURES)


def active(args: "ModelArgs") -> tuple[Feature, ...]:
    return tuple(f for f in FEATURES if f.on(args))


def problems(args: "ModelArgs") -> list[str]:
    """One line per switch set together with one its feature excludes."""
    return [
        f"{f.name}: true together with {other}: {why}; drop one of {f.name} / {other}"
        for f in active(args)
        for other, why in f.excludes
        if getattr(args, other)
    ]
