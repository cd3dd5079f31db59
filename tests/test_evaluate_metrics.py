"""Metrics against hand-computed values and plain-Python references; threshold rules and overrides."""

import math

import numpy as np
import pytest
import torch

from titan_pipe.config import ConfigError, parse_flow
from titan_pipe.errors import UserError
from titan_pipe.evaluate.metrics import CSV_COLUMNS, compare_tensors, csv_cells, perplexity
from titan_pipe.rules.thresholds import DEFAULTS, check_metrics, check_task, resolve_thresholds


def test_hand_computed_values():
    r = np.array([[1.0, 2.0], [0.0, -4.0]])
    c = np.array([[1.0, 2.5], [0.5, -4.0]])
    m = compare_tensors(r, c)
    d = np.array([0.0, 0.5, 0.5, 0.0])
    assert m.max_abs == 0.5 and m.mean_abs == 0.25
    assert m.rmse == pytest.approx(math.sqrt(0.5 / 4))
    assert m.rel_euclidean == pytest.approx(math.sqrt(0.5) / math.sqrt(21))
    dot, nr, nc = 1 + 5 + 0 + 16, math.sqrt(21), math.sqrt(1 + 6.25 + 0.25 + 16)
    assert m.cosine == pytest.approx(dot / (nr * nc))
    # msit: an element whose reference is (near) zero counts 0; msprobe: eps is added to both sides
    rel = [0, 0.25, 0, 0]
    assert m.max_rel == pytest.approx(max(rel)) and m.mean_rel == pytest.approx(sum(rel) / 4)
    assert m.acc_rel == pytest.approx(sum(rel))
    eps = np.finfo(np.float64).eps
    assert m.msprobe_max_rel == pytest.approx(0.5 / eps)
    assert m.err_ratio_1e3 == m.err_ratio_5e3 == 0.5  # the two exact elements
    assert m.euc_dist == pytest.approx(math.sqrt(0.5))
    assert (m.ref_mean, m.cand_mean) == (pytest.approx(-0.25), pytest.approx(0.0))
    assert m.ref_std == pytest.approx(np.std([1.0, 2.0, 0.0, -4.0]))
    assert m.msit_std() == "(0.000;%.3f),(-0.250;%.3f)" % (np.std([1.0, 2.5, 0.5, -4.0]), np.std([1.0, 2.0, 0.0, -4.0]))
    assert m.top1 == 1.0  # row argmaxes: (1, 1) and (0, 0)
    assert compare_tensors(np.array([[0.0, 1.0], [2.0, 1.0]]), np.array([[1.0, 0.0], [2.0, 1.0]])).top1 == 0.5
    assert (m.nan, m.inf) == (0, 0)
    assert d.size == m.numel


def _kl_reference(r_rows, c_rows):
    total = 0.0
    for r, c in zip(r_rows, c_rows):
        zr = sum(math.exp(v) for v in r)
        zc = sum(math.exp(v) for v in c)
        total += sum(math.exp(a) / zr * (math.log(math.exp(a) / zr) - math.log(math.exp(b) / zc)) for a, b in zip(r, c))
    return total / len(r_rows)


def test_kl_and_cosine_against_plain_python():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(5, 7, generator=g)
    c = r + 0.1 * torch.randn(5, 7, generator=g)
    m = compare_tensors(r, c)
    assert m.kl == pytest.approx(_kl_reference(r.tolist(), c.tolist()), rel=1e-9)
    rf, cf = r.double().flatten().tolist(), c.double().flatten().tolist()
    cos = sum(a * b for a, b in zip(rf, cf)) / math.sqrt(sum(a * a for a in rf) * sum(b * b for b in cf))
    assert m.cosine == pytest.approx(cos, rel=1e-12)
    assert compare_tensors(r, r).kl == 0.0 and compare_tensors(r, r).cosine == pytest.approx(1.0)


def test_float16_and_bfloat16_inputs_are_compared_in_float64():
    x = torch.tensor([1.0, 1.0009765625, 3.0])  # 1 + 2^-10 is exact in float16
    m = compare_tensors(x, x.half())
    assert m.max_abs == 0.0
    mb = compare_tensors(x, x.bfloat16())
    assert mb.max_abs == pytest.approx(0.0009765625)  # bf16 rounds 1 + 2^-10 to 1
    # msprobe's relative error of a zero reference adds eps of the computing dtype (>= float32)
    z = compare_tensors(torch.zeros(2, dtype=torch.float16), torch.tensor([0.0, 1e-3]))
    assert z.msprobe_max_rel == pytest.approx(1e-3 / float(torch.finfo(torch.float32).eps), rel=1e-6)
    assert z.max_rel == 0.0  # msit leaves zero references out


def test_nan_inf_counted_and_excluded():
    r = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    c = torch.tensor([[1.0, float("nan")], [3.0, float("inf")]])
    m = compare_tensors(r, c)
    assert (m.nan, m.inf) == (1, 1)
    assert m.max_abs == 0.0  # the finite pairs agree
    assert math.isnan(m.kl)  # no row is wholly finite
    fails = check_metrics(m, resolve_thresholds("float16"), "tensor")
    assert any(f.key == "nan_inf" for f in fails)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="shape mismatch"):
        compare_tensors(torch.zeros(2, 3), torch.zeros(3, 2))


def test_perplexity_against_manual_cross_entropy():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 11, generator=g)
    targets = torch.randint(0, 11, (2, 5), generator=g)
    ce = torch.nn.functional.cross_entropy(logits.double().view(-1, 11), targets.view(-1))
    assert perplexity(logits, targets) == pytest.approx(math.exp(ce.item()), rel=1e-12)


def test_msit_bounds_and_msprobe_rule():
    lim = resolve_thresholds("float16")
    ok = compare_tensors(torch.ones(100), torch.ones(100) * 1.0001)
    assert check_metrics(ok, lim, "tensor") == []
    g = torch.Generator().manual_seed(0)
    r = torch.randn(1000, generator=g)
    # cosine ~0.98 with max abs > 0.001: msit (cosine) and the msprobe rule both fire
    bad = compare_tensors(r, r + 0.2 * torch.randn(1000, generator=g))
    keys = {f.key for f in check_metrics(bad, lim, "tensor")}
    assert {"cosine_min", "msprobe_cosine", "rel_euclidean_max"} <= keys
    # an error larger than the element it is in (and than its row's median size) fails under the
    # msprobe rule even when cosine is fine; an error of 2 on elements of ~1000 is fp16's rounding
    # there (steps of 0.5), not a fault: judged relative, it passes (a massive activation's case)
    big = torch.randn(1000, generator=g) * 1000
    spike = big.clone()
    spike[3] += 2.0
    assert check_metrics(compare_tensors(big, spike), lim, "tensor") == []
    med = float(big.abs().median())
    i = int((big.abs() - med / 2).abs().argmin())  # an element half the median: judged against the median
    spike[3] = big[3]
    spike[i] = big[i] + 1.5 * med
    keys = {f.key for f in check_metrics(compare_tensors(big, spike), lim, "tensor")}
    assert keys == {"msprobe_abs_max"}
    # operators are judged on scale-free bounds only
    assert check_metrics(compare_tensors(big, spike), lim, "operator") == []


def test_fp32_is_tighter_than_fp16():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(64, 320, generator=g) * 3
    c = r.half().float()  # float16 rounding only
    m = compare_tensors(r, c)
    assert check_metrics(m, resolve_thresholds("float16"), "logits") == []
    keys = {f.key for f in check_metrics(m, resolve_thresholds("float32"), "logits")}
    assert "rel_euclidean_max" in keys
    assert DEFAULTS["float32"]["logits_kl_max"] == 1e-6


def test_task_bounds():
    lim = resolve_thresholds("float32")
    assert check_task(ppl_ref=10.0, ppl_cand=10.0, agreement=1.0, limits=lim) == []
    fails = check_task(ppl_ref=10.0, ppl_cand=10.1, agreement=0.5, limits=lim)
    assert {f.key for f in fails} == {"ppl_rel_max", "generation_agree_min"}


def test_overrides_apply_and_bad_keys_are_named():
    lim = resolve_thresholds("float32", {"float32": {"cosine_min": 0.5}})
    assert lim["cosine_min"] == 0.5 and lim["kl_max"] == DEFAULTS["float32"]["kl_max"]
    with pytest.raises(UserError, match=r"float32\.cosine_mn: unknown threshold key"):
        resolve_thresholds("float32", {"float32": {"cosine_mn": 0.5}})
    with pytest.raises(UserError, match="float8: unknown dtype"):
        resolve_thresholds("float32", {"float8": {}})
    with pytest.raises(UserError, match="no thresholds"):
        resolve_thresholds("int8")


def test_flow_yaml_thresholds_are_validated():
    cfg = parse_flow({"evaluate": {"thresholds": {"float16": {"rmse_max": 0.5}}, "dtype": "float16"}})
    assert cfg.evaluate.thresholds["float16"]["rmse_max"] == 0.5
    with pytest.raises(ConfigError) as e:
        parse_flow({"evaluate": {"thresholds": {"float16": {"rmse": 0.5}}}})
    assert any("float16.rmse: unknown threshold key" in line for line in e.value.lines)


def test_csv_columns_are_msit_names():
    for name in (
        "CosineSimilarity",
        "MaxAbsoluteError",
        "MeanAbsoluteError",
        "MaxRelativeError",
        "MeanRelativeError",
        "RelativeEuclideanDistance",
        "RootMeanSquareError",
        "KullbackLeiblerDivergence",
    ):
        assert name in CSV_COLUMNS
    cells = csv_cells(compare_tensors(torch.ones(3), torch.tensor([1.0, 1.0, 2.0])).to_dict())
    assert len(cells) == len(CSV_COLUMNS)
    row = dict(zip(CSV_COLUMNS, cells))
    assert row["MaxAbsoluteError"] == 1.0 and row["StandardDeviation"] == "(1.333;0.471),(1.000;0.000)"
    assert csv_cells(None) == [""] * len(CSV_COLUMNS)


def test_layer_plot_draws_each_dtypes_threshold(tmp_path, monkeypatch):
    """The relative-distance threshold the verdict uses is drawn across the per-layer panel."""
    import matplotlib.figure

    from titan_pipe.evaluate.report import plot_layer_errors

    drawn = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    rows = [
        {"layer": i, "tensor": f"hidden.{i}", "metrics": {"rel_euclidean": 1e-7 * (i + 1), "max_abs": 1e-8}}
        for i in range(3)
    ]
    comps = [
        {"id": "a", "candidate": "x", "dtype": "float32", "rows": rows},
        {"id": "b", "candidate": "y", "dtype": "float16", "rows": rows},
    ]
    assert plot_layer_errors(
        comps, tmp_path / "p.png", {"float32": {"rel_euclidean_max": 1e-4}, "float16": {"rel_euclidean_max": 2e-3}}
    )
    lines = {ln.get_label(): ln.get_ydata()[0] for ln in drawn[0].axes[0].get_lines()}
    assert lines["threshold float32 (0.0001)"] == 1e-4 and lines["threshold float16 (0.002)"] == 2e-3
    assert not any(label.startswith("threshold") for label in (ln.get_label() for ln in drawn[0].axes[1].get_lines()))


def test_a_lora_merge_is_judged_on_relative_bounds_a_layout_on_the_reduction_order_too():
    """Logits of RMS ~0.5 off by the float32 rounding of a merged W + (alpha/r) B A (relative 1e-5, max
    abs 4e-5: what a 4-step Gemma 3 LoRA run showed): a layout change (TP reduction order) may not
    move them by 1e-5, a merge may; a real difference (relative 1e-3) fails both."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(2, 32, 256, generator=g) * 0.5
    rounding = ref * (1 + 1e-5 * torch.randn(ref.shape, generator=g))
    m = compare_tensors(ref.numpy(), rounding.numpy())
    limits = DEFAULTS["float32"]
    assert m.max_abs > limits["sharded_max_abs_max"]
    assert [f.key for f in check_metrics(m, limits, "sharded")] == ["sharded_max_abs_max"]
    assert check_metrics(m, limits, "sharded_merged") == []
    wrong = compare_tensors(ref.numpy(), (ref * (1 + 1e-3 * torch.randn(ref.shape, generator=g))).numpy())
    assert check_metrics(wrong, limits, "sharded_merged") and check_metrics(wrong, limits, "sharded")
