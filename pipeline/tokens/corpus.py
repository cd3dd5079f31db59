"""Token data: corpus loading, the train/validation split and the packed loader.

Everything here is deterministic and independent of the process layout: the corpus is read in
sorted file order, and the global batch at step s is a pure function of (tokens, seq_len,
global_batch, seed, s). A dp rank only slices its rows out of that global batch, so dp=1 and dp=4
see the same samples at every step, and a run resumed under another dp continues the same stream.
Tensors come back on the CPU; the trainer moves them to its device.
"""
from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import titan_pipe
from titan_pipe.errors import UserError
from titan_pipe.limits import RECORD_BYTES
from titan_pipe.tokens.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer

# The titan_pipe package dir (pipeline/ in the repo, site-packages/titan_pipe when installed).
CORPUS_DIR = Path(titan_pipe.__file__).resolve().parent / "data" / "corpus"
TEXT_SUFFIXES = (".txt", ".jsonl")

def default_corpus() -> Path:
    """The directory of public-domain texts shipped with titan-pipe (see docs/data.md)."""
    return CORPUS_DIR


def corpus_files(path: Path) -> list[Path]:
    """The .txt/.jsonl files of ``path`` (a file, or a directory searched recursively), sorted."""
    if not path.exists():
        raise UserError(f"data.path: {path} does not exist; fix the path or set it to null for the "
                        "shipped corpus")
    if path.is_file():
        if path.suffix not in TEXT_SUFFIXES:
            raise UserError(f"data.path: {path} is not a .txt or .jsonl file; convert it or point at a "
                            "directory of .txt/.jsonl files")
        return [path]
    files = sorted((p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES),
                   key=lambda p: p.relative_to(path).as_posix())
    if not files:
        raise UserError(f"data.path: {path} holds no .txt or .jsonl files; add some or fix the path")
    return files


def _raw_records(path: Path):
    """(line number, bytes) of each record of a data file, read one at a time: a .txt file is one
    record, a .jsonl file one per line. A record larger than titan_pipe.limits.RECORD_BYTES is
    refused before it is read whole (one enormous line would otherwise be decoded, parsed and
    tokenized in memory)."""
    limit = int(RECORD_BYTES.hi)
    fix = (f"split it into records of at most {_size(limit)} (.jsonl: one document per line; "
           ".txt: one document per file)")
    with open(path, "rb") as f:
        if path.suffix == ".txt":
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise UserError(f"{path}: {_size(size)} in one document (a .txt file), over the limit of "
                                f"{_size(limit)} ({RECORD_BYTES.why}); {fix}")
            lines = iter([f.read()])
        else:
            lines = iter(lambda: f.readline(limit + 1), b"")
        for lineno, raw in enumerate(lines, start=1):
            if len(raw) > limit:
                raise UserError(f"{path}:{lineno}: a record over the limit of {_size(limit)} "
                                f"({RECORD_BYTES.why}); {fix}")
            yield lineno, raw


def _size(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n} bytes"


def check_records(path: Path) -> None:
    """Refuse a data file holding a record over the limit, reading it one record at a time."""
    for _ in _raw_records(path):
        pass


def records(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of each record of a data file (see ``_raw_records``)."""
    out = []
    for lineno, raw in _raw_records(path):
        try:
            text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a leading BOM is not text
        except UnicodeDecodeError as e:
            raise UserError(f"{path}:{lineno}: not UTF-8 text (byte {e.start}); re-encode it as UTF-8") from None
        out.append((lineno, text))
    return out


def read_documents(path: Path, *, text_key: str = "text") -> list[str]:
    """A .txt file is one document; a .jsonl file is one document per non-blank line (its text_key)."""
    recs = records(path)
    if path.suffix == ".txt":
        return [recs[0][1] if recs else ""]
    docs = []
    for lineno, line in recs:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise UserError(f"{path}:{lineno}: not valid JSON ({e}); each line must be one JSON object") from None
        if not isinstance(record, dict) or text_key not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise UserError(f"{path}:{lineno}: no {text_key!r} field (found {keys}); set data.text_key to "
                            "the field that holds the text")
        value = record[text_key]
        if not isinstance(value, str):
            raise UserError(f"{path}:{lineno}: field {text_key!r} is a {type(value).__name__}, not a string")
        docs.append(value)
    return docs


def load_tokens(*, path: Path | None, tokenizer: ByteTokenizer | HFTokenizer,
                text_key: str = "text") -> torch.Tensor:
    """Every document of the corpus, each followed by eos, as one 1-D int64 tensor (CPU).

    ``path`` None reads the shipped corpus. Files are read in sorted order, so the stream is the
    same on every rank and every run.
    """
    root = default_corpus() if path is None else Path(path)
    pieces: list[np.ndarray] = []
    eos = np.array([tokenizer.eos_id], dtype=np.int64)
    for f in corpus_files(root):
        docs = [d for d in read_documents(f, text_key=text_key) if d]
        if isinstance(tokenizer, ByteTokenizer):
            encoded = [tokenizer.encode_array(d) for d in docs]
        elif hasattr(tokenizer, "encode_batch"):
            encoded = [np.asarray(ids, dtype=np.int64) for ids in tokenizer.encode_batch(docs)]
        else:
            encoded = [np.asarray(tokenizer.encode(d), dtype=np.int64) for d in docs]
        for ids in encoded:
            if len(ids):
                pieces.extend((ids.astype(np.int64), eos))
    if not pieces:
        raise UserError(f"data.path: {root} holds no text (every document is empty); add text or fix "
                        "data.text_key")
    return torch.from_numpy(np.concatenate(pieces))


def split_train_val(tokens: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The last ``val_fraction`` of the stream is validation, the rest training (views, no copy)."""
    if not 0 <= val_fraction < 1:
        raise UserError(f"data.val_fraction: {val_fraction} must be in [0, 1)")
    n_val = int(len(tokens) * val_fraction)
    cut = len(tokens) - n_val
    return tokens[:cut], tokens[cut:]


def tokens_fingerprint(tokens: torch.Tensor) -> str:
    """A cheap content hash (crc32 of the int64 bytes) so a resume can tell the data changed."""
    return f"{zlib.crc32(tokens.contiguous().numpy().tobytes()):08x}"


@dataclass(frozen=True)
class Batch:
    """inputs, labels: (B_local, T) int64 on the CPU; labels are inputs shifted left by one."""

    inputs: torch.Tensor
    labels: torch.Tensor


class PackedLoader:
    """Packed next-token batches whose global content at each step is independent of dp_size.

    The stream is cut into ``n_seq = (len(tokens) - 1) // seq_len`` windows of seq_len + 1 tokens,
    window i starting at i * seq_len (neighbours share one token, so every token is a label once).
    Each epoch visits the windows in a permutation seeded by (seed, epoch); step s of the epoch
    takes permuted windows [s*B, (s+1)*B) as the global batch (B = global_batch; the tail that does
    not fill a batch is skipped that epoch). dp rank r keeps rows [r*B/dp, (r+1)*B/dp).
    The state is the number of global batches served so far.
    """

    def __init__(self, tokens: torch.Tensor, *, seq_len: int, global_batch: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0, shuffle: bool = True):
        if tokens.ndim != 1:
            raise UserError(f"PackedLoader needs a 1-D token stream, got shape {tuple(tokens.shape)}")
        if seq_len <= 0 or global_batch <= 0:
            raise UserError(f"train.seq_len={seq_len} and train.batch_size={global_batch} must be positive")
        if dp_size <= 0 or not 0 <= dp_rank < dp_size:
            raise UserError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        if global_batch % dp_size:
            raise UserError(f"train.batch_size: {global_batch} is not divisible by dp={dp_size}")
        n_seq = (len(tokens) - 1) // seq_len if len(tokens) > 1 else 0
        if n_seq < global_batch:
            raise UserError(f"the corpus has {len(tokens)} tokens = {n_seq} sequences of seq_len={seq_len}, "
                            f"fewer than one global batch of {global_batch}; use more text or lower "
                            "train.batch_size / train.seq_len (or data.val_fraction)")
        self.tokens = tokens.to(torch.int64)
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.n_seq = n_seq
        self.steps_per_epoch = n_seq // global_batch
        self.step = 0
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.int64)
        # Window offsets as a gather index: (n_seq, seq_len + 1)
        self._span = torch.arange(seq_len + 1, dtype=torch.int64)
        self._fingerprint = tokens_fingerprint(self.tokens)

    @property
    def epoch(self) -> int:
        return self.step // self.steps_per_epoch

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dp_size

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % (2**63))
                self._perm = torch.randperm(self.n_seq, generator=g)
            else:
                self._perm = torch.arange(self.n_seq)
            self._perm_epoch = epoch
        return self._perm

    def global_windows(self, step: int) -> torch.Tensor:
        """Indices (global_batch,) of the windows making up the global batch at ``step``."""
        epoch, i = divmod(step, self.steps_per_epoch)
        return self._order(epoch)[i * self.global_batch:(i + 1) * self.global_batch]

    def batch_at(self, step: int) -> Batch:
        """This rank's rows of the global batch at ``step`` (does not move the position)."""
        rows = self.global_windows(step)[self.dp_rank * self.local_batch:(self.dp_rank + 1) * self.local_batch]
        seq = self.tokens[rows[:, None] * self.seq_len + self._span]  # (B_local, T + 1)
        return Batch(inputs=seq[:, :-1].contiguous(), labels=seq[:, 1:].contiguous())

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), each (B_local, T) int64 on the CPU; advances by one global batch."""
        b = self.batch_at(self.step)
        self.step += 1
        return b.inputs, b.labels

    def state_dict(self) -> dict:
        """JSON-able global position plus what must match on resume (not the dp layout)."""
        return {"step": self.step, "seed": self.seed, "seq_len": self.seq_len,
                "global_batch": self.global_batch, "shuffle": self.shuffle,
                "n_tokens": int(len(self.tokens)), "tokens_crc32": self._fingerprint}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position; any dp_size/dp_rank may load any saved state."""
        mine = self.state_dict()
        for key in ("seed", "seq_len", "global_batch", "shuffle", "n_tokens", "tokens_crc32"):
            if key in state and state[key] != mine[key]:
                raise UserError(f"data loader state: {key} was {state[key]!r} when saved but is "
                                f"{mine[key]!r} now; resume with the same data and train settings, "
                                "or start a fresh run without --resume")
        step = state.get("step")
        if not isinstance(step, int) or step < 0:
            raise UserError(f"data loader state: step {step!r} is not a non-negative integer")
        self.step = step


@dataclass(frozen=True)
class DataSplits:
    tokenizer: ByteTokenizer | HFTokenizer
    train: torch.Tensor  # 1-D int64
    val: torch.Tensor  # 1-D int64, possibly empty
    source: Path | None = None  # the corpus read (None: not recorded)
    n_files: int = 0

    def describe(self) -> str:
        """One log line: where the tokens came from and how they split."""
        where = f"{self.source} ({self.n_files} file{'s' * (self.n_files != 1)})" if self.source else "corpus"
        return (f"data: {where}, {self.tokenizer!r}: {len(self.train) + len(self.val):,} tokens, "
                f"train {len(self.train):,} / val {len(self.val):,}")


def prepare_data(*, path: str | None, tokenizer: str, text_key: str = "text", val_fraction: float = 0.05,
                 base: Path | None = None, vocab_size: int | None = None) -> DataSplits:
    """The config's data section made concrete: tokenizer + train/val token streams.

    Relative paths are read from ``base`` (the flow.yaml's directory). ``vocab_size`` (the model's)
    is checked against the tokenizer so an id can never index past the embedding.
    """
    tok = build_tokenizer(tokenizer, base=base)
    if vocab_size is not None and tok.vocab_size > vocab_size:
        raise UserError(f"model.vocab_size: {vocab_size} is smaller than the tokenizer's {tok.vocab_size} "
                        f"ids ({tok!r}); raise model.vocab_size to at least {tok.vocab_size}")
    root = None
    if path is not None:
        root = Path(path).expanduser()
        if not root.is_absolute() and base is not None:
            root = base / root
    tokens = load_tokens(path=root, tokenizer=tok, text_key=text_key)
    train, val = split_train_val(tokens, val_fraction)
    source = default_corpus() if root is None else root
    return DataSplits(tokenizer=tok, train=train, val=val, source=source, n_files=len(corpus_files(source)))
