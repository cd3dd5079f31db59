"""Gemma 3's config.json as transformers writes it in both layouts (4.x: rope_theta, rope_local_base_freq,
rope_scaling, sliding_window_pattern; 5.x: rope_parameters per layer type, layer_types), read into the
same model; what the model cannot compute refused in one line naming the key; Gemma's switches only
together."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from released_configs import PUBLISHED
from titan_pipe.errors import UserError
from titan_pipe.model import features
from titan_pipe.model.args import FLAVOURS, args_problems
from titan_pipe.model.hf_config import from_hf_config, to_hf_config
from titan_pipe.model.rope_scaling import RopeScaling

G1 = PUBLISHED["gemma-3-1b-it"]
FULL, SLIDING = "full_attention", "sliding_attention"


def _v5(cfg: dict, *, factor: float | None = None) -> dict:
    """The same config as transformers 5 writes it: per-layer-type RoPE, layer_types, no 4.x RoPE keys."""
    out = {
        k: v
        for k, v in copy.deepcopy(cfg).items()
        if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling", "sliding_window_pattern")
    }
    full = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    if factor is not None:
        full = {"rope_type": "linear", "factor": factor, "rope_theta": cfg["rope_theta"]}
    out["rope_parameters"] = {FULL: full, SLIDING: {"rope_type": "default", "rope_theta": cfg["rope_local_base_freq"]}}
    out["layer_types"] = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(cfg["num_hidden_layers"])]
    return out


def test_both_layouts_read_as_the_released_model_and_write_back():
    a = from_hf_config(G1, source="4.x")
    assert a == replace(FLAVOURS["gemma3_1b"], family="gemma3_text") and a.family == "gemma3_text"
    assert [a.layer_window(i) for i in range(6)] == [512] * 5 + [None]
    assert [features.layer_rope(a, i) for i in range(6)] == ["local"] * 5 + [""] and a.attn_scale == 256**-0.5
    assert from_hf_config(_v5(G1), source="5.x") == a
    back = to_hf_config(a)
    for key in (
        "hidden_activation",
        "query_pre_attn_scalar",
        "sliding_window",
        "sliding_window_pattern",
        "rope_local_base_freq",
        "rope_theta",
        "rope_scaling",
        "head_dim",
        "attn_logit_softcapping",
    ):
        assert back[key] == G1[key], key
    assert "hidden_act" not in back and back["model_type"] == "gemma3_text"
    assert from_hf_config(back, source="back") == a


def test_linear_scaling_of_the_global_layers_is_read_from_either_layout():
    """Gemma 3 4B and larger scale the global layers' RoPE linearly (factor 8); the local ones never."""
    legacy = dict(G1, rope_scaling={"rope_type": "linear", "factor": 8.0})
    a = from_hf_config(legacy, source="4.x")
    assert a.rope_scaling == RopeScaling(factor=8.0, rope_type="linear")
    assert from_hf_config(_v5(G1, factor=8.0), source="5.x") == a
    assert from_hf_config(to_hf_config(a), source="back") == a


@pytest.mark.parametrize(
    "change, key",
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_activation": "silu"}, "hidden_activation"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
        ({"query_pre_attn_scalar": "256"}, "query_pre_attn_scalar"),
        ({"sliding_window_pattern": 0}, "sliding_window_pattern"),
        ({"layer_types": [SLIDING] * 25}, "layer_types"),
    ],
)
def test_what_the_model_cannot_compute_is_one_line_naming_the_key(change, key):
    with pytest.raises(UserError) as e:
        from_hf_config(dict(G1, **change), source="cfg.json")
    assert str(e.value).startswith("cfg.json") and key in str(e.value) and "\n" not in str(e.value)


def test_layer_types_that_are_not_every_nth_and_scaled_sliding_layers_are_refused():
    types = [SLIDING] * 26
    types[3] = types[11] = FULL  # global layers 3 and 11: no N puts them there
    with pytest.raises(UserError, match="one global layer in every N"):
        from_hf_config(dict(G1, layer_types=types), source="cfg.json")
    v5 = _v5(G1)
    v5["rope_parameters"][SLIDING] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(UserError, match=f"rope_parameters.{SLIDING}.rope_type"):
        from_hf_config(v5, source="cfg.json")
    both = dict(_v5(G1), rope_theta=500000.0)  # the 4.x key beside the 5.x one, disagreeing
    with pytest.raises(UserError, match="disagrees"):
        from_hf_config(both, source="cfg.json")


def test_all_full_or_all_sliding_layers_read_as_one_attention():
    """Every layer global: full attention with the global RoPE (scaled where the config says); every
    layer sliding: the window with the local base, unscaled, as transformers runs them; either
    spelling of each reads as one model and writes back as it."""
    scaled = dict(G1, rope_scaling={"rope_type": "linear", "factor": 8.0})
    full = from_hf_config(dict(scaled, sliding_window_pattern=1), source="cfg.json")
    assert full.sliding_window is None and full.global_every == 0 and full.rope_local_theta is None
    assert full.rope_theta == 1e6 and full.rope_scaling == RopeScaling(factor=8.0, rope_type="linear")
    sliding = from_hf_config(dict(_v5(scaled), layer_types=[SLIDING] * 26), source="cfg.json")
    assert sliding.global_every == 0 and sliding.sliding_window == 512 and sliding.rope_local_theta is None
    assert sliding.rope_theta == 1e4 and sliding.rope_scaling is None  # the sliding layers' RoPE
    assert from_hf_config(dict(scaled, sliding_window_pattern=27), source="cfg.json") == sliding
    for args in (full, sliding):
        assert from_hf_config(to_hf_config(args), source="back") == args


def test_the_multimodal_gemma3_is_named_not_guessed():
    with pytest.raises(UserError, match="Gemma3ForConditionalGeneration"):
        from_hf_config(dict(G1, model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"]))


def test_gemmas_switches_come_together():
    """A model with some of Gemma 3's switches names no Hugging Face architecture: refused before
    training, naming what is missing; global_every and rope_local_theta need their partners."""
    g = FLAVOURS["gemma3_1b"]
    half = replace(g, activation="silu")
    assert any("activation: silu" in p for p in args_problems(replace(half, family="gemma3_text")))
    assert any(
        p.startswith("norm_offset: True: Gemma 3 computes") and "activation: silu" in p for p in args_problems(half)
    )
    with pytest.raises(ValueError, match="together"):
        to_hf_config(half)
    assert any(p.startswith("global_every") for p in args_problems(replace(g, sliding_window=None)))
    assert any(p.startswith("rope_local_theta") for p in args_problems(replace(g, global_every=0)))
    assert any(p.startswith("activation") for p in args_problems(replace(g, activation="relu")))
    assert any("rope_type" in p for p in args_problems(replace(g, rope_scaling=RopeScaling(rope_type="ntk"))))


def test_validate_refuses_a_flow_with_half_of_gemma_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from titan_pipe.cli import app

    flow = tmp_path / "flow.yaml"
    flow.write_text("model:\n  flavour: debug\n  activation: gelu_tanh\n")
    r = CliRunner().invoke(app, ["validate", str(flow)])
    assert r.exit_code != 0 and "Traceback" not in r.output
    line = " ".join(r.output.split())
    assert "model.activation: gelu_tanh: Gemma 3 computes" in line and "norm_offset: False" in line
    flow.write_text("model:\n  flavour: gemma3_1b\n  n_layers: 4\n  dim: 128\n  vocab_size: 512\n")
    assert CliRunner().invoke(app, ["validate", str(flow)]).exit_code == 0
