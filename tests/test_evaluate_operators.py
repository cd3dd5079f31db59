"""Operator conformance: PyTorch training operators vs one-node ONNX graphs in ONNX Runtime."""

import dataclasses

import pytest

pytest.importorskip("onnxruntime")

from titan_pipe.evaluate.operators import CASES, OPERATORS, run_conformance, run_operator  # noqa: E402


@pytest.fixture(scope="module")
def table():
    return run_conformance()


def test_every_operator_dtype_case_has_a_row(table):
    assert len(table) == len(OPERATORS) * 3 * len(CASES)
    assert {r.op for r in table} == {
        "embedding",
        "linear",
        "rms_norm",
        "rope",
        "attention",
        "softmax",
        "silu",
        "swiglu",
        "residual_add",
        "cast",
        "linear_bias",
        "qk_norm",
        "attention_window",
        "rms_norm_offset",
        "geglu",
    }  # Qwen2, Qwen3, Mistral, Gemma 3


def test_float32_all_pass(table):
    fp32 = [r for r in table if r.dtype == "float32"]
    assert all(r.status == "pass" for r in fp32), [
        (r.op, r.case, r.status, r.failures) for r in fp32 if r.status != "pass"
    ]
    # gathers, adds, RoPE and casts are exact in both runtimes
    for r in fp32:
        if r.op in ("embedding", "residual_add", "cast"):
            assert r.metrics.max_abs == 0.0


def test_float16_rows_are_judged_with_float16_bounds(table):
    fp16 = [r for r in table if r.dtype == "float16"]
    for r in fp16:
        assert r.status == "pass" or r.status.startswith("skipped: ORT has no float16"), (r.op, r.case, r.status)
    ran = [r for r in fp16 if r.status == "pass"]
    assert ran, "ORT runs float16 on CPU"
    # float16 arithmetic really happened: matmul/norm differ from torch by float16 rounding,
    # more than float32's bounds allow, but within msit's.
    lin = next(r for r in ran if r.op == "linear" and r.case == "normal")
    assert 1e-5 < lin.metrics.rel_euclidean < 0.05


def test_bfloat16_skips_say_why(table):
    bf16 = [r for r in table if r.dtype == "bfloat16"]
    skipped = [r for r in bf16 if r.status.startswith("skipped")]
    assert skipped, "ORT's CPU provider lacks most bfloat16 kernels"
    for r in skipped:
        assert r.status.startswith("skipped: ORT has no bfloat16 "), r.status
        assert r.metrics is None
    # casts and gathers do exist in bfloat16 and must then really pass
    assert all(r.status == "pass" for r in bf16 if r.op in ("cast", "embedding"))


def test_a_wrong_graph_fails():
    """RoPE with the halves swapped the other way (interleaved vs rotate-half mix-up) must fail."""
    rope = next(s for s in OPERATORS if s.name == "rope")

    def wrong_graph(b, n, a):
        half, axis = a["q"].shape[-1] // 2, b.const([-1])
        x1 = b.op("Slice", [n["q"], b.const([0]), b.const([half]), axis])
        x2 = b.op("Slice", [n["q"], b.const([half]), b.const([2 * half]), axis])
        rot = b.op("Concat", [x2, b.op("Neg", [x1])], axis=-1)  # sign flipped
        return b.op("Add", [b.op("Mul", [n["q"], n["cos"]]), b.op("Mul", [rot, n["sin"]])])

    row = run_operator(dataclasses.replace(rope, graph=wrong_graph), "float32", "normal")
    assert row.status == "fail" and row.failures
