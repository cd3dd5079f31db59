"""The training loss: mean next-token cross entropy, from logits or fused with the output projection.

``cross_entropy(logits, labels)`` upcasts the whole (N, vocab) logits to float32: at a 1B model's
shape (8 x 2048 tokens, vocab 128256) that is 8.4 GB, and as much again for its gradient.
``linear_cross_entropy(h, weight, labels)`` never holds them: it walks the tokens in chunks, computes
each chunk's logits (in the matmul's dtype), its log-sum-exp and softmax in float32, and right
there the chunk's gradients with respect to ``h`` and ``weight`` (the loss is a mean over every
token, so they are final up to the upstream scalar); backward only scales them. Peak extra memory:
one chunk's logits in float32 plus the gradients of ``h`` and ``weight`` (which backward needs
anyway). The same loss and the same gradients as the full form, to float rounding (tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_BYTES = 256 * 2**20  # one chunk's float32 logits


IGNORE = -100  # a label the loss skips (fine-tuning: prompts, padding, across documents)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, denom: float | None = None) -> torch.Tensor:
    """Next-token cross entropy of (..., vocab) logits, in float32 for a stable softmax: the mean over
    the labels that are not -100, or with ``denom`` their sum divided by it."""
    flat = logits.flatten(0, -2).to(torch.promote_types(logits.dtype, torch.float32))
    if denom is None:
        return F.cross_entropy(flat, labels.flatten(), ignore_index=IGNORE)
    return F.cross_entropy(flat, labels.flatten(), ignore_index=IGNORE, reduction="sum") / denom


def chunk_rows(vocab: int, n: int) -> int:
    return max(1, min(n, CHUNK_BYTES // (4 * vocab)))


def chunk_loss_grads(
    hc: torch.Tensor, wc: torch.Tensor, y: torch.Tensor, ok: torch.Tensor, denom: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk of the fused loss: (its loss sum over the labels that count, its gradient with
    respect to the chunk's hidden rows (compute dtype), its share of the weight's gradient (float32
    at least)). ``hc`` (rows, dim) and ``wc`` (vocab, dim) in the matmul's dtype, ``y`` the labels
    with -100 clamped to 0, ``ok`` whether each counts, ``denom`` a 0-d tensor (a tensor, so a
    compiled chunk is not re-traced for every batch's target count). Plain tensor code with static
    shapes: under ``train.compile`` it is what torch.compile fuses (the matmul's epilogue, the
    float32 softmax, the one-hot subtraction), called once per chunk."""
    acc = torch.promote_types(hc.dtype, torch.float32)  # softmax and sums: float32 at least
    logits = (hc @ wc.t()).to(acc)  # (rows, vocab)
    lse = torch.logsumexp(logits, dim=-1)
    per_token = lse - logits.gather(1, y[:, None]).squeeze(1)
    total = (per_token * ok).sum()
    # d(CE sum / denom)/d(logits) = (softmax - onehot) / denom on the labels that count, in place
    probs = logits.sub_(lse[:, None]).exp_()
    probs.scatter_add_(1, y[:, None], torch.full_like(probs[:, :1], -1.0))
    probs.div_(denom).mul_(ok[:, None])
    g = probs.to(hc.dtype)
    return total, g @ wc, g.t() @ hc


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, rows: int, denom: float | None, chunk
    ) -> torch.Tensor:
        n = h.shape[0]
        valid = labels != IGNORE
        if denom is None:
            denom = int(valid.sum())
        denom = max(denom, 1)
        compute = h.dtype if h.dtype == weight.dtype else torch.promote_types(h.dtype, weight.dtype)
        if torch.is_autocast_enabled(h.device.type):  # the projection runs as autocast would run it
            compute = torch.get_autocast_dtype(h.device.type)
        hc, wc = h.to(compute), weight.to(compute)
        acc = torch.promote_types(compute, torch.float32)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        total = torch.zeros((), dtype=acc, device=h.device)
        denom_t = torch.tensor(float(denom), dtype=acc, device=h.device)
        ok, y = valid.to(acc), labels.clamp(min=0)
        with torch.autocast(h.device.type, enabled=False):  # the dtypes above are the ones autocast chose
            for lo in range(0, n, rows):
                hi = min(n, lo + rows)
                part, gh, gw = (chunk or chunk_loss_grads)(hc[lo:hi], wc, y[lo:hi], ok[lo:hi], denom_t)
                total += part
                grad_h[lo:hi] = gh.to(h.dtype)
                grad_w.add_(gw)  # in the matmul's dtype, summed over chunks in float32
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        return total / denom

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        return (grad_h * grad_out.to(grad_h.dtype), grad_w * grad_out.to(grad_w.dtype), None, None, None, None)


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    rows: int | None = None,
    denom: float | None = None,
    chunk=None,
) -> torch.Tensor:
    """Cross entropy of ``h @ weight.T`` against ``labels`` without materialising the logits: the
    mean over labels that are not -100, or with ``denom`` their sum divided by it.
    h (..., dim), weight (vocab, dim), labels (...) int64. ``chunk``: the chunk step to call (a
    compiled ``chunk_loss_grads``; None: the eager one)."""
    h2, y = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    return _LinearCrossEntropy.apply(h2, weight, y, rows or chunk_rows(weight.shape[0], h2.shape[0]), denom, chunk)


def _cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the summed float32 cross entropy over labels that are not -100, their count): the part of
    the full loss that torch.compile fuses (the upcast, log-softmax and gather in one pass)."""
    flat = logits.flatten(0, -2).to(torch.promote_types(logits.dtype, torch.float32))
    y = labels.flatten()
    return F.cross_entropy(flat, y, ignore_index=IGNORE, reduction="sum"), (y != IGNORE).sum()


class CompiledLoss:
    """The training loss under ``train.compile``: the fused chunk step (``chunked``) or the full
    cross entropy (``full``) compiled with the blocks' backend, the division by the target count
    outside the graph (a Python number would be traced into it and re-trace every batch)."""

    def __init__(self, backend) -> None:
        self.chunk = torch.compile(chunk_loss_grads, backend=backend, fullgraph=True, dynamic=False)
        self._sum = torch.compile(_cross_entropy_sum, backend=backend, fullgraph=True, dynamic=False)

    def full(self, logits: torch.Tensor, labels: torch.Tensor, *, denom: float | None = None) -> torch.Tensor:
        total, count = self._sum(logits, labels)
        return total / (denom if denom is not None else count.clamp_min(1))
