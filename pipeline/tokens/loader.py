"""The packed next-token loader: the same global batch at every step for any dp, resumable under any dp.

A dataset of N tokens is cut into ``n_seq = (N - 1) // seq_len`` windows of seq_len + 1 tokens,
window i starting at token i * seq_len (neighbours share one token, so every token is a label
once). The global batch at step s is samples [s*B, (s+1)*B) of a deterministic sample stream;
dp rank r keeps rows [r*B/dp, (r+1)*B/dp) and reads only those windows from the files.

- One dataset: an epoch is ``n_seq // B`` steps (the tail that does not fill a batch is skipped
  that epoch); sample k of epoch e is window perm_e(k), perm_e a keyed bijection of [0, n_seq)
  (titan_pipe.tokens.shuffle) with key (seed, epoch).
- A blend: sample j goes to component d and its sample number s by the block schedule
  (titan_pipe.tokens.blend); component d's sample s is window perm_{d,e}(s mod n_seq_d), e = s // n_seq_d.

Nothing here is O(tokens) or O(windows): the loader holds the spans (open files) and a few
small tables. Tensors come back on the CPU; the trainer moves them to its device.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch

from titan_pipe.errors import UserError
from titan_pipe.tokens.blend import BlendSchedule
from titan_pipe.tokens.dataset import TokenSpan
from titan_pipe.tokens.shuffle import Permutation, splitmix64

STATE_KEYS = ("seed", "seq_len", "global_batch", "shuffle", "n_tokens", "tokens_crc32", "blend")


@dataclass(frozen=True)
class Batch:
    """inputs, labels: (B_local, T) int64 on the CPU; labels are inputs shifted left by one.

    Fine-tuning batches (titan_pipe.tokens.packing) add ``positions`` (B_local, T) restarting at
    each packed document, labels -100 where nothing is learned, and ``targets``, the labels that
    count in the whole global batch (the loss's denominator)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None
    targets: int | None = None


def as_parts(data) -> list[tuple[TokenSpan, float]]:
    """A 1-D tensor/array, a TokenSpan, or [(TokenSpan, weight), ...] as weighted spans."""
    if isinstance(data, list):
        return data
    if isinstance(data, TokenSpan):
        return [(data, 1.0)]
    tokens = data.numpy() if isinstance(data, torch.Tensor) else np.asarray(data)
    if tokens.ndim != 1:
        raise UserError(f"PackedLoader needs a 1-D token stream, got shape {tuple(tokens.shape)}")
    return [(TokenSpan(tokens, 0, len(tokens)), 1.0)]


class PackedLoader:
    """Packed (inputs, labels) batches over one dataset or a weighted blend (see the module doc).

    The state is the number of global batches served so far (``step``).
    """

    def __init__(
        self,
        data,
        *,
        seq_len: int,
        global_batch: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        vocab_size: int | None = None,
    ):
        if seq_len <= 0 or global_batch <= 0:
            raise UserError(f"train.seq_len={seq_len} and train.batch_size={global_batch} must be positive")
        if dp_size <= 0 or not 0 <= dp_rank < dp_size:
            raise UserError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        if global_batch % dp_size:
            raise UserError(f"train.batch_size: {global_batch} is not divisible by dp={dp_size}")
        self.parts = as_parts(data)
        self.seq_len, self.global_batch, self.seed, self.shuffle = seq_len, global_batch, seed, shuffle
        self.dp_rank, self.dp_size, self.vocab_size = dp_rank, dp_size, vocab_size
        self.n_windows = [self._windows(span) for span, _ in self.parts]
        self.n_seq = sum(self.n_windows)
        self.steps_per_epoch = self.n_seq // global_batch
        self.blend = BlendSchedule([w for _, w in self.parts]) if len(self.parts) > 1 else None
        if self.blend is not None and 0 in self.blend.counts:
            d = self.blend.counts.index(0)
            raise UserError(
                f"data.blend: weight {self.parts[d][1]:.3g} of {self.parts[d][0].name} is below "
                f"1/{self.blend.block} of the total; raise it or drop the entry"
            )
        # Samples per epoch of each component: whole batches for one dataset, every window in a blend.
        self.epoch_len = [self.steps_per_epoch * global_batch] if self.blend is None else list(self.n_windows)
        self.step = 0
        self._perms: dict[tuple[int, int], Permutation] = {}
        self._fingerprint = self._crc()

    def _windows(self, span: TokenSpan) -> int:
        n_seq = (len(span) - 1) // self.seq_len if len(span) > 1 else 0
        if n_seq < (self.global_batch if len(self.parts) == 1 else 1):
            raise UserError(
                f"{span.name}: {len(span):,} tokens = {n_seq} sequences of seq_len={self.seq_len}, "
                f"fewer than one global batch of {self.global_batch}; use more text or lower "
                "train.batch_size / train.seq_len (or data.val_fraction)"
            )
        return n_seq

    def _crc(self) -> str:
        crc = 0
        for span, _ in self.parts:
            crc = zlib.crc32(span.fingerprint().to_bytes(4, "little"), crc)
        return f"{crc:08x}"

    @property
    def epoch(self) -> int:
        return self.step // self.steps_per_epoch

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dp_size

    def _perm(self, component: int, epoch: int) -> Permutation:
        key = (component, epoch)
        if key not in self._perms:
            if len(self._perms) > 8:  # an epoch boundary: older keys are not asked for again
                self._perms.clear()
            mixed = splitmix64(splitmix64(splitmix64(self.seed) ^ epoch) ^ component)
            self._perms[key] = Permutation(self.n_windows[component], mixed)
        return self._perms[key]

    def samples(self, j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(component, window) of sample numbers ``j`` (n,) of the stream."""
        comp, s = (np.zeros_like(j), j) if self.blend is None else self.blend(j)
        windows = np.empty_like(j)
        for d in np.unique(comp):
            at = comp == d
            epoch, k = np.divmod(s[at], self.epoch_len[d])
            out = k.copy()
            if self.shuffle:
                for e in np.unique(epoch):
                    out[epoch == e] = self._perm(int(d), int(e))(k[epoch == e])
            windows[at] = out
        return comp, windows

    def global_windows(self, step: int) -> torch.Tensor:
        """Window indices (global_batch,) of the global batch at ``step`` (of its component in a blend)."""
        j = np.arange(step * self.global_batch, (step + 1) * self.global_batch, dtype=np.int64)
        return torch.from_numpy(self.samples(j)[1])

    def batch_at(self, step: int) -> Batch:
        """This rank's rows of the global batch at ``step`` (does not move the position)."""
        lo = step * self.global_batch + self.dp_rank * self.local_batch
        comp, windows = self.samples(np.arange(lo, lo + self.local_batch, dtype=np.int64))
        T = self.seq_len
        seq = np.stack([self.parts[d][0].read(w * T, w * T + T + 1) for d, w in zip(comp, windows)])
        if self.vocab_size is not None and seq.size and int(seq.max()) >= self.vocab_size:
            row = int(np.argmax(seq.max(axis=1)))
            span = self.parts[comp[row]][0]
            raise UserError(
                f"{span.name}: token id {int(seq.max())} at token {int(windows[row]) * T:,} is >= "
                f"model.vocab_size {self.vocab_size}; train with the tokenizer the data was made "
                "with, or raise model.vocab_size"
            )
        seq = torch.from_numpy(seq)  # (B_local, T + 1)
        return Batch(inputs=seq[:, :-1].contiguous(), labels=seq[:, 1:].contiguous())

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), each (B_local, T) int64 on the CPU; advances by one global batch."""
        b = self.batch_at(self.step)
        self.step += 1
        return b.inputs, b.labels

    def state_dict(self) -> dict:
        """JSON-able global position plus what must match on resume (not the dp layout)."""
        state = {
            "step": self.step,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "shuffle": self.shuffle,
            "n_tokens": sum(len(s) for s, _ in self.parts),
            "tokens_crc32": self._fingerprint,
        }
        if self.blend is not None:
            state["blend"] = [round(w, 12) for _, w in self.parts]
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position; any dp_size/dp_rank may load any saved state."""
        self.step = saved_step(state, self.state_dict(), STATE_KEYS, required=("blend",))


def saved_step(state: dict, mine: dict, keys, *, required) -> int:
    """The step of a saved loader ``state`` once each of ``keys`` is checked to equal ``mine``'s (a key
    the state lacks is not checked unless it is ``required``): one line naming the first that differs."""
    for key in keys:
        if state.get(key) != mine.get(key) and (key in state or key in required):
            raise UserError(
                f"data loader state: {key} was {state.get(key)!r} when saved but is "
                f"{mine.get(key)!r} now; resume with the same data and train settings, "
                "or start a fresh run without --resume"
            )
    step = state.get("step")
    if not isinstance(step, int) or step < 0:
        raise UserError(f"data loader state: step {step!r} is not a non-negative integer")
    return step
