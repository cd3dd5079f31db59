"""ONNX Runtime, streamed: a deployed graph run one piece at a time (evaluate/graph_pieces.py).

The embedding piece, then decoder layer after decoder layer, then the head. A piece's session
opens when its turn comes and stays open while the budget holds it (``Sessions``: whole-graph
mode keeps every one; streamed mode keeps as many as fit in --max-memory, counted with the
per-piece estimate the mode choice uses, so a budget of one layer holds one session at a time).
Opening a 7B-width layer's session costs ~1.7 s (ONNX Runtime casts its float16 weights to
float32 and prepacks them), and the KV row runs the prefill graph's pieces again after
torch_vs_onnx ran them: what stays open is not paid for twice.
Work is layer-major: every batch (or every decode step) goes through layer i before layer i+1
opens, so each piece opens once. Each layer's piece runs on the chain's own previous output (what
the whole graph computes) and, when asked, separately on the reference's input to that layer
(its own error, apart from what it inherited).

The KV-cache path runs teacher-forced (the tokens of every step are known up front): per layer,
the prefill piece fills that layer's cache slice, then the decode piece runs every step against
it (titan_pipe.graphs.generation's feeds: the deployed loop's host state, step by step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx
import torch

from titan_pipe.errors import UserError
from titan_pipe.evaluate.graph_pieces import Piece, layer_pieces
from titan_pipe.evaluate.memory import release
from titan_pipe.evaluate.runners.ort import OnnxGraph
from titan_pipe.evaluate.runners.outputs import Outputs, OutputsSink
from titan_pipe.graphs.generation import PaddedBatch, cache_of, decode_feeds, ort_session, past_of, prefill_feeds
from titan_pipe.graphs.graph_io import LOGITS, PRESENT, router_name


def _own(a: np.ndarray) -> np.ndarray:
    """A copy of a session's output: an output array keeps the closed session's whole memory arena
    alive as long as it is referenced (measured: ~110 MB per decode layer of a 0.46 B model)."""
    return np.array(a, copy=True)


class Sessions:
    """Open sessions of pieces, shared by the graphs' chains, holding at most ``budget`` bytes by
    ``need(piece)`` (None: no limit, whole mode). A piece that does not fit beside those open
    closes them, newest first: the passes walk the layers in order, so the oldest kept ones are
    the next to come again (evicting the oldest would evict each one just before its turn)."""

    def __init__(self, budget: int | None = None):
        self.budget = budget
        self.open: dict[tuple[int, str], tuple[object, int]] = {}  # (chain, piece) -> (session, bytes)

    @property
    def held(self) -> int:
        return sum(b for _, b in self.open.values())

    def get(self, chain: "LayerChain", piece: Piece):
        key = (id(chain), piece.name)
        if key in self.open:
            return self.open[key][0]
        need = chain.need(piece)
        if self.budget is not None:
            while self.open and self.held + need > self.budget:
                self.open.popitem()  # newest first
                release()
        s = ort_session(
            piece.model,
            threads=chain.graph.threads,
            external_dir=chain.graph.path.parent,
            hint="re-export it with `titan-pipe export`",
            prepack=False,
        )
        if self.budget is None or self.held + need <= self.budget:
            self.open[key] = (s, need)
        return s

    def close(self, chain: "LayerChain") -> None:
        for key in [k for k in self.open if k[0] == id(chain)]:
            del self.open[key]


class LayerChain:
    """One deployed graph as pieces; ``graph.find_layers`` must have found its per-layer values.
    ``sessions``: where its pieces' sessions are kept (shared with the other graph's chain);
    ``need(piece)``: the bytes a piece's session holds (memory.ort_bytes of its weights)."""

    def __init__(self, graph: OnnxGraph, *, sessions: Sessions | None = None, need=None):
        t = graph.taps
        if t is None or t.embed is None:
            why = graph.layers_note or "no per-layer values found"
            raise UserError(
                f"{graph.path}: cannot be evaluated one layer at a time ({why}); re-export it with "
                "`titan-pipe export` (export.json then names the values between layers) or raise "
                "--max-memory so the whole graph fits"
            )
        self.graph, self.taps = graph, t
        self.pieces = layer_pieces(graph.structure, embed=t.embed, layers=t.layer, attn=t.attn, mlp=t.mlp)
        self.layers = self.pieces[1:-1]
        self.sessions = sessions if sessions is not None else Sessions(budget=0)  # alone: one piece at a time
        self.need = need or (lambda p: p.weight_bytes)

    @property
    def largest_piece(self) -> Piece:
        return max(self.pieces, key=lambda p: p.weight_bytes)

    def session(self, piece: Piece):
        """The piece's session: kept from before, or opened now (and kept if the budget holds it)."""
        return self.sessions.get(self, piece)

    def close(self) -> None:
        self.sessions.close(self)
        release()

    def free(self) -> None:
        """After a piece's turn: what was not kept is gone; hand its memory back (streamed)."""
        if self.sessions.budget is not None:
            release()

    def _feeds(self, piece: Piece, graph_feeds: dict, stream) -> dict:
        feeds = {n: graph_feeds[n] for n in piece.graph_inputs}
        if piece.inputs:
            feeds[piece.inputs[0]] = stream
        return feeds

    def boundary_dtype(self, piece: Piece) -> np.dtype:
        """The numpy dtype of the stream a piece takes (the graph's float type)."""
        vi = next(v for v in piece.model.graph.input if v.name == piece.inputs[0])
        return onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)

    def embed(self, feeds: list[dict]) -> list[np.ndarray]:
        piece = self.pieces[0]
        s = self.session(piece)
        out = [_own(s.run(list(piece.outputs), self._feeds(piece, f, None))[0]) for f in feeds]
        del s
        self.free()
        return out

    def head(self, feeds: list[dict], streams: list[np.ndarray], last: bool = False) -> list[np.ndarray]:
        """Logits of each part (B, T, vocab); ``last``: only the last position's (B, vocab)."""
        piece = self.pieces[-1]
        s = self.session(piece)
        out = [_own(s.run([LOGITS], self._feeds(piece, f, h))[0]) for f, h in zip(feeds, streams)]
        del s
        self.free()
        return [o[:, -1] for o in out] if last else out

    def run_layer(
        self, session, i: int, feeds: dict, stream, extra: dict | None = None, copy_cache: bool = True
    ) -> dict[str, np.ndarray]:
        """Layer i's piece on ``stream`` -> {value name: array} of every output it returns;
        ``copy_cache`` False: its ``present.*`` outputs are the session's own arrays (for a caller
        that drops them before the session closes: a static cache is MBs a step to copy)."""
        piece = self.layers[i]
        got = session.run(list(piece.outputs), self._feeds(piece, {**feeds, **(extra or {})}, stream))
        return {n: a if not copy_cache and n.startswith(PRESENT) else _own(a) for n, a in zip(piece.outputs, got)}

    def values(self, i: int, named: dict) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """(attention block, MLP block, layer output) of layer i from a piece's named outputs."""
        t = self.taps
        pick = lambda n: torch.from_numpy(named[n]) if n and n in named else None  # noqa: E731
        return pick(t.attn[i]), pick(t.mlp[i]), torch.from_numpy(named[t.layer[i]])

    def forward(self, feeds: list[dict], sink, inherited: Callable | None = None) -> None:
        """Each part's graph feeds through the chain, layer-major: ``sink.layer(part, i, attn, mlp,
        hidden)`` per layer, ``sink.logits(part, logits)`` at the end; a sink with ``present(part, i,
        named)`` also gets every output of the piece (its KV cache). ``inherited(i, part)``: the
        reference's input to layer i (a tensor, or None for a part without one) to also run the
        piece on, reported through ``sink.own(part, i, hidden)``."""
        streams = self.embed(feeds)
        for i, piece in enumerate(self.layers):
            s = self.session(piece)
            dtype = self.boundary_dtype(piece)
            for b, f in enumerate(feeds):
                named = self.run_layer(s, i, f, streams[b])
                streams[b] = named[self.taps.layer[i]]
                sink.layer(b, i, *self.values(i, named))
                if hasattr(sink, "present"):
                    sink.present(b, i, named)
                routed = named
                ref_in = inherited(i, b) if inherited is not None else None
                if ref_in is not None:
                    routed = self.run_layer(s, i, f, ref_in.numpy().astype(dtype))
                    sink.own(b, i, torch.from_numpy(routed[self.taps.layer[i]]))
                if router_name(i) in routed and hasattr(sink, "router"):  # on the reference's input when given
                    sink.router(b, i, torch.from_numpy(routed[router_name(i)]))
            del s
            self.free()
        for b, logits in enumerate(self.head(feeds, streams)):
            sink.logits(b, torch.from_numpy(logits))

    def outputs(self, feeds: list[dict]) -> list[Outputs]:
        """Each part through the chain, every layer's values and the logits kept (small models, tests)."""
        sink = OutputsSink(len(feeds), len(self.layers))
        self.forward(feeds, sink)
        return sink.outputs

    def logits(self, feeds: list[dict]) -> list[torch.Tensor]:
        """Each part's logits (B, T, vocab) through the chain (no per-layer values kept)."""
        sink = LogitsSink()
        self.forward(feeds, sink)
        return [sink.got[b] for b in range(len(feeds))]


class LogitsSink:
    def __init__(self):
        self.got = {}

    def layer(self, *_):
        pass

    def logits(self, part: int, logits: torch.Tensor) -> None:
        self.got[part] = logits


class JoinedSink:
    """Several sinks over one forward: ``groups`` [(sink, number of parts), ...] take the parts in
    that order, each renumbered from 0, so one pass of the pieces serves several rows' sequences."""

    def __init__(self, groups: list[tuple[object, int]]):
        self.route: list[tuple[object, int]] = [(sink, p) for sink, n in groups for p in range(n)]

    def __getattr__(self, hook: str):
        if hook.startswith("_") or hook == "route" or not any(hasattr(sink, hook) for sink, _ in self.route):
            raise AttributeError(hook)

        def call(part: int, *args):
            sink, p = self.route[part]
            if hasattr(sink, hook):
                getattr(sink, hook)(p, *args)

        return call


@dataclass
class Prefilled:
    """The prefill graph's run over the loop's padded batches: per layer, per batch, its present.*
    values under the decode graph's past.* names ({name: (B, Hkv, T, hd)}: the prompt positions
    only; ``cache`` places them in the decode graph's cache of C slots when that layer's turn
    comes, so what is held for every layer at once grows with the prompts, not with C); per batch,
    the logits of the last prompt position (B, vocab), which choose new token 0. It depends on the
    prompts only, never on the tokens forced after them, so every teacher-forced run of the same
    prompts shares it."""

    caches: list[list[dict]]
    first: list[np.ndarray]

    def cache(self, i: int, batch: PaddedBatch, b: int) -> dict:
        """Layer i's cache of batch ``b`` as the decode graph takes it ({past.*: (B, Hkv, C, hd)})."""
        return {n: cache_of(v, batch.cache_len) for n, v in self.caches[i][b].items()}


class PrefillSink:
    """Collects a Prefilled from a prefill chain's forward over the padded batches of ``plan``."""

    def __init__(self, plan: list[PaddedBatch], n_layers: int):
        self.plan = plan
        self.caches: list[list[dict]] = [[{} for _ in plan] for _ in range(n_layers)]
        self.first: list[np.ndarray | None] = [None] * len(plan)

    def layer(self, *_):
        pass

    def present(self, b: int, i: int, named: dict) -> None:
        self.caches[i][b] = {past_of(n): _own(v) for n, v in named.items() if n.startswith(PRESENT)}

    def logits(self, b: int, logits: torch.Tensor) -> None:
        self.first[b] = logits[:, -1].numpy().copy()  # not a view keeping every position's logits

    def result(self) -> Prefilled:
        return Prefilled(self.caches, list(self.first))


def prefill(chain: LayerChain, plan: list[PaddedBatch]) -> Prefilled:
    """The prefill graph's pieces over the loop's padded batches, layer-major."""
    sink = PrefillSink(plan, len(chain.layers))
    chain.forward([prefill_feeds(pb) for pb in plan], sink)
    return sink.result()


def forced_steps(
    pre: Prefilled, decode: LayerChain, plan: list[PaddedBatch], n_new: int, sink=None
) -> list[np.ndarray]:
    """The generation loop teacher-forced onto each batch's ``forced`` tokens, layer-major: per
    batch, logits (B, n_new, vocab) float32, row k predicting new token k. ``sink.step(batch, k, i,
    attn, mlp, hidden)`` gets decode.onnx's layer-i values of decode step k (feeding new token k+1).
    ``pre``: the prefill graph's run over these prompts (``prefill``, or the torch_vs_onnx row's
    pass, which runs them beside its batches so the prefill pieces open once for both)."""
    steps = [(b, k, decode_feeds(pb, k, pb.forced[:, k])) for b, pb in enumerate(plan) for k in range(n_new - 1)]
    if steps:
        s_dec = decode.embed([f for _, _, f in steps])
        for i in range(len(decode.layers)):
            s = decode.session(decode.layers[i])
            for j, (b, k, f) in enumerate(steps):  # batch by batch, step by step: each step's cache is the last one's
                if k == 0:  # one batch's cache at a time (a static cache is C slots a layer, whatever the
                    cache = named = None  # prompt): the last batch's is gone before this one is made
                    cache = pre.cache(i, plan[b], b)
                named = decode.run_layer(s, i, f, s_dec[j], cache, copy_cache=False)
                s_dec[j] = named[decode.taps.layer[i]]
                cache = {past_of(n): v for n, v in named.items() if n.startswith(PRESENT)}
                if sink is not None:
                    sink.step(b, k, i, *decode.values(i, named))
            del s, named, cache  # the last step's cache is the session's arrays: gone before it may close
            decode.free()
    later = decode.head([f for _, _, f in steps], s_dec, last=True) if steps else []
    out = []
    for b in range(len(plan)):
        mine = [later[j] for j, (bb, _, _) in enumerate(steps) if bb == b]
        out.append(np.stack([pre.first[b], *mine], axis=1).astype(np.float32))
    return out
