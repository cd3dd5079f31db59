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
  ScaledMaxError            max |d_i| / max(|r_i|, median |r| of its row, 1e-6)       (titan-pipe)
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
    "CosineSimilarity",
    "MaxAbsoluteError",
    "MeanAbsoluteError",
    "MaxRelativeError",
    "MeanRelativeError",
    "AccumulatedRelativeError",
    "RelativeEuclideanDistance",
    "RootMeanSquareError",
    "KullbackLeiblerDivergence",
    "StandardDeviation",
    "EucDist",
    "MaxRelativeErr",
    "One Thousandth Err Ratio",
    "Five Thousandths Err Ratio",
    "SoftmaxKL",
    "Top1Agreement",
    "ScaledMaxError",
    "CandidateNaN",
    "CandidateInf",
)
# TensorMetrics field under each CSV column ("StandardDeviation" is formatted from four fields).
CSV_FIELDS: tuple[str, ...] = (
    "cosine",
    "max_abs",
    "mean_abs",
    "max_rel",
    "mean_rel",
    "acc_rel",
    "rel_euclidean",
    "rmse",
    "msit_kl",
    "std",
    "euc_dist",
    "msprobe_max_rel",
    "err_ratio_1e3",
    "err_ratio_5e3",
    "kl",
    "top1",
    "max_scaled",
    "nan",
    "inf",
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
    # max |d_i| / max(|r_i|, median |r| of its row): the error against the element's own size, or its
    # row's typical size where the element is smaller; a massive activation (one channel at 2e4, where
    # fp16 rounds in steps of 16) is judged by its own size, the other channels by theirs (ScaledMaxError)
    max_scaled: float = math.nan
    ref_rms: float = math.nan  # sqrt(mean(r^2)): the scale an RMSE is judged against

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


SCALE_FLOOR = 1e-6  # a row of zeros (or near it) is judged against this size, not divided by zero


def scaled_errors(rows_r: np.ndarray, rows_c: np.ndarray, chunk: int = 256) -> np.ndarray:
    """Per row (last axis) the max of |c_i - r_i| / max(|r_i|, median_row |r|, SCALE_FLOOR): (rows,)."""
    out = np.empty(rows_r.shape[0])
    for i in range(0, rows_r.shape[0], chunk):
        r, c = rows_r[i : i + chunk], rows_c[i : i + chunk]
        a = np.abs(r)
        scale = np.maximum(np.maximum(a, np.median(a, axis=-1, keepdims=True)), SCALE_FLOOR)
        out[i : i + chunk] = (np.abs(c - r) / scale).max(axis=-1)
    return out


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def _softmax_kl_sum(r: np.ndarray, c: np.ndarray, chunk: int = 256) -> float:
    """Sum over rows of KL(softmax(r) || softmax(c)); r, c are (rows, cols) float64, taken ``chunk``
    rows at a time so the temporaries stay a few chunk x cols arrays."""
    total = 0.0
    for i in range(0, r.shape[0], chunk):
        lr, lc = _log_softmax(r[i : i + chunk]), _log_softmax(c[i : i + chunk])
        total += float((np.exp(lr) * (lr - lc)).sum())
    return total


@dataclass
class _Pair:
    """One part of a compared pair in float64: finite elements flattened, finite rows (last axis)."""

    r: np.ndarray
    c: np.ndarray
    rows_r: np.ndarray
    rows_c: np.ndarray
    rel_dtype: np.dtype
    counts: tuple[int, int, int, int, int]  # candidate NaN, Inf, reference NaN, Inf, numel


def _pair(ref, cand) -> _Pair:
    r_full, c_full = as_float64(ref), as_float64(cand)
    if r_full.shape != c_full.shape:
        raise ValueError(f"shape mismatch: reference {tuple(r_full.shape)} vs candidate {tuple(c_full.shape)}")
    rel_dtype = np.result_type(_np_dtype(cand), _np_dtype(ref), np.float32)  # what msprobe computes in
    counts = (
        int(np.isnan(c_full).sum()),
        int(np.isinf(c_full).sum()),
        int(np.isnan(r_full).sum()),
        int(np.isinf(r_full).sum()),
        int(r_full.size),
    )
    rows_r = r_full.reshape(-1, r_full.shape[-1]) if r_full.ndim else r_full.reshape(1, 1)
    rows_c = c_full.reshape(-1, c_full.shape[-1]) if c_full.ndim else c_full.reshape(1, 1)
    if any(counts[:4]):
        finite = np.isfinite(r_full) & np.isfinite(c_full)
        r, c = r_full[finite].ravel(), c_full[finite].ravel()
        row_ok = np.isfinite(rows_r).all(axis=-1) & np.isfinite(rows_c).all(axis=-1)
        rows_r, rows_c = rows_r[row_ok], rows_c[row_ok]
    else:  # the common case: views, no copies
        r, c = r_full.ravel(), c_full.ravel()
    return _Pair(r, c, rows_r, rows_c, rel_dtype, counts)


class _Sums:
    """Pass 1 over the parts: counts, extremes and sums of every measure that adds up."""

    def __init__(self):
        self.counts = np.zeros(5, dtype=np.int64)
        self.n = 0
        self.v = dict.fromkeys(
            ("dot", "rr", "cc", "dd", "sum_abs", "sum_rel", "sum_r", "sum_c", "kl", "top1", "rows", "n1e3", "n5e3"), 0.0
        )
        self.hi = dict.fromkeys(("max_abs", "max_rel", "msprobe_max_rel", "max_scaled"), -math.inf)
        self.lo_r = self.lo_c = math.inf
        self.hi_r = self.hi_c = -math.inf

    def add(self, p: _Pair) -> None:
        self.counts += p.counts
        if p.r.size:
            r, c, v = p.r, p.c, self.v
            rel = msit_relative_errors(r, c)
            self._max("max_rel", rel.max())
            v["sum_rel"] += float(rel.sum())
            rel = msprobe_relative_errors(r, c, p.rel_dtype)
            self._max("msprobe_max_rel", rel.max())
            v["n1e3"] += int((rel < 0.001).sum())
            v["n5e3"] += int((rel < 0.005).sum())
            del rel
            d = np.abs(c - r)
            self._max("max_abs", d.max())
            v["sum_abs"] += float(d.sum())
            v["dd"] += float(np.dot(d, d))
            del d
            v["dot"] += float(np.dot(r, c))
            v["rr"] += float(np.dot(r, r))
            v["cc"] += float(np.dot(c, c))
            v["sum_r"] += float(r.sum())
            v["sum_c"] += float(c.sum())
            self.lo_r, self.hi_r = min(self.lo_r, float(r.min())), max(self.hi_r, float(r.max()))
            self.lo_c, self.hi_c = min(self.lo_c, float(c.min())), max(self.hi_c, float(c.max()))
            self.n += r.size
        if p.rows_r.shape[0]:
            self._max("max_scaled", scaled_errors(p.rows_r, p.rows_c).max())
            self.v["kl"] += _softmax_kl_sum(p.rows_r, p.rows_c)
            self.v["top1"] += int((p.rows_r.argmax(axis=-1) == p.rows_c.argmax(axis=-1)).sum())
            self.v["rows"] += p.rows_r.shape[0]

    def _max(self, key: str, value) -> None:
        self.hi[key] = max(self.hi[key], float(value))


def _msit_pdf_part(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """msit's unnormalised pdf of one part: min-max scaled over the whole tensor, floored at float32 eps."""
    span = hi - lo
    x = (x - lo) / span if span != 0 else x
    return np.maximum(x, _EPS32)


def compare_parts(parts) -> TensorMetrics:
    """All measures of a candidate against a reference given as parts (batches of one tensor), equal
    to compare_tensors on the parts joined: ``parts()`` yields (reference, candidate) pairs, the
    same each call; it is walked three times (sums; msit's normalisers and the moments; msit's KL),
    one part in float64 at a time."""
    return _compare_pairs(lambda: (_pair(r, c) for r, c in parts()))


def _compare_pairs(pairs) -> TensorMetrics:
    s = _Sums()
    for p in pairs():
        s.add(p)
    nan, inf, ref_nan, ref_inf, numel = (int(x) for x in s.counts)
    if s.n == 0:
        n = float("nan")
        return TensorMetrics(n, n, n, n, n, n, n, n, n, nan, inf, ref_nan, ref_inf, numel)
    mean_r, mean_c = s.v["sum_r"] / s.n, s.v["sum_c"] / s.n
    a_sum = b_sum = var_r = var_c = 0.0
    for p in pairs():
        a_sum += float(_msit_pdf_part(p.c, s.lo_c, s.hi_c).sum())
        b_sum += float(_msit_pdf_part(p.r, s.lo_r, s.hi_r).sum())
        var_r += float(np.square(p.r - mean_r).sum())
        var_c += float(np.square(p.c - mean_c).sum())
    kl = 0.0
    for p in pairs():
        pc = _msit_pdf_part(p.c, s.lo_c, s.hi_c) / a_sum
        gr = _msit_pdf_part(p.r, s.lo_r, s.hi_r) / b_sum
        kl += float((pc * np.log(pc / gr)).sum())
    return _metrics(s, kl, mean_r, mean_c, var_r, var_c, numel)


def _metrics(
    s: _Sums, msit_kl: float, mean_r: float, mean_c: float, var_r: float, var_c: float, numel: int
) -> TensorMetrics:
    v, n = s.v, s.n
    nr, nc, nd = math.sqrt(v["rr"]), math.sqrt(v["cc"]), math.sqrt(v["dd"])
    if nr == 0.0 or nc == 0.0:
        cosine = 1.0 if nr == nc else 0.0
    else:
        cosine = v["dot"] / (nr * nc)
    rows = v["rows"]
    nan, inf, ref_nan, ref_inf, _ = (int(x) for x in s.counts)
    return TensorMetrics(
        cosine=cosine,
        max_abs=s.hi["max_abs"],
        mean_abs=v["sum_abs"] / n,
        max_rel=s.hi["max_rel"],
        mean_rel=v["sum_rel"] / n,
        rel_euclidean=nd / nr if nr > 0 else (0.0 if nd == 0 else math.inf),
        rmse=nd / math.sqrt(n),
        # rounding can make a zero divergence come out as -1e-17; KL is never negative
        kl=max(v["kl"] / rows, 0.0) if rows else float("nan"),
        top1=v["top1"] / rows if rows else float("nan"),
        nan=nan,
        inf=inf,
        ref_nan=ref_nan,
        ref_inf=ref_inf,
        numel=numel,
        acc_rel=v["sum_rel"],
        msit_kl=0.0 if abs(msit_kl) < _EPS64 else msit_kl,
        cand_mean=mean_c,
        cand_std=math.sqrt(var_c / n),
        ref_mean=mean_r,
        ref_std=math.sqrt(var_r / n),
        euc_dist=nd,
        msprobe_max_rel=s.hi["msprobe_max_rel"],
        err_ratio_1e3=v["n1e3"] / n,
        err_ratio_5e3=v["n5e3"] / n,
        max_scaled=s.hi["max_scaled"] if s.hi["max_scaled"] > -math.inf else math.nan,
        ref_rms=nr / math.sqrt(n),
    )


def compare_tensors(ref, cand) -> TensorMetrics:
    """All measures of ``cand`` against ``ref`` (same shape; any float dtypes), computed in float64.

    Rows for KL and top-1 are taken along the last axis. Non-finite entries are counted, then left
    out of the other measures (so one Inf does not hide what the rest of the tensor looks like);
    a tensor with no finite pair gets NaN measures.
    """
    pair = _pair(ref, cand)  # converted once, walked three times
    return _compare_pairs(lambda: [pair])


def nll_sum(logits, targets, keep=None) -> tuple[float, int]:
    """(sum of token NLLs, token count): logits (B, T, V) predicting targets (B, T) int, in float64;
    parts add up, so perplexity is reduced batch by batch. ``keep`` (B, T) bool: only those targets
    (the answers of chat data)."""
    lg = as_float64(logits).reshape(-1, np.shape(logits)[-1])
    tg = np.asarray(targets.cpu() if isinstance(targets, torch.Tensor) else targets).reshape(-1)
    if keep is not None:
        rows = np.asarray(keep.cpu() if isinstance(keep, torch.Tensor) else keep).reshape(-1).astype(bool)
        lg, tg = lg[rows], tg[rows]
    m = lg.max(axis=-1, keepdims=True)
    logz = (m + np.log(np.exp(lg - m).sum(axis=-1, keepdims=True)))[:, 0]
    return float((logz - lg[np.arange(lg.shape[0]), tg]).sum()), int(tg.size)


def perplexity(logits, targets) -> float:
    """exp(mean token NLL): logits (B, T, V) predicting targets (B, T) int, in float64."""
    total, n = nll_sum(logits, targets)
    return float(np.exp(total / n))
