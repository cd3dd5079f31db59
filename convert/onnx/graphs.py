"""The modules torch.onnx traces: prefill and KV-cache decode over a loaded Transformer's weights.

Both graphs run the same step: new tokens at absolute positions ``past .. past+T-1`` attend to the
cached keys/values plus their own, under an explicit causal mask built from ``Range`` and
``LessOrEqual`` (no ``Trilu``, which ATC's ONNX parser is not known to take). The prefill graph is
that step with an empty cache, written without the cache inputs.

Linear weights are held as transposed *views* of the model's own parameters, so the exporter
emits ``MatMul(x, W^T)`` straight onto an initializer: no ``Transpose`` node in the graph, and no
constant folding that would materialise a second, transposed copy of every weight. Norms, RoPE
and the kv-head repeat are the model's own modules and ``training/kernels.py`` reference
functions.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_pipe.training.kernels import apply_rotary_ref, repeat_kv
from titan_pipe.training.model import Transformer


class _BlockWeights(nn.Module):
    """One decoder layer: its two RMSNorm modules (shared) and (in, out) views of its linears."""

    def __init__(self, layer):
        super().__init__()
        a, f = layer.attention, layer.feed_forward
        self.attention_norm = layer.attention_norm
        self.ffn_norm = layer.ffn_norm
        for name, lin in (("wq", a.wq), ("wk", a.wk), ("wv", a.wv), ("wo", a.wo),
                          ("w1", f.w1), ("w2", f.w2), ("w3", f.w3)):
            self.register_buffer(name, lin.weight.detach().t())


class LlamaStep(nn.Module):
    """Shared body of the export graphs; see PrefillGraph / DecodeGraph for the signatures."""

    def __init__(self, model: Transformer, *, kv_cache: bool, taps: bool):
        super().__init__()
        if model.tok_embeddings is None or model.output is None or model.norm is None:
            raise ValueError("export needs a whole model (embedding, norm and output), not a pipeline stage")
        args = model.args
        self.n_heads, self.head_dim = args.n_heads, args.head_dim
        self.n_rep = args.n_heads // args.kv_heads
        self.kv_cache, self.taps = kv_cache, taps
        self.tok_embeddings = model.tok_embeddings
        self.layers = nn.ModuleList(_BlockWeights(layer) for layer in model.layers.values())
        self.norm = model.norm
        self.register_buffer("output_t", model.output.weight.detach().t())
        self.register_buffer("rope_cos", model.rope_cos)
        self.register_buffer("rope_sin", model.rope_sin)

    def step(self, input_ids: torch.Tensor, past: list[tuple[torch.Tensor, torch.Tensor]] | None):
        """input_ids (B, T) int64, past [(k, v) (B, Hkv, P, hd)] * n_layers or None (P = 0).

        Returns (logits (B, T, vocab), presents [(k, v) (B, Hkv, P+T, hd)], taps): taps[i] is
        (layer i's output = the residual stream after it, its attention block's output, its MLP
        block's output), each (B, T, dim); the two block outputs are taken before their residual Add.
        """
        b, t = input_ids.shape
        p = past[0][0].shape[2] if past else 0
        h = self.tok_embeddings(input_ids)
        cos = self.rope_cos[p:p + t].to(h.dtype)
        sin = self.rope_sin[p:p + t].to(h.dtype)
        # Query i (absolute position p+i) sees key j iff j <= p+i.
        q_pos = torch.arange(t, device=h.device) + p
        k_pos = torch.arange(p + t, device=h.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # (T, P+T) bool
        presents, taps = [], []
        for i, w in enumerate(self.layers):
            x = w.attention_norm(h)
            q = torch.matmul(x, w.wq).view(b, t, -1, self.head_dim).transpose(1, 2)
            k = torch.matmul(x, w.wk).view(b, t, -1, self.head_dim).transpose(1, 2)
            v = torch.matmul(x, w.wv).view(b, t, -1, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_ref(q, k, cos, sin)
            if past:
                k = torch.cat([past[i][0], k], dim=2)
                v = torch.cat([past[i][1], v], dim=2)
            presents.append((k, v))
            out = F.scaled_dot_product_attention(q, repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep),
                                                 attn_mask=mask)
            attn = torch.matmul(out.transpose(1, 2).reshape(b, t, -1), w.wo)
            h = h + attn
            x = w.ffn_norm(h)
            mlp = torch.matmul(F.silu(torch.matmul(x, w.w1)) * torch.matmul(x, w.w3), w.w2)
            h = h + mlp
            taps.append((h, attn, mlp))
        logits = torch.matmul(self.norm(h), self.output_t)
        return logits, presents, taps

    def flat_outputs(self, logits, presents, taps) -> tuple[torch.Tensor, ...]:
        out = [logits]
        if self.kv_cache:
            for k, v in presents:
                out += [k, v]
        if self.taps:  # in io_names order: every hidden.{i}, then attn_out.{i}, then mlp_out.{i}
            for j in range(3):
                out += [t[j] for t in taps]
        return tuple(out)


class PrefillGraph(LlamaStep):
    """forward(input_ids (B, T) int64) -> logits (B, T, vocab)
    [, present.{i}.key, present.{i}.value (B, Hkv, T, hd) for each layer i when kv_cache]
    [, hidden.{i}, attn_out.{i}, mlp_out.{i} (B, T, dim) for each layer i when taps]."""

    def forward(self, input_ids: torch.Tensor):
        return self.flat_outputs(*self.step(input_ids, None))


class DecodeGraph(LlamaStep):
    """forward(input_ids (B, T), past.{i}.key, past.{i}.value (B, Hkv, P, hd) ...) -> logits (B, T, vocab),
    present.{i}.key/value (B, Hkv, P+T, hd) [, taps as PrefillGraph]. Positions are P .. P+T-1."""

    def __init__(self, model: Transformer, *, taps: bool):
        super().__init__(model, kv_cache=True, taps=taps)

    def forward(self, input_ids: torch.Tensor, *past_flat: torch.Tensor):
        past = [(past_flat[2 * i], past_flat[2 * i + 1]) for i in range(len(past_flat) // 2)]
        return self.flat_outputs(*self.step(input_ids, past))


TAP_KINDS = ("hidden", "attn_out", "mlp_out")  # layer output, attention block output, MLP block output


def tap_names(n_layers: int) -> dict[str, list[str]]:
    """{kind: [value name of layer i]}: the per-layer values traced as outputs, then kept as inner
    value names of the graph and recorded in export.json (layer_outputs, attn_outputs, mlp_outputs)."""
    return {kind: [f"{kind}.{i}" for i in range(n_layers)] for kind in TAP_KINDS}


def io_names(n_layers: int, *, decode: bool, kv_cache: bool, taps: bool) -> tuple[list[str], list[str]]:
    """(input names, output names) of a graph, in the order forward() takes and returns them."""
    inputs = ["input_ids"]
    if decode:
        for i in range(n_layers):
            inputs += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
    outputs = ["logits"]
    if kv_cache or decode:
        for i in range(n_layers):
            outputs += [f"present.{i}.key", f"present.{i}.value"]
    if taps:
        for names in tap_names(n_layers).values():
            outputs += names
    return inputs, outputs


def dynamic_axes(inputs: list[str], outputs: list[str], *, decode: bool) -> dict[str, dict[int, str]]:
    """Named dynamic dims: batch, seq (new tokens), past (cached length), total (= past + seq).

    In the prefill graph the cache it returns is as long as the sequence, so present.* use ``seq``.
    """
    axes: dict[str, dict[int, str]] = {}
    for name in inputs + outputs:
        if name in ("input_ids", "logits") or name.split(".")[0] in TAP_KINDS:
            axes[name] = {0: "batch", 1: "seq"}
        elif name.startswith("past_key_values."):
            axes[name] = {0: "batch", 2: "past"}
        elif name.startswith("present."):
            axes[name] = {0: "batch", 2: "total" if decode else "seq"}
    return axes
