"""File digests, read in blocks: the one place a digest is computed, by algorithm name.

``sha256`` is what every stage records for its own files (checkpoints, tokenizers, stage caches).
The export record tags each file's digest with its algorithm: ``xxh3_128`` by default (the
``xxhash`` package, ~10x sha256's speed: it detects a corrupted, truncated or swapped data file, not
tampering, which would rewrite export.json too), ``sha256`` when a cryptographic one is wanted.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

DIGESTS = ("xxh3_128", "sha256")  # export.digest's choice set (titan_pipe.rules.choices re-exports it)


def new_hasher(algorithm: str):
    """A fresh hasher object (``update(bytes)``, ``hexdigest()``) of one of DIGESTS; ValueError otherwise."""
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "xxh3_128":
        import xxhash  # only where an xxh3 digest is made or checked

        return xxhash.xxh3_128()
    raise ValueError(f"digest {algorithm!r} is not one of {', '.join(DIGESTS)}")


def file_digest(path: Path | str, *, algorithm: str, block: int = 1 << 22) -> str:
    """Hex digest of the file's bytes with ``algorithm`` (one of DIGESTS; memory: one block)."""
    h = new_hasher(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def sha256_file(path: Path | str, *, block: int = 1 << 22) -> str:
    """Hex sha256 of the file's bytes (memory: one block)."""
    return file_digest(path, algorithm="sha256", block=block)
