"""The LLaMA family beyond Llama, through every stage, against transformers' own Qwen2, Qwen3 and
Mistral: Qwen2 (q/k/v biases, tied embeddings), Qwen3 (per-head q/k norms, head_dim 32 on a
64-wide model: decoupled) and Mistral (a sliding window of 8 positions, shorter than every test
sequence). One fast single-process test of each claim per family; the 3-D training parity runs
are in tests/test_training_parallel.py's one 8-rank launch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from safetensors.torch import load_file
from typer.testing import CliRunner

from convert_writers import (
    hash_tree,
    model_args,
    native_state,
    write_dcp,
    write_hf,
    write_megatron,
    write_megatron_dist,
)
from titan_pipe.config import ConvertConfig, ExportConfig
from titan_pipe.records.checkpoint_format import Manifest
from titan_pipe.cli import app
from titan_pipe.config import EvaluateConfig
from titan_pipe.convert.api import convert_checkpoint
from titan_pipe.convert.onnx.export import export_model
from titan_pipe.errors import UserError
from titan_pipe.evaluate.api import evaluate_model
from titan_pipe.evaluate.operators import OPERATORS, model_operators, run_operator
from titan_pipe.graphs.generation import generate, ort_session
from titan_pipe.model.args import RopeScaling, model_differences
from titan_pipe.model.names import hf_to_native, native_to_hf
from titan_pipe.model.hf_config import from_hf_config, to_hf_config
from titan_pipe.model.params import native_shapes
from titan_pipe.model.transformer import build_model
from titan_pipe.model.unified_dir import read_model_args

transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")
runner = CliRunner()

FAMILIES = {
    "qwen2": dict(qkv_bias=True, tie_embeddings=True),
    "qwen3": dict(qk_norm=True, head_dim=32),
    "mistral": dict(sliding_window=8),
    # Gemma 3's switches at small size: a global layer in every 3 (released: 6), the sliding ones over 8
    # positions with their own RoPE base, the global ones linearly scaled, a query_pre_attn_scalar apart
    # from head_dim (the 27B's case), tied
    "gemma3": dict(
        norm_offset=True,
        sandwich_norms=True,
        embed_scale=True,
        activation="gelu_tanh",
        qk_norm=True,
        head_dim=32,
        sliding_window=8,
        global_every=3,
        rope_theta=1e6,
        rope_local_theta=1e4,
        rope_scaling=RopeScaling(factor=8.0, rope_type="linear"),
        attn_scalar=24.0,
        tie_embeddings=True,
        norm_eps=1e-6,
    ),
}
ARCH = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
MODEL_TYPE = {"gemma3": "gemma3_text"}
T, NEW, CACHE = 16, 24, 48


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, ModelArgs, weights, a transformers model holding them, its save_pretrained dir)."""
    name = request.param
    args = model_args(**FAMILIES[name])
    sd = native_state(args)
    src = write_hf(sd, args, tmp_path_factory.mktemp(name) / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return name, args, sd, hf, src


def _ours(args, sd):
    model = build_model(args, seed=None)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= ({"output.weight"} if args.tie_embeddings else set())
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model.eval()


# --- the model ------------------------------------------------------------------------------------


def test_parameter_list_is_the_module_and_its_switches(family):
    name, args, sd, hf, _ = family
    assert native_shapes(args) == {
        n: tuple(p.shape) for n, p in build_model(args, device="meta", seed=None).named_parameters()
    }
    extra = {k.split(".", 2)[2] for k in native_shapes(args) if k.startswith("layers.0.")} - {
        k.split(".", 2)[2] for k in native_shapes(model_args()) if k.startswith("layers.0.")
    }
    assert (
        extra
        == {
            "qwen2": {"attention.wq.bias", "attention.wk.bias", "attention.wv.bias"},
            "qwen3": {"attention.q_norm.weight", "attention.k_norm.weight"},
            "mistral": set(),
            "gemma3": {
                "attention.q_norm.weight",
                "attention.k_norm.weight",
                "post_attention_norm.weight",
                "post_ffn_norm.weight",
            },
        }[name]
    )
    family = MODEL_TYPE.get(name, name)
    assert {hf_to_native(k, family) for k in hf.state_dict()} == set(native_shapes(args)) | {
        "output.weight"
    }  # lm_head tied too


def test_logits_equal_transformers(family):
    name, args, sd, hf, _ = family
    assert type(hf).__name__ == ARCH[name]
    # the config transformers itself wrote reads back as the same model
    assert not model_differences(from_hf_config(hf.config.to_dict()), args)
    tokens = torch.randint(0, args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, got = hf(tokens).logits, _ours(args, sd)(tokens)
    assert (got - ref).abs().max().item() <= 1e-5


def test_flops_count_the_new_terms():
    """flops_per_token against torch's FLOP counter on Qwen3's decoupled head_dim (q 128 wide on a
    64-wide model: attention and projections counted on n_heads x head_dim)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from titan_pipe.model.args import flops_per_token

    args = model_args(qk_norm=True, head_dim=32, qkv_bias=False)
    model, seq = build_model(args, seed=0), 64
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        model(torch.randint(0, args.vocab_size, (1, seq))).sum().backward()
    measured = fc.get_total_flops() / seq
    assert abs(measured - flops_per_token(args, seq)) / measured < 0.02


# --- convert --------------------------------------------------------------------------------------


def test_hf_round_trip_through_tp2_pp2_is_bit_exact(family, tmp_path):
    name, args, sd, _, src = family
    convert_checkpoint(src, tmp_path / "s", ConvertConfig(tp=2, pp=2))
    m = Manifest.load(tmp_path / "s")
    if args.qkv_bias:  # biases split with their weight's rows
        assert (
            m.params["layers.0.attention.wk.bias"].tp_dim == 0
            and len(m.params["layers.0.attention.wk.bias"].chunks) == 2
        )
    if args.qk_norm:  # q/k norms replicated
        assert (
            m.params["layers.3.attention.q_norm.weight"].tp_dim is None
            and m.params["layers.3.attention.q_norm.weight"].stage == 1
        )
    convert_checkpoint(tmp_path / "s", tmp_path / "u")
    got = load_file(tmp_path / "u/model.safetensors")
    family = MODEL_TYPE.get(name, name)
    assert set(got) == {native_to_hf(k, family) for k in sd}
    for k, v in sd.items():
        assert torch.equal(_bits(got[native_to_hf(k, family)]), _bits(v)), k
    cfg = json.loads((tmp_path / "u/config.json").read_text())
    assert cfg["architectures"] == [ARCH[name]]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "u", dtype=torch.float32)
    assert type(back).__name__ == ARCH[name]
    for k, v in back.state_dict().items():
        if "rotary" not in k:
            native = hf_to_native(k, family)
            assert torch.equal(v, sd[native] if native in sd else sd["tok_embeddings.weight"]), k


@pytest.mark.parametrize("fam", ["qwen2", "qwen3"])
def test_megatron_legacy_and_torch_dist_convert_bit_exactly(fam, tmp_path):
    """Qwen2-style (add_qkv_bias: linear_qkv.bias interleaved per query group like the weight) and
    Qwen3-style (qk_layernorm) Megatron checkpoints, tp2 x pp2, both formats: the same bytes as the
    Hugging Face model of the same weights."""
    args = model_args(**{k: v for k, v in FAMILIES[fam].items() if k != "tie_embeddings"})
    sd = native_state(args)
    ref = convert_checkpoint(write_hf(sd, args, tmp_path / "hf"), tmp_path / "ref")
    want = (ref.out_dir / "model.safetensors").read_bytes()
    for kind, src in (
        ("legacy", write_megatron(sd, args, tmp_path / "meg", tp=2, pp=2)),
        ("torch_dist", write_megatron_dist(sd, args, tmp_path / "megd", tp=2, pp=2, vpp=None)),
    ):
        before = hash_tree(src)
        res = convert_checkpoint(src, tmp_path / f"out_{kind}")
        assert hash_tree(src) == before
        assert (res.out_dir / "model.safetensors").read_bytes() == want, kind
        assert read_model_args(res.out_dir) == read_model_args(ref.out_dir), kind


def test_torchtitan_qwen3_dcp_is_read_rotate_half(tmp_path):
    """torchtitan's qwen3 keeps Hugging Face's rotate-half q/k rows (its llama3 interleaves them); head_dim
    and the q/k norms come off the tensor shapes when the config is a Meta-style params.json."""
    args = model_args(**FAMILIES["qwen3"])
    sd = native_state(args)
    res = convert_checkpoint(write_dcp(sd, args, tmp_path / "dcp"), tmp_path / "u", ConvertConfig(naming="native"))
    got = load_file(res.out_dir / "model.safetensors")
    assert set(got) == set(sd)
    for k, v in sd.items():
        assert torch.equal(_bits(got[k]), _bits(v)), k
    back = read_model_args(res.out_dir)
    assert back.qk_norm and back.head_dim == 32 and not back.qkv_bias


# --- export and generation ------------------------------------------------------------------------


def test_export_generates_like_transformers(family, tmp_path):
    """Static prefill + fixed-capacity decode: a left-padded batch of two prompts gives transformers'
    greedy tokens of each prompt alone, logits within 1e-4; the new operators pass the ATC list."""
    name, args, sd, hf, src = family
    res = export_model(
        src, tmp_path / "onnx", ExportConfig(dynamic=False, batch=2, seq_len=T, cache_len=CACHE, atc=False)
    )
    record = json.loads(res.export_json.read_text())
    ops = {o["op_type"] for o in record["graphs"]["decode.onnx"]["operators"]}
    assert {
        "qwen2": {"Gemm"},
        "qwen3": {"Pow", "ReduceMean"},
        "mistral": {"CumSum", "Less"},
        "gemma3": {"Tanh", "CumSum", "Less"},
    }[name] <= ops
    if name in ("mistral", "gemma3"):
        assert "Sub" in {o["op_type"] for o in record["graphs"]["model.onnx"]["operators"]}
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, args.vocab_size, (n,), generator=g).tolist() for n in (T, T // 2)]
    gen = generate(
        prefill=ort_session(res.onnx, threads=1),
        decode=ort_session(res.decode_onnx, threads=1),
        prompts=prompts,
        max_new_tokens=NEW,
    )
    for r, p in enumerate(prompts):
        ids = torch.tensor([p])
        with torch.no_grad():
            seq = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False, pad_token_id=0
            )[0]
            ref = hf(seq[None, :-1]).logits[0, len(p) - 1 :].numpy()
        assert np.array_equal(gen.new_tokens[r], seq[len(p) :].numpy()), (name, r)
        assert np.abs(gen.logits[r] - ref).max() <= 1e-4, (name, r)


# --- evaluate -------------------------------------------------------------------------------------

FAULT = {
    "qwen2": "layers.1.wv.bias",
    "qwen3": "layers.1.attention.q_norm.weight",
    "mistral": "layers.1.w2",
    "gemma3": "layers.1.post_ffn_norm.weight",
}


def test_evaluate_reference_generates_like_transformers(family, tmp_path):
    """evaluate's reference, one decoder layer at a time with its own KV cache (streamed: nothing
    kept), gives transformers' greedy tokens for ragged prompts generated together, past Mistral's
    window; a bfloat16 copy with tied embeddings runs too (its stored table gathers, its float32 copy
    projects)."""
    from titan_pipe.evaluate.runners.pytorch import LayeredModel

    name, args, sd, hf, src = family
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, args.vocab_size, (n,), generator=g).tolist() for n in (T, T // 2 + 1)]
    got = LayeredModel.from_path(src, keep=False).greedy(prompts, NEW)
    for r, p in enumerate(prompts):
        ids = torch.tensor([p])
        with torch.no_grad():
            seq = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False, pad_token_id=0
            )[0]
        assert torch.equal(got[r], seq[len(p) :]), (name, r)
    if args.tie_embeddings:
        bf = write_hf({k: v.to(torch.bfloat16) for k, v in sd.items()}, args, tmp_path / "bf16")
        model = LayeredModel.from_path(bf, keep=True)
        assert model.greedy(prompts, 2).shape == (2, 2)


def test_evaluate_passes_and_names_the_perturbed_layer(family, tmp_path):
    name, args, _, _, src = family
    fast = EvaluateConfig(batches=1, batch_size=2, seq_len=32, prompts=1, new_tokens=4, operators=False)
    res = export_model(src, tmp_path / "onnx", ExportConfig(kv_cache=False, atc=False))
    r = evaluate_model(out_dir=tmp_path / "ok", model_dir=src, onnx=res.onnx, settings=fast)
    assert r.passed, r.summary.verdict
    m = onnx.load(str(res.onnx))
    init = next(i for i in m.graph.initializer if i.name == FAULT[name])
    w = numpy_helper.to_array(init).copy()
    w.flat[3] += 0.05
    init.CopyFrom(numpy_helper.from_array(w, init.name))
    bad = tmp_path / "bad" / "model.onnx"
    bad.parent.mkdir()
    onnx.save(m, str(bad))
    shutil.copy(res.export_json, bad.parent / "export.json")
    for memory in ("auto", "1.5MB"):  # whole graphs, and one layer's piece at a time
        r = evaluate_model(
            out_dir=tmp_path / f"rep-{memory}",
            model_dir=src,
            onnx=bad,
            settings=fast.model_copy(update={"max_memory": memory}),
        )
        assert r.summary.memory_mode == ("whole" if memory == "auto" else "streamed")
        assert not r.passed and r.summary.first_failing_layer["layer"] == 1, r.summary.verdict


def test_evaluate_streams_the_kv_decode_layer_by_layer(family, tmp_path):
    """The KV generation row in streamed mode: decode.onnx cut into per-layer pieces (Qwen2's bias
    Gemms, Qwen3's q/k norms, Mistral's window band inside them), each layer's cache slice filled by
    the prefill piece, then every decode step, against the layered reference past the window."""
    name, args, _, _, src = family
    res = export_model(src, tmp_path / "onnx", ExportConfig(kv_cache=True, atc=False))
    fast = EvaluateConfig(
        batches=1, batch_size=1, seq_len=32, prompts=2, new_tokens=8, operators=False, max_memory="1.5MB"
    )
    r = evaluate_model(out_dir=tmp_path / "rep", model_dir=src, onnx=res.onnx, settings=fast)
    assert r.passed and r.summary.memory_mode == "streamed", r.summary.verdict
    rows = {c["id"]: c for c in json.loads(r.report_json.read_text())["comparisons"]}
    kv = rows["onnx_kv_decode"]
    assert kv["status"] == "pass" and [x["tensor"] for x in kv["rows"] if x["tensor"].startswith("hidden.")] == [
        f"hidden.{i}" for i in range(args.n_layers)
    ], name


def test_operator_conformance_runs_each_familys_operators():
    plain = model_operators(model_args())
    assert plain == tuple(s.name for s in OPERATORS if s.family is None or s.name in ("rms_norm", "silu", "swiglu"))
    for fam, op in (("qwen2", "linear_bias"), ("qwen3", "qk_norm"), ("mistral", "attention_window")):
        ops = model_operators(model_args(**FAMILIES[fam]))
        assert op in ops and len(ops) == len(plain) + 1
        assert run_operator(next(s for s in OPERATORS if s.name == op), "float32", "normal").status == "pass"
    # Gemma 3: its offset norm in place of RMSNorm and the q/k norms, GeGLU in place of SiLU / SwiGLU
    gemma = model_operators(model_args(**FAMILIES["gemma3"]))
    assert set(gemma) == set(plain) - {"rms_norm", "silu", "swiglu"} | {"rms_norm_offset", "geglu", "attention_window"}
    for op in ("rms_norm_offset", "geglu"):
        for dtype in ("float32", "float16"):
            assert run_operator(next(s for s in OPERATORS if s.name == op), dtype, "large").status == "pass"


def test_a_window_off_by_one_fails_conformance():
    import dataclasses

    from titan_pipe.graphs import onnx_nodes as nodes
    from titan_pipe.evaluate import operators as opmod

    spec = next(s for s in OPERATORS if s.name == "attention_window")

    def wider(b, n, a):  # the band one position too wide: what a slot-vs-position mix-up gives
        _, _, t, hd = a["q"].shape
        pos = np.arange(t)
        causal = b.const(pos[None, :] <= pos[:, None], dtype=bool)
        allowed = nodes.within_window(b, causal, b.const(pos[:, None] - pos[None, :]), opmod.WINDOW + 1, "w")
        return nodes.attention(b, n["q"], n["k"], n["v"], allowed, n_heads=4, n_kv_heads=2, hd=hd, name="a")

    assert run_operator(dataclasses.replace(spec, graph=wider), "float32", "normal").status == "fail"


# --- bad input ------------------------------------------------------------------------------------


def _config_dir(tmp_path: Path, **changes) -> Path:
    d = tmp_path / "m"
    write_hf(native_state(model_args()), model_args(), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize(
    "changes, expect",
    [
        # a mixture-of-experts family without its expert keys (tests/test_moe.py reads the whole ones)
        ({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}, "num_local_experts = None is missing"),
        ({"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"]}, "architecture Qwen2MoeForCausalLM"),
        (
            {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]},
            "architecture DeepseekV3ForCausalLM",
        ),
        (
            {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
            "a sliding window on 2 of 4 layers only",
        ),
        ({"attention_bias": True}, "attention_bias = True puts a bias on o_proj"),
    ],
)
def test_unsupported_architectures_are_one_line(tmp_path, changes, expect):
    src = _config_dir(tmp_path, **changes)
    r = runner.invoke(app, ["convert", str(src), "-o", str(tmp_path / "out")])
    text = r.output
    assert r.exit_code == 1 and expect in text and str(src / "config.json") in text, text
    assert "Traceback" not in text and len([ln for ln in text.splitlines() if ln.strip()]) == 1, text
    if "architecture" in expect:
        assert "Qwen2ForCausalLM, Qwen3ForCausalLM" in text
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError, match=expect.split(" (")[0]):
        read_model_args(src)


def test_qwen2_config_windows_read_as_transformers_reads_them():
    base = to_hf_config(model_args(qkv_bias=True))
    assert (
        from_hf_config(
            {
                **base,
                "layer_types": None,
                "use_sliding_window": False,
                "sliding_window": 131072,
                "max_window_layers": 28,
            }
        ).sliding_window
        is None
    )  # Qwen2.5's published config
    whole = from_hf_config(
        {**base, "layer_types": None, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}
    )
    assert whole.sliding_window == 8 and to_hf_config(whole)["layer_types"] == ["sliding_attention"] * 4
    assert to_hf_config(model_args(sliding_window=8))["architectures"] == ["MistralForCausalLM"]
    cfg = transformers.Qwen2Config(**{k: v for k, v in to_hf_config(whole).items() if k != "architectures"})
    assert cfg.layer_types == ["sliding_attention"] * 4 and cfg.sliding_window == 8


def test_init_writes_a_valid_example_of_every_flavour(tmp_path):
    from titan_pipe.model.args import FLAVOURS

    for flavour in FLAVOURS:
        r = runner.invoke(app, ["init", str(tmp_path / flavour), "--flavour", flavour])
        assert r.exit_code == 0, r.output
        r = runner.invoke(app, ["validate", str(tmp_path / flavour / "flow.yaml"), "--elsewhere"])
        assert r.exit_code == 0 and f"model {flavour} " in r.output, r.output
    r = runner.invoke(app, ["init", str(tmp_path / "x"), "--flavour", "qwen3_moe_30b"])
    assert r.exit_code == 1 and "qwen3_8b" in r.output and not (tmp_path / "x").exists()


def test_init_flavour_writes_a_run_of_that_model_not_the_tiny_one(tmp_path):
    """--flavour once changed the flavour line alone: the run was still named tiny (runs/tiny), on a
    64-token window and the tiny example's dp2 x tp2 x pp2."""
    import yaml

    from titan_pipe.config import load_flow
    from titan_pipe.training.planner.search import build_cluster, make_plan
    from titan_pipe.training.planner.workload import Workload
    from titan_pipe.model.args import FLAVOURS

    r = runner.invoke(
        app, ["init", str(tmp_path / "q"), "--flavour", "qwen3_0.6b", "--devices", "16", "--device", "h100"]
    )
    assert r.exit_code == 0, r.output
    path = tmp_path / "q" / "flow.yaml"
    cfg = load_flow(path)
    # the run is named after the project directory, never the shipped example's (or another init's)
    assert cfg.name == "q" and cfg.model.flavour == "qwen3_0.6b" and cfg.device == "cuda"
    assert cfg.train.seq_len == 4096 and cfg.precision.amp and cfg.parallel.world_size == 16
    best = make_plan(
        Workload(FLAVOURS["qwen3_0.6b"], 4096, 64, flavour="qwen3_0.6b"), build_cluster("h100", 16)[0]
    ).best
    lay = best.layout
    assert (cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp) == (lay.dp, lay.tp, lay.pp)
    text = path.read_text()
    assert "FILL IN" in text and "tokenizer.json" in text  # the line to fill in
    assert yaml.safe_load(text)["data"]["tokenizer"] == "byte"
    assert runner.invoke(app, ["validate", str(path), "--elsewhere"]).exit_code == 0
    r = runner.invoke(app, ["init", str(tmp_path / "z"), "--flavour", "qwen3_8b", "--devices", "0"])
    assert r.exit_code == 1 and "--devices 0: must be >= 1" in r.output and not (tmp_path / "z").exists()


@pytest.mark.parametrize(
    "model, parallel, expect",
    [
        ({"flavour": "qwen3_8b"}, {"tp": 16}, "parallel.tp: 16 does not divide model n_kv_heads=8"),
        ({"flavour": "qwen2.5_7b"}, {"tp": 8}, "parallel.tp: 8 does not divide model n_heads=28"),
        ({"flavour": "debug", "qk_norm": True, "qkv_bias": True}, {}, "no Hugging Face architecture has both"),
        (
            {"flavour": "debug", "dim": 66},
            {},
            "model.dim: 66 is not divisible by n_heads=4; pick dim = n_heads x head_dim",
        ),
    ],
)
def test_validate_refuses_what_the_families_cannot_run(tmp_path, model, parallel, expect):
    import yaml

    f = tmp_path / "flow.yaml"
    f.write_text(yaml.safe_dump({"device": "cpu", "model": model, "parallel": parallel}))
    r = runner.invoke(app, ["validate", str(f)])
    assert r.exit_code == 2 and expect in r.output, r.output
