"""Blending datasets by weight, deterministically and without a per-sample index.

The sample stream is cut into blocks of ``BLOCK`` samples. Every block gives component d the
same count c_d (the weights' largest-remainder share of BLOCK, so the realised mix is within
1/BLOCK of the weights), spread evenly through the block: the items (d, i), i < c_d, ordered by
(i + 0.5) / c_d, ties by d. Sample j is then block j // BLOCK, item j % BLOCK = (d, i), and it is
component d's sample number (j // BLOCK) * c_d + i. The table is BLOCK entries, whatever the
corpus; Megatron's BlendedDataset keeps a cached array per sample instead.
"""

from __future__ import annotations

import numpy as np

BLOCK = 4096


def block_counts(weights: list[float], block: int = BLOCK) -> list[int]:
    """Per-component samples in each block: largest remainders of weight * block (ties: lower index)."""
    total = float(sum(weights))
    exact = [w / total * block for w in weights]
    counts = [int(e) for e in exact]
    by_remainder = sorted(range(len(weights)), key=lambda d: (-(exact[d] - counts[d]), d))
    for d in by_remainder[: block - sum(counts)]:
        counts[d] += 1
    return counts


class BlendSchedule:
    """Sample number j of the blend -> (component, that component's sample number)."""

    def __init__(self, weights: list[float], block: int = BLOCK):
        self.counts = block_counts(weights, block)
        self.block = block
        items = sorted(((i + 0.5) / c, d, i) for d, c in enumerate(self.counts) for i in range(c))
        self.component = np.array([d for _, d, _ in items], dtype=np.int64)
        self.rank = np.array([i for _, _, i in items], dtype=np.int64)
        self._count = np.array(self.counts, dtype=np.int64)

    def __call__(self, j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(component (n,), sample within it (n,)) of sample numbers ``j`` (n,)."""
        b, o = np.divmod(np.asarray(j, dtype=np.int64), self.block)
        d = self.component[o]
        return d, b * self._count[d] + self.rank[o]
