"""RoPE frequencies and cos/sin tables in numpy (no torch): the one formula the model and the export share.

``inv_freq`` is the frequency formula (Llama-3.1 scaling included) the module's rotary tables are
built from (titan_pipe.model.transformer.rope_cos_sin). ``cos_sin`` gives the tables an exported
graph stores: angles as the module computes them (fp32 position x fp32 frequency), cos and sin in
float64 rounded once to fp32, so each entry is the correctly rounded value; torch's fp32 cos/sin is
within one unit in the last place of it (about 5% of entries differ by that one unit).
"""

from __future__ import annotations

import math

import numpy as np

from titan_pipe.model.args import ModelArgs
from titan_pipe.model.features import RopeTable


def inv_freq(args: ModelArgs, table: RopeTable | None = None) -> np.ndarray:
    """(head_dim/2,) float32 inverse frequencies, computed in float64, with the configured scaling
    (Llama-3.1's or linear) where the table takes it; ``table``: one of features.rope_tables (None:
    the main one, rope_theta)."""
    hd = args.head_dim
    theta = args.rope_theta if table is None else table.theta
    inv = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    s = args.rope_scaling if table is None or table.scaled else None
    if s is None:
        return inv.astype(np.float32)
    if s.rope_type == "linear":
        return (inv / s.factor).astype(np.float32)
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    scaled = np.where(mid, (1 - smooth) * inv / s.factor + smooth * inv, scaled)
    return scaled.astype(np.float32)


def cos_sin(args: ModelArgs, rows: int, table: RopeTable | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 of shape (rows, head_dim), each half repeated (rotate-half convention), of
    ``table`` (inv_freq)."""
    freqs = np.outer(np.arange(rows, dtype=np.float32), inv_freq(args, table))  # fp32 products, as torch.outer
    angles = np.concatenate([freqs, freqs], axis=-1).astype(np.float64)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
