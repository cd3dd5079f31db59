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


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, rows: int,
                denom: float | None) -> torch.Tensor:
        n = h.shape[0]
        valid = labels != IGNORE
        masked = not bool(valid.all())
        if denom is None:
            denom = int(valid.sum()) if masked else n
        denom = max(denom, 1)
        compute = h.dtype if h.dtype == weight.dtype else torch.promote_types(h.dtype, weight.dtype)
        if torch.is_autocast_enabled(h.device.type):  # the projection runs as autocast would run it
            compute = torch.get_autocast_dtype(h.device.type)
        hc, wc = h.to(compute), weight.to(compute)
        acc = torch.promote_types(compute, torch.float32)  # softmax and sums: float32 at least
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        total = torch.zeros((), dtype=acc, device=h.device)
        for lo in range(0, n, rows):
            hi = min(n, lo + rows)
            logits = (hc[lo:hi] @ wc.t()).to(acc)  # (rows, vocab)
            y = labels[lo:hi]
            ok = valid[lo:hi]
            y = y.clamp(min=0) if masked else y
            lse = torch.logsumexp(logits, dim=-1)
            per_token = lse - logits.gather(1, y[:, None]).squeeze(1)
            total += (per_token * ok).sum() if masked else per_token.sum()
            # d(CE sum / denom)/d(logits) = (softmax - onehot) / denom on the labels that count, in place
            probs = logits.sub_(lse[:, None]).exp_()
            probs.scatter_add_(1, y[:, None], torch.full_like(probs[:, :1], -1.0))
            probs.div_(denom)
            if masked:
                probs.mul_(ok[:, None])
            g = probs.to(compute)
            grad_h[lo:hi] = (g @ wc).to(h.dtype)
            grad_w.add_(g.t() @ hc[lo:hi])  # in the matmul's dtype, summed over chunks in float32
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        return total / denom

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out.to(grad_h.dtype), grad_w * grad_out.to(grad_w.dtype), None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         rows: int | None = None, denom: float | None = None) -> torch.Tensor:
    """Cross entropy of ``h @ weight.T`` against ``labels`` without materialising the logits: the
    mean over labels that are not -100, or with ``denom`` their sum divided by it.
    h (..., dim), weight (vocab, dim), labels (...) int64."""
    h2, y = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    return _LinearCrossEntropy.apply(h2, weight, y, rows or chunk_rows(weight.shape[0], h2.shape[0]), denom)
