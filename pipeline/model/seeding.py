"""The one seed rule of parameter initialisation: a generator per (seed, parameter name), so every
parallel layout, and every pipeline stage or tp rank of it, draws a parameter's values alike."""

from __future__ import annotations

import zlib

import torch


def param_generator(seed: int, name: str) -> torch.Generator:
    """The generator parameter ``name`` is initialised from under ``seed``."""
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
