"""sha256 of a file, read in blocks: the one digest every stage records and checks."""
from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: Path | str, *, block: int = 1 << 22) -> str:
    """Hex sha256 of the file's bytes (memory: one block)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()
