"""Error measures between a reference tensor and a candidate, as Ascend's tools define them.

Notation: r = reference (golden, "GroundTruth" in msit, "Bench" in msprobe), c = candidate
("MyOutput" in msit, "NPU" in msprobe), both flattened; d = c - r; n elements. Computed in float64
except where a tool computes in the tensors' own dtype (msprobe's relative errors), which is then
reproduced. Every formula is in docs/evaluate.md; tests/test_evaluate_msit.py checks them against
the tools' own functions. msit ``debug compare`` runs CANN's msaccucmp (shipped in msprobe as
``msprobe/msaccucmp``); msprobe ``compare`` has its own set (``msprobe/core/compare/algorithm``).

  CosineSimilarity          sum(r*c) / (||r|| * ||c||)     (1 when both are all zero, 0 when one is)
  MaxAbsoluteError          max |d|
  MeanAbsoluteError         mean |d|
  MaxRelativeError          max  q,  q_i = |c_i / r_i - 1| where |r_i| > eps64, else 0   (msit)
  MeanRelativeError         mean q                                                   (msit)
  AccumulatedRelativeError  sum  q                                                   (msit)
  RelativeEuclideanDistance ||d|| / ||r||                  (msit: sqrt(sum(d^2)) / sqrt(sum(r^2)))
  RootMeanSquareError       sqrt(mean(d^2))
  KullbackLeiblerDivergence msit's: p = pdf(c), g = pdf(r), sum p log(p / g), pdf(x) = x' / sum x',
                            x' = max((x - min x) / (max x - min x), eps32)
  StandardDeviation         msit's "(mean c;std c),(mean r;std r)" (population std)
  EucDist                   ||d||                                                    (msprobe)
  MaxRelativeErr            max e, e = |(c' - r') / r'| in the tensors' result dtype (>= float32),
                            c', r' = c, r with eps of that dtype added where r == 0     (msprobe)
  One Thousandth / Five Thousandths Err Ratio   fraction of e < 0.001 / 0.005         (msprobe)
  SoftmaxKL                 mean over rows of KL(softmax(r_row) || softmax(c_row)), rows along the
                            last axis (for logits: per token, over the vocabulary)   (titan-pipe)
  Top1Agreement             fraction of rows (last axis) with argmax(r_row) == argmax(c_row)
  NaN/Inf                   counts in the candidate (and the reference, reported separately)
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

# msit's CSV column names, in the order its result_*.csv shows them, then msprobe's, then ours.
CSV_COLUMNS: tuple[str, ...] = (
    "CosineSimilarity", "MaxAbsoluteError", "MeanAbsoluteError", "MaxRelativeError",
    "MeanRelativeError", "AccumulatedRelativeError", "RelativeEuclideanDistance", "RootMeanSquareError",
    "KullbackLeiblerDivergence", "StandardDeviation",
    "EucDist", "MaxRelativeErr", "One Thousandth Err Ratio", "Five Thousandths Err Ratio",
    "SoftmaxKL", "Top1Agreement", "CandidateNaN", "CandidateInf",
)
# TensorMetrics field under each CSV column ("StandardDeviation" is formatted from four fields).
CSV_FIELDS: tuple[str, ...] = (
    "cosine", "max_abs", "mean_abs", "max_rel", "mean_rel", "acc_rel", "rel_euclidean", "rmse", "msit_kl",
    "std", "euc_dist", "msprobe_max_rel", "err_ratio_1e3", "err_ratio_5e3", "kl", "top1", "nan", "inf",
)
_EPS64 = float(np.finfo(np.float64).eps)
_EPS32 = float(np.finfo(np.float32).eps)


@dataclass(frozen=True)
class TensorMetrics:
    """All measures for one (reference, candidate) pair; floats are plain Python floats."""

    cosine: float
    max_abs: float
    mean_abs: float
    max_rel: float  # msit MaxRelativeError
    mean_rel: float  # msit MeanRelativeError
    rel_euclidean: float
    rmse: float
    kl: float  # softmax KL per row (SoftmaxKL)
    top1: float
    nan: int  # NaN count in the candidate
    inf: int  # +-Inf count in the candidate
    ref_nan: int
    ref_inf: int
    numel: int
    acc_rel: float = math.nan  # msit AccumulatedRelativeError
    msit_kl: float = math.nan  # msit KullbackLeiblerDivergence
    cand_mean: float = math.nan  # msit StandardDeviation, candidate side
    cand_std: float = math.nan
    ref_mean: float = math.nan  # and reference side
    ref_std: float = math.nan
    euc_dist: float = math.nan  # msprobe EucDist
    msprobe_max_rel: float = math.nan  # msprobe MaxRelativeErr
    err_ratio_1e3: float = math.nan  # msprobe One Thousandth Err Ratio
    err_ratio_5e3: float = math.nan  # msprobe Five Thousandths Err Ratio

    def to_dict(self) -> dict:
        return asdict(self)

    def msit_std(self) -> str:
        return msit_std(self.to_dict())


def msit_std(m: dict) -> str:
    """msit's StandardDeviation cell: "(mean;std),(mean;std)", candidate first, 3 decimals, |x| < 1e-3
    as 0; "nan" when a moment is missing or not finite."""
    vals = [m.get(k) for k in ("cand_mean", "cand_std", "ref_mean", "ref_std")]
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in vals):
        return "nan"
    return "(%.3f;%.3f),(%.3f;%.3f)" % tuple(0.0 if abs(v) < 1e-3 else v for v in vals)


def csv_cells(m: dict | None) -> list:
    """The CSV_COLUMNS cells of one metrics dict (``TensorMetrics.to_dict()``, as report.json holds
    it); empty cells for a row without metrics (a skipped one)."""
    if not m:
        return [""] * len(CSV_COLUMNS)
    return [msit_std(m) if f == "std" else m.get(f, "") for f in CSV_FIELDS]


def as_float64(x) -> np.ndarray:
    """A torch tensor (any float dtype, incl. bfloat16) or numpy array -> float64 numpy array."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def _np_dtype(x) -> np.dtype:
    """The numpy dtype a dump of ``x`` has (bfloat16, which numpy lacks, is dumped as float32)."""
    if isinstance(x, torch.Tensor):
        return np.dtype(np.float32) if x.dtype == torch.bfloat16 else torch.empty(0, dtype=x.dtype).numpy().dtype
    return np.asarray(x).dtype


def cosine_similarity(r: np.ndarray, c: np.ndarray) -> float:
    nr, nc = float(np.linalg.norm(r)), float(np.linalg.norm(c))
    if nr == 0.0 and nc == 0.0:
        return 1.0
    if nr == 0.0 or nc == 0.0:
        return 0.0
    return float(np.dot(r, c) / (nr * nc))


def msit_relative_errors(r: np.ndarray, c: np.ndarray) -> np.ndarray:
    """msit's q_i = |c_i / r_i - 1| where |r_i| > float64 eps, else 0 (float64)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(np.abs(r) > _EPS64, np.abs(c / r - 1), 0.0)


def msprobe_relative_errors(r: np.ndarray, c: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """msprobe's e_i = |(c' - r') / r'| computed in ``dtype``, with eps(dtype) added to both where r == 0."""
    n, b = c.astype(dtype), r.astype(dtype)
    zero = b == 0
    eps = np.finfo(dtype).eps
    n[zero] += eps
    b[zero] += eps
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.abs(np.divide(n - b, b))


def msit_kl(r: np.ndarray, c: np.ndarray) -> float:
    """msit's KullbackLeiblerDivergence: min-max normalised, floored at float32 eps, summed to 1,
    sum p log(p / g) with p from the candidate and g from the reference."""
    def pdf(x):
        span = x.max() - x.min()
        x = (x - x.min()) / span if span != 0 else x
        x = np.maximum(x, _EPS32)
        return x / x.sum()

    p, g = pdf(c), pdf(r)
    v = float((p * np.log(p / g)).sum())
    return 0.0 if abs(v) < _EPS64 else v


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
    rel_dtype = np.result_type(_np_dtype(cand), _np_dtype(ref), np.float32)  # what msprobe computes in
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
    rel = msit_relative_errors(r, c)
    max_rel, mean_rel, acc_rel = float(rel.max()), float(rel.mean()), float(rel.sum())
    rel = msprobe_relative_errors(r, c, rel_dtype)
    msprobe_max_rel = float(rel.max())
    ratio_1e3, ratio_5e3 = float((rel < 0.001).sum() / rel.size), float((rel < 0.005).sum() / rel.size)
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
        ref_nan=ref_nan, ref_inf=ref_inf, numel=int(r_full.size), acc_rel=acc_rel, msit_kl=msit_kl(r, c),
        cand_mean=float(np.mean(c)), cand_std=float(np.std(c)), ref_mean=float(np.mean(r)), ref_std=float(np.std(r)),
        euc_dist=nd, msprobe_max_rel=msprobe_max_rel, err_ratio_1e3=ratio_1e3, err_ratio_5e3=ratio_5e3)


def perplexity(logits, targets) -> float:
    """exp(mean token NLL): logits (B, T, V) predicting targets (B, T) int, in float64."""
    lg = as_float64(logits).reshape(-1, np.shape(logits)[-1])
    tg = np.asarray(targets.cpu() if isinstance(targets, torch.Tensor) else targets).reshape(-1)
    m = lg.max(axis=-1, keepdims=True)
    logz = (m + np.log(np.exp(lg - m).sum(axis=-1, keepdims=True)))[:, 0]
    nll = logz - lg[np.arange(lg.shape[0]), tg]
    return float(np.exp(nll.mean()))
