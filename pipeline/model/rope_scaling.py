"""RopeScaling: how a model scales its RoPE frequencies (pure data; titan_pipe.model.rope computes them)."""

from __future__ import annotations

from dataclasses import dataclass

from titan_pipe.rules import limits
from titan_pipe.rules.values import FLOAT, INT, read, refuse

ROPE_TYPES = ("llama3", "linear")
_NAMES = {"llama3": "Llama-3.1 scaling (llama3)", "linear": "linear scaling (linear)"}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: Llama-3.1's (``rope_type: llama3`` in Hugging Face configs: the low
    frequencies divided by ``factor``, a smooth band between) or linear (``rope_type: linear``, Gemma 3's
    global layers: every frequency divided by ``factor``; the other fields unused)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"


def read_rope_scaling(spec: dict | None, where: str, source: str, *, kinds: tuple[str, ...]) -> RopeScaling | None:
    """The scaling a config.json's rope_scaling / rope_parameters object ``spec`` (at key ``where``)
    states, of one of ``kinds`` (what the family computes); None for plain RoPE; anything else, or a
    bad value, is one line naming the key."""
    if not spec:
        return None
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind == "default":
        return None
    if kind not in kinds:
        raise refuse(
            source,
            f"{where}.rope_type",
            kind,
            "is not supported",
            f"titan-pipe computes plain RoPE (default) and {' or '.join(_NAMES[k] for k in kinds)} here",
        )
    p = f"{where}."
    factor = read(spec, "factor", FLOAT, source=source, bound=limits.ROPE_FACTOR, prefix=p)
    if kind == "linear":
        return RopeScaling(factor=factor, rope_type="linear")
    low = read(spec, "low_freq_factor", FLOAT, source=source, bound=limits.ROPE_FACTOR, prefix=p)
    high = read(spec, "high_freq_factor", FLOAT, source=source, bound=limits.ROPE_FACTOR, prefix=p)
    if high <= low:
        raise refuse(
            source,
            f"{where}.high_freq_factor",
            high,
            f"must exceed low_freq_factor {low:g}",
            "copy the values of the model's original config.json",
        )
    original = read(spec, "original_max_position_embeddings", INT, source=source, bound=limits.POSITIONS, prefix=p)
    return RopeScaling(factor, low, high, original)
