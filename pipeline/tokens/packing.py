"""Fine-tuning batches: whole conversations packed into windows, each one seeing only itself.

The training documents of a chat / instruction dataset (titan_pipe.tokens.chat: one conversation a
document, a loss mask beside the tokens) are packed in order, next-fit, into windows of ``seq_len``
tokens (``pack_documents``, pure data: O(documents) integers, never O(tokens)); a conversation
longer than a window is left out and counted. A window's row gives:

- ``inputs``: the conversations back to back, then padding (id 0);
- ``labels``: the next token of the same conversation where that token is an answer token, else
  -100 (ignored): the last token of a conversation predicts nothing, the padding nothing;
- ``positions``: 0, 1, ... restarting at each conversation (and at the padding): RoPE positions,
  and the attention mask, since a query sees only keys of its own conversation (a document starts
  where the position is 0; titan_pipe.model.kernels.document_mask);
- ``targets``: the labels that are not -100 in the whole global batch (every dp rank, every
  microbatch), the denominator that makes the loss the mean over target tokens of the global batch
  however it is split (training sums each part's cross entropy and divides by it).

Windows are visited as PackedLoader visits its windows: a keyed permutation per epoch, the global
batch at step s is permuted windows [s*B, (s+1)*B), dp rank r keeps rows [r*B/dp, (r+1)*B/dp).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from titan_pipe.errors import UserError
from titan_pipe.tokens.loader import STATE_KEYS, Batch, saved_step
from titan_pipe.tokens.shuffle import Permutation, splitmix64

IGNORE = -100  # labels the loss skips (torch's cross-entropy ignore_index)
MAX_TOO_LONG = 0.01  # conversations longer than a window that may be left out before the loader refuses


@dataclass(frozen=True)
class Packing:
    """Windows as lists of documents: window w holds documents ``docs[offsets[w]:offsets[w + 1]]``."""

    docs: np.ndarray  # (n_kept,) int64 document numbers, in order
    offsets: np.ndarray  # (n_windows + 1,) int64
    too_long: np.ndarray  # documents longer than a window, left out

    @property
    def n_windows(self) -> int:
        return len(self.offsets) - 1


def pack_documents(lengths: np.ndarray, seq_len: int) -> Packing:
    """Next-fit packing of documents (token counts ``lengths``, in order) into windows of ``seq_len``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    fits = lengths <= seq_len
    kept = np.flatnonzero(fits)
    offsets = [0]
    fill = 0
    for i, d in enumerate(kept):
        n = int(lengths[d])
        if fill and fill + n > seq_len:
            offsets.append(i)
            fill = 0
        fill += n
    if len(kept):
        offsets.append(len(kept))
    return Packing(kept.astype(np.int64), np.asarray(offsets, dtype=np.int64), np.flatnonzero(~fits))


def window_row(tokens: list[np.ndarray], masks: list[np.ndarray], seq_len: int) -> tuple[np.ndarray, ...]:
    """(inputs, labels, positions) int64 (seq_len,) of one window's documents (see the module doc)."""
    inputs = np.zeros(seq_len, dtype=np.int64)
    labels = np.full(seq_len, IGNORE, dtype=np.int64)
    positions = np.zeros(seq_len, dtype=np.int64)
    at = 0
    for toks, mask in zip(tokens, masks):
        n = len(toks)
        inputs[at : at + n] = toks
        labels[at : at + n - 1] = np.where(mask[1:] != 0, toks[1:], IGNORE)
        positions[at : at + n] = np.arange(n)
        at += n
    positions[at:] = np.arange(seq_len - at)  # the padding: one more "document" nobody else sees
    return inputs, labels, positions


class DocumentLoader:
    """SFT batches of a chat / instruction dataset's training documents (see the module doc).

    ``source``: an OpenedSource (titan_pipe.tokens.dataset) whose record has a loss mask.
    ``next_batch()`` returns a Batch with positions and the global target count.
    """

    def __init__(
        self,
        source,
        *,
        seq_len: int,
        global_batch: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        vocab_size: int | None = None,
    ):
        from titan_pipe.tokens.loss_mask import has_target, open_mask

        rec = source.record
        if rec is None or not rec.loss_mask:
            raise UserError(
                f"{source.path}: train.mode sft trains on chat or instruction data with its answers "
                "marked; prepare it with `titan-pipe data prepare --format chat|instruction "
                "--tokenizer MODEL_DIR` (or set data.format in flow.yaml)"
            )
        if global_batch % dp_size:
            raise UserError(f"train.batch_size: {global_batch} is not divisible by dp={dp_size}")
        self.source, self.ds = source, source.indexed
        self.seq_len, self.global_batch, self.seed, self.shuffle = seq_len, global_batch, seed, shuffle
        self.dp_rank, self.dp_size, self.vocab_size = dp_rank, dp_size, vocab_size
        self.mask = open_mask(self.ds.prefix, self.ds.n_tokens)
        n_docs = rec.split.train_documents
        self.lengths = np.asarray(self.ds.lengths[0:n_docs], dtype=np.int64)
        self.starts = np.concatenate(([0], np.cumsum(self.lengths)))
        if not has_target(self.mask, 0, int(self.starts[-1])):
            raise UserError(
                f"{source.path}: its loss mask marks no target token in the {n_docs} training "
                "conversations, so there is nothing to learn (the loss would be 0); prepare the data "
                "again, with a chat template whose answers are found"
            )
        self.packing = pack_documents(self.lengths, seq_len)
        bad = self.packing.too_long
        if len(bad) > MAX_TOO_LONG * max(1, n_docs):
            d = int(bad[0])
            raise UserError(
                f"{source.path}: {len(bad)} of {n_docs} conversations are longer than train.seq_len "
                f"{seq_len} (the first, document {d}, has {int(self.lengths[d])} tokens); raise "
                f"train.seq_len, or leave them out: data.max_tokens: {seq_len} (raw records in data.path), or "
                f"`titan-pipe data prepare ... --max-tokens {seq_len}` again (a prepared dir)"
            )
        self.n_too_long = len(bad)
        self.n_seq = self.packing.n_windows
        self.steps_per_epoch = self.n_seq // global_batch
        if self.steps_per_epoch == 0:
            raise UserError(
                f"{source.path}: {n_docs} conversations pack into {self.n_seq} windows of "
                f"train.seq_len {seq_len}, fewer than one global batch of {global_batch}; use more "
                "data or lower train.batch_size"
            )
        self.step = 0
        self._perms: dict[int, Permutation] = {}
        self._fingerprint = f"{source.train.fingerprint():08x}"

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dp_size

    def _windows(self, j: np.ndarray) -> np.ndarray:
        epoch, k = np.divmod(j, self.steps_per_epoch * self.global_batch)
        if not self.shuffle:
            return k
        out = k.copy()
        for e in np.unique(epoch):
            e = int(e)
            if e not in self._perms:
                if len(self._perms) > 8:
                    self._perms.clear()
                self._perms[e] = Permutation(self.n_seq, splitmix64(splitmix64(self.seed) ^ e) ^ 0x5F7)
            out[epoch == e] = self._perms[e](k[epoch == e])
        return out

    def _docs(self, w: int) -> np.ndarray:
        p = self.packing
        return p.docs[p.offsets[w] : p.offsets[w + 1]]

    def _row(self, w: int) -> tuple[np.ndarray, ...]:
        docs = self._docs(w)
        toks = [np.asarray(self.ds.tokens[self.starts[d] : self.starts[d + 1]], dtype=np.int64) for d in docs]
        masks = [np.asarray(self.mask[self.starts[d] : self.starts[d + 1]]) for d in docs]
        return window_row(toks, masks, self.seq_len)

    def _targets(self, w: int) -> int:
        """Labels that count in window ``w``: answer tokens that are not a conversation's first."""
        return sum(int(np.count_nonzero(self.mask[self.starts[d] + 1 : self.starts[d + 1]])) for d in self._docs(w))

    def batch_at(self, step: int) -> Batch:
        g = np.arange(step * self.global_batch, (step + 1) * self.global_batch, dtype=np.int64)
        windows = self._windows(g)
        lo = self.dp_rank * self.local_batch
        mine = windows[lo : lo + self.local_batch]
        rows = [self._row(int(w)) for w in mine]
        inputs, labels, positions = (torch.from_numpy(np.stack(x)) for x in zip(*rows))
        if self.vocab_size is not None and int(inputs.max()) >= self.vocab_size:
            raise UserError(
                f"{self.source.path}: token id {int(inputs.max())} is >= model.vocab_size "
                f"{self.vocab_size}; train with the tokenizer the data was made with"
            )
        # this rank's rows count their own labels; the other ranks' rows are counted from their masks
        others = np.concatenate([windows[:lo], windows[lo + self.local_batch :]])
        targets = int((labels != IGNORE).sum()) + sum(self._targets(int(w)) for w in others)
        return Batch(inputs=inputs, labels=labels, positions=positions, targets=targets)

    def next_batch(self) -> Batch:
        b = self.batch_at(self.step)
        self.step += 1
        return b

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "shuffle": self.shuffle,
            "n_tokens": int(self.starts[-1]),
            "tokens_crc32": self._fingerprint,
            "packing": "documents",
        }

    def load_state_dict(self, state: dict) -> None:
        keys = (*STATE_KEYS, "packing")
        self.step = saved_step(state, self.state_dict(), keys, required=keys)
