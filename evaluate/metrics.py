"""Error measures between a reference tensor and a candidate, in float64, as Ascend's tools define them.

Notation: r = reference (golden, "GroundTruth" in msit), c = candidate ("NPUDump"/"MyOutput"), both
flattened to float64 vectors of n elements; d = c - r. Every formula is written out in
docs/evaluate.md; the names of ``TensorMetrics.csv_row`` are msit ``debug compare``'s CSV columns.

  CosineSimilarity          sum(r*c) / (||r|| * ||c||)     (1 when both are all zero, 0 when one is)
  MaxAbsoluteError          max |d|
  MeanAbsoluteError         mean |d|
  MaxRelativeError          max |d| / |r'|   r' = r with zeros replaced by eps(dtype of r), as msprobe
  MeanRelativeError         mean |d| / |r'|
  RelativeEuclideanDistance ||d|| / ||r||                  (msit: sqrt(sum(d^2)) / sqrt(sum(r^2)))
  RootMeanSquareError       sqrt(mean(d^2))
  KullbackLeiblerDivergence mean over rows of KL(softmax(r_row) || softmax(c_row)), rows along the
                            last axis (for logits: per token, over the vocabulary)
  Top1Agreement             fraction of rows (last axis) with argmax(r_row) == argmax(c_row)
  NaN/Inf                   counts in the candidate (and the reference, reported separately)
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

# msit's CSV column names, in the order its result_*.csv shows them, then ours.
CSV_COLUMNS: tuple[str, ...] = (
    "CosineSimilarity", "MaxAbsoluteError", "MeanAbsoluteError", "MaxRelativeError",
    "MeanRelativeError", "RelativeEuclideanDistance", "RootMeanSquareError",
    "KullbackLeiblerDivergence", "Top1Agreement", "CandidateNaN", "CandidateInf",
)


@dataclass(frozen=True)
class TensorMetrics:
    """All measures for one (reference, candidate) pair; floats are plain Python floats."""

    cosine: float
    max_abs: float
    mean_abs: float
    max_rel: float
    mean_rel: float
    rel_euclidean: float
    rmse: float
    kl: float
    top1: float
    nan: int  # NaN count in the candidate
    inf: int  # +-Inf count in the candidate
    ref_nan: int
    ref_inf: int
    numel: int

    def to_dict(self) -> dict:
        return asdict(self)

    def csv_row(self) -> dict[str, float | int]:
        """The values under msit's column names (CSV_COLUMNS)."""
        return dict(zip(CSV_COLUMNS, (self.cosine, self.max_abs, self.mean_abs, self.max_rel,
                                      self.mean_rel, self.rel_euclidean, self.rmse, self.kl,
                                      self.top1, self.nan, self.inf)))


def as_float64(x) -> np.ndarray:
    """A torch tensor (any float dtype, incl. bfloat16) or numpy array -> float64 numpy array."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def _eps_of(x) -> float:
    """Machine epsilon of the reference's own dtype (msprobe replaces zeros by it)."""
    if isinstance(x, torch.Tensor):
        return float(torch.finfo(x.dtype).eps) if x.dtype.is_floating_point else float(np.finfo(float).eps)
    dt = np.asarray(x).dtype
    return float(np.finfo(dt).eps) if np.issubdtype(dt, np.floating) else float(np.finfo(float).eps)


def cosine_similarity(r: np.ndarray, c: np.ndarray) -> float:
    nr, nc = float(np.linalg.norm(r)), float(np.linalg.norm(c))
    if nr == 0.0 and nc == 0.0:
        return 1.0
    if nr == 0.0 or nc == 0.0:
        return 0.0
    return float(np.dot(r, c) / (nr * nc))


def relative_errors(r: np.ndarray, c: np.ndarray, eps: float) -> np.ndarray:
    """|c - r| / |r'| elementwise, r' = r with exact zeros replaced by eps (msprobe's rule)."""
    denom = np.abs(r)
    denom[denom == 0.0] = eps
    return np.divide(np.abs(c - r), denom, out=denom)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def softmax_kl(r: np.ndarray, c: np.ndarray, chunk: int = 256) -> float:
    """Mean over rows of KL(softmax(r) || softmax(c)); r, c are (rows, cols) float64.

    Rows are taken ``chunk`` at a time so the temporaries stay a few chunk x cols arrays.
    """
    total = 0.0
    for i in range(0, r.shape[0], chunk):
        lr, lc = _log_softmax(r[i:i + chunk]), _log_softmax(c[i:i + chunk])
        total += float((np.exp(lr) * (lr - lc)).sum())
    # Rounding can make a zero divergence come out as -1e-17; KL is never negative.
    return max(total / r.shape[0], 0.0)


def top1_agreement(r: np.ndarray, c: np.ndarray) -> float:
    """Fraction of rows whose argmax agrees; r, c are (rows, cols)."""
    return float((r.argmax(axis=-1) == c.argmax(axis=-1)).mean())


def compare_tensors(ref, cand) -> TensorMetrics:
    """All measures of ``cand`` against ``ref`` (same shape; any float dtypes), computed in float64.

    Rows for KL and top-1 are taken along the last axis. Non-finite entries are counted, then left
    out of the other measures (so one Inf does not hide what the rest of the tensor looks like);
    a tensor with no finite pair gets NaN measures.
    """
    r_full, c_full = as_float64(ref), as_float64(cand)
    if r_full.shape != c_full.shape:
        raise ValueError(f"shape mismatch: reference {tuple(r_full.shape)} vs candidate {tuple(c_full.shape)}")
    eps = _eps_of(ref)
    nan, inf = int(np.isnan(c_full).sum()), int(np.isinf(c_full).sum())
    ref_nan, ref_inf = int(np.isnan(r_full).sum()), int(np.isinf(r_full).sum())
    rows_r = r_full.reshape(-1, r_full.shape[-1]) if r_full.ndim else r_full.reshape(1, 1)
    rows_c = c_full.reshape(-1, c_full.shape[-1]) if c_full.ndim else c_full.reshape(1, 1)
    if nan or inf or ref_nan or ref_inf:
        finite = np.isfinite(r_full) & np.isfinite(c_full)
        r, c = r_full[finite].ravel(), c_full[finite].ravel()
    else:  # the common case: views, no copies
        r, c = r_full.ravel(), c_full.ravel()
    if r.size == 0:
        n = float("nan")
        return TensorMetrics(n, n, n, n, n, n, n, n, n, nan, inf, ref_nan, ref_inf, int(r_full.size))
    rel = relative_errors(r, c, eps)
    max_rel, mean_rel = float(rel.max()), float(rel.mean())
    del rel
    absd = np.abs(c - r)
    nr = float(np.linalg.norm(r))
    nd = float(np.linalg.norm(absd))
    red = nd / nr if nr > 0 else (0.0 if nd == 0 else math.inf)
    max_abs, mean_abs = float(absd.max()), float(absd.mean())
    rmse = nd / math.sqrt(absd.size)
    del absd
    if nan or inf or ref_nan or ref_inf:
        row_ok = np.isfinite(rows_r).all(axis=-1) & np.isfinite(rows_c).all(axis=-1)
        rows_r, rows_c = rows_r[row_ok], rows_c[row_ok]
    if rows_r.shape[0]:
        kl, top1 = softmax_kl(rows_r, rows_c), top1_agreement(rows_r, rows_c)
    else:
        kl = top1 = float("nan")
    return TensorMetrics(
        cosine=cosine_similarity(r, c), max_abs=max_abs, mean_abs=mean_abs, max_rel=max_rel, mean_rel=mean_rel,
        rel_euclidean=red, rmse=rmse, kl=kl, top1=top1, nan=nan, inf=inf,
        ref_nan=ref_nan, ref_inf=ref_inf, numel=int(r_full.size))


def perplexity(logits, targets) -> float:
    """exp(mean token NLL): logits (B, T, V) predicting targets (B, T) int, in float64."""
    lg = as_float64(logits).reshape(-1, np.shape(logits)[-1])
    tg = np.asarray(targets.cpu() if isinstance(targets, torch.Tensor) else targets).reshape(-1)
    m = lg.max(axis=-1, keepdims=True)
    logz = (m + np.log(np.exp(lg - m).sum(axis=-1, keepdims=True)))[:, 0]
    nll = logz - lg[np.arange(lg.shape[0]), tg]
    return float(np.exp(nll.mean()))
