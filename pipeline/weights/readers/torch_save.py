"""Where the bytes of one ``torch.save``'d tensor lie in a file, found without running its pickle.

``torch.save`` writes a zip archive (every record stored uncompressed, tensor data aligned to 64
bytes): ``<prefix>/data.pkl`` (the pickle that rebuilds the tensor), ``<prefix>/byteorder``,
``<prefix>/data/<key>`` (the raw bytes of each storage) and a central directory at the end.
torch.distributed.checkpoint's default ``FileSystemWriter`` writes each tensor chunk as one such
archive at (offset, length) inside a ``.distcp`` file. ``locate`` reads only the archive's
directory and its small records, and interprets ``data.pkl`` with an unpickler whose globals are
stand-ins that merely record their arguments (nothing of torch's is called), to give the absolute
byte offset, dtype, shape and strides of the tensor: the data itself can then be read like a
safetensors tensor, with pread, by the block reader.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import struct
import zipfile
from collections import OrderedDict
from dataclasses import dataclass

from titan_pipe.rules.dtypes import DTYPE_SIZES

# torch's legacy storage names (its dtype -> storage table, torch.storage._dtype_to_storage_type_map)
# -> safetensors dtype codes; tests/test_convert_dcp_metadata.py holds it against torch's own table.
# Written out, so reading a DCP checkpoint imports no torch.
STORAGE_DTYPES = {
    "DoubleStorage": "F64",
    "FloatStorage": "F32",
    "HalfStorage": "F16",
    "BFloat16Storage": "BF16",
    "LongStorage": "I64",
    "IntStorage": "I32",
    "ShortStorage": "I16",
    "CharStorage": "I8",
    "ByteStorage": "U8",
    "BoolStorage": "BOOL",
}
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # zip local file header, 30 bytes
_MAX_PICKLE = 1 << 20  # a one-tensor data.pkl is ~200 bytes


class PayloadError(ValueError):
    """The bytes are not a plain torch.save'd tensor this reader can address."""


@dataclass(frozen=True)
class SavedTensor:
    """A tensor inside a file: element (i0, i1, ...) is at ``start + sum(i_k * stride_k) * itemsize``."""

    dtype: str  # safetensors code (BF16, F32, ...)
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    start: int  # absolute byte offset of element 0 (storage offset applied)
    storage_start: int  # absolute byte offset of the storage record
    storage_nbytes: int

    @property
    def row_major(self) -> bool:
        expect, acc = [], 1
        for n in reversed(self.shape):
            expect.append(acc)
            acc *= n
        return all(s == e or n == 1 for s, e, n in zip(self.stride, reversed(expect), self.shape))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]


class _View(io.RawIOBase):
    """Bytes [offset, offset + length) of an open file, as a seekable stream (pread, no shared position)."""

    def __init__(self, fd: int, offset: int, length: int):
        self.fd, self.offset, self.length, self.pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        data = os.pread(self.fd, n, self.offset + self.pos) if n else b""
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)


class _Rebuild:
    """Stand-in for torch._utils._rebuild_tensor_v2: records (storage, offset, size, stride)."""

    def __init__(self, storage, storage_offset, size, stride, *rest):
        self.storage, self.storage_offset = storage, storage_offset
        self.size, self.stride = tuple(size), tuple(stride)


class _StorageType:
    def __init__(self, name: str):
        self.name = name


class _PayloadUnpickler(pickle.Unpickler):
    """Admits exactly the globals a one-tensor torch.save pickle holds, as inert stand-ins."""

    def find_class(self, module: str, name: str):
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _Rebuild
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageType(name)
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        raise PayloadError(f"its pickle uses {module}.{name}, which a plain saved tensor does not")

    def persistent_load(self, pid):
        # ('storage', storage type, key, location, numel)
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)):
            raise PayloadError(f"unexpected persistent id {pid!r:.80}")
        return pid


def locate(fd: int, offset: int, length: int) -> SavedTensor:
    """The tensor torch.save wrote at [offset, offset + length) of ``fd``; PayloadError otherwise."""
    if length < 4 or os.pread(fd, 4, offset) != b"PK\x03\x04":
        raise PayloadError("the bytes there are not a torch.save archive")
    try:
        z = zipfile.ZipFile(_View(fd, offset, length))
    except (zipfile.BadZipFile, OSError, ValueError, struct.error) as e:
        raise PayloadError(f"damaged torch.save archive ({e})") from None
    with z:
        names = {i.filename: i for i in z.infolist()}
        pkl = next((n for n in names if n.endswith("/data.pkl") or n == "data.pkl"), None)
        if pkl is None:
            raise PayloadError(f"the archive has no data.pkl (records: {sorted(names)[:4]})")
        prefix = pkl[: -len("data.pkl")]
        for i in names.values():
            if i.compress_type != zipfile.ZIP_STORED:
                raise PayloadError(
                    f"record {i.filename} is compressed (method {i.compress_type}); "
                    "torch.save stores records uncompressed"
                )
        if names[pkl].file_size > _MAX_PICKLE:
            raise PayloadError(f"data.pkl is {names[pkl].file_size} bytes; not a single tensor")
        try:
            order = z.read(prefix + "byteorder").decode() if prefix + "byteorder" in names else "little"
            obj = _PayloadUnpickler(io.BytesIO(z.read(pkl))).load()
        except PayloadError:
            raise
        except (
            pickle.UnpicklingError,
            zipfile.BadZipFile,
            EOFError,
            ValueError,
            TypeError,
            UnicodeDecodeError,
            struct.error,
        ) as e:
            raise PayloadError(f"damaged data.pkl ({type(e).__name__}: {str(e)[:80]})") from None
    if order != "little":
        raise PayloadError(f"saved with byte order {order!r}; only little-endian data is read")
    if not isinstance(obj, _Rebuild):
        raise PayloadError(f"the archive holds a {type(obj).__name__}, not one tensor")
    _, stype, key, _, numel = obj.storage
    dtype = STORAGE_DTYPES[stype.name]
    itemsize = DTYPE_SIZES[dtype]
    rec = names.get(f"{prefix}data/{key}")
    if rec is None:
        raise PayloadError(f"storage record data/{key} is missing from the archive")
    head = os.pread(fd, _LOCAL_HEADER.size, offset + rec.header_offset)
    if len(head) < _LOCAL_HEADER.size or head[:4] != b"PK\x03\x04":
        raise PayloadError(f"bad local header for data/{key}")
    name_len, extra_len = _LOCAL_HEADER.unpack(head)[-2:]
    data_at = rec.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    nbytes = int(numel) * itemsize
    if rec.file_size != nbytes or data_at + nbytes > length:
        raise PayloadError(
            f"storage record data/{key} holds {rec.file_size} bytes at {data_at}, "
            f"expected {nbytes} within the {length}-byte item"
        )
    size, stride, soff = obj.size, obj.stride, int(obj.storage_offset)
    last = soff + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else soff - 1
    if len(size) != len(stride) or soff < 0 or any(s < 0 for s in stride) or last >= int(numel):
        raise PayloadError(
            f"tensor view {list(size)} stride {list(stride)} offset {soff} lies outside its storage of {numel} elements"
        )
    return SavedTensor(dtype, size, stride, offset + data_at + soff * itemsize, offset + data_at, nbytes)
