"""Verdict rules as data: msit/msprobe bounds, tighter per-dtype bounds, flow.yaml overrides.

A threshold set is a flat ``{key: value}`` dict per dtype. The suffix of a key says the direction:
``*_min`` must be exceeded (value > bound), ``*_max`` must not be reached (value < bound), exactly
as msit's analyser writes them (CosineSimilarity < 0.99 is an error, so cosine must be > 0.99).
``evaluate.thresholds`` in flow.yaml lays ``{dtype: {key: value}}`` over these defaults.

Where each default comes from is in ``SOURCES`` (and in docs/evaluate.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from titan_pipe.rules.dtypes import FLOAT_NAMES
from titan_pipe.errors import UserError

DTYPES = FLOAT_NAMES

# msit `debug compare` analyser, normal precision: the first operator outside these is reported.
MSIT_NORMAL = {
    "cosine_min": 0.99,
    "rel_euclidean_max": 0.05,
    "kl_max": 0.005,
    "rmse_max": 1.0,
    "mean_rel_max": 1.0,
}

# msprobe's failure rule: cosine < 0.99 with max abs error > 0.001, or cosine < 0.9, or
# max abs error > 1, or any NaN/Inf (NaN/Inf always fail; no key turns that off). The "max abs > 1"
# part is judged relative to the tensor (metrics.ScaledMaxError: each element's error against its own
# size, or its row's median size where it is smaller): a released model's massive activation (2e4 in
# one channel, rounded by fp16 in steps of 16) passes, an error as large as the values it is in fails.
MSPROBE = {
    "msprobe_cosine": 0.99,
    "msprobe_abs": 0.001,
    "msprobe_cosine_floor": 0.9,
    "msprobe_abs_max": 1.0,
}

# Model-level extras: logits and task-level agreement, and comparison 1 (sharded vs unified).
_COMMON = {
    "logits_kl_max": 0.005,
    "logits_top1_min": 0.9,
    "ppl_rel_max": 0.01,  # |ppl_cand - ppl_ref| / ppl_ref
    "generation_agree_min": 0.5,  # fraction of greedy tokens equal, position by position
    "sharded_max_abs_max": math.inf,
    "router_agree_min": 0.9,  # a mixture of experts: tokens whose k experts are the same set
}

DEFAULTS: dict[str, dict[str, float]] = {
    # fp32 against fp32 should differ by reduction order only: far tighter than msit's generic
    # bounds; logits KL < 1e-6 as torchtitan's Hugging Face parity check uses; sharded-vs-unified
    # logits agree to 1e-5 (the TP reduction-order tolerance).
    "float32": {
        **MSIT_NORMAL,
        **MSPROBE,
        **_COMMON,
        "cosine_min": 0.99999,
        "rel_euclidean_max": 1e-4,
        "logits_kl_max": 1e-6,
        "logits_top1_min": 0.99,
        "ppl_rel_max": 1e-4,
        "generation_agree_min": 0.9,
        "sharded_max_abs_max": 1e-5,
        "router_agree_min": 0.99,
    },
    "float16": {**MSIT_NORMAL, **MSPROBE, **_COMMON},
    "bfloat16": {
        **MSIT_NORMAL,
        **MSPROBE,
        **_COMMON,
        "logits_top1_min": 0.8,
        "ppl_rel_max": 0.05,
        "generation_agree_min": 0.3,
        "router_agree_min": 0.8,
    },
}

SOURCES = {
    "cosine_min": "msit debug compare normal precision (CosineSimilarity < 0.99 flagged); fp32: 1 - 1e-5",
    "rel_euclidean_max": "msit debug compare (RelativeEuclideanDistance > 0.05 flagged); fp32: 1e-4",
    "kl_max": "msit debug compare (KullbackLeiblerDivergence > 0.005 flagged)",
    "mean_rel_max": "msit debug compare (MeanRelativeError > 1.0 flagged)",
    "msprobe_cosine": "msprobe: cosine < 0.99 together with max abs > 0.001 fails",
    "msprobe_abs": "msprobe: cosine < 0.99 together with max abs > 0.001 fails",
    "msprobe_cosine_floor": "msprobe: cosine < 0.9 fails",
    "msprobe_abs_max": "msprobe: max abs error > 1 fails; here relative to the element (or its row's median size)",
    "rmse_max": "msit debug compare (RootMeanSquareError > 1.0 flagged), against the reference's RMS where that exceeds 1",
    "logits_kl_max": "logits KL; fp32: 1e-6 as torchtitan's HF parity check",
    "logits_top1_min": "titan-pipe: next-token argmax agreement on the logits",
    "ppl_rel_max": "titan-pipe: relative perplexity difference on held-out text",
    "generation_agree_min": "titan-pipe: greedy tokens equal position by position",
    "sharded_max_abs_max": "titan-pipe: sharded vs unified logits within the TP reduction-order tolerance, fp32 <= 1e-5",
    "router_agree_min": "titan-pipe: a routing layer's top-k expert sets equal token by token, on the same input",
}

# Which keys apply to which kind of row. Operators see large magnitudes on purpose, so absolute
# bounds (RMSE, max abs) and KL of softmaxed raw outputs would flag correct fp16 kernels; they are
# judged on scale-free measures only.
SCOPES = {
    "tensor": ("cosine_min", "rel_euclidean_max", "kl_max", "rmse_max", "mean_rel_max", "msprobe"),
    "logits": (
        "cosine_min",
        "rel_euclidean_max",
        "rmse_max",
        "mean_rel_max",
        "msprobe",
        "logits_kl_max",
        "logits_top1_min",
    ),
    "sharded": ("cosine_min", "rel_euclidean_max", "msprobe", "logits_kl_max", "sharded_max_abs_max"),
    # a LoRA checkpoint's adapters applied beside the base vs the same adapters merged into the weights:
    # the merge rounds W + (alpha/r) B A to the weights' dtype once, an error that grows with the weights'
    # and the activations' size, not a reduction order: judged on the scale-free bounds only
    "sharded_merged": ("cosine_min", "rel_euclidean_max", "msprobe", "logits_kl_max"),
    "operator": ("cosine_min", "rel_euclidean_max"),
    # a layer's attention / MLP block output before the residual Add: no residual stream to keep
    # magnitudes up, so near-zero elements make absolute and mean-relative measures meaningless
    "block": ("cosine_min", "rel_euclidean_max"),
}


@dataclass(frozen=True)
class Failure:
    """One broken bound: what, the value seen, the bound, and where the bound comes from."""

    key: str
    value: float
    bound: float
    text: str

    def to_dict(self) -> dict:
        return {"key": self.key, "value": _json_float(self.value), "bound": _json_float(self.bound), "text": self.text}


def _json_float(x: float):
    return x if math.isfinite(x) else str(x)


def resolve_thresholds(
    dtype: str, overrides: dict[str, dict[str, float]] | None = None, *, source: str = "evaluate.thresholds"
) -> dict[str, float]:
    """The threshold set of ``dtype`` with flow.yaml overrides laid over; bad keys are UserErrors."""
    if dtype not in DEFAULTS:
        raise UserError(f"dtype {dtype!r} has no thresholds; use one of {', '.join(DTYPES)}")
    validate_overrides(overrides or {}, source=source)
    out = dict(DEFAULTS[dtype])
    out.update({k: float(v) for k, v in (overrides or {}).get(dtype, {}).items()})
    return out


def validate_overrides(overrides: dict, *, source: str = "evaluate.thresholds") -> None:
    """Every dtype and key must be known (a typo must not silently keep the default)."""
    for dt, table in overrides.items():
        if dt not in DEFAULTS:
            raise UserError(f"{source}.{dt}: unknown dtype; use one of {', '.join(DTYPES)}")
        if not isinstance(table, dict):
            raise UserError(f"{source}.{dt}: must be a mapping of threshold keys to numbers")
        for key, value in table.items():
            if key not in DEFAULTS[dt]:
                raise UserError(
                    f"{source}.{dt}.{key}: unknown threshold key; known keys: {', '.join(sorted(DEFAULTS[dt]))}"
                )
            if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
                raise UserError(f"{source}.{dt}.{key}: {value!r} is not a number")


def _below(key, value, bound, what) -> list[Failure]:
    # NaN compares false everywhere: treat it as failing every bound.
    if math.isnan(value) or not value > bound:
        return [Failure(key, value, bound, f"{what} {value:.6g} <= {bound:.6g} [{key}]")]
    return []


def _above(key, value, bound, what) -> list[Failure]:
    if math.isnan(value) or not value < bound:
        return [Failure(key, value, bound, f"{what} {value:.6g} >= {bound:.6g} [{key}]")]
    return []


def check_metrics(m, limits: dict[str, float], scope: str) -> list[Failure]:
    """The bounds a TensorMetrics ``m`` breaks under ``limits`` for a row of kind ``scope``."""
    keys = SCOPES[scope]
    out: list[Failure] = []
    if m.nan or m.inf:
        out.append(
            Failure(
                "nan_inf",
                float(m.nan + m.inf),
                0.0,
                f"candidate has {m.nan} NaN and {m.inf} Inf values [msprobe rule: any NaN/Inf fails]",
            )
        )
    if "cosine_min" in keys:
        out += _below("cosine_min", m.cosine, limits["cosine_min"], "cosine similarity")
    if "rel_euclidean_max" in keys:
        out += _above("rel_euclidean_max", m.rel_euclidean, limits["rel_euclidean_max"], "relative Euclidean distance")
    if "kl_max" in keys:
        out += _above("kl_max", m.msit_kl, limits["kl_max"], "KL divergence (msit's)")
    if "logits_kl_max" in keys:
        out += _above("logits_kl_max", m.kl, limits["logits_kl_max"], "logits KL divergence")
    if "rmse_max" in keys:  # judged against the tensor's own RMS where that exceeds 1 (an RMSE is absolute)
        scale = max(1.0, m.ref_rms) if math.isfinite(m.ref_rms) else 1.0
        out += _above(
            "rmse_max",
            m.rmse / scale,
            limits["rmse_max"],
            "RMSE" if scale == 1.0 else f"RMSE / reference RMS {scale:.3g}",
        )
    if "mean_rel_max" in keys:
        out += _above("mean_rel_max", m.mean_rel, limits["mean_rel_max"], "mean relative error")
    if "logits_top1_min" in keys and not m.top1 >= limits["logits_top1_min"]:
        out.append(
            Failure(
                "logits_top1_min",
                m.top1,
                limits["logits_top1_min"],
                f"top-1 agreement {m.top1:.4f} < {limits['logits_top1_min']:.4g} [logits_top1_min]",
            )
        )
    if "sharded_max_abs_max" in keys and not m.max_abs <= limits["sharded_max_abs_max"]:
        out.append(
            Failure(
                "sharded_max_abs_max",
                m.max_abs,
                limits["sharded_max_abs_max"],
                f"max abs error {m.max_abs:.3g} > {limits['sharded_max_abs_max']:.3g} [sharded_max_abs_max]",
            )
        )
    if "msprobe" in keys:
        out += _msprobe(m, limits)
    return out


def _msprobe(m, limits) -> list[Failure]:
    cos, mx = m.cosine, m.max_abs
    if math.isnan(cos) or math.isnan(mx):
        return []  # already failed as NaN above
    if cos < limits["msprobe_cosine"] and mx > limits["msprobe_abs"]:
        return [
            Failure(
                "msprobe_cosine",
                cos,
                limits["msprobe_cosine"],
                f"cosine {cos:.6g} < {limits['msprobe_cosine']} with max abs {mx:.3g} > "
                f"{limits['msprobe_abs']} [msprobe rule]",
            )
        ]
    if cos < limits["msprobe_cosine_floor"]:
        return [
            Failure(
                "msprobe_cosine_floor",
                cos,
                limits["msprobe_cosine_floor"],
                f"cosine {cos:.6g} < {limits['msprobe_cosine_floor']} [msprobe rule]",
            )
        ]
    scaled = m.max_scaled if math.isfinite(m.max_scaled) else mx  # records made before the scaled measure
    if scaled > limits["msprobe_abs_max"]:
        return [
            Failure(
                "msprobe_abs_max",
                scaled,
                limits["msprobe_abs_max"],
                f"max error {scaled:.6g} x the element's size (or its row's median) > "
                f"{limits['msprobe_abs_max']} (max abs error {mx:.3g}) [msprobe rule, relative]",
            )
        ]
    return []


def check_task(*, ppl_ref: float, ppl_cand: float, agreement: float | None, limits: dict[str, float]) -> list[Failure]:
    """Task-level bounds: perplexity close to the reference's, greedy generations agreeing."""
    out: list[Failure] = []
    rel = abs(ppl_cand - ppl_ref) / ppl_ref if math.isfinite(ppl_ref) and ppl_ref > 0 else math.nan
    out += _above("ppl_rel_max", rel, limits["ppl_rel_max"], "relative perplexity difference")
    if agreement is not None and not agreement >= limits["generation_agree_min"]:
        out.append(
            Failure(
                "generation_agree_min",
                agreement,
                limits["generation_agree_min"],
                f"greedy token agreement {agreement:.3f} < {limits['generation_agree_min']} [generation_agree_min]",
            )
        )
    return out
