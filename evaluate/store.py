"""The values each side of a comparison computed (per-layer tensors and logits, per batch), kept in
memory or spilled to disk, so what a comparison holds at once is one layer's or one batch's worth.

Keys are ``(side, kind, layer, part)`` with kind "hidden" / "attn" / "mlp" (layer i) or "logits"
(layer None); ``part`` numbers the batches (or prompts) of that side. Whole-graph mode keeps them
in memory; streamed mode writes each to a file in a temp dir and reads it back memory-mapped.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from titan_pipe.evaluate.runners.outputs import Outputs

KINDS = ("attn", "mlp", "hidden")  # a layer's values in computation order


class ValueStore:
    def __init__(self, *, spill: bool):
        self._mem: dict[tuple, torch.Tensor] = {}
        self._dir = Path(tempfile.mkdtemp(prefix="titan-eval-values-")) if spill else None
        self._files: dict[tuple, Path] = {}

    @property
    def spills(self) -> bool:
        return self._dir is not None

    def put(self, key: tuple, value) -> None:
        """Keep ``value`` (a tensor or numpy array; None is not stored) under ``key``."""
        if value is None:
            return
        t = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(value))
        t = t.detach().to("cpu").contiguous()
        if self._dir is None:
            self._mem[key] = t
            return
        path = self._dir / f"{len(self._files)}.pt"
        torch.save(t, path)
        self._files[key] = path

    def get(self, key: tuple) -> torch.Tensor | None:
        if self._dir is None:
            return self._mem.get(key)
        path = self._files.get(key)
        return None if path is None else torch.load(path, mmap=True, weights_only=True)

    def put_outputs(self, side: str, part: int, out: Outputs) -> None:
        """One batch's Outputs of ``side``: its logits and each layer's values."""
        self.put((side, "logits", None, part), out.logits if out.logits.numel() else None)
        for kind, values in zip(KINDS, (out.attn, out.mlp, out.hidden)):
            for i, v in enumerate(values):
                self.put((side, kind, i, part), v)

    def close(self) -> None:
        self._mem.clear()
        self._files.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


@dataclass(frozen=True)
class Values:
    """One side's values in a store over ``parts`` batches: a layer's tensor joined along ``dim``."""

    store: ValueStore
    side: str
    n_layers: int
    parts: int
    dim: int = 0  # 0: batches stack along B; 1: steps along T

    def layer(self, kind: str, i: int) -> torch.Tensor | None:
        """Layer i's ``kind`` value over every part (None where any part lacks it)."""
        got = [self.store.get((self.side, kind, i, p)) for p in range(self.parts)]
        return None if any(g is None for g in got) else torch.cat(got, dim=self.dim)

    def logits(self, part: int) -> torch.Tensor | None:
        return self.store.get((self.side, "logits", None, part))

    @property
    def has_layers(self) -> bool:
        return self.n_layers > 0 and self.store.get((self.side, "hidden", 0, 0)) is not None

    def outputs(self) -> Outputs:
        """Everything as one Outputs (for callers that want it whole: small models, tests)."""
        logits = [self.logits(p) for p in range(self.parts)]
        lists = [[self.layer(k, i) for i in range(self.n_layers)] for k in KINDS] if self.has_layers else [[]] * 3
        lg = torch.cat(logits, dim=self.dim) if all(x is not None for x in logits) else torch.empty(0)
        return Outputs(lg, lists[2], lists[0], lists[1])


class StoreSink:
    """A LayerSink (runners) writing into a store: sequence ``j`` of a forward is ``parts[j]`` =
    (side, part); the reference's embedding output goes under kind "embed", a piece's output on the
    reference's input (its own error) under kind "own"."""

    def __init__(self, store: ValueStore, parts: list[tuple[str, int]]):
        self.store, self.parts = store, parts

    def embed(self, seq: int, h: torch.Tensor) -> None:
        side, part = self.parts[seq]
        self.store.put((side, "embed", None, part), h)

    def layer(self, seq: int, i: int, attn, mlp, hidden) -> None:
        side, part = self.parts[seq]
        for kind, v in zip(KINDS, (attn, mlp, hidden)):
            self.store.put((side, kind, i, part), v)

    def router(self, seq: int, i: int, chosen) -> None:
        """Layer i's experts per token (N, k) of a mixture of experts, under kind "router"."""
        side, part = self.parts[seq]
        self.store.put((side, "router", i, part), chosen)

    def own(self, seq: int, i: int, hidden) -> None:
        side, part = self.parts[seq]
        self.store.put((side, "own", i, part), hidden)

    def logits(self, seq: int, logits) -> None:
        side, part = self.parts[seq]
        self.store.put((side, "logits", None, part), logits)
