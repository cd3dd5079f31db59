"""The loss mask of chat / instruction data: one byte per token beside a Megatron indexed dataset.

``<prefix>.lossmask`` holds, for token i of ``<prefix>.bin``, 1 when it is a loss target (an answer
token) and 0 when it is not (system, user, the template's headers). It is a file of its own, so
megatron-core and every other reader of ``.bin``/``.idx`` still reads the tokens unchanged; the
prepared dir's data.json names it (``loss_mask``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from titan_pipe.errors import UserError
from titan_pipe.tokens.indexed import FileArray

SUFFIX = ".lossmask"


def mask_path(prefix: Path) -> Path:
    return Path(f"{prefix}{SUFFIX}")


def open_mask(prefix: Path, n_tokens: int) -> FileArray:
    """The mask of a dataset of ``n_tokens`` tokens, checked to be that long."""
    path = mask_path(prefix)
    if not path.is_file():
        raise UserError(f"{path}: not found, but data.json says the data has a loss mask; prepare the data again")
    size = path.stat().st_size
    if size != n_tokens:
        raise UserError(
            f"{path}: {size:,} bytes for {n_tokens:,} tokens (one byte a token); the file is truncated "
            "or belongs to other data, prepare it again"
        )
    return FileArray(path, np.uint8, count=n_tokens)


class MaskWriter:
    """Appends masks chunk by chunk, in the order the tokens are written."""

    def __init__(self, prefix: Path):
        self.path = mask_path(prefix)
        self._f = open(self.path, "wb")
        self.n = 0

    def add(self, mask: np.ndarray) -> None:
        self._f.write(np.ascontiguousarray(mask, dtype=np.uint8).tobytes())
        self.n += len(mask)

    def close(self) -> None:
        self._f.close()


def has_target(mask, lo: int, hi: int, *, chunk: int = 8 * 2**20) -> bool:
    """Whether tokens [lo, hi) hold a loss target: read in 8 MiB pieces up to the first one (so a
    normal mask costs one piece; an all-zero one, refused by the caller, a full read)."""
    for a in range(lo, hi, chunk):
        if np.asarray(mask[a : min(hi, a + chunk)]).any():
            return True
    return False
