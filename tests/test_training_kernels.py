"""The training kernels, the fused loss and the fused optimizer each equal what they replace
(values and gradients), on CPU where they run here; the accelerator figures are the device check's."""

from __future__ import annotations

import pytest
import torch

from titan_pipe.model.args import resolve_args
from titan_pipe.model.kernels import reference_kernels, resolve_kernels, torch_fused_kernels
from titan_pipe.model.loss import cross_entropy, linear_cross_entropy
from titan_pipe.model.transformer import build_model

REF, FUSED = reference_kernels(), torch_fused_kernels()


def _grads(fn, *xs):
    xs = [x.detach().clone().requires_grad_() for x in xs]
    out = fn(*xs)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
    (out * w).sum().backward()
    return out.detach(), [x.grad for x in xs]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_rms_norm_fused_equals_the_reference(dtype, tol):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 7, 64, generator=g).to(dtype), (torch.rand(64, generator=g) + 0.5).to(dtype)
    a, ga = _grads(lambda x, w: REF.rms_norm(x, w, 1e-5), x, w)
    b, gb = _grads(lambda x, w: FUSED.rms_norm(x, w, 1e-5), x, w)
    torch.testing.assert_close(b, a, atol=tol, rtol=tol)
    for u, v in zip(gb, ga):
        torch.testing.assert_close(u, v, atol=tol * 10, rtol=tol)


def test_rotary_on_halves_equals_the_reference():
    from titan_pipe.model.transformer import rope_cos_sin

    args = resolve_args("debug")
    cos, sin = rope_cos_sin(args)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 4, 16, args.head_dim, generator=g), torch.randn(2, 2, 16, args.head_dim, generator=g)
    a, ga = _grads(lambda q, k: torch.cat(REF.apply_rotary(q, k, cos[:16], sin[:16]), 1), q, k)
    b, gb = _grads(lambda q, k: torch.cat(FUSED.apply_rotary(q, k, cos[:16], sin[:16]), 1), q, k)
    torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-6)
    for u, v in zip(gb, ga):
        torch.testing.assert_close(u, v, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("n_rep", [1, 2, 4])
def test_attention_with_grouped_kv_equals_the_reference(n_rep, window):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 12, 16, generator=g)
    k, v = (torch.randn(2, 4 // n_rep, 12, 16, generator=g) for _ in range(2))
    a, ga = _grads(lambda q, k, v: REF.attention(q, k, v, n_rep=n_rep, window=window), q, k, v)
    b, gb = _grads(lambda q, k, v: FUSED.attention(q, k, v, n_rep=n_rep, window=window), q, k, v)
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    for u, v_ in zip(gb, ga):
        torch.testing.assert_close(u, v_, atol=1e-5, rtol=1e-5)


def test_auto_kernels_per_device():
    assert resolve_kernels("auto", "cuda").name == "torch_fused"
    assert resolve_kernels("auto", "cpu").name == "reference"
    assert resolve_kernels("torch_fused", "cpu").name == "torch_fused"
    with pytest.raises(ValueError, match="npu_fused needs device npu"):
        resolve_kernels("npu_fused", "cuda")


@pytest.mark.parametrize("rows", [1, 7, 64, None])
def test_chunked_loss_equals_the_full_loss_and_its_gradients(rows):
    g = torch.Generator().manual_seed(3)
    h = torch.randn(4, 16, 32, generator=g, dtype=torch.float64)
    w = torch.randn(300, 32, generator=g, dtype=torch.float64) * 0.2
    y = torch.randint(0, 300, (4, 16), generator=g)
    a, ga = _grads(lambda h, w: cross_entropy(h @ w.t(), y).reshape(1), h, w)
    b, gb = _grads(lambda h, w: linear_cross_entropy(h, w, y, rows=rows).reshape(1), h, w)
    torch.testing.assert_close(b.double(), a.double(), atol=1e-12, rtol=1e-12)
    for u, v in zip(gb, ga):
        torch.testing.assert_close(u, v, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("kernels", ["reference", "torch_fused"])
def test_model_loss_with_labels_equals_the_loss_of_its_logits_under_bf16_autocast(kernels):
    """Transformer(tokens, labels) -> the fused loss; the same loss and parameter gradients as the
    cross entropy of its logits, in the mixed precision training runs in."""
    args = resolve_args("debug")
    torch.manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (2, 24))
    labels = torch.roll(tokens, -1, 1)
    results = []
    for fused_loss in (False, True):
        model = build_model(args, seed=4, kernels=resolve_kernels(kernels, "cpu"))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(tokens, labels=labels) if fused_loss else cross_entropy(model(tokens), labels)
        loss.backward()
        results.append((loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}))
    (la, ga), (lb, gb) = results
    torch.testing.assert_close(lb, la, atol=2e-3, rtol=2e-3)
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], atol=3e-3, rtol=5e-2, msg=n)


def test_fused_adamw_makes_the_foreach_update():
    from titan_pipe.training.optim import adamw_kernel, build_optimizer

    assert adamw_kernel("auto", "cuda") == {"fused": True} and adamw_kernel("auto", "cpu") == {"foreach": True}
    params = {}
    for impl in ("foreach", "fused"):
        torch.manual_seed(5)
        ps = [torch.nn.Parameter(torch.randn(33, 17)), torch.nn.Parameter(torch.randn(17))]
        opt = build_optimizer(ps, name="adamw", lr=1e-2, weight_decay=0.1, implementation=impl)
        for step in range(5):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
            opt.step()
        params[impl] = [p.detach().clone() for p in ps]
    for a, b in zip(params["foreach"], params["fused"]):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-6)


def test_chunked_loss_needs_tp_and_pp_of_one(tmp_path):
    from titan_pipe.config import ConfigError, parse_flow

    with pytest.raises(ConfigError, match="train.loss: chunked fuses the loss"):
        parse_flow({"name": "x", "train": {"loss": "chunked"}, "parallel": {"tp": 2}}, base=tmp_path)
    parse_flow({"name": "x", "train": {"loss": "auto"}, "parallel": {"tp": 2}}, base=tmp_path)


def test_float8_is_refused_off_hopper_in_one_line(tmp_path):
    import yaml
    from typer.testing import CliRunner

    from titan_pipe.cli import app
    from titan_pipe.training.float8 import float8_problem

    assert float8_problem("none", "cpu") is None
    why = float8_problem("rowwise", "cpu")
    assert "compute capability 9.0 or later" in why and "precision.float8: none" in why
    flow = tmp_path / "flow.yaml"
    flow.write_text(
        yaml.safe_dump(
            {"name": "f8", "runs_dir": str(tmp_path / "runs"), "device": "cpu", "precision": {"float8": "tensorwise"}}
        )
    )
    assert CliRunner().invoke(app, ["validate", str(flow)]).exit_code == 0  # validate may run off the cluster
    r = CliRunner().invoke(app, ["train", str(flow)])
    assert r.exit_code == 2 and "precision.float8: tensorwise needs a CUDA GPU of compute capability 9.0" in r.output
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "counts",
    [[40, 0, 0, 0], [0, 0, 0, 40], [1, 2, 3, 34], [0, 17, 0, 23], [16, 16, 8, 0], [0, 0, 0, 0]],
    ids=["all-first", "all-last", "skewed", "empty", "aligned", "none"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_grouped_experts_equal_the_loop(counts, dtype):
    """Grouped GEMMs on groups padded to 16 rows (any routing: one expert with every token, empty
    experts, counts not a multiple of 8) equal the per-expert loop, forward and every gradient.
    On this CPU torch._grouped_mm runs the same padded groups the CUDA path hands it."""
    from titan_pipe.model.kernels import GROUP_ALIGN, experts_grouped_padded, experts_loop, grouped_rows

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    g = torch.Generator().manual_seed(sum(counts) + len(counts))
    e, dim, hidden, n = len(counts), 32, 48, sum(counts)
    counts_t = torch.tensor(counts)
    dest, offs, rows = grouped_rows(counts_t, n)
    starts = offs.long() - torch.clamp_min((counts_t + 15) // 16 * 16, 16)
    assert rows == n + e * GROUP_ALIGN and int(offs[-1]) <= rows and bool((starts % GROUP_ALIGN == 0).all())
    assert len(set(dest.tolist())) == n  # every token its own row
    inputs = [
        torch.randn(n, dim, generator=g),
        torch.randn(e, hidden, dim, generator=g) / dim**0.5,
        torch.randn(e, hidden, dim, generator=g) / dim**0.5,
        torch.randn(e, dim, hidden, generator=g) / hidden**0.5,
    ]
    upstream = torch.randn(n, dim, generator=g)
    outs, grads = [], []
    for fn in (experts_loop, experts_grouped_padded):
        leaves = [t.to(dtype).requires_grad_() for t in inputs]
        y = fn(leaves[0], counts_t, *leaves[1:])
        (y.float() * upstream).sum().backward()
        outs.append(y.detach().float())
        grads.append([t.grad.float() for t in leaves])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert outs[1].shape == (n, dim)
    for ref, got in zip(outs[:1] + grads[0], outs[1:] + grads[1]):
        bound = tol * float(ref.abs().max().clamp_min(1e-6)) if ref.numel() else 0.0
        assert ref.numel() == 0 or float((got - ref).abs().max()) <= bound


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("masked", [False, True], ids=["all-labels", "masked"])
def test_compiled_loss_equals_eager(backend, masked):
    """train.compile's loss (model.loss.CompiledLoss): the fused chunk step and the full cross
    entropy compiled equal the eager loss in value and in the gradients of h and the weight, with
    a tail chunk of another size, -100 labels, and a target count given as a number (sft) that
    changes between calls without a re-trace."""
    from titan_pipe.model.loss import CompiledLoss
    from titan_pipe.training.compile import cpp_compiler

    if backend == "inductor" and not cpp_compiler():
        pytest.skip("inductor on cpu needs a C++ compiler")
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    g = torch.Generator().manual_seed(7)
    n, dim, vocab = 45, 32, 300
    h0, w0 = torch.randn(n, dim, generator=g), torch.randn(vocab, dim, generator=g) / dim**0.5
    labels = torch.randint(0, vocab, (n,), generator=g)
    if masked:
        labels[::3] = -100
    compiled = CompiledLoss(backend)
    for denom in [None] if not masked else [None, 17.0, 23.0]:
        got, ref = [], []
        for out, fn in (
            (ref, lambda h, w: linear_cross_entropy(h, w, labels, rows=16, denom=denom)),
            (got, lambda h, w: linear_cross_entropy(h, w, labels, rows=16, denom=denom, chunk=compiled.chunk)),
            (ref, lambda h, w: cross_entropy(h @ w.t(), labels, denom=denom)),
            (got, lambda h, w: compiled.full(h @ w.t(), labels, denom=denom)),
        ):
            h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
            loss = fn(h, w)
            loss.backward()
            out.append((loss.detach(), h.grad, w.grad))
        for (lr, hr, wr), (lg, hg, wg) in zip(ref, got):
            assert torch.allclose(lg, lr, rtol=1e-5, atol=1e-6)
            assert torch.allclose(hg, hr, rtol=1e-4, atol=1e-6) and torch.allclose(wg, wr, rtol=1e-4, atol=1e-6)
    # two chunk shapes (16 rows and the tail of 13) and no re-trace per target count
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 3, dict(torch._dynamo.utils.counters["stats"])
