"""Operator backends: the reference PyTorch ops (written for ONNX), PyTorch's own fused ones for
training on CUDA, and the fused torch_npu kernels Ascend trains with.

Every set implements the same three functions, so the model and the evaluator can run any:
  rms_norm(x (..., dim), weight (dim,), eps) -> (..., dim)
  apply_rotary(q (B, H, T, hd), k (B, Hkv, T, hd), cos (T, hd), sin (T, hd)) -> q, k
  attention(q (B, H, T, hd), k, v (B, Hkv, T, hd), n_rep, causal, window, positions, scale) -> (B, H, T, hd)

``window`` (Mistral's sliding window, None: none): query t sees keys s with t - window < s <= t.
``positions`` (B, T) of packed documents (fine-tuning; None: one document a row): a document starts
where the position is 0, and a query sees only keys of its own document (``document_mask``).
RoPE's cos/sin are then per row, (B, 1, T, hd), which every apply_rotary broadcasts.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch
import torch.nn.functional as F

from titan_pipe.rules.choices import KERNELS


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Computed in float32 whatever the input dtype (as Hugging Face and torchtitan do), then cast
    # back; written as pow/mean/rsqrt so ONNX sees Pow/ReduceMean/Sqrt/Div, no fused norm op.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T (+ bias), W (out, in) as stored: nn.Linear's forward."""
    return F.linear(x, weight, bias)


def rms_norm_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: the weight is an offset from 1, and the product is taken in float32 before
    the cast back (Hugging Face's Gemma3RMSNorm), whichever kernels the rest of the model runs."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def norm_for(kernels: "Kernels", offset: bool) -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]:
    """The RMSNorm a model's norms run, chosen in this one place: Gemma's offset form (its float32
    product, whichever kernels) for ``offset`` (titan_pipe.model.features.offset_norms), else the kernels' own."""
    return rms_norm_offset if offset else kernels.rms_norm


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_ref(q, k, cos, sin):
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, Hkv, T, hd) -> (B, Hkv*n_rep, T, hd), each kv head repeated for its query group."""
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


def allowed_keys(t: int, window: int | None, device=None) -> torch.Tensor:
    """(T, T) bool: query t may see key s, s <= t and, with a window, t - s < window."""
    pos = torch.arange(t, device=device)
    gap = pos[:, None] - pos[None, :]
    return (gap >= 0) & (gap < window) if window is not None else gap >= 0


def document_mask(positions: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """(B, 1, T, T) bool of packed documents: query t sees key s when both lie in one document
    (no position 0 in (s, t]) and s <= t (within ``window`` when given)."""
    doc = torch.cumsum(positions == 0, dim=-1)
    t = positions.shape[-1]
    idx = torch.arange(t, device=positions.device)
    allowed = (doc[:, :, None] == doc[:, None, :]) & (idx[:, None] >= idx[None, :])
    if window is not None:
        allowed &= (idx[:, None] - idx[None, :]) < window
    return allowed[:, None]


def attention_ref(
    q,
    k,
    v,
    *,
    n_rep: int,
    causal: bool = True,
    window: int | None = None,
    positions: torch.Tensor | None = None,
    scale: float | None = None,
):
    # Explicit repeat instead of SDPA's enable_gqa: older exporters and runtimes lack it.
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    if positions is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(positions, window), scale=scale)
    if window is None or window >= q.shape[-2]:  # a window as long as the sequence masks nothing
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_keys(q.shape[-2], window, q.device), scale=scale)


def experts_loop(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """SwiGLU experts over tokens sorted by expert: rows [c_0 .. c_0 + counts[e]) of ``x`` (N, dim)
    go through expert e (weights stacked (E, out, in)). An expert without tokens still runs (on no
    rows): the autograd graph is then the same whatever the routing, so collectives its backward
    meets (expert parallelism, FSDP) come in the same order on every rank."""
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        xe = x[start : start + n]
        out.append(F.linear(F.silu(F.linear(xe, w1[e])) * F.linear(xe, w3[e]), w2[e]))
        start += n
    return torch.cat(out)


GROUP_ALIGN = 16  # rows: each expert's group starts on a multiple of 16 (bf16 and float8 grouped GEMMs on Hopper)


def grouped_rows(counts: torch.Tensor, n: int, align: int = GROUP_ALIGN) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each of ``n`` tokens sorted by expert sits once every expert's group is padded to a
    multiple of ``align`` rows (an empty expert gets ``align`` zero rows, never an empty group):
    (destination row of each token (n,), the padded groups' end offsets (E,) int32, the padded
    buffer's rows). The buffer's size is the bound n + E * align, not the routing's: the same
    shapes every step, no host sync. torch._grouped_mm's CUDA kernels want group starts aligned
    (torchtitan pads the same way); unpadded counts from real routing can trip a device assert."""
    e = counts.shape[0]
    counts = counts.to(torch.int64)
    padded = torch.clamp_min((counts + align - 1) // align * align, align)
    pad_end = torch.cumsum(padded, 0)
    pad_start, start = pad_end - padded, torch.cumsum(counts, 0) - counts
    expert = torch.repeat_interleave(torch.arange(e, device=counts.device), counts, output_size=n)
    dest = torch.arange(n, device=counts.device) - start[expert] + pad_start[expert]
    return dest, pad_end.to(torch.int32), n + e * align


def experts_grouped_padded(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    align: int = GROUP_ALIGN,
) -> torch.Tensor:
    """The experts through torch._grouped_mm on groups padded to ``align`` rows (grouped_rows): the
    tokens are scattered into a zero buffer, the three grouped GEMMs run on it, the tokens' rows
    are gathered back. Padding rows are zeros (their SwiGLU output is 0), take no part in the
    weights' gradients and are never read; rows past the last group are outside every group."""
    dest, offs, rows = grouped_rows(counts, x.shape[0], align)
    xp = x.new_zeros(rows, x.shape[1]).index_copy(0, dest, x)
    gate = torch._grouped_mm(xp, w1.transpose(-2, -1), offs=offs)
    up = torch._grouped_mm(xp, w3.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs).index_select(0, dest)


def experts_grouped(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """The same experts as one grouped matrix multiply per projection (torch._grouped_mm on padded
    groups: CUDA with compute capability 9.0+, bfloat16); elsewhere the per-expert loop."""
    if not (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
    ):
        return experts_loop(x, counts, w1, w3, w2)
    return experts_grouped_padded(x, counts, w1, w3, w2)


@dataclass(frozen=True)
class Kernels:
    name: str
    rms_norm: Callable
    apply_rotary: Callable
    attention: Callable
    experts: Callable = experts_loop  # a mixture of experts' SwiGLU experts (titan_pipe.model.transformer.MoE)


def reference_kernels() -> Kernels:
    return Kernels("reference", rms_norm_ref, apply_rotary_ref, attention_ref)


def rms_norm_fused(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # One fused kernel where the device has one (F.rms_norm), still in float32 as the reference
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def apply_rotary_halves(q, k, cos, sin):
    """The reference's rotation on the two halves directly (cos and sin repeat over them): no
    rotate_half copy, two fewer full-size multiplies."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]

    def rot(x):
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    return rot(q), rot(k)


def attention_documents_flex(q, k, v, positions: torch.Tensor, window: int | None, scale: float | None = None):
    """Packed documents through flex attention's block-sparse kernel (CUDA): blocks no query of its
    document reaches are skipped, not masked. Same result as SDPA with document_mask (tests)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc = torch.cumsum(positions == 0, dim=-1)

    def keep(b, h, qi, ki):
        ok = (doc[b, qi] == doc[b, ki]) & (qi >= ki)
        return ok & (qi - ki < window) if window is not None else ok

    b, _, t, _ = q.shape
    block = create_block_mask(keep, b, None, t, t, device=q.device)
    run = _compiled_flex() if q.is_cuda else flex_attention  # eager flex is a reference, not a kernel
    return run(q, k, v, block_mask=block, enable_gqa=k.shape[1] != q.shape[1], scale=scale)


@lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def attention_gqa(
    q,
    k,
    v,
    *,
    n_rep: int,
    causal: bool = True,
    window: int | None = None,
    positions: torch.Tensor | None = None,
    scale: float | None = None,
):
    # K/V keep their kv heads: SDPA's enable_gqa reads each for its query group without copies
    gqa = n_rep > 1
    if positions is not None:
        if q.is_cuda:
            return attention_documents_flex(q, k, v, positions, window, scale)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=document_mask(positions, window), enable_gqa=gqa, scale=scale
        )
    if window is None or window >= q.shape[-2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa, scale=scale)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed_keys(q.shape[-2], window, q.device), enable_gqa=gqa, scale=scale
    )


def torch_fused_kernels() -> Kernels:
    """Training kernels for CUDA (they run anywhere torch runs, CPU included): the same math as the
    reference, checked against it forward and backward (tests); export keeps the reference ops."""
    return Kernels("torch_fused", rms_norm_fused, apply_rotary_halves, attention_gqa, experts_grouped)


def npu_fused_kernels() -> Kernels:
    """torch_npu's fused kernels; imported here only, so CPU/CUDA never need torch_npu."""
    import torch_npu  # noqa: F401  (lazy: only on Ascend hosts)

    def rms_norm(x, weight, eps):
        return torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]

    def apply_rotary(q, k, cos, sin):
        # npu_rotary_mul takes 4-D cos/sin broadcastable to (B, H, T, hd), rotate-half layout.
        c, s = (cos, sin) if cos.dim() == 4 else (cos[None, None], sin[None, None])
        return torch_npu.npu_rotary_mul(q, c, s), torch_npu.npu_rotary_mul(k, c, s)

    def attention(q, k, v, *, n_rep, causal=True, window=None, positions=None, scale=None):
        b, h, t, d = q.shape
        mask = None
        if positions is not None:  # packed documents: the explicit mask (True: masked)
            mask = ~document_mask(positions, window)
        elif causal:
            mask = ~allowed_keys(t, window, q.device)
        # BNSD layout; GQA handled natively (k/v carry the kv heads); sparse_mode=0 with an
        # explicit upper-triangular mask means "masked where True".
        return torch_npu.npu_fusion_attention(
            q,
            k,
            v,
            h,
            input_layout="BNSD",
            atten_mask=mask,
            scale=d**-0.5 if scale is None else scale,
            keep_prob=1.0,
            sparse_mode=0,
        )[0]

    return Kernels("npu_fused", rms_norm, apply_rotary, attention)


def resolve_kernels(choice: str, device_type: str) -> Kernels:
    """auto -> npu_fused on NPU, torch_fused on CUDA, reference on CPU. npu_fused off NPU is a
    config error."""
    if choice not in KERNELS:
        raise ValueError(f"model.kernels={choice!r} is not one of {KERNELS}")
    if choice == "auto":
        choice = {"npu": "npu_fused", "cuda": "torch_fused"}.get(device_type, "reference")
    if choice == "torch_fused":
        return torch_fused_kernels()
    if choice == "npu_fused":
        if device_type != "npu":
            raise ValueError(
                f"model.kernels=npu_fused needs device npu, got {device_type!r}; use kernels: reference (or auto)"
            )
        return npu_fused_kernels()
    return reference_kernels()
