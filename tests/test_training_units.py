"""Single-process checks of the trainer's pieces: loss scaling, activation checkpointing, LR
schedule, layout planning, checkpoint discovery/pruning, and weight sources (HF dir -> our model)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from titan_pipe.records.checkpoint_format import newest_complete
from titan_pipe.config import PrecisionConfig
from titan_pipe.errors import UserError
from titan_pipe.model.args import FLAVOURS, ModelArgs
from titan_pipe.training.activation_checkpoint import ac_layer_ids, apply_ac
from titan_pipe.training.amp import LossScaler
from titan_pipe.training.checkpoint import prune
from titan_pipe.training.data_parallel import plan_dp
from titan_pipe.model.transformer import build_model
from titan_pipe.training.optim import lr_factor
from titan_pipe.training.parallel_dims import ParallelDims
from titan_pipe.training.parallelize import fill_parameters
from titan_pipe.training.pipeline_parallel import build_stage_module, plan_stages
from titan_pipe.model.weights import SafetensorsWeights, check_compatible, open_weights

DEBUG = FLAVOURS["debug"]


# --- fp16 loss scaling --------------------------------------------------------------------------


def _params_with_grads(*values):
    ps = []
    for v in values:
        p = torch.nn.Parameter(torch.zeros(2))
        p.grad = torch.tensor(v, dtype=torch.float32)
        ps.append(p)
    return ps


def test_overflow_skips_and_halves_the_scale():
    s = LossScaler(enabled=True, init_scale=1024.0, window=3, min_scale=256.0)
    ps = _params_with_grads([1.0, float("inf")], [2.0, 2.0])
    assert s.unscale_(ps) is True
    assert ps[1].grad.tolist() == [2.0, 2.0]  # a skipped step leaves the grads alone
    s.update(True)
    assert s.scale == 512.0 and s.skipped == 1
    for _ in range(3):
        s.update(True)
    assert s.scale == 256.0  # never below min_loss_scale


def test_clean_window_doubles_the_scale_and_unscales():
    s = LossScaler(enabled=True, init_scale=8.0, window=2, min_scale=1.0)
    ps = _params_with_grads([8.0, 16.0])
    assert s.unscale_(ps) is False
    assert ps[0].grad.tolist() == [1.0, 2.0]
    s.update(False)
    assert s.scale == 8.0
    s.update(False)
    assert s.scale == 16.0 and s.good_steps == 0
    s.update(True)  # an overflow resets the clean-step count
    s.update(False)
    assert s.scale == 8.0 and s.good_steps == 1
    assert torch.equal(s.scale_loss(torch.tensor(2.0)), torch.tensor(16.0))


def test_scaler_follows_the_config():
    on = LossScaler.from_config(
        PrecisionConfig(amp=True, amp_dtype="float16", loss_scale="dynamic", loss_scale_window=7, min_loss_scale=4)
    )
    assert on.enabled and on.scale == 2.0**16 and on.window == 7 and on.min_scale == 4
    assert LossScaler.from_config(PrecisionConfig(amp=True, amp_dtype="float16", loss_scale=128)).scale == 128
    off = LossScaler.from_config(PrecisionConfig(amp=True, amp_dtype="bfloat16"))
    assert not off.enabled and off.scale == 1.0
    g = _params_with_grads([float("nan"), 1.0])
    assert off.unscale_(g) is False  # bf16: no scaling, nothing skipped by the scaler


def test_nan_gradients_count_as_overflow():
    s = LossScaler(enabled=True, init_scale=4.0)
    assert s.unscale_(_params_with_grads([float("nan"), 0.0])) is True


# --- activation checkpointing -------------------------------------------------------------------


def test_ac_layer_choice():
    assert ac_layer_ids([0, 1, 2, 3], 1) == [0, 1, 2, 3]
    assert ac_layer_ids([0, 1, 2, 3], 2) == [0, 2]
    assert ac_layer_ids([2, 3], 2) == [2]  # by global id, whatever the pipeline split
    with pytest.raises(ValueError):
        ac_layer_ids([0], 0)


@pytest.mark.parametrize("every", [1, 2])
def test_activation_checkpointing_gives_the_same_loss_and_grads(every):
    x = torch.randint(0, DEBUG.vocab_size, (2, 24))
    y = torch.randint(0, DEBUG.vocab_size, (2, 24))
    plain, ckpt = build_model(DEBUG, seed=3), build_model(DEBUG, seed=3)
    assert apply_ac(ckpt, every) == ([0, 1, 2, 3] if every == 1 else [0, 2])
    losses = []
    for m in (plain, ckpt):
        loss = F.cross_entropy(m(x).flatten(0, 1), y.flatten())
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    for (n, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-7, msg=n)
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in ckpt.named_parameters()]


# --- LR schedule, layouts -------------------------------------------------------------------------


def test_lr_warmup_then_cosine_to_the_floor():
    f = [lr_factor(s, warmup=2, total=10, min_ratio=0.1) for s in range(10)]
    assert f[:3] == [0.5, 1.0, 1.0]
    assert f[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[1:], f[2:]))
    assert lr_factor(0, warmup=0, total=1, min_ratio=0.0) == 1.0


def test_parallel_dims_validate_and_place_ranks():
    d = ParallelDims(dp=2, tp=2, pp=2)
    assert d.world_size == 8
    assert [d.coords(r) for r in (0, 1, 2, 7)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 1, 1)]
    with pytest.raises(ValueError, match="parallel.tp"):
        ParallelDims(dp=1, tp=0, pp=1)
    with pytest.raises(ValueError, match="4 processes"):
        d.check_world(4)


def test_dp_plan_maps_zero_stages():
    kw = dict(dp=2, tp=1)
    assert plan_dp(**kw, dp_mode="fsdp", zero_stage=None).kind == "fsdp"
    assert plan_dp(**kw, dp_mode="fsdp", zero_stage=3).reshard_after_forward is True
    assert plan_dp(**kw, dp_mode="fsdp", zero_stage=2).reshard_after_forward is False
    z1 = plan_dp(**kw, dp_mode="ddp", zero_stage=1)
    assert z1.kind == "ddp" and z1.zero1
    assert plan_dp(dp=2, tp=2, dp_mode="ddp", zero_stage=None).kind == "replicate"
    assert plan_dp(dp=2, tp=2, dp_mode="fsdp", zero_stage=1).kind == "fsdp"
    assert plan_dp(dp=1, tp=2, dp_mode="fsdp", zero_stage=None).kind == "none"
    off = plan_dp(dp=1, tp=1, dp_mode="fsdp", zero_stage=None, offload="cpu")
    assert off.kind == "fsdp" and off.cpu_offload
    p = plan_dp(**kw, dp_mode="fsdp", zero_stage=None, amp_dtype="bfloat16", gradient_sync_dtype="bfloat16")
    assert p.param_dtype == torch.bfloat16 and p.reduce_dtype == torch.bfloat16


def test_interleaved_stage_plan_loops_over_ranks():
    plan = plan_stages(8, 2, 1, "interleaved_1f1b", virtual_stages=2)
    assert plan.n_stages == 4 and plan.local == [1, 3]
    assert plan.stages == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan_stages(4, 2, 0, "1f1b").local == [0]
    with pytest.raises(ValueError, match="pp_schedule"):
        plan_stages(4, 2, 0, "zbv")


def test_stage_module_keeps_global_names():
    part = build_stage_module(DEBUG, [2, 3], first=False, last=True)
    names = [n for n, _ in part.named_parameters()]
    assert names[0].startswith("layers.2.") and "output.weight" in names
    assert not any(n.startswith(("tok_embeddings", "layers.0", "layers.1")) for n in names)
    tied = ModelArgs(**{**DEBUG.__dict__, "tie_embeddings": True})
    with pytest.raises(ValueError, match="tie_embeddings"):
        build_stage_module(tied, [0], first=True, last=False)


# --- checkpoint discovery and pruning -----------------------------------------------------------


def _fake_step(root, step, complete=True):
    d = root / f"step-{step:06d}"
    (d / "model").mkdir(parents=True)
    if complete:
        (d / "manifest.json").write_text("{}")
    return d


def test_newest_complete_skips_incomplete_with_a_warning(tmp_path):
    assert newest_complete(tmp_path / "none") is None
    _fake_step(tmp_path, 2)
    _fake_step(tmp_path, 4)
    _fake_step(tmp_path, 6, complete=False)
    with pytest.warns(UserWarning, match="step-000006"):
        assert newest_complete(tmp_path, warn=True).name == "step-000004"
    assert newest_complete(tmp_path.parent / tmp_path.name).name == "step-000004"  # no warning asked


def test_prune_keeps_the_newest_complete(tmp_path):
    for s in (1, 2, 3):
        _fake_step(tmp_path, s)
    _fake_step(tmp_path, 0, complete=False)
    _fake_step(tmp_path, 9, complete=False)  # newer than any complete: maybe being written, kept
    (tmp_path / "notes").mkdir()
    removed = prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in removed) == ["step-000000", "step-000001"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "step-000002", "step-000003", "step-000009"]


# --- weight sources -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    out = tmp_path_factory.mktemp("hf")
    model.save_pretrained(out, safe_serialization=True)
    return out, model


def test_init_from_hf_dir_reproduces_its_logits(hf_dir):
    path, hf = hf_dir
    weights = open_weights(path)
    assert isinstance(weights, SafetensorsWeights) and weights.args.n_layers == 2
    ours = build_model(weights.args, seed=None, device="meta")
    fill_parameters(ours, weights.args, device=torch.device("cpu"), seed=0, weights=weights)
    x = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, rtol=0, atol=1e-5)


def test_weight_source_errors_name_the_fix(tmp_path, hf_dir):
    with pytest.raises(UserError, match="neither a titan-pipe checkpoint"):
        open_weights(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UserError, match="missing field"):
        open_weights(tmp_path)
    path, _ = hf_dir
    with pytest.raises(UserError, match="n_layers=2 there vs 4 in flow.yaml"):
        check_compatible(open_weights(path).args, DEBUG, path)
    with pytest.raises(UserError, match="no tensor for parameter"):
        open_weights(path).full("layers.7.attention.wq.weight")


def test_fill_parameters_keeps_tied_embeddings_tied():
    """to_empty allocates every registration anew; the tie is restored, values as the single-process model."""
    from titan_pipe.model.args import resolve_args
    from titan_pipe.model.transformer import build_model
    from titan_pipe.training.parallelize import fill_parameters

    args = resolve_args("debug", tie_embeddings=True)
    model = build_model(args, seed=None, device="meta")
    fill_parameters(model, args, device=torch.device("cpu"), seed=0)
    assert model.output.weight is model.tok_embeddings.weight
    ref = build_model(args, seed=0)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    for (name, got), want in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(got, want), name
