"""The one dtype table: every name a dtype goes by in titan-pipe's files and tools, one row each.

``name`` is torch's and Hugging Face's (config.json ``torch_dtype``, flow.yaml), ``code`` is the
safetensors header's (and the checkpoint manifest's), ``onnx`` the ``onnx.TensorProto`` enum name,
``ort`` what ONNX Runtime reports as ``tensor(<ort>)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from titan_pipe.errors import UserError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DType:
    name: str
    code: str
    itemsize: int
    onnx: str
    ort: str

    @property
    def torch(self) -> "torch.dtype":
        import torch  # imported when a torch dtype is asked for: the config and the CLI need none

        return getattr(torch, self.name)


TABLE: tuple[DType, ...] = (
    DType("float64", "F64", 8, "DOUBLE", "double"),
    DType("float32", "F32", 4, "FLOAT", "float"),
    DType("float16", "F16", 2, "FLOAT16", "float16"),
    DType("bfloat16", "BF16", 2, "BFLOAT16", "bfloat16"),
    DType("int64", "I64", 8, "INT64", "int64"),
    DType("int32", "I32", 4, "INT32", "int32"),
    DType("int16", "I16", 2, "INT16", "int16"),
    DType("int8", "I8", 1, "INT8", "int8"),
    DType("uint8", "U8", 1, "UINT8", "uint8"),
    DType("bool", "BOOL", 1, "BOOL", "bool"),
)

# The float types a model is trained, converted, exported and evaluated in.
FLOAT_NAMES: tuple[str, ...] = ("float32", "float16", "bfloat16")
# The float types an exported graph may carry (ATC graphs carry no bfloat16).
EXPORT_NAMES: tuple[str, ...] = ("float32", "float16")
# Short spellings accepted where a user types a dtype.
ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}

BY_NAME = {d.name: d for d in TABLE}
# safetensors code -> element size
DTYPE_SIZES = {d.code: d.itemsize for d in TABLE}
# flow.yaml / Hugging Face name <-> safetensors code, for the float types
OUT_DTYPES = {n: BY_NAME[n].code for n in FLOAT_NAMES}
HF_DTYPE_NAMES = {d.code: d.name for d in TABLE if d.name in FLOAT_NAMES + ("float64",)}
# name -> bytes per element, for the float types
DTYPE_BYTES_BY_NAME = {n: BY_NAME[n].itemsize for n in FLOAT_NAMES}
# ONNX Runtime's "tensor(float)" -> name, for the float types
ORT_NAMES = {f"tensor({BY_NAME[n].ort})": n for n in FLOAT_NAMES}


def __getattr__(attr: str):
    """The torch-valued tables, built on first use (PEP 562), so importing this module imports no torch:
    TORCH_DTYPES (safetensors code -> torch dtype), DTYPE_NAMES (torch dtype -> code),
    TORCH_BY_NAME (float name -> torch dtype)."""
    tables = {
        "TORCH_DTYPES": lambda: {d.code: d.torch for d in TABLE},
        "DTYPE_NAMES": lambda: {d.torch: d.code for d in TABLE},
        "TORCH_BY_NAME": lambda: {n: BY_NAME[n].torch for n in FLOAT_NAMES},
    }
    if attr not in tables:
        raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
    value = globals()[attr] = tables[attr]()
    return value


def name_of(dtype: "torch.dtype") -> str:
    """'float32' for torch.float32 (torch's own spelling for a dtype outside the table)."""
    for d in TABLE:
        if d.torch == dtype:
            return d.name
    return str(dtype).removeprefix("torch.")


def onnx_type(name: str) -> int:
    """The ``onnx.TensorProto`` enum value of a dtype name ('float32' -> TensorProto.FLOAT)."""
    from onnx import TensorProto

    return getattr(TensorProto, BY_NAME[name].onnx)


def parse_dtype(dtype: "str | torch.dtype | None") -> "torch.dtype | None":
    """'float32'/'float16'/'bfloat16' (or fp32/fp16/bf16, a torch.dtype, or None = keep) -> torch.dtype | None."""
    if dtype is None or not isinstance(dtype, str):
        return dtype
    if dtype in ("keep", "auto"):
        return None
    name = ALIASES.get(dtype, dtype)
    if name not in FLOAT_NAMES:
        raise UserError(f"dtype {dtype!r} is not one of float32, float16, bfloat16 (or keep)")
    return BY_NAME[name].torch
