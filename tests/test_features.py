"""A model feature is one file (titan_pipe.model.features): its parameters, its torch forward, its
ONNX nodes, its conformance row, its planner terms and its checkpoint keys come from there, and no
stage tests its switch itself. Checked on the features moved there (q/k/v biases, q/k norms,
scaled embeddings, sandwich norms); the families' and stages' numerics with them on are the Qwen2 / Qwen3 / Gemma 3
tests (test_families, test_released_models, test_gemma3_config)."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from titan_pipe.model import features
from titan_pipe.model.args import FLAVOURS, ModelArgs, args_problems, count_params, flops_per_token, model_differences
from titan_pipe.model.families import FAMILIES, family_of
from titan_pipe.model.features import embed_scale, qk_norm, qkv_bias, sandwich_norms
from titan_pipe.model.params import LAYER_PARAMS, native_names
from titan_pipe.model.transformer import build_model

REPO = Path(__file__).resolve().parents[1]
STAGES = ("pipeline", "training", "convert", "evaluate", "flows")
# where a feature's switch may be written outside its own file: the flow.yaml schema (ModelArgs and
# the flavours' values) and the lists of features a family has
SCHEMA_AND_FAMILIES = {
    "pipeline/model/args.py",
    "pipeline/model/families.py",
    "pipeline/model/family.py",  # the family record: a family without window keys holds no window
    "pipeline/model/gemma3.py",
    "pipeline/model/features/__init__.py",  # the feature list
}


def small(**kw) -> ModelArgs:
    return ModelArgs(
        **{"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 96, "ffn_hidden_dim": 96, **kw}
    )


# (feature, a word it owns): its switch or value, and the other fields it owns (Gemma 3's rope_local_theta)
OWNED_WORDS = [
    (f, word)
    for f in features.FEATURES
    for word in dict.fromkeys((f.name, *(field for field, _ in f.compared_fields())))
]


def _own_file(feature) -> str:
    """The features/ file whose record it is (named after its field, or after what it is: experts.py)."""
    spelled = re.compile(rf'^FEATURE = Feature\(\s*name="{feature.name}"', re.M)
    (own,) = [p for p in (REPO / "pipeline/model/features").glob("*.py") if spelled.search(p.read_text())]
    return str(own.relative_to(REPO))


@pytest.mark.parametrize("feature, word", OWNED_WORDS, ids=[w for _, w in OWNED_WORDS])
def test_no_stage_spells_a_features_switch_or_values(feature, word):
    """grep for the switch (or a value the feature owns) finds its feature file, the schema and the
    family lists only: every stage asks the feature list."""
    pattern = re.compile(rf"\b{re.escape(word)}\b")
    own = _own_file(feature)
    found = {
        str(p.relative_to(REPO))
        for folder in STAGES
        for p in (REPO / folder).rglob("*.py")
        if pattern.search(p.read_text())
    }
    assert own in found
    assert found - {own} <= SCHEMA_AND_FAMILIES, sorted(found - {own} - SCHEMA_AND_FAMILIES)


def test_the_features_parameters_are_rows_of_the_list_held_only_when_on():
    for f in features.FEATURES:
        assert all(p in LAYER_PARAMS for p in f.params)
    on, off = small(qk_norm=True), small()
    norms = {f"layers.{i}.attention.{x}_norm.weight" for i in range(2) for x in "qk"}
    assert norms <= set(native_names(on)) and not norms & set(native_names(off))
    assert count_params(on) - count_params(off) == 2 * 2 * on.head_dim == 2 * qk_norm.FEATURE.layer_params(on)
    # norm weights are no matmul: the training FLOPs do not change
    assert flops_per_token(on, 128) == flops_per_token(off, 128)
    held = {n for n, _ in build_model(on).named_parameters()}
    assert norms <= held and not norms & {n for n, _ in build_model(off).named_parameters()}


def test_the_biases_are_the_features_rows_and_its_adds():
    on, off = small(qkv_bias=True), small()
    biases = {f"layers.{i}.attention.w{x}.bias" for i in range(2) for x in "qkv"}
    assert biases <= set(native_names(on)) and not biases & set(native_names(off))
    per_layer = on.q_dim + 2 * on.kv_dim
    assert count_params(on) - count_params(off) == 2 * per_layer == 2 * qkv_bias.FEATURE.layer_params(on)
    assert flops_per_token(on, 128) - flops_per_token(off, 128) == 3 * 2 * per_layer  # one add each, x3 for training
    attn = build_model(on).layers["0"].attention
    assert attn.wq.bias is not None and attn.wv.bias is not None and attn.wo.bias is None
    assert build_model(off).layers["0"].attention.wq.bias is None
    assert family_of(on).model_type == "qwen2" and {k for k, on in FAMILIES["qwen2"].switches().items() if on} == {
        "qkv_bias"
    }


def test_scaled_embeddings_are_a_feature_without_parameters():
    """Gemma 3's sqrt(dim) on the embedding rows, rounded to their dtype, in the module (and the
    reference evaluate runs, which calls the same function); a switch of the numerics, not the shapes."""
    from titan_pipe import model
    from titan_pipe.model.args import SAME_MODEL_KEYS, SHAPE_KEYS
    from titan_pipe.model.transformer import scale_embeddings

    h = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    assert torch.equal(scale_embeddings(h, small(embed_scale=True)), h * torch.tensor(8.0, dtype=torch.bfloat16))
    assert scale_embeddings(h, small()) is h
    assert embed_scale.FEATURE.params == () and count_params(small(embed_scale=True)) == count_params(small())
    assert "embed_scale" in SAME_MODEL_KEYS and "embed_scale" not in SHAPE_KEYS
    g = model.gemma3
    assert g.REQUIRED["embed_scale"] is True and g.OFF["embed_scale"] is False and "qk_norm" not in g.OFF


def test_sandwich_norms_norm_each_sublayers_output_before_its_residual_add():
    """Two dim-wide norm rows a layer (counted, no FLOPs), the block's forward by hand, the planner's
    two more norms split like the others under sequence parallel."""
    from titan_pipe.training.planner.memory import layer_activation_terms

    on, off = small(sandwich_norms=True), small()
    rows = {f"layers.{i}.{n}.weight" for i in range(2) for n in ("post_attention_norm", "post_ffn_norm")}
    assert rows <= set(native_names(on)) and not rows & set(native_names(off))
    assert count_params(on) - count_params(off) == 2 * 2 * on.dim == 2 * sandwich_norms.FEATURE.layer_params(on)
    assert flops_per_token(on, 128) == flops_per_token(off, 128)
    torch.manual_seed(0)
    block = build_model(on).layers["0"]
    with torch.no_grad():
        for n in ("post_attention_norm", "post_ffn_norm"):
            getattr(block, n).weight.uniform_(0.5, 1.5)

    def norm(y, w):
        return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + on.norm_eps) * w

    a = torch.randn(2, 5, on.dim)
    assert torch.allclose(block.sublayer_output("attention", a), norm(a, block.post_attention_norm.weight), atol=1e-6)
    assert torch.allclose(block.sublayer_output("mlp", a), norm(a, block.post_ffn_norm.weight), atol=1e-6)
    plain = build_model(off).layers["0"]
    assert plain.sublayer_output("mlp", a) is a and not hasattr(plain, "post_ffn_norm")
    with_sp = layer_activation_terms(on, tp=2, sp=True)
    assert set(with_sp) - set(layer_activation_terms(off, tp=2, sp=True)) == {"sandwich_norms"}
    # the two norms cost what the two before attention and MLP cost (each term of theirs: 2 norms)
    assert with_sp["sandwich_norms"] == sum(v for k, v in with_sp.items() if k.startswith("norm_"))


def test_the_torch_hook_normalises_each_head_of_q_and_k_before_rope():
    """The attention's q with the feature equals the projection's heads normalised by hand."""
    args = small(qk_norm=True)
    attn = build_model(args).layers["0"].attention
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 5, args.dim)
    y = attn.wq(x).view(2, 5, -1, args.head_dim)
    by_hand = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + args.norm_eps) * attn.q_norm.weight
    assert torch.allclose(attn._heads("q", x), by_hand.transpose(1, 2), atol=1e-6)
    assert torch.equal(attn._heads("v", x), attn.wv(x).view(2, 5, -1, args.head_dim).transpose(1, 2))
    plain = build_model(small()).layers["0"].attention
    assert plain.features == () and not hasattr(plain, "q_norm")


def test_families_are_lists_of_features():
    """Qwen3's, Qwen3-MoE's and Gemma 3's architectures have q/k norms; the others none; the family
    a model is written as follows from the features it has; a combination none has is one line."""
    assert {t for t, f in FAMILIES.items() if qk_norm.FEATURE in f.features} == {"qwen3", "qwen3_moe", "gemma3_text"}
    assert family_of(small(qk_norm=True)).model_type == "qwen3"
    assert family_of(small()).model_type == "llama"
    assert family_of(FLAVOURS["qwen3_30b_a3b"]).model_type == "qwen3_moe"
    assert family_of(replace(FLAVOURS["mixtral_8x7b"], qk_norm=True)).model_type == "qwen3_moe"
    problems = args_problems(small(qk_norm=True, qkv_bias=True))
    assert any(
        p.startswith("qk_norm: true together with qkv_bias: no Hugging Face architecture has both") for p in problems
    )
    assert {k for k, on in FAMILIES["qwen3"].switches().items() if on} == {"qk_norm"}
    assert {k for k, on in FAMILIES["gemma3_text"].switches().items() if on} == {
        "qk_norm",
        "embed_scale",
        "sandwich_norms",
        "norm_offset",
    }
    assert not any(FAMILIES["llama"].switches().values())
    with pytest.raises(ValueError, match="a mixture of experts with q/k/v biases: no supported architecture"):
        family_of(replace(FLAVOURS["mixtral_8x7b"], qkv_bias=True))


def test_the_planner_and_the_conformance_table_ask_the_feature():
    from titan_pipe.evaluate.operators import model_operators, run_operator, OPERATORS
    from titan_pipe.training.planner.memory import layer_activation_terms

    on, off = small(qk_norm=True), small()
    assert set(layer_activation_terms(on)) - set(layer_activation_terms(off)) == {"qk_norm"}
    assert "qk_norm" in model_operators(on) and "qk_norm" not in model_operators(off)
    assert "qk_norm" not in model_operators(FLAVOURS["gemma3_1b"])  # offset norms: the rms_norm_offset row
    assert "linear_bias" in model_operators(small(qkv_bias=True)) and "linear_bias" not in model_operators(on)
    for name, shape in (("qk_norm", (2, 16, 4, 128)), ("linear_bias", (16, 96))):
        result = run_operator(next(s for s in OPERATORS if s.name == name), "float32", "normal")
        assert result.status == "pass" and result.shape == shape, result


def test_a_checkpoint_shows_the_feature_by_its_tensors_and_megatron_by_its_argument():
    assert qk_norm.FEATURE.shown_in({"layers.0.attention.q_norm.weight": (16,)})
    assert not qk_norm.FEATURE.shown_in({"layers.0.attention.wq.weight": (64, 64)})
    assert qkv_bias.FEATURE.shown_in({"layers.0.attention.wq.bias": (64,)})
    assert qkv_bias.FEATURE.megatron_arg == "add_qkv_bias" and not qkv_bias.FEATURE.rotate_half_in_torchtitan
    assert qk_norm.FEATURE.megatron_arg == "qk_layernorm" and qk_norm.FEATURE.rotate_half_in_torchtitan


def test_offset_norms_are_a_feature_of_the_norms_not_a_switch_each_stage_reads():
    """Gemma's (1 + w) norms: the module's norms start at 0 and multiply by 1 + w; the conformance
    table runs the offset row in place of every plain norm row."""
    from titan_pipe.evaluate.operators import model_operators
    from titan_pipe.model.features import norm_offset

    on = small(norm_offset=True, qk_norm=True)
    assert features.offset_norms(on) and not features.offset_norms(small())
    assert norm_offset.FEATURE.params == () and count_params(on) == count_params(small(qk_norm=True))
    model = build_model(on)
    norm = model.layers["0"].attention_norm
    assert torch.count_nonzero(norm.weight) == 0 and torch.count_nonzero(model.layers["0"].attention.q_norm.weight) == 0
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 0.5)
    x = torch.randn(3, on.dim)
    by_hand = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + on.norm_eps) * (1 + norm.weight)
    assert torch.allclose(norm(x), by_hand, atol=1e-6)
    ops = model_operators(on)
    assert "rms_norm_offset" in ops and "rms_norm" not in ops and "qk_norm" not in ops


def test_the_mlp_gate_is_one_record_per_kind():
    """The gate kinds (features/gates.py) are the schema's choices, the module's gate, the graph's
    product and the operator rows; no stage reads ``activation`` itself."""
    import torch.nn.functional as F

    from titan_pipe.evaluate.operators import model_operators
    from titan_pipe.model.args import ACTIVATIONS
    from titan_pipe.model.features import gates

    assert ACTIVATIONS == ("silu", "gelu_tanh")
    geglu = small(activation="gelu_tanh")
    ffn = build_model(geglu).layers["0"].feed_forward
    x = torch.randn(2, geglu.dim)
    by_hand = ffn.w2(F.gelu(ffn.w1(x), approximate="tanh") * ffn.w3(x))
    assert torch.allclose(ffn(x), by_hand, atol=1e-6)
    assert {"geglu"} <= set(model_operators(geglu)) and not {"silu", "swiglu"} & set(model_operators(geglu))
    assert {"silu", "swiglu"} <= set(model_operators(small()))
    assert any("use silu (SwiGLU) or gelu_tanh (GeGLU)" in p for p in args_problems(small(activation="relu")))
    pattern = re.compile(r"\.activation\b")
    readers = {
        str(p.relative_to(REPO))
        for folder in STAGES
        for p in (REPO / folder).rglob("*.py")
        if pattern.search(p.read_text())
    }
    assert readers == {"pipeline/model/features/gates.py", "pipeline/model/args.py"}, readers
    assert gates.gate_of(geglu) is gates.GELU_TANH and gates.gate_of(small()) is gates.DEFAULT


def test_global_layers_rotate_with_the_main_table_and_sliding_ones_with_their_own():
    """Gemma 3's pattern at small size: every 3rd layer global (RoPE base and linear scaling of the
    model), the others sliding with rope_local_theta unscaled; the module, the exported tables and
    evaluate's reference all take the tables from features.rope_tables / layer_rope."""
    from titan_pipe.model import rope
    from titan_pipe.model.rope_scaling import RopeScaling

    a = small(n_layers=6, sliding_window=8, global_every=3, rope_local_theta=1e4, rope_theta=1e6)
    a = replace(a, rope_scaling=RopeScaling(rope_type="linear", factor=8.0))
    tables = features.rope_tables(a)
    assert [(t.name, t.theta, t.scaled, t.suffix) for t in tables] == [
        ("", 1e6, True, ""),
        ("local", 1e4, False, "_local"),
    ]
    assert [features.layer_rope(a, i) for i in range(6)] == ["local", "local", "", "local", "local", ""]
    assert [a.layer_window(i) for i in range(6)] == [8, 8, None, 8, 8, None]
    hd = a.head_dim
    by_hand = 1.0 / (1e6 ** (np.arange(0, hd, 2, dtype=np.float64) / hd)) / 8.0
    np.testing.assert_allclose(rope.inv_freq(a), by_hand.astype(np.float32), rtol=0)
    by_hand = 1.0 / (1e4 ** (np.arange(0, hd, 2, dtype=np.float64) / hd))  # unscaled
    np.testing.assert_allclose(rope.inv_freq(a, tables[1]), by_hand.astype(np.float32), rtol=0)
    m = build_model(a)
    assert torch.equal(m.rope_cos_local[5, : hd // 2], torch.cos(5 * torch.as_tensor(by_hand, dtype=torch.float32)))
    assert not torch.equal(m.rope_cos_local, m.rope_cos)
    plain = small(n_layers=6)  # no feature: one table every layer takes
    assert [t.name for t in features.rope_tables(plain)] == [""] and features.layer_rope(plain, 1) == ""
    assert not hasattr(build_model(plain), "rope_cos_local")


def test_the_query_scale_is_a_value_feature_compared_by_the_scale_it_gives():
    a = small(attn_scalar=24.0)
    assert features.attention_scale(a) == 24.0**-0.5 and features.attention_scale(small()) is None
    assert build_model(a).layers["0"].attention.scale == 24.0**-0.5
    assert build_model(small()).layers["0"].attention.scale is None  # SDPA's own head_dim^-1/2
    # None and head_dim's own value compute the same model: not a difference
    assert model_differences(small(attn_scalar=float(small().head_dim)), small()) == []
    assert model_differences(a, small()) == [f"attn_scale {24.0**-0.5} vs {small().head_dim ** -0.5}"]
    # a value feature is no switch: families are told apart by their switches only
    assert "attn_scalar" not in features.switches() and "global_every" not in features.switches()
    assert features.compared()["attn_scalar"] == "attn_scale"


def test_a_value_features_check_names_the_fix():
    assert any(
        "global_every: 3 needs sliding_window" in line and "global_every: 0" in line
        for line in args_problems(small(global_every=3))
    )
    assert any(
        "rope_local_theta: 10000 is the sliding layers'" in line for line in args_problems(small(rope_local_theta=1e4))
    )
    # set together, neither check speaks (what is left is that only Gemma 3 has them: families)
    lines = args_problems(small(n_layers=6, sliding_window=8, global_every=3, rope_local_theta=1e4))
    assert lines and not any("needs sliding_window" in x or "beside global layers" in x for x in lines)


def _code_mentions(path: Path, name: str) -> list[int]:
    """Lines of ``path`` whose code (not comments, not docstrings) names ``name``: an identifier or
    inside a one-quoted string."""
    import io
    import tokenize

    lines = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.NAME and tok.string == name:
            lines.append(tok.start[0])
        elif tok.type == tokenize.STRING and not tok.string.lstrip("rbfu").startswith(('"""', "'''")):
            if re.search(rf"\b{re.escape(name)}\b", tok.string):
                lines.append(tok.start[0])
    return lines


def test_gemma3_is_its_module_and_one_line_in_the_family_list():
    """Gemma 3's keys, values, spellings, flavour and relatives live in titan_pipe.model.gemma3 (its
    Family record) and its feature files; outside them the code names it once: the family list's
    entry (and the import that brings it)."""
    from titan_pipe.model import gemma3

    named = {
        str(p.relative_to(REPO)): lines
        for folder in STAGES
        for p in (REPO / folder).rglob("*.py")
        if p.name != "gemma3.py"
        for lines in [_code_mentions(p, "gemma3") + _code_mentions(p, gemma3.MODEL_TYPE)]
        if lines
    }
    assert list(named) == ["pipeline/model/families.py"] and len(named["pipeline/model/families.py"]) == 2, named
    assert FAMILIES[gemma3.MODEL_TYPE] is gemma3.FAMILY and "gemma3_1b" in FLAVOURS
    # what the record carries is what the stages read: its spelling, its own tensors, its relatives
    from titan_pipe.model.families import NOT_COMPUTED
    from titan_pipe.model.names import hf_to_native, native_to_hf

    assert native_to_hf("layers.0.ffn_norm.weight", gemma3.MODEL_TYPE).endswith("pre_feedforward_layernorm.weight")
    assert hf_to_native("model.layers.0.post_attention_layernorm.weight", gemma3.MODEL_TYPE) == (
        "layers.0.post_attention_norm.weight"
    )
    assert hf_to_native("model.layers.0.post_attention_layernorm.weight", "llama") == "layers.0.ffn_norm.weight"
    assert set(gemma3.RELATIVES) <= set(NOT_COMPUTED)


def test_the_sliding_window_owns_its_mask_bytes_and_its_megatron_argument():
    from argparse import Namespace

    from titan_pipe.errors import UserError
    from titan_pipe.model.features import sliding_window
    from titan_pipe.weights.readers.megatron.common import arg

    a = small(n_layers=6, sliding_window=8, global_every=3)  # layers 2 and 5 global: 4 of 6 slide
    assert [a.layer_window(i) for i in range(6)] == [8, 8, None, 8, 8, None]
    assert features.mask_bytes(a, 64, 2) == 2 * 64 * 64 * 4 / 6  # a (T, T) bias per sliding layer, averaged
    assert features.mask_bytes(a, 8, 2) == 0  # the window covers the sequence: no mask
    assert features.mask_bytes(small(n_layers=6), 64, 2) == 0 and not features.windowed(small())
    assert features.windowed(small(sliding_window=8))

    def read(a):
        return sliding_window.FEATURE.read_megatron(a, Path("ckpt"), arg)

    assert read(Namespace(window_size=(7, 0))) == {"sliding_window": 8}  # the query plus 7 before it
    assert read(Namespace()) == read(Namespace(window_size=None)) == {"sliding_window": None}
    with pytest.raises(UserError, match=r"ckpt: Megatron args window_size \(7, 3\): only a causal window"):
        read(Namespace(window_size=(7, 3)))
    # a feature that needs another says which and how to fix it
    assert any(
        line.startswith("global_every: 3 needs sliding_window (the other layers' window); set sliding_window")
        for line in args_problems(small(global_every=3))
    )


def test_a_value_features_bounds_are_its_own_and_checked_like_every_field():
    from titan_pipe.model.args import FIELD_BOUNDS

    owned = features.bounds()
    assert set(owned) == {"sliding_window", "global_every", "rope_local_theta", "attn_scalar"} | {
        "n_experts",
        "experts_per_token",
        "moe_hidden_dim",
        "moe_step",
    }
    assert all(FIELD_BOUNDS[k] is b for k, b in owned.items())
    assert args_problems(small(attn_scalar=0.5)) == ["attn_scalar: 0.5 must be >= 1; use a value in 1..1000000"]
    assert args_problems(small(sliding_window=0))[0].startswith("sliding_window: 0 must be >= 1")


def test_the_tied_head_is_the_embeddings_tensor_wherever_a_stage_asks():
    """The tied head (features/tie_embeddings.py) as the stages see it: one shared tensor, not a
    switch: the parameter list, the module, the counts, and every format's way of stating it."""
    from argparse import Namespace

    from titan_pipe.model.args import SAME_MODEL_KEYS, SHAPE_KEYS
    from titan_pipe.model.features import sliding_window, tie_embeddings
    from titan_pipe.model.hf_config import from_hf_config, to_hf_config
    from titan_pipe.weights.readers.megatron.common import model_args as megatron_model_args

    on, off = small(tie_embeddings=True), small()
    assert features.shared(on) == {"output.weight": "tok_embeddings.weight"} and features.shared(off) == {}
    assert features.read_from(on, "output.weight") == "tok_embeddings.weight"
    assert features.read_from(off, "output.weight") == "output.weight"
    assert features.read_from(on, "norm.weight") == "norm.weight" and features.unshared(on) == off
    assert "output.weight" in native_names(off) and "output.weight" not in native_names(on)
    assert count_params(off) - count_params(on) == 96 * 64
    assert flops_per_token(on, 128) == flops_per_token(off, 128)  # the matrix runs once as the head either way
    m = build_model(on, seed=0)
    assert m.output.weight is m.tok_embeddings.weight and len(list(m.parameters())) == len(native_names(on))
    # config.json both ways (absent: untied); Megatron's argument is the negation; a DCP checkpoint
    # shows it by holding no head; value features without tensors leave the DCP reader alone
    cfg = to_hf_config(on)
    assert cfg["tie_word_embeddings"] is True and to_hf_config(off)["tie_word_embeddings"] is False
    assert (
        from_hf_config(cfg).tie_embeddings and not from_hf_config({**cfg, "tie_word_embeddings": False}).tie_embeddings
    )
    assert not from_hf_config({k: v for k, v in cfg.items() if k != "tie_word_embeddings"}).tie_embeddings
    meg = dict(num_attention_heads=4, hidden_size=64, num_layers=2, ffn_hidden_size=96, swiglu=True)
    assert megatron_model_args(Namespace(**meg), 96, Path("ckpt")).tie_embeddings
    assert not megatron_model_args(
        Namespace(**meg, untie_embeddings_and_output_weights=True), 96, Path("ckpt")
    ).tie_embeddings
    f = tie_embeddings.FEATURE
    assert f.shown_in({"tok_embeddings.weight": (96, 64)}) is True
    assert f.shown_in({"tok_embeddings.weight": (96, 64), "output.weight": (96, 64)}) is False
    assert sliding_window.FEATURE.shown_in({}) is None and qk_norm.FEATURE.shown_in({}) is False
    # it changes the shapes: a shape key, compared once
    assert SHAPE_KEYS.count("tie_embeddings") == SAME_MODEL_KEYS.count("tie_embeddings") == 1
    assert model_differences(on, off) == ["tie_embeddings True vs False"]


def test_a_mixture_of_experts_is_its_file_and_the_stages_take_its_routing():
    """Mixtures of experts (features/experts.py): the stages take its Routing record; its parameter
    rows, rules, expert-parallel split and Megatron reading are the file's."""
    from argparse import Namespace

    from titan_pipe.model.features import experts
    from titan_pipe.model.params import native_shapes
    from titan_pipe.weights.readers.megatron.common import model_args as megatron_model_args

    # Qwen3-MoE's shape: q/k norms, narrow experts, layer 0 dense
    moe = small(n_layers=4, qk_norm=True, n_experts=4, experts_per_token=2, moe_hidden_dim=48, dense_layers=(0,))
    r = features.routing(moe)
    assert r == features.Routing(experts=4, top_k=2, width=48, renormalize=True, layers=(1, 2, 3))
    assert features.routing(small()) is None
    shapes = native_shapes(moe)
    assert shapes["layers.1.moe.experts.w1"] == (4, 48, 64) and shapes["layers.3.moe.router.gate.weight"] == (4, 64)
    assert "layers.0.moe.experts.w1" not in shapes and "layers.0.feed_forward.w1.weight" in shapes
    assert all(p in LAYER_PARAMS for p in experts.PARAMS)
    m = build_model(moe, seed=0)
    assert m.layers["1"].moe.routing == r and m.layers["1"].moe.experts.w1.shape == (4, 48, 64)
    assert m.layers["0"].moe is None
    # its rules and its split over expert-parallel ranks: one line each, naming the fix
    assert args_problems(replace(moe, experts_per_token=5)) == [
        "experts_per_token: 5 must be 1..n_experts=4 (each token goes to that many of the 4 experts); "
        "pick a top-k in 1..4"
    ]
    assert features.split_problems(moe, 2) == [] and features.split_problems(small(), 1) == []
    assert "does not divide the model's n_experts=4" in features.split_problems(moe, 3)[0]
    assert "the model has none (n_experts: 0); use ep: 1" in features.split_problems(small(), 2)[0]
    # two spellings of the same routed layers are one model; another top-k is not
    assert (
        model_differences(
            small(n_layers=4, qk_norm=True, n_experts=4, experts_per_token=2, moe_step=2),
            replace(moe, dense_layers=(0, 2), moe_hidden_dim=None),
        )
        == []
    )
    assert model_differences(moe, replace(moe, experts_per_token=1)) == ["experts_per_token 2 vs 1"]
    # Megatron's MoE arguments, through the file's reader: layer 0 keeps the dense MLP
    meg = Namespace(
        num_attention_heads=4,
        hidden_size=64,
        num_layers=4,
        ffn_hidden_size=96,
        swiglu=True,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=48,
        moe_layer_freq=[0, 1, 1, 1],
        qk_layernorm=True,
    )
    assert features.routing(megatron_model_args(meg, 96, Path("ckpt"))) == r
