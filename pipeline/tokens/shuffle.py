"""Keyed permutations of [0, n) computed per index, so an epoch's shuffle needs no O(n) array.

A balanced Feistel network on the smallest even number of bits covering n is a bijection of
[0, 2^bits); applying it again to the few results >= n ("cycle walking") makes it a bijection of
[0, n). 2^bits < 4n, so an index walks fewer than 4 times on average. The round function is
splitmix64's finaliser over (half, round key); the round keys come from the key by splitmix64.
"""

from __future__ import annotations

import numpy as np

ROUNDS = 6
_M64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """splitmix64 of a Python int (mod 2^64): the key schedule and the per-epoch keys."""
    z = (x + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class Permutation:
    """``perm(idx)``: the images of indices ``idx`` (int array in [0, n)) under a bijection keyed by ``key``."""

    def __init__(self, n: int, key: int):
        if n <= 0:
            raise ValueError(f"a permutation needs n > 0, got {n}")
        bits = max(2, (n - 1).bit_length())
        bits += bits % 2
        self.n = n
        self.half = np.uint64(bits // 2)
        self.mask = np.uint64((1 << (bits // 2)) - 1)
        keys, k = [], key & _M64
        for _ in range(ROUNDS):
            k = splitmix64(k)
            keys.append(np.uint64(k))
        self.keys = keys

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << self.half) | right

    def __call__(self, idx: np.ndarray) -> np.ndarray:
        x = np.asarray(idx, dtype=np.uint64)
        out = self._encrypt(x)
        outside = out >= np.uint64(self.n)
        while outside.any():
            out[outside] = self._encrypt(out[outside])
            outside = out >= np.uint64(self.n)
        return out.astype(np.int64)
