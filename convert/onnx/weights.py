"""Export weights planned from safetensors headers: which stored tensor becomes which initializer.

Planning reads only the headers (names, dtypes, shapes, byte offsets) of the unified directory and
checks them against config.json, so a bad directory fails before a byte is written. The bytes are
then streamed into the data files (``model.onnx.data``) by titan_pipe.convert.onnx.data_file. No torch is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_pipe.errors import UserError
from titan_pipe.model.unified_dir import StoredParam, UnifiedDir

_CASTABLE = ("F32", "F16", "BF16")  # safetensors codes of the float types export reads


@dataclass(frozen=True)
class DataEntry:
    """Where one initializer lives: its data file (a name beside the graphs) and byte range there."""

    name: str
    file: str
    offset: int
    length: int
    dims: tuple[int, ...]


def plan_weights(unified: UnifiedDir) -> dict[str, tuple[StoredParam, ...]]:
    """Every stored parameter of an opened unified dir (titan_pipe.model.unified_dir has placed and
    shape-checked each from the headers) -> where it is stored (one tensor, or one per expert of a
    stacked expert parameter); UserError naming the tensor and file for one export cannot cast.
    Reads headers only."""
    found = {name: unified.parts(name) for name in (*unified.params, *unified.experts)}
    for parts in found.values():
        for p in parts:
            if p.stored.dtype not in _CASTABLE:
                raise UserError(
                    f"{p.file}: tensor {p.key!r} has dtype {p.stored.dtype}; export reads float32, "
                    "float16 or bfloat16 weights — convert the checkpoint with `titan-pipe convert`"
                )
    return found
