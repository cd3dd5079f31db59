"""RopeScaling: how a model scales its RoPE frequencies (pure data; titan_pipe.model.rope computes them)."""

from __future__ import annotations

from dataclasses import dataclass

ROPE_TYPES = ("llama3", "linear")


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
