"""The PyTorch reference: the model's own decoder blocks, driven one layer at a time.

The blocks are titan_pipe.model.transformer's ``TransformerBlock`` with the training operators
(titan_pipe.model.kernels), in float32, fed exactly as ``Transformer.forward`` feeds them
(embedding, RoPE rows of each position, layer after layer, final norm, output). Weights come
from a WeightSource (titan_pipe.model.weights: a unified dir's safetensors, or a checkpoint's
shards assembled by its manifest), one layer's at a time:

  resident (whole-graph mode)  every layer read once and kept
  streamed                     a layer read when its turn comes and dropped after

Linear layers (every 2-D weight: attention and feed-forward projections, a router, the output
projection) keep their weights as stored: ``StoredLinear`` casts them to float32 a cache-sized band
at a time while multiplying, with the float32 result of the whole cast weight (checked on the first
call of each shape). So the reference holds a bfloat16 model at its stored size, not twice it, and
a streamed layer's linear weights are used as stored, never cast whole: from a unified dir, where
its file's pages are (each file mapped once; one madvise(MADV_POPULATE_READ) faults a tensor's pages
in, a third of the time reading them takes, and MADV_DONTNEED takes them out again after the layer),
else by plain file reads into one buffer every layer and the head reuse. Everything else (norms,
biases, a mixture of experts' stacked experts) is float32: streamed, cast into one arena every
layer reuses (a fresh float32 copy is memory the system must map and zero first, about half of
each read; the cast is the same exact conversion either way, and each weight starts on a 64-byte
boundary as a fresh tensor's does).

Measured (benchmarks/evaluate.py --linear: 2 cores, a bfloat16 32000 x 2048 projection, 2 input
rows): cast whole then multiply 105 ms, float32 copy held 31 ms, banded from bfloat16 14 ms. Greedy
generation reads every layer and the output projection once a step, so this is most of its time.

``forward`` runs token sequences layer-major (each layer loaded once for all of them) and hands
each layer's values to a sink; ``greedy`` generates with a per-layer KV cache (one new token a
step: the same blocks, the attention kernel prepending the cached keys and values).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from titan_pipe.evaluate.memory import release
from titan_pipe.evaluate.runners.outputs import Outputs, OutputsSink
from titan_pipe.model import features
from titan_pipe.model.args import ModelArgs
from titan_pipe.model.kernels import Kernels, norm_for, reference_kernels
from titan_pipe.model.params import native_shapes
from titan_pipe.model.transformer import TransformerBlock, rope_cos_sin, scale_embeddings

_ALIGN = 16  # float32 elements: 64 bytes, where the CPU allocator starts every tensor


class LayerSink(Protocol):
    """Receives a forward's values, on the CPU: ``embed(seq, h)`` (B, T, dim) the stream entering
    layer 0, ``layer(seq, i, attn, mlp, hidden)`` (each (B, T, dim)) as layer i finishes a sequence,
    ``logits(seq, logits)`` (B, T, vocab) at the end."""

    def embed(self, seq: int, h: torch.Tensor) -> None: ...

    def layer(self, seq: int, i: int, attn: torch.Tensor, mlp: torch.Tensor, hidden: torch.Tensor) -> None: ...

    def logits(self, seq: int, logits: torch.Tensor) -> None: ...


class _CachedAttention:
    """The attention kernel with a KV cache. ``past`` None: the block's tokens attend causally among
    themselves. ``past`` a list (one (keys, values) (1, Hkv, S_r, hd) per batch row, each row its
    own length): each row's one new token attends to its cached positions and itself (under a
    sliding window, the last ``window`` of them). ``seen`` is each row's keys and values so far, the
    next step's ``past``."""

    def __init__(self, base: Callable):
        self.base, self.past, self.seen = base, None, None

    def __call__(self, q, k, v, *, n_rep: int, causal: bool = True, **kw):
        if self.past is None:
            self.seen = [(k[r : r + 1], v[r : r + 1]) for r in range(k.shape[0])]
            return self.base(q, k, v, n_rep=n_rep, causal=causal, **kw)
        if q.shape[2] != 1:
            raise ValueError("the cached reference takes one new token a step")
        window = kw.pop("window", None)
        out, self.seen = [], []
        for r, (pk, pv) in enumerate(self.past):
            kr, vr = torch.cat([pk, k[r : r + 1]], dim=2), torch.cat([pv, v[r : r + 1]], dim=2)
            self.seen.append((kr, vr))
            if window is not None:  # a row's cache holds its positions 0..t: the window is its tail
                kr, vr = kr[:, :, -window:], vr[:, :, -window:]
            out.append(self.base(q[r : r + 1], kr, vr, n_rep=n_rep, causal=False, **kw))
        return torch.cat(out)


class LayeredModel:
    """The reference model over a WeightSource; ``keep``: resident (True) or streamed (False)."""

    def __init__(
        self,
        source,
        *,
        device: str = "cpu",
        kernels: Kernels | None = None,
        keep: bool = True,
        label: str = "torch float32",
    ):
        self.source, self.args, self.device, self.keep, self.label = source, source.args, device, keep, label
        self.dtype = "float32"
        self._attn = _CachedAttention((kernels or reference_kernels()).attention)
        self.kernels = replace(kernels or reference_kernels(), attention=self._attn)
        # table name -> (cos, sin): one per features.rope_tables (Gemma 3's sliding layers: their own base)
        self._tables = {
            table.name: tuple(t.to(device) for t in rope_cos_sin(self.args, table=table))
            for table in features.rope_tables(self.args)
        }
        self._layer_rope = tuple(features.layer_rope(self.args, i) for i in range(self.args.n_layers))
        self._blocks: dict[int, TransformerBlock] = {}
        self._tops: dict[tuple[str, bool], torch.Tensor] = {}
        self._arena: torch.Tensor | None = None  # streamed: one block's float32 parameters besides its linears
        self._used = 0  # float32 elements of the arena handed out for the block being read
        self._exact: dict = {}  # StoredLinear's banding checks, per (dtype, shape)
        self._stored: torch.Tensor | None = None  # streamed: one block's (or the head's) linear weights as stored
        self._stored_used = self._stored_need = 0
        self._mapped = False  # streamed: some weight is used from its file's pages (_map)

    @property
    def stored_itemsize(self) -> int:
        """Bytes per element of the linear layers' weights as stored (what the reference holds of them)."""
        return self.source.stored_dtype("layers.0.attention.wq.weight").itemsize

    # -- weights ---------------------------------------------------------------------------------

    def _weight(self, name: str, *, cast: bool = True) -> torch.Tensor:
        t = self.source.full(name)
        return (t.to(torch.float32) if cast else t).to(self.device)

    def _linear(self, name: str, shape, bias: str | None = None) -> "StoredLinear":
        """The linear layer of weight ``name`` (of ``shape``) as stored: resident, the source's own
        tensor (a unified dir's memory-mapped file); streamed, read into the stored arena after what
        this block (or the head) took already. Its bias, if any, in float32."""
        if self.keep:
            w = self._weight(name, cast=False)
        elif (w := self._map(name)) is not None:
            w = w.view(shape)
        else:
            dtype = self.source.stored_dtype(name)
            start = -(-self._stored_used // 64) * 64
            self._stored_used = start + _numel(shape) * dtype.itemsize
            if self._stored is None or self._stored.numel() < self._stored_need:
                self._stored = None
                self._stored = torch.empty(self._stored_need, dtype=torch.uint8, device=self.device)
            w = self.source.read_into(name, self._stored[start : self._stored_used].view(dtype).view(shape))
        b = self._weight(bias) if bias is not None else None
        linear = StoredLinear(w, b, exact=self._exact)
        ab = self.source.adapter(name) if hasattr(self.source, "adapter") else None
        if ab is None:
            return linear
        return AdaptedLinear(linear, *(t.to(torch.float32).to(self.device) for t in ab), self.source.lora.scale)

    def _reserve_stored(self, nbytes: int) -> None:
        """Streamed: the linear layers of the block (or head) about to be read take at most
        ``nbytes`` of the stored-weights arena, made (or grown) when a weight is first read into it
        rather than mapped (``_map``); refilled by plain reads."""
        self._stored_used = 0
        self._stored_need = nbytes + 64 * 64

    def _map(self, name: str) -> torch.Tensor | None:
        """Streamed, from a unified dir on the CPU: the weight as stored, a view of its file's pages
        (titan_pipe.model.weights.SafetensorsWeights.mapped), taken out of this process again by
        ``_evict`` once its layer is done. Faulting the pages in costs a third of reading them into
        the arena (88 MB: 6.5 ms vs 22 ms here), and a greedy step does it for every layer."""
        if self.device != "cpu" or not hasattr(self.source, "mapped"):
            return None
        w = self.source.mapped(name)
        self._mapped = self._mapped or w is not None
        return w

    def _evict(self) -> None:
        if self._mapped:
            self.source.evict()
        self._mapped = False

    def _in_arena(self, name: str) -> torch.Tensor:
        """Streamed: parameter ``name`` cast into the arena after what this block took already;
        the block read before must not be used after this."""
        stored = self.source.full(name)
        start = -(-self._used // _ALIGN) * _ALIGN
        self._used = start + stored.numel()
        return self._arena[start : self._used].view(stored.shape).copy_(stored)

    def _reserve(self, nbytes: int) -> None:
        """Streamed: an arena of at least ``nbytes`` for the block about to be read (grown when a
        block needs more; nothing read before is used after)."""
        self._used = 0
        if self.keep:
            return
        most = nbytes + 4 * _ALIGN * 64
        if self._arena is None or 4 * self._arena.numel() < most:
            self._arena = None
            self._arena = torch.empty(most // 4, dtype=torch.float32, device=self.device)

    def _layer_weight(self, name: str) -> torch.Tensor:
        return self._weight(name) if self.keep else self._in_arena(name)

    def _load_block(self, i: int) -> TransformerBlock:
        """Decoder layer i: its linear layers over their stored weights (StoredLinear), the rest
        (norms, a mixture of experts' stacked experts) in float32, streamed into the arena."""
        with torch.device("meta"):
            block = TransformerBlock(self.args, self.kernels, i)
        if block.moe is not None:
            block.moe.keep_choices = True  # the router row compares them (evaluate/comparisons/router.py)
        linears = [(name, m) for name, m in block.named_modules() if isinstance(m, torch.nn.Linear)]
        self._reserve_stored(
            sum(
                m.weight.numel() * self.source.stored_dtype(f"layers.{i}.{name}.weight").itemsize + 64
                for name, m in linears
            )
        )
        for name, module in linears:
            owner, _, leaf = name.rpartition(".")
            bias = f"layers.{i}.{name}.bias" if module.bias is not None else None
            setattr(
                block.get_submodule(owner), leaf, self._linear(f"layers.{i}.{name}.weight", module.weight.shape, bias)
            )
        rest = list(block.named_parameters())
        self._reserve(4 * sum(p.numel() + _ALIGN for _, p in rest))
        for name, _ in rest:
            owner, _, leaf = name.rpartition(".")
            setattr(
                block.get_submodule(owner),
                leaf,
                torch.nn.Parameter(self._layer_weight(f"layers.{i}.{name}"), requires_grad=False),
            )
        return block.eval()

    def block(self, i: int) -> TransformerBlock:
        """Decoder layer i in float32 on the device (read now, or kept from before when resident)."""
        if i in self._blocks:
            return self._blocks[i]
        block = self._load_block(i)
        if self.keep:
            self._blocks[i] = block
        self._release()
        return block

    def _top(self, name: str, cast: bool) -> torch.Tensor:
        """A weight outside the layers: the embedding table or the output projection as stored (cast
        False; tied embeddings: the one table both gathers and projects), the final norm in float32."""
        key = (name, cast)
        if key in self._tops:
            return self._tops[key]
        t = self._weight(name, cast=cast)
        if self.keep:
            self._tops[key] = t
        return t

    def _release(self) -> None:
        """Close the source's open files between layers, so mapped pages do not add up (streamed)."""
        if not self.keep and hasattr(self.source, "close"):
            self.source.close()

    def _free(self) -> None:
        if not self.keep:
            self._evict()
            release()

    def drop(self) -> None:
        """Forget every layer kept (whole mode, once the reference's values are all computed)."""
        self._blocks.clear()
        self._tops.clear()
        self._arena = self._stored = None
        release()

    def load_all(self) -> "LayeredModel":
        """Read every layer now (resident mode), so load time is not counted in the first forward."""
        for i in range(self.args.n_layers):
            self.block(i)
        return self

    # -- pieces of the forward ------------------------------------------------------------------

    def embed(self, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
        """(B, T) ids each -> (B, T, dim) float32: rows gathered in the stored dtype, then cast (exact)."""
        table = self._top("tok_embeddings.weight", cast=False)
        return [scale_embeddings(F.embedding(t.to(self.device), table).to(torch.float32), self.args) for t in seqs]

    def head(self, hs: list[torch.Tensor]) -> list[torch.Tensor]:
        """(B, T, dim) each -> logits (B, T, vocab) float32 on the CPU: final norm, output projection."""
        norm_name, out_name = _head_names(self.args)
        norm = self._top(norm_name, cast=True)
        if self.keep:
            out = StoredLinear(self._top(out_name, cast=False), None, exact=self._exact)
        else:
            shape = native_shapes(self.args)[out_name]
            self._reserve_stored(_numel(shape) * self.source.stored_dtype(out_name).itemsize + 64)
            out = self._linear(out_name, shape)
        norm_of = norm_for(self.kernels, features.offset_norms(self.args))
        logits = [out(norm_of(h, norm, self.args.norm_eps)).to("cpu") for h in hs]
        del out
        self._evict()
        self._release()
        return logits

    def _table(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE (cos, sin) tables layer ``layer`` rotates with."""
        return self._tables[self._layer_rope[layer]]

    def _rope(self, start: int, n: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._table(layer)
        return cos[start : start + n], sin[start : start + n]

    @torch.no_grad()
    def run_block(
        self, block: TransformerBlock, h: torch.Tensor, start: int = 0, rope=None, *, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer output, attention block output, MLP block output for ``h`` (B, T, dim) at positions
        start..start+T-1, or at each row's own positions given as ``rope`` (cos, sin) (a cached step:
        ``self._attn.past`` set by the caller)."""
        got = {}
        hooks = [
            block.attention.register_forward_hook(lambda _m, _i, o: got.__setitem__("attn", o)),
            (block.moe or block.feed_forward).register_forward_hook(lambda _m, _i, o: got.__setitem__("mlp", o)),
        ]
        try:
            out = block(h, *(rope if rope is not None else self._rope(start, h.shape[1], layer)))
        finally:
            for hk in hooks:
                hk.remove()
        return out, got["attn"], got["mlp"]

    # -- what the comparisons call ---------------------------------------------------------------

    @torch.no_grad()
    def forward(self, seqs: list[torch.Tensor], sink: LayerSink) -> None:
        """Every sequence (B, T) int64 through the model, layer-major: layer i is loaded once for all."""
        h = self.embed(seqs)
        for j, x in enumerate(h):
            sink.embed(j, x.to("cpu"))
        self._attn.past = None
        for i in range(self.args.n_layers):
            block = self.block(i)
            for j, x in enumerate(h):
                h[j], attn, mlp = self.run_block(block, x, layer=i)
                sink.layer(j, i, attn.to("cpu"), mlp.to("cpu"), h[j].to("cpu"))
                if block.moe is not None and hasattr(sink, "router"):  # the experts it chose per token
                    sink.router(j, i, block.moe.chosen.to("cpu"))
            del block
            self._free()
        for j, logits in enumerate(self.head(h)):
            sink.logits(j, logits)

    @classmethod
    def from_path(
        cls, path, *, device: str = "cpu", kernels: Kernels | None = None, keep: bool = True, label: str | None = None
    ) -> "LayeredModel":
        """A unified model dir or a checkpoint step dir (titan_pipe.model.weights.open_weights)."""
        from pathlib import Path

        from titan_pipe.model.weights import open_weights

        return cls(
            open_weights(Path(path)),
            device=device,
            kernels=kernels,
            keep=keep,
            label=label or f"torch float32 ({Path(path).name})",
        )

    def run(self, tokens: torch.Tensor) -> Outputs:
        """One batch (B, T) -> Outputs (logits and every layer's values)."""
        sink = OutputsSink(1, self.args.n_layers)
        self.forward([tokens], sink)
        return sink.outputs[0]

    @torch.no_grad()
    def greedy(self, prompts: list[list[int]], n_new: int, *, values: dict | None = None) -> torch.Tensor:
        """Greedy continuation of each prompt, unpadded -> (N, n_new) int64: each prompt alone in one
        step, then one token a step for all prompts at once, each row against its own KV cache
        (per row: its own positions, its own cached keys; only the matmuls are shared).
        ``values``: a dict filled with what the steps computed on the way, the reference side of
        the KV-cache loop, keyed (kind, layer): ("logits", None) (N, n_new, vocab), row k the logits
        that chose new token k, and ("attn" | "mlp" | "hidden", i) layer i's values at the positions
        of new tokens 0..n_new-2 (N, n_new - 1, dim), which the decode steps feed."""
        n, layers = len(prompts), range(self.args.n_layers)
        new = torch.zeros(n, n_new, dtype=torch.int64)
        h = self.embed([torch.tensor([p], dtype=torch.int64) for p in prompts])
        cache: list[list] = [[] for _ in layers]  # layer -> per row (keys, values)
        for i in layers:
            block = self.block(i)
            for j in range(n):
                h[j] = self.run_block(block, h[j], layer=i)[0]
                cache[i] += self._attn.seen
            del block
            self._free()
        logits = [torch.cat([lg[:, -1] for lg in self.head([x[:, -1:] for x in h])])]  # each (N, vocab)
        new[:, 0] = logits[0].argmax(-1)
        steps: dict[tuple[str, int], list[torch.Tensor]] = {}
        pos = torch.tensor([len(p) for p in prompts], device=self.device)
        for step in range(1, n_new):
            x = self.embed([new[:, step - 1 : step]])[0]  # (N, 1, dim)
            for i in layers:
                cos, sin = self._table(i)
                rope = cos[pos][:, None, None], sin[pos][:, None, None]  # (N, 1, 1, hd)
                block = self.block(i)
                self._attn.past = cache[i]
                x, attn, mlp = self.run_block(block, x, rope=rope, layer=i)
                cache[i] = self._attn.seen
                if values is not None:
                    for kind, v in zip(("attn", "mlp", "hidden"), (attn, mlp, x)):
                        steps.setdefault((kind, i), []).append(v.to("cpu"))
                del block
                self._free()
            self._attn.past = None
            logits.append(self.head([x])[0][:, -1])
            new[:, step] = logits[-1].argmax(-1)
            pos += 1
        if values is not None:
            values["logits", None] = torch.stack(logits, dim=1)
            values.update({key: torch.cat(vs, dim=1) for key, vs in steps.items()})
        return new


def layer_bytes(args: ModelArgs, i: int, itemsize: int = 4) -> int:
    """Bytes the reference holds for decoder layer i: its linear layers' weights (2-D) as stored,
    ``itemsize`` bytes each, everything else (norms, biases, stacked experts) in float32."""
    prefix = f"layers.{i}."
    return sum(
        (itemsize if len(s) == 2 else 4) * _numel(s) for n, s in native_shapes(args).items() if n.startswith(prefix)
    )


def _head_names(args: ModelArgs) -> tuple[str, str]:
    """The head's parameters: the final norm, and the output projection (the embedding when tied)."""
    return "norm.weight", features.read_from(args, "output.weight")


def top_bytes(args: ModelArgs, itemsize: int = 4) -> int:
    """Bytes the reference holds outside the layers: the embedding and output as stored, the final norm."""
    return sum(
        (itemsize if len(s) == 2 else 4) * _numel(s)
        for n, s in native_shapes(args).items()
        if not n.startswith("layers.")
    )


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


_BAND_BYTES = 4 << 20  # float32 bytes of weight rows cast at once: the band stays in cache while it is multiplied


class AdaptedLinear(torch.nn.Module):
    """A stored linear with its LoRA adapter applied beside it, as training computed it (not merged):
    linear(x) + (scale * x A^T) B^T, in float32 (titan_pipe.model.lora_modules.Adapter's arithmetic and order)."""

    def __init__(self, linear: "StoredLinear", a: torch.Tensor, b: torch.Tensor, scale: float):
        super().__init__()
        self.linear, self.a, self.b, self.scale = linear, a, b, scale

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + F.linear(F.linear(x, self.a) * self.scale, self.b)


class StoredLinear(torch.nn.Module):
    """A linear layer over its weight as stored (bfloat16, float16 or float32): the float32 result
    F.linear gives on the float32 copy of the weight, without making that copy. The rows are cast
    in bands of ~4 MB (a multiple of 64 rows), each multiplied while it is still in cache: half
    the memory traffic of reading a bfloat16 weight's float32 copy, and no copy held (streamed: the
    weights stay the memory-mapped file's pages; whole: the model is held at its stored size).

    Each output element is the same dot product whichever band its row is in, and on the CPU
    tested (oneDNN/MKL sgemm, 1 to 128 input rows, widths 64 to 11008) the values are bit for bit
    those of the whole weight cast at once. That is checked, not assumed: the first call for each
    (weight dtype and shape, number of input rows) computes both and compares them (``exact``:
    the results, shared by a model's layers); where they differ the whole weight is cast per call,
    as before."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, exact: dict):
        super().__init__()
        if weight.dtype == torch.float32 and weight.data_ptr() % 64:  # multiplied as it is: aligned as a
            weight = weight.clone()  # fresh tensor (a memory-mapped file's offset is arbitrary, and the
        if bias is not None and bias.data_ptr() % 64:  # matmul kernels' rounding follows alignment)
            bias = bias.clone()
        self.weight, self.bias, self.exact = weight, bias, exact
        rows = _BAND_BYTES // (4 * weight.shape[1]) // 64 * 64
        self.band = rows if weight.dtype != torch.float32 and 64 <= rows < weight.shape[0] else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.band is None:
            return F.linear(x, self.weight.to(torch.float32), self.bias)
        key = (self.weight.dtype, tuple(self.weight.shape), x.numel() // x.shape[-1], x.device.type)
        exact = self.exact.get(key)
        if exact is None:
            whole = F.linear(x, self.weight.to(torch.float32), self.bias)
            self.exact[key] = torch.equal(whole, self._banded(x))
            return whole
        return self._banded(x) if exact else F.linear(x, self.weight.to(torch.float32), self.bias)

    def _banded(self, x: torch.Tensor) -> torch.Tensor:
        w, b, n = self.weight, self.bias, self.band
        return torch.cat(
            [
                F.linear(x, w[i : i + n].to(torch.float32), None if b is None else b[i : i + n])
                for i in range(0, w.shape[0], n)
            ],
            dim=-1,
        )
