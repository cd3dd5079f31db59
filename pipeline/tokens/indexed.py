"""The Megatron-LM / megatron-core indexed dataset: ``<prefix>.bin`` token ids and ``<prefix>.idx`` index.

Layout of the ``.idx`` (little-endian), as megatron-core's ``datasets/indexed_dataset.py`` reads it:

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    u64       version (1)
    u8        dtype code of the token ids in .bin (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16)
    u64       sequence count S
    u64       document count D (= documents + 1: the document index starts with 0)
    i32[S]    sequence lengths, in tokens
    i64[S]    sequence pointers, byte offsets into .bin
    i64[D]    document index: document d is sequences [doc[d], doc[d+1])
    (i8[S]    sequence modes, multimodal datasets only; not read here)

The ``.bin`` is the token ids of every sequence back to back. Readers here open both files for
pread (FileArray) and touch only the header and the few index entries they look up, so opening a
dataset costs the same for 10 MB and 20 GB. Sequences are assumed contiguous in ``.bin`` (every
writer we know lays them out so): the token stream is ``.bin`` read as one array.
"""

from __future__ import annotations

import os
import struct
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from titan_pipe.errors import UserError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count: 34 bytes
# megatron-core's DType codes; the integer ones can hold token ids.
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
TOKEN_CODES = (1, 2, 3, 4, 5, 8)
# Megatron's preprocess_data.py stores ids as uint16 below this vocabulary size, else int32; so do we.
UINT16_VOCAB_LIMIT = 65500
BLOCK = 1 << 20  # entries per block when writing the index (bounded memory)


def token_dtype(vocab_size: int) -> np.dtype:
    """The .bin dtype for a tokenizer of ``vocab_size`` ids: uint16 when it fits, else int32."""
    return np.dtype(np.uint16 if vocab_size < UINT16_VOCAB_LIMIT else np.int32)


def dtype_code(dtype: np.dtype) -> int:
    return next(code for code, t in DTYPE_CODES.items() if np.dtype(t) == np.dtype(dtype))


def bin_path(prefix: Path) -> Path:
    return Path(f"{prefix}.bin")


def idx_path(prefix: Path) -> Path:
    return Path(f"{prefix}.idx")


def is_prefix(path: Path) -> bool:
    """True when ``path`` names a .bin/.idx pair (``path`` itself, or with its .bin/.idx suffix dropped)."""
    prefix = strip_suffix(path)
    return bin_path(prefix).is_file() and idx_path(prefix).is_file()


def strip_suffix(path: Path) -> Path:
    """``data/x.bin`` or ``data/x.idx`` -> ``data/x``; anything else unchanged."""
    path = Path(path)
    return path.with_suffix("") if path.suffix in (".bin", ".idx") else path


@dataclass(frozen=True)
class IndexHeader:
    dtype: np.dtype
    n_sequences: int
    n_doc_entries: int  # documents + 1
    has_modes: bool

    @property
    def n_documents(self) -> int:
        return self.n_doc_entries - 1


def read_header(idx: Path) -> IndexHeader:
    """The .idx header, checked against the file's size (one short read, no index arrays)."""
    size = idx.stat().st_size
    with open(idx, "rb") as f:
        raw = f.read(HEADER.size)
    if len(raw) < HEADER.size or raw[:9] != MAGIC:
        raise UserError(
            f"{idx}: not a Megatron indexed-dataset index (starts with {raw[:9]!r}, expected "
            f"{MAGIC!r}); give the .idx written by `titan-pipe data prepare` or Megatron's "
            "preprocess_data.py"
        )
    _, version, code, n_seq, n_doc = HEADER.unpack(raw)
    if version != VERSION:
        raise UserError(
            f"{idx}: index version {version}, but only version {VERSION} (megatron-core's) is "
            "read; re-write it with `titan-pipe data prepare` or megatron-core"
        )
    if code not in TOKEN_CODES:
        what = DTYPE_CODES[code].__name__ if code in DTYPE_CODES else "unknown"
        raise UserError(
            f"{idx}: dtype code {code} ({what}) cannot hold token ids; token ids are integers "
            "(code 8 uint16 or 4 int32); re-write the dataset with an integer dtype"
        )
    plain = HEADER.size + n_seq * (4 + 8) + n_doc * 8
    if size not in (plain, plain + n_seq) or n_doc < 1:
        raise UserError(
            f"{idx}: {size} bytes, but its header's {n_seq} sequences and {n_doc} document "
            f"entries need {plain}; the index is truncated or damaged, copy or prepare it again"
        )
    return IndexHeader(np.dtype(DTYPE_CODES[code]), n_seq, n_doc, size != plain)


class FileArray:
    """A 1-D array of ``dtype`` stored in a file at ``offset``, read with pread: ``a[i]``, ``a[lo:hi]``.

    Not a memory map on purpose: a fault in a mapped file maps a whole page-cache folio (2 MB on
    current kernels, however small the read), so a rank's RSS would grow with every window it
    reads; pread copies just the bytes asked for. The page cache is still shared by all ranks.
    """

    def __init__(self, path: Path, dtype, *, offset: int = 0, count: int):
        self.path, self.dtype, self.offset, self.count = Path(path), np.dtype(dtype), offset, count
        self._fd = os.open(self.path, os.O_RDONLY)
        weakref.finalize(self, os.close, self._fd)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, key):
        if isinstance(key, slice):
            lo, hi, step = key.indices(self.count)
            if step != 1:
                raise ValueError("FileArray slices have step 1")
            return self._read(lo, max(lo, hi))
        i = int(key)
        i = i + self.count if i < 0 else i
        if not 0 <= i < self.count:
            raise IndexError(f"index {key} out of range for {self.count} entries of {self.path}")
        return self._read(i, i + 1)[0]

    def _read(self, lo: int, hi: int) -> np.ndarray:
        size = (hi - lo) * self.dtype.itemsize
        raw = os.pread(self._fd, size, self.offset + lo * self.dtype.itemsize) if size else b""
        if len(raw) != size:
            raise UserError(
                f"{self.path}: ended at byte {self.offset + lo * self.dtype.itemsize + len(raw)} while "
                f"reading entries {lo}..{hi}; the file was truncated while in use, prepare it again"
            )
        return np.frombuffer(raw, dtype=self.dtype)


class IndexedTokens:
    """A .bin/.idx pair opened for reading: ``tokens`` (the whole stream) and document starts.

    ``tokens``: a FileArray of ``dtype`` over .bin (nothing is read until indexed); the index
    arrays likewise. Document d spans tokens ``[doc_start(d), doc_start(d + 1))``.
    """

    def __init__(self, prefix: Path):
        self.prefix = strip_suffix(Path(prefix))
        idx, bin_ = idx_path(self.prefix), bin_path(self.prefix)
        for p in (idx, bin_):
            if not p.is_file():
                raise UserError(
                    f"{p}: not found; a Megatron indexed dataset is a {self.prefix.name}.bin/"
                    f"{self.prefix.name}.idx pair, give the prefix of both"
                )
        self.header = h = read_header(idx)
        at = HEADER.size
        self.lengths = FileArray(idx, np.int32, offset=at, count=h.n_sequences)
        at += 4 * h.n_sequences
        self.pointers = FileArray(idx, np.int64, offset=at, count=h.n_sequences)
        at += 8 * h.n_sequences
        self.doc_index = FileArray(idx, np.int64, offset=at, count=h.n_doc_entries)
        self.dtype = h.dtype
        self.n_tokens = self._check_bin(bin_)
        self.tokens = FileArray(bin_, self.dtype, count=self.n_tokens)

    def _check_bin(self, bin_: Path) -> int:
        h, item = self.header, self.dtype.itemsize
        if int(self.doc_index[0]) != 0 or int(self.doc_index[-1]) != h.n_sequences:
            raise UserError(
                f"{idx_path(self.prefix)}: its document index runs from {int(self.doc_index[0])} to "
                f"{int(self.doc_index[-1])}, not 0 to its {h.n_sequences} sequences; the index is "
                "damaged, copy or prepare it again"
            )
        end = 0 if h.n_sequences == 0 else int(self.pointers[-1]) + int(self.lengths[-1]) * item
        size = bin_.stat().st_size
        if size < end:
            raise UserError(
                f"{bin_}: {size} bytes, but {idx_path(self.prefix).name} says its {h.n_sequences} "
                f"sequences end at byte {end}; the .bin is truncated or belongs to another .idx, "
                "copy or prepare it again"
            )
        if h.n_sequences and int(self.pointers[0]) != 0:
            raise UserError(
                f"{idx_path(self.prefix)}: the first sequence starts at byte {int(self.pointers[0])}, "
                "not 0; only datasets with sequences back to back are read"
            )
        return end // item

    VERIFY_BLOCK = 1 << 20  # index entries read at once by verify()

    def verify(self) -> None:
        """Every index entry against the layout megatron-core's format implies and this reader relies
        on: lengths non-negative, each sequence starting where the previous ends (back to back),
        the document index non-decreasing. Read in blocks (memory bounded); run once before a
        launch (the ranks only open the header), since the reader takes ``.bin`` as one stream and a
        damaged index would otherwise train on other documents than it describes."""
        h, item, idx = self.header, self.dtype.itemsize, idx_path(self.prefix)
        expect, block = 0, self.VERIFY_BLOCK
        for lo in range(0, h.n_sequences, block):
            hi = min(h.n_sequences, lo + block)
            lengths = np.asarray(self.lengths[lo:hi]).astype(np.int64)
            pointers = np.asarray(self.pointers[lo:hi])
            bad = np.flatnonzero(lengths < 0)
            if bad.size:
                i = lo + int(bad[0])
                raise UserError(
                    f"{idx}: sequence {i} has length {int(lengths[bad[0]])}; lengths cannot be negative, "
                    "the index is damaged: copy or prepare it again"
                )
            starts = expect + np.concatenate(([0], np.cumsum(lengths[:-1] * item)))
            off = np.flatnonzero(pointers != starts)
            if off.size:
                i = lo + int(off[0])
                raise UserError(
                    f"{idx}: sequence {i} starts at byte {int(pointers[off[0]])}, not {int(starts[off[0]])} "
                    "where the one before it ends; only sequences back to back in the .bin are read "
                    "(as every Megatron writer lays them out): copy or prepare the dataset again"
                )
            expect = int(starts[-1] + lengths[-1] * item)
        previous = 0
        for lo in range(0, h.n_doc_entries, block):
            docs = np.asarray(self.doc_index[lo : lo + block])
            steps = np.diff(np.concatenate(([previous], docs)))
            back = np.flatnonzero(steps < 0)
            if back.size:
                i = lo + int(back[0])
                raise UserError(
                    f"{idx}: document index entry {i} ({int(docs[back[0]])}) comes before the one ahead "
                    f"of it; documents must be in sequence order: the index is damaged, copy or prepare "
                    "it again"
                )
            previous = int(docs[-1]) if docs.size else previous

    @property
    def n_documents(self) -> int:
        return self.header.n_documents

    def doc_start(self, d: int) -> int:
        """Token offset of document ``d``'s first token (``n_documents`` -> the end of the stream)."""
        if d >= self.n_documents:
            return self.n_tokens
        seq = int(self.doc_index[d])
        return int(self.pointers[seq]) // self.dtype.itemsize if seq < self.header.n_sequences else self.n_tokens

    def document(self, d: int) -> np.ndarray:
        return np.asarray(self.tokens[self.doc_start(d) : self.doc_start(d + 1)])


class IndexWriter:
    """Writes documents into ``<prefix>.bin`` as they come; ``finish()`` writes ``<prefix>.idx``.

    One sequence per document (no sentence splitting). Memory stays O(1) in the corpus: the
    lengths go to a side file and the index is written in blocks.
    """

    def __init__(self, prefix: Path, dtype: np.dtype):
        self.prefix, self.dtype = Path(prefix), np.dtype(dtype)
        self._lengths_path = Path(f"{prefix}.lengths.partial")
        self._bin = open(bin_path(self.prefix), "wb")
        self._lengths = open(self._lengths_path, "wb")
        self.n_documents = 0
        self.n_tokens = 0

    def add_chunk(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Documents back to back: ``ids`` (sum(lengths),) in the writer's dtype, ``lengths`` (n_docs,)."""
        if ids.dtype != self.dtype or int(lengths.sum()) != len(ids):
            raise ValueError("chunk ids must be in the writer's dtype and match their lengths")
        self._bin.write(np.ascontiguousarray(ids).tobytes())
        self._lengths.write(lengths.astype(np.int32).tobytes())
        self.n_documents += len(lengths)
        self.n_tokens += len(ids)

    def finish(self) -> None:
        self._bin.close()
        self._lengths.close()
        n = self.n_documents
        with open(idx_path(self.prefix), "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, dtype_code(self.dtype), n, n + 1))
            with open(self._lengths_path, "rb") as src:
                while block := src.read(4 * BLOCK):
                    f.write(block)
            offset = 0
            lengths = np.memmap(self._lengths_path, dtype=np.int32, mode="r") if n else np.zeros(0, np.int32)
            for lo in range(0, n, BLOCK):
                nbytes = lengths[lo : lo + BLOCK].astype(np.int64) * self.dtype.itemsize
                ptr = np.cumsum(nbytes) - nbytes + offset
                offset = int(ptr[-1] + nbytes[-1])
                f.write(ptr.tobytes())
            for lo in range(0, n + 1, BLOCK):
                f.write(np.arange(lo, min(n + 1, lo + BLOCK), dtype=np.int64).tobytes())
            del lengths
        os.unlink(self._lengths_path)

    def abort(self) -> None:
        self._bin.close()
        self._lengths.close()
