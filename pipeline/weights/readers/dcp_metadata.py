"""DCP's ``.metadata`` read without importing torch.distributed.checkpoint.

Importing it (its planners, DTensor, the distributed C10d bindings) cost seconds before a convert
moved its first byte (issue 36: 3.6 of a 5-7 s conversion). The pickle names a handful of plain
dataclasses; the restricted unpickler of the DCP reader maps each allowed name to the stand-in of
the same shape here, so loading builds only these (same field names, the same state protocol) and
never imports or calls torch's. Nor torch itself (another 1.2 s): ``torch.Size`` is loaded as a
tuple and a ``torch.<dtype>`` as its safetensors code ("BF16"), by the reader's unpickler. Anything
not on the allow list is still refused by name.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from titan_pipe.rules.dtypes import TABLE

# torch.<name> as pickled (a dtype pickles as its attribute name) -> safetensors code; the other
# torch dtypes as "torch.<name>", which no reader converts (they say so, naming it)
DTYPE_CODES = {d.name: d.code for d in TABLE}
OTHER_DTYPES = (
    "complex32",
    "complex64",
    "complex128",
    "uint16",
    "uint32",
    "uint64",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "qint8",
    "quint8",
    "qint32",
    "quint4x2",
    "quint2x4",
    "bits8",
    "bits16",
    "bits1x8",
    "bits2x4",
    "bits4x2",
)


def torch_global(name: str):
    """What ``torch.<name>`` in DCP metadata loads as: Size -> tuple, a dtype -> its code; None
    for anything else (refused)."""
    if name == "Size":
        return tuple
    if name in DTYPE_CODES:
        return DTYPE_CODES[name]
    return f"torch.{name}" if name in OTHER_DTYPES else None


@dataclass
class ChunkStorageMetadata:
    offsets: tuple
    sizes: tuple


class MemFormatEncoding(enum.Enum):  # torch's _MEM_FORMAT_ENCODING: pickled by value
    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


@dataclass
class TensorProperties:
    dtype: str = "F32"  # safetensors code (torch's dtype as pickled, mapped by torch_global)
    layout: Any = None
    requires_grad: bool = False
    memory_format: Any = None
    pin_memory: bool = False

    def __setstate__(self, state) -> None:
        # torch pickles (dtype, layout, requires_grad, memory format encoding, pin_memory)
        if isinstance(state, tuple):
            self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state
        else:
            self.__dict__.update(state)


@dataclass
class TensorStorageMetadata:
    properties: TensorProperties
    size: tuple
    chunks: list


@dataclass
class BytesStorageMetadata:
    pass


@dataclass
class StorageMeta:
    checkpoint_id: Any = None
    save_id: Any = None
    load_id: Any = None
    modules: list = field(default_factory=list)


@dataclass
class Metadata:
    state_dict_metadata: dict
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: Any = None
    version: Any = None


class MetadataIndex:
    """The key of ``storage_data``: fqn and chunk offset (the index hint takes no part in equality)."""

    __slots__ = ("fqn", "offset", "index")

    def __init__(self, fqn: str = "", offset=None, index: int | None = None):
        self.fqn, self.index = fqn, index
        self.offset = tuple(offset) if offset is not None else None

    def __setstate__(self, state) -> None:  # a frozen dataclass's pickled state: (None, slots) or a dict
        if isinstance(state, tuple):
            state = {**(state[0] or {}), **(state[1] or {})}
        self.fqn, self.offset, self.index = state.get("fqn", ""), state.get("offset"), state.get("index")

    def _key(self):
        return self.fqn, None if self.offset is None else tuple(self.offset)

    def __eq__(self, other) -> bool:
        return isinstance(other, MetadataIndex) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


@dataclass
class StorageInfo:  # filesystem._StorageInfo
    relative_path: str = ""
    offset: int = 0
    length: int = 0
    transform_descriptors: Any = None


class Opaque:
    """Planner records some savers keep (SavePlan, WriteItem, ...): loaded as plain state, never used."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state) -> None:
        self.state = state


def layout_name(name: str) -> str:
    """torch's _get_layout (a layout's name -> torch.strided ...): the name kept, nothing of torch's."""
    return name


# allowed (module, name) -> the stand-in
STAND_INS: dict[tuple[str, str], Any] = {
    **{
        ("torch.distributed.checkpoint.metadata", c.__name__): c
        for c in (
            ChunkStorageMetadata,
            TensorProperties,
            TensorStorageMetadata,
            BytesStorageMetadata,
            StorageMeta,
            Metadata,
            MetadataIndex,
        )
    },
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): MemFormatEncoding,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): StorageInfo,
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"): Opaque,
    ("torch.serialization", "_get_layout"): layout_name,
    ("torch._utils", "_get_layout"): layout_name,
    **{
        ("torch.distributed.checkpoint.planner", n): Opaque
        for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")
    },
}
