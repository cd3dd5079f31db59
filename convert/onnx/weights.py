"""Export weights planned from safetensors headers: which stored tensor becomes which initializer.

Planning reads only the headers (names, dtypes, shapes, byte offsets) of the unified directory and
checks them against config.json, so a bad directory fails before a byte is written. The bytes are
then streamed into the data files (``model.onnx.data``) by titan_pipe.convert.onnx.data_file. No torch is imported.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from titan_pipe.convert.readers.store import StoredTensor, read_header
from titan_pipe.errors import UserError
from titan_pipe.model.args import ModelArgs
from titan_pipe.model.params import native_shapes
from titan_pipe.unified_dir import check_all_placed, locate_weights, place_tensor

_CASTABLE = ("F32", "F16", "BF16")  # safetensors codes of the float types export reads


@dataclass(frozen=True)
class SourceTensor:
    """One parameter as stored: file, stored key, dtype name (safetensors), shape, byte range."""

    name: str  # native parameter name, e.g. layers.0.attention.wq.weight
    file: Path
    key: str
    stored: StoredTensor


@dataclass(frozen=True)
class DataEntry:
    """Where one initializer lives: its data file (a name beside the graphs) and byte range there."""

    name: str
    file: str
    offset: int
    length: int
    dims: tuple[int, ...]


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Native parameter name -> shape, from the dims alone; a tied model may still store output.weight
    (it is the embedding, and the graphs use the embedding)."""
    shapes = native_shapes(args)
    if args.tie_embeddings:
        shapes["output.weight"] = (args.vocab_size, args.dim)
    return shapes


def plan_weights(model_dir: Path, args: ModelArgs) -> dict[str, SourceTensor]:
    """Every parameter of the model -> where it is stored; UserError naming the tensor and file
    for a missing, extra, duplicated, mis-shaped or non-float tensor. Reads headers only."""
    model_dir = Path(model_dir)
    weights = locate_weights(model_dir)
    expected = expected_shapes(args)
    found: dict[str, SourceTensor] = {}
    for path in weights.files:
        header, _ = read_header(path)
        for stored in sorted(k for k, f in weights.key_to_file.items() if f == path):
            info = header.get(stored)
            name = place_tensor(model_dir, args, expected, path=path, stored=stored, present=header,
                                shape=info.shape if info is not None else None, placed=found)
            if name is None:
                continue
            if info.dtype not in _CASTABLE:
                raise UserError(f"{path}: tensor {stored!r} has dtype {info.dtype}; export reads float32, "
                                "float16 or bfloat16 weights — convert the checkpoint with `titan-pipe convert`")
            found[name] = SourceTensor(name, path, stored, info)
    check_all_placed(model_dir, args, expected, found)
    return found
