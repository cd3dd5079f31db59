"""Float casts between raw buffers with numpy alone, bit for bit what torch's ``Tensor.to(dtype)`` gives.

Export (and anything else that streams weights) casts chunk by chunk without importing torch:

  bf16 -> fp32   exact: a bf16 is the upper 16 bits of an fp32, so the bits are widened and shifted.
  bf16 -> fp16   a 65536-entry table (every bf16 bit pattern -> its fp16 bits), built once with the
                 fp32 -> fp16 rule below from the exact widening; applied with ``np.take`` in blocks
                 that stay in cache.
  fp16 -> fp32   a 65536-entry table too (numpy's widening is exact; NaNs quieted as below).
  fp32 -> fp16   numpy's cast, in blocks: round to nearest, ties to even, subnormals kept, overflow to inf.

NaNs follow torch's vectorised CPU conversion (the F16C instructions): the quiet bit is set and the
top payload bits kept, sign included (fp32 0x7f800001 -> fp16 0x7e00, 0xff802000 -> 0xfe01;
fp16 0x7c01 -> fp32 0x7fc02000). numpy keeps payloads without quieting, so NaNs are patched after
its cast, only in a chunk that has one. (torch's scalar path, used for the last few elements of a
tensor whose length is no multiple of the vector width, turns an fp16 NaN into 0x7fffffff; that
length-dependent result is not reproduced.) tests/test_export_casts.py holds every rule against torch.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

BLOCK = 1 << 16  # elements per np.take call: the block's indices and output stay in L2 with the table
# elements per fp32 -> fp16 cast call: numpy casts a large array through its buffered loop at ~4.5 ns an
# element here, a block of 8-32 k elements at ~2.2 ns (measured on 4 M elements, numpy 2.4)
F16_BLOCK = 1 << 14

# safetensors codes -> (numpy dtype of the raw bits, bytes per element)
_BITS = {"F32": np.uint32, "F16": np.uint16, "BF16": np.uint16}
_F32_NAN = np.uint32(0x7F800000)  # |bits| above this is a NaN


def bits_dtype(code: str):
    """The unsigned integer dtype holding one element of a float dtype's raw bits ('F32' -> uint32)."""
    return _BITS[code]


def f32_to_f16(src: np.ndarray, out: np.ndarray) -> None:
    """fp32 bits (uint32) -> fp16 bits (uint16), same length; what torch's ``.to(torch.float16)`` gives."""
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf is the rule, not an accident
        wide, narrow = src.view(np.float32), out.view(np.float16)
        for i in range(0, len(src), F16_BLOCK):
            np.copyto(narrow[i : i + F16_BLOCK], wide[i : i + F16_BLOCK], casting="unsafe")
        has_nan = len(src) and np.isnan(np.max(src.view(np.float32)))  # max propagates NaN: one pass, no temporaries
    if has_nan:
        _quiet_f16_nans(src, out)


def _quiet_f16_nans(src: np.ndarray, out: np.ndarray) -> None:
    at = np.flatnonzero((src & np.uint32(0x7FFFFFFF)) > _F32_NAN)
    w = src[at]
    out[at] = ((w >> 16) & 0x8000) | 0x7E00 | ((w >> 13) & 0x3FF)


def bf16_to_f32(src: np.ndarray, out: np.ndarray) -> None:
    """bf16 bits (uint16) -> fp32 bits (uint32): exact, payloads included."""
    np.left_shift(src, np.uint32(16), out=out, dtype=np.uint32)  # one pass: widened in numpy's buffered loop


@lru_cache(maxsize=None)
def _table(src: str, dst: str) -> np.ndarray:
    """Every bit pattern of a 16-bit float -> its cast's bits (read-only)."""
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    if (src, dst) == ("BF16", "F16"):
        wide = np.empty(1 << 16, np.uint32)
        bf16_to_f32(every, wide)
        table = np.empty(1 << 16, np.uint16)
        f32_to_f16(wide, table)
    else:  # F16 -> F32
        table = every.view(np.float16).astype(np.float32).view(np.uint32)
        nan = (table & np.uint32(0x7FFFFFFF)) > _F32_NAN
        table[nan] |= np.uint32(0x00400000)
    table.flags.writeable = False
    return table


def _lookup(table: np.ndarray, src: np.ndarray, out: np.ndarray) -> None:
    for i in range(0, len(src), BLOCK):
        np.take(table, src[i : i + BLOCK], out=out[i : i + BLOCK], mode="clip")  # clip: every uint16 is in range


def cast_bits(src: np.ndarray, src_code: str, out: np.ndarray, dst_code: str) -> None:
    """Cast the raw bits ``src`` (dtype bits_dtype(src_code)) into ``out`` (bits_dtype(dst_code)), same length.

    src_code/dst_code are safetensors codes: F32, F16, BF16 (to F32 or F16). Same code: a copy.
    """
    if src_code == dst_code:
        np.copyto(out, src)
    elif (src_code, dst_code) == ("F32", "F16"):
        f32_to_f16(src, out)
    elif (src_code, dst_code) == ("BF16", "F32"):
        bf16_to_f32(src, out)
    elif (src_code, dst_code) in (("BF16", "F16"), ("F16", "F32")):
        _lookup(_table(src_code, dst_code), src, out)
    else:
        raise ValueError(f"no cast from {src_code} to {dst_code}")
