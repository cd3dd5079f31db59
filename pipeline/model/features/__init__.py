"""Architectural features, one file each (see feature.py for what a feature owns).

``FEATURES`` is the list the stages iterate; a model family (titan_pipe.model.families) names the
features its architecture always has. Migrated so far: q/k/v biases (qkv_bias.py), q/k norms
(qk_norm.py), scaled embeddings (embed_scale.py), sandwich norms (sandwich_norms.py), offset
norms (norm_offset.py), and two values a family's config states: global layers among sliding ones
with their own RoPE table (global_every.py) and the query scale (attn_scalar.py), and the sliding
window (sliding_window.py), the tied head (tie_embeddings.py: the output projection shares the
embedding), and mixtures of experts (experts.py: the stages take its ``Routing``); the MLP's gate
is a choice among records (gates.py). See docs/architecture.md, "Features".
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from titan_pipe.model.features import (
    attn_scalar,
    embed_scale,
    experts,
    global_every,
    norm_offset,
    qk_norm,
    qkv_bias,
    sandwich_norms,
    sliding_window,
    tie_embeddings,
)
from titan_pipe.model.features.experts import Routing, routing, split_problems
from titan_pipe.model.features.feature import Conformance, Feature, RopeTable

if TYPE_CHECKING:
    from titan_pipe.model.args import ModelArgs
    from titan_pipe.rules.limits import Bound

__all__ = [
    "Conformance",
    "FEATURES",
    "Feature",
    "RopeTable",
    "Routing",
    "active",
    "attention_scale",
    "biased",
    "bounds",
    "clashes",
    "compared",
    "layer_rope",
    "mask_bytes",
    "onnx_mask",
    "offset_norms",
    "problems",
    "read_from",
    "shared",
    "split_problems",
    "unshared",
    "rope_tables",
    "routing",
    "switches",
    "windowed",
]

FEATURES: tuple[Feature, ...] = (
    qkv_bias.FEATURE,
    qk_norm.FEATURE,
    embed_scale.FEATURE,
    sandwich_norms.FEATURE,
    norm_offset.FEATURE,
    sliding_window.FEATURE,
    global_every.FEATURE,
    attn_scalar.FEATURE,
    experts.FEATURE,
    tie_embeddings.FEATURE,
)
# features no architecture has together, and why (a relation between two files, so kept in the list)
EXCLUSIVE: tuple[tuple[Feature, Feature, str], ...] = (
    (
        qk_norm.FEATURE,
        qkv_bias.FEATURE,
        "no Hugging Face architecture has both (Qwen2: q/k/v biases, Qwen3: q/k norms)",
    ),
)


# features that need another, and what the other is to them (a relation between two files, so kept here)
REQUIRES: tuple[tuple[Feature, Feature, str], ...] = (
    (global_every.FEATURE, sliding_window.FEATURE, "the other layers' window"),
)


def switches() -> tuple[str, ...]:
    """The ModelArgs switches (bools an architecture has or not) the features own."""
    return tuple(f.name for f in FEATURES if f.switch)


def bounds() -> dict[str, "Bound"]:
    """ModelArgs field -> its bound, of every numeric value the features own (args.FIELD_BOUNDS)."""
    return {field: b for f in FEATURES for field, b in f.bounds}


def compared() -> dict[str, str]:
    """ModelArgs field -> the property two models are compared on, of every field the features own."""
    return {field: prop for f in FEATURES for field, prop in f.compared_fields()}


def active(args: "ModelArgs") -> tuple[Feature, ...]:
    return tuple(f for f in FEATURES if f.on(args))


def biased(args: "ModelArgs", part: str) -> bool:
    """Whether the attention projection w``part`` has a bias."""
    return any(part in f.biased_projections for f in active(args))


def offset_norms(args: "ModelArgs") -> bool:
    """Whether the model's RMSNorm weights are offsets from 1 (titan_pipe.model.kernels.norm_for)."""
    return any(f.offset_norms for f in active(args))


def rope_tables(args: "ModelArgs") -> tuple[RopeTable, ...]:
    """The RoPE tables the model's layers rotate with: the main one (rope_theta, scaled) first."""
    extra = (f.rope_table(args) for f in active(args) if f.rope_table is not None)
    return (RopeTable("", args.rope_theta, scaled=True), *(t for t in extra if t is not None))


def layer_rope(args: "ModelArgs", i: int) -> str:
    """The name of the RoPE table (rope_tables) layer ``i`` rotates with."""
    return next((f.layer_rope(args, i) for f in active(args) if f.layer_rope is not None), "")


def shared(args: "ModelArgs") -> dict[str, str]:
    """Parameter -> the parameter whose tensor it is, of each tensor a feature makes one with
    another (the tied head: output.weight -> tok_embeddings.weight). Such a name is not in the
    parameter list; a checkpoint may store it (unified_dir decides whether it is the same tensor)."""
    return {name: source for f in active(args) for name, source in f.shares}


def read_from(args: "ModelArgs", name: str) -> str:
    """The parameter whose tensor ``name`` reads: itself, or the one it shares (``shared``)."""
    return shared(args).get(name, name)


def unshared(args: "ModelArgs") -> "ModelArgs":
    """``args`` with every sharing feature off: each shared name its own parameter (a pipeline
    stage's head as a copy, a stored head that differs from the embedding)."""
    return replace(args, **{f.name: False for f in active(args) if f.shares})


def windowed(args: "ModelArgs") -> bool:
    """Whether a feature narrows the attention mask (a sliding window: the window operator row runs)."""
    return any(f.onnx_mask is not None for f in active(args))


def mask_bytes(args: "ModelArgs", seq_len: int, elem_bytes: float) -> float:
    """Bytes of attention masks the features keep for backward, per layer and microbatch."""
    return sum(f.mask_bytes(args, seq_len, elem_bytes) for f in active(args) if f.mask_bytes is not None)


def onnx_mask(nodes, g, args: "ModelArgs", allowed: str, **names) -> str:
    """The keys each query may see, narrowed by each feature's mask term (onnx_mask)."""
    for f in active(args):
        if f.onnx_mask is not None:
            allowed = f.onnx_mask(nodes, g, args, allowed, **names)
    return allowed


def attention_scale(args: "ModelArgs") -> float | None:
    """The factor on q.k a feature sets; None: head_dim^-1/2."""
    return next((f.attention_scale(args) for f in active(args) if f.attention_scale is not None), None)


def problems(args: "ModelArgs") -> list[str]:
    """One line per feature value the model cannot compute, per feature set without one it needs
    (REQUIRES), then the clashes."""
    needs = [
        f"{a.name}: {getattr(args, a.name)} needs {b.name} ({what}); set {b.name}, or {a.name}: 0"
        for a, b, what in REQUIRES
        if a.on(args) and not b.on(args)
    ]
    return [line for f in FEATURES if f.check is not None for line in f.check(args)] + needs + clashes(args)


def clashes(args: "ModelArgs") -> list[str]:
    """One line per pair of features set together that no architecture has (EXCLUSIVE)."""
    return [
        f"{a.name}: true together with {b.name}: {why}; drop one of {a.name} / {b.name}"
        for a, b, why in EXCLUSIVE
        if a.on(args) and b.on(args)
    ]
