"""Mixture of experts in the one model: Mixtral and Qwen3-MoE against transformers (logits, the
load-balancing loss, gradients), the flavours' sizes against transformers' own count, the expert
kernels against each other and against a dense reference, config.json both ways, bad configs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from titan_pipe.records.checkpoint_format import Box
from titan_pipe.config import ConfigError, parse_flow
from titan_pipe.errors import UserError
from titan_pipe.model.args import FLAVOURS, ModelArgs, count_params, resolve_args
from titan_pipe.model.hf_config import from_hf_config, to_hf_config
from titan_pipe.model.kernels import experts_loop
from titan_pipe.model.names import hf_expert_key, hf_to_native, parse_hf_expert
from titan_pipe.model.params import native_shapes, param_of
from titan_pipe.model.transformer import build_model

transformers = pytest.importorskip("transformers")

MIXTRAL = resolve_args("debug_moe", router_aux_loss_coef=0.02)
# Qwen3-MoE: q/k norms, narrower experts than the dense layers, layer 1 dense (mlp_only_layers),
# the top-k not renormalized (norm_topk_prob false).
QWEN3_MOE = resolve_args(
    "debug_moe",
    qk_norm=True,
    head_dim=32,
    moe_hidden_dim=48,
    ffn_hidden_dim=96,
    dense_layers=(1,),
    router_norm_topk=False,
    n_experts=6,
    experts_per_token=3,
    router_aux_loss_coef=0.001,
)


def _hf_model(args: ModelArgs, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(**to_hf_config(args))
    cfg.output_router_logits = True
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    model.generation_config.eos_token_id = None  # Mixtral's default eos (2) would end a greedy run early
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.08)
    return model


def _native_state(hf_model, args: ModelArgs, family: str) -> dict[str, torch.Tensor]:
    """Our state dict from the transformers model's checkpoint names (one tensor per expert, stacked
    into dim 0 of ours by the name table)."""
    state, experts = {}, {}
    sd = hf_model.state_dict()
    if any(".experts.gate_up_proj" in k for k in sd):  # transformers 5 holds experts fused in memory
        sd = _per_expert(sd, args, family)
    for key, value in sd.items():
        found = parse_hf_expert(key)
        if found is not None:
            experts.setdefault(found[0], {})[found[1]] = value
        else:
            state[hf_to_native(key)] = value
    for name, by_expert in experts.items():
        state[name] = torch.stack([by_expert[e] for e in range(args.n_experts)])
    if args.tie_embeddings:
        state.pop("output.weight", None)
    return state


def _per_expert(sd: dict, args: ModelArgs, family: str) -> dict:
    """transformers 5's in-memory experts (gate_up_proj (E, 2h, d), down_proj (E, d, h)) as the
    per-expert checkpoint names it saves (save_pretrained converts back to those)."""
    out = {}
    for key, value in sd.items():
        if key.endswith(".experts.gate_up_proj") or key.endswith(".experts.down_proj"):
            lid = int(key.split(".layers.")[1].split(".")[0])
            for e in range(args.n_experts):
                if key.endswith("gate_up_proj"):
                    gate, up = value[e].chunk(2, dim=0)
                    out[hf_expert_key(f"layers.{lid}.moe.experts.w1", e, family)] = gate
                    out[hf_expert_key(f"layers.{lid}.moe.experts.w3", e, family)] = up
                else:
                    out[hf_expert_key(f"layers.{lid}.moe.experts.w2", e, family)] = value[e]
        else:
            out[key] = value
    return out


@pytest.mark.parametrize("args,family", [(MIXTRAL, "mixtral"), (QWEN3_MOE, "qwen3_moe")], ids=["mixtral", "qwen3_moe"])
def test_logits_aux_loss_and_gradients_match_transformers(args, family):
    hf = _hf_model(args)
    assert type(hf).__name__ == {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[family]
    ours = build_model(args, seed=None)
    ours.load_state_dict(_native_state(hf, args, family), strict=True)
    assert sorted(native_shapes(args)) == sorted(n for n, _ in ours.named_parameters())
    assert [layer.moe is not None for layer in ours.layers.values()] == [args.is_moe_layer(i) for i in range(4)]

    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    labels = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(4))
    out = hf(tokens, labels=labels)  # transformers: CE of logits[:, :-1] against labels[:, 1:], + coef x aux
    logits = ours(tokens)
    assert (logits - out.logits).abs().max().item() <= 1e-5
    aux = ours.aux_loss()
    assert abs(aux.item() / args.router_aux_loss_coef - out.aux_loss.item()) <= 1e-6
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, args.vocab_size), labels[:, 1:].reshape(-1)) + aux
    assert abs(loss.item() - out.loss.item()) <= 1e-5
    loss.backward()
    out.loss.backward()
    # the training path: forward with labels is the fused cross entropy plus the same aux term
    with torch.no_grad():
        fused = ours(tokens, labels=labels)
        assert (
            abs(
                fused.item()
                - (
                    F.cross_entropy(ours(tokens).reshape(-1, args.vocab_size), labels.reshape(-1)) + ours.aux_loss()
                ).item()
            )
            <= 1e-5
        )
    named = dict(hf.named_parameters())  # transformers 5 names Mixtral's block "mlp" in memory
    want = next(
        named[f"model.layers.0.{r}.weight"]
        for r in ("block_sparse_moe.gate", "mlp.gate")
        if f"model.layers.0.{r}.weight" in named
    ).grad
    assert torch.allclose(ours.layers["0"].moe.router.gate.weight.grad, want, atol=1e-6, rtol=1e-4)
    got_q = ours.layers["2"].attention.wq.weight.grad
    assert torch.allclose(got_q, hf.model.layers[2].self_attn.q_proj.weight.grad, atol=1e-6, rtol=1e-4)


def test_the_flavours_have_the_released_sizes():
    """Total parameters equal transformers' count of the released configs (built on the meta
    device); active ones are the published 12.9B, 3.3B and 22.2B (to their rounding)."""
    for name, active in (("mixtral_8x7b", 12.9), ("qwen3_30b_a3b", 3.3), ("qwen3_235b_a22b", 22.2)):
        args = FLAVOURS[name]
        cfg = transformers.AutoConfig.for_model(**to_hf_config(args))
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        assert count_params(args) == sum(p.numel() for p in model.parameters()), name
        assert abs(count_params(args, active=True) / 1e9 - active) <= 0.06, name  # as published, to its rounding
        assert from_hf_config(to_hf_config(args)) == args


def _dense_reference(x, probs_topk, chosen, w1, w3, w2):
    """Every expert on every token, kept where the router chose it: no sorting, no grouping."""
    every = torch.stack([F.linear(F.silu(F.linear(x, w1[e])) * F.linear(x, w3[e]), w2[e]) for e in range(len(w1))])
    mask = torch.zeros(x.shape[0], len(w1)).scatter_(1, chosen, probs_topk)
    return torch.einsum("etd,te->td", every, mask)


def test_expert_kernels_agree_with_a_dense_reference():
    """The per-expert loop, torch._grouped_mm (its CPU forward) and a dense computation of every
    expert give the same MoE output; an expert no token chose is skipped, not a failure."""
    from titan_pipe.model.transformer import MoE
    from titan_pipe.model.kernels import reference_kernels

    args = resolve_args("debug_moe", n_experts=8, experts_per_token=2, ffn_hidden_dim=32)
    torch.manual_seed(0)
    moe = MoE(args, reference_kernels())
    for p in moe.parameters():
        p.data.normal_(0, 0.1)
    x = torch.randn(40, args.dim)
    y = moe(x[None])[0]
    _, chosen, weights = moe.route(x)
    e = moe.experts
    assert torch.allclose(y, _dense_reference(x, weights, chosen, e.w1, e.w3, e.w2), atol=1e-5)
    assigned = chosen.reshape(-1)
    order = assigned.argsort(stable=True)
    counts = torch.bincount(assigned, minlength=8)
    xs = x[order // 2]
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    gate = torch._grouped_mm(xs, e.w1.transpose(-2, -1).contiguous().detach(), offs=offs)
    up = torch._grouped_mm(xs, e.w3.transpose(-2, -1).contiguous().detach(), offs=offs)
    grouped = torch._grouped_mm(F.silu(gate) * up, e.w2.transpose(-2, -1).contiguous().detach(), offs=offs)
    assert torch.allclose(grouped, experts_loop(xs, counts, e.w1, e.w3, e.w2), atol=1e-5)
    few = torch.zeros(8, dtype=torch.long)
    few[3] = 4  # one expert with every row, seven with none
    assert torch.allclose(
        experts_loop(xs[:4], few, e.w1, e.w3, e.w2),
        F.linear(F.silu(F.linear(xs[:4], e.w1[3])) * F.linear(xs[:4], e.w3[3]), e.w2[3]),
    )


def test_qwen3_moe_config_json_both_ways():
    cfg = to_hf_config(QWEN3_MOE)
    assert (
        cfg["model_type"],
        cfg["num_experts"],
        cfg["moe_intermediate_size"],
        cfg["mlp_only_layers"],
        cfg["norm_topk_prob"],
    ) == ("qwen3_moe", 6, 48, [1], False)
    hf_cfg = transformers.AutoConfig.for_model(**cfg).to_dict()  # transformers 5 writes num_local_experts
    assert from_hf_config(hf_cfg) == QWEN3_MOE
    assert hf_expert_key("layers.2.moe.experts.w2", 5, "qwen3_moe") == "model.layers.2.mlp.experts.5.down_proj.weight"
    assert param_of("layers.2.moe.experts.w2").expert and not param_of("layers.2.moe.router.gate.weight").expert


@pytest.mark.parametrize(
    "change,expect",
    [
        ({"num_experts_per_tok": None}, "num_experts_per_tok"),
        ({"num_experts_per_tok": 9}, "experts_per_token: 9 must be 1..n_experts=6"),
        ({"num_local_experts": None, "num_experts": None}, "num_local_experts"),
        ({"num_local_experts": 6, "num_experts": 8}, "disagrees with num_local_experts 6"),
        ({"mlp_only_layers": [7]}, "dense_layers: 7 is not a layer"),
        ({"mlp_only_layers": "1"}, "mlp_only_layers"),
    ],
)
def test_a_bad_moe_config_json_is_one_line(change, expect):
    cfg = to_hf_config(QWEN3_MOE)
    for k, v in change.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    with pytest.raises(UserError) as e:
        from_hf_config(cfg, source="x/config.json")
    assert "x/config.json" in str(e.value) and expect in str(e.value) and len(str(e.value).splitlines()) == 1


def test_mixtral_jitter_noise_is_refused():
    cfg = dict(to_hf_config(MIXTRAL), router_jitter_noise=0.1)
    with pytest.raises(UserError, match="router_jitter_noise"):
        from_hf_config(cfg)


@pytest.mark.parametrize(
    "section,expect",
    [
        ({"parallel": {"dp": 2, "tp": 2, "ep": 2}, "launch": {"nproc_per_node": 4}}, "parallel.tp: 2 with ep=2"),
        (
            {"parallel": {"tp": 2, "sequence_parallel": True}, "launch": {"nproc_per_node": 2}},
            "parallel.sequence_parallel: true with a mixture of experts",
        ),
        ({"train": {"compile": True}}, "train.compile: true: the routing has data-dependent shapes"),
        (
            {"model": {"flavour": "debug_moe", "experts_per_token": 5}},
            "model.experts_per_token: 5 must be 1..n_experts=4",
        ),
        ({"model": {"flavour": "debug_moe", "moe_hidden_dim": 48}}, "Mixtral's"),
        ({"parallel": {"dp": 4, "ep": 3}, "launch": {"nproc_per_node": 4}}, "parallel.ep: 3 does not divide dp=4"),
        (
            {"parallel": {"dp": 6, "ep": 3}, "launch": {"nproc_per_node": 6}, "train": {"batch_size": 6}},
            "parallel.ep: 3 does not divide the model's n_experts=4",
        ),
        (
            {"parallel": {"dp": 2, "ep": 2, "dp_mode": "ddp"}, "launch": {"nproc_per_node": 2}},
            "parallel.dp_mode: ddp with ep=2",
        ),
        (
            {"model": {"flavour": "debug"}, "parallel": {"dp": 2, "ep": 2}, "launch": {"nproc_per_node": 2}},
            "parallel.ep: 2 splits a mixture of experts' experts; the model has none",
        ),
    ],
)
def test_flow_yaml_refuses_what_moe_training_does_not_do(tmp_path, section, expect):
    flow = {"name": "m", "model": {"flavour": "debug_moe"}, **section}
    with pytest.raises(ConfigError) as e:
        parse_flow(flow, base=tmp_path)
    assert any(expect in line for line in e.value.lines), e.value.lines


@pytest.mark.parametrize("flavour", ["debug_moe", "qwen3_dense_first"])
def test_pipeline_stages_carry_the_routing_statistics(flavour):
    """The model cut into two pipeline stages with carry_balance: stage 0 hands (h, assignments,
    probability sums) to stage 1, whose load-balancing loss from them equals the whole model's, and
    whose gradient reaches the routers of both stages as in the whole model (a dense first layer,
    as Qwen3-MoE's mlp_only_layers makes one, included)."""
    from titan_pipe.model.transformer import balance_loss
    from titan_pipe.training.pipeline_parallel import build_stage_module

    over = {"dense_layers": (0,)} if flavour != "debug_moe" else {}
    args = resolve_args("debug_moe", router_aux_loss_coef=0.5, **over)
    whole = build_model(args, seed=3)
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    whole(tokens)
    want = whole.aux_loss()
    want.backward()
    stages = [
        build_stage_module(args, ids, first=i == 0, last=i == 1, device="cpu") for i, ids in enumerate([[0, 1], [2, 3]])
    ]
    for st in stages:
        st.init_rope()
        st.load_state_dict({k: v for k, v in whole.state_dict().items() if k in st.state_dict()})
        st.carry_balance = True
    h, assigned, prob = stages[0](tokens)
    logits, assigned, prob = stages[1](h, assigned, prob)
    rows = tokens.numel() * len(args.moe_layers)
    got = args.router_aux_loss_coef * balance_loss(assigned.detach(), prob, rows, args.n_experts)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    grads = {n: p.grad for st in stages for n, p in st.named_parameters() if "router" in n}
    assert set(grads) == {n for n, _ in whole.named_parameters() if "router" in n} and len(grads) >= 3
    for n, p in whole.named_parameters():
        if "router" in n:
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-8)
            assert grads[n].abs().sum() > 0, n


@pytest.mark.parametrize("args,family", [(MIXTRAL, "mixtral"), (QWEN3_MOE, "qwen3_moe")], ids=["mixtral", "qwen3_moe"])
def test_hugging_face_moe_dirs_convert_both_ways(tmp_path, args, family):
    """A dir transformers saved (one tensor per expert) -> our pp2 shards (experts stacked) -> a
    Hugging Face dir again: every tensor bit for bit, transformers loads it with the same logits;
    the native-named dir stores the stacks, and init_from reads either as the same stacks."""
    from safetensors.torch import load_file

    from titan_pipe.config import ConvertConfig
    from titan_pipe.convert.api import convert_checkpoint
    from titan_pipe.model.weights import open_weights

    hf = _hf_model(args)
    hf.save_pretrained(tmp_path / "hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "shards", ConvertConfig(pp=2))
    convert_checkpoint(tmp_path / "shards", tmp_path / "back")
    convert_checkpoint(tmp_path / "hf", tmp_path / "native", ConvertConfig(naming="native"))
    original, back = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(tmp_path / "back" / "model.safetensors"),
    )
    assert set(back) == set(original) and all(torch.equal(back[k], original[k]) for k in original)
    assert any(parse_hf_expert(k) for k in back)  # per expert, in this family's spelling
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").float().eval()
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(again(tokens).logits, hf(tokens).logits)
    stacked = load_file(tmp_path / "native" / "model.safetensors")
    name = f"layers.{args.moe_layers[-1]}.moe.experts.w2"
    assert stacked[name].shape == (args.n_experts, args.dim, args.expert_dim)
    for src in ("hf", "native", "shards"):
        w = open_weights(tmp_path / src)
        assert torch.equal(w.full(name), stacked[name]), src
        box = Box((1, 0, 8), (2, args.dim, 16))
        assert torch.equal(w.box(name, box), stacked[name][1:3, :, 8:24]), src


def test_moe_dir_faults_are_one_line(tmp_path):
    """A missing expert, an expert past the config's count, an expert of the wrong shape: one line
    naming the file and the tensor."""
    from safetensors.torch import load_file, save_file

    hf = _hf_model(MIXTRAL)
    hf.save_pretrained(tmp_path / "hf")
    f = tmp_path / "hf" / "model.safetensors"
    good = load_file(f)
    key = "model.layers.2.block_sparse_moe.experts.3.w1.weight"
    cases = {
        "missing": ({k: v for k, v in good.items() if k != key}, "expert 3 of 'layers.2.moe.experts.w1' is missing"),
        "extra": ({**good, key.replace(".3.", ".4."): good[key].clone()}, "has no place"),
        "shape": ({**good, key: good[key][:8].clone()}, "per expert"),
    }
    from titan_pipe.model.unified_dir import open_unified

    for name, (sd, expect) in cases.items():
        save_file(sd, f, metadata={"format": "pt"})
        with pytest.raises(UserError) as e:
            open_unified(tmp_path / "hf")
        assert expect in str(e.value) and len(str(e.value).splitlines()) == 1, (name, str(e.value))


@pytest.mark.parametrize("args,family", [(MIXTRAL, "mixtral"), (QWEN3_MOE, "qwen3_moe")], ids=["mixtral", "qwen3_moe"])
def test_export_generates_like_transformers(tmp_path, args, family):
    """Static prefill + fixed-capacity decode graphs of a dir transformers saved (experts one tensor
    each, stacked into one initializer): a left-padded batch of two prompts gives transformers'
    greedy tokens of each prompt alone for 24 steps, logits within 1e-4; TopK, Softmax, ReduceSum
    route on ATC's operator list at opset 14."""
    import json

    import numpy as np

    from titan_pipe.config import ExportConfig
    from titan_pipe.convert.onnx.export import export_model
    from titan_pipe.graphs.generation import generate, ort_session

    hf = _hf_model(args)
    hf.save_pretrained(tmp_path / "hf")
    res = export_model(
        tmp_path / "hf", tmp_path / "onnx", ExportConfig(dynamic=False, batch=2, seq_len=12, cache_len=40, atc=False)
    )
    ops = {o["op_type"] for o in json.loads(res.export_json.read_text())["graphs"]["decode.onnx"]["operators"]}
    assert {"TopK", "Softmax", "ReduceSum", "Equal", "MatMul"} <= ops
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, args.vocab_size, (n,), generator=g).tolist() for n in (12, 6)]
    gen = generate(
        prefill=ort_session(res.onnx, threads=1),
        decode=ort_session(res.decode_onnx, threads=1),
        prompts=prompts,
        max_new_tokens=24,
    )
    for r, p in enumerate(prompts):
        ids = torch.tensor([p])
        with torch.no_grad():
            seq = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, pad_token_id=0
            )[0]
            ref = hf(seq[None, :-1]).logits[0, len(p) - 1 :].numpy()
        assert np.array_equal(gen.new_tokens[r], seq[len(p) :].numpy()), (family, r)
        assert np.abs(gen.logits[r] - ref).max() <= 1e-4, (family, r)


def test_evaluate_routes_and_names_the_perturbed_router_or_expert(tmp_path):
    """A Qwen3-MoE export (layer 1 dense) passes evaluate with a router row per routing layer; a
    router weight perturbed in layer 2 fails that row at layer 2 (and no other); an expert weight
    perturbed in layer 2 leaves the routing alone and fails the layer comparison at layer 2."""
    import json
    import shutil

    import onnx
    from onnx import numpy_helper

    from titan_pipe.config import EvaluateConfig, ExportConfig
    from titan_pipe.convert.onnx.export import export_model
    from titan_pipe.evaluate.api import evaluate_model

    _hf_model(QWEN3_MOE).save_pretrained(tmp_path / "hf")
    src = tmp_path / "hf"
    res = export_model(src, tmp_path / "onnx", ExportConfig(kv_cache=False, atc=False))
    fast = EvaluateConfig(batches=1, batch_size=2, seq_len=32, prompts=1, new_tokens=4, operators=False)
    r = evaluate_model(out_dir=tmp_path / "ok", model_dir=src, onnx=res.onnx, settings=fast)
    rows = {c["id"]: c for c in json.loads(r.report_json.read_text())["comparisons"]}
    assert r.passed, r.summary.verdict
    assert rows["moe_router"]["status"] == "pass"
    assert set(rows["moe_router"]["details"]["agreement"]) == {"0", "2", "3"}  # layer 1 is dense

    def perturbed(name: str, how):
        m = onnx.load(str(res.onnx))
        init = next(i for i in m.graph.initializer if i.name == name)
        w = numpy_helper.to_array(init).copy()
        how(w)
        init.CopyFrom(numpy_helper.from_array(w, init.name))
        bad = tmp_path / name / "model.onnx"
        bad.parent.mkdir()
        onnx.save(m, str(bad))
        shutil.copy(res.export_json, bad.parent / "export.json")
        return bad

    def reverse_router(w):
        w[:] = w[::-1]  # each expert gets another expert's routing row: other choices

    def scale_expert(w):
        w[:] = w * 3.0  # every expert's down projection, three times too large: the same choices

    bad = perturbed("layers.2.moe.router", reverse_router)
    r = evaluate_model(out_dir=tmp_path / "rep-router", model_dir=src, onnx=bad, settings=fast)
    router = {c["id"]: c for c in json.loads(r.report_json.read_text())["comparisons"]}["moe_router"]
    assert not r.passed and router["status"] == "fail"
    assert [f.split(":")[0] for f in router["failures"]] == ["layer 2 router"], router["failures"]
    bad = perturbed("layers.2.moe.w2", scale_expert)
    r = evaluate_model(out_dir=tmp_path / "rep-expert", model_dir=src, onnx=bad, settings=fast)
    rows = {c["id"]: c for c in json.loads(r.report_json.read_text())["comparisons"]}
    assert not r.passed and r.summary.first_failing_layer["layer"] == 2, r.summary.verdict
    assert rows["moe_router"]["status"] == "pass"


def test_a_torchtitan_moe_dcp_checkpoint_converts(tmp_path):
    """torchtitan's Qwen3-MoE saves experts stacked per layer under the names ours have
    (layers.{i}.moe.experts.w1, moe.router.gate.weight): its DCP checkpoint, with the Hugging Face
    config.json given, converts to a dir equal to what transformers saved, bit for bit."""
    from convert_writers import write_dcp
    from safetensors.torch import load_file

    from titan_pipe.config import ConvertConfig
    from titan_pipe.convert.api import convert_checkpoint

    hf = _hf_model(QWEN3_MOE)
    hf.save_pretrained(tmp_path / "hf")
    dcp_dir = write_dcp(_native_state(hf, QWEN3_MOE, "qwen3_moe"), QWEN3_MOE, tmp_path / "dcp")
    with pytest.raises(UserError, match="pass the model's Hugging Face config.json with --model-config"):
        convert_checkpoint(dcp_dir, tmp_path / "no")
    convert_checkpoint(dcp_dir, tmp_path / "out", ConvertConfig(source_config=tmp_path / "hf" / "config.json"))
    want, got = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_megatron_moe_arguments_read_strictly(tmp_path):
    """Megatron-LM's MoE arguments as ModelArgs (moe_layer_freq as a step or a 0/1 list, the top-k
    renormalized unless moe_router_pre_softmax), and what the model cannot compute one line each."""
    from convert_writers import megatron_args, model_args
    from titan_pipe.weights.readers.megatron.common import model_args as from_megatron

    args = model_args(
        n_experts=4,
        experts_per_token=2,
        moe_hidden_dim=48,
        dense_layers=(0,),
        qk_norm=True,
        head_dim=16,
        router_aux_loss_coef=0.01,
    )
    ns = megatron_args(args, tp=2, pp=1, padded=512)
    got = from_megatron(ns, 320, tmp_path)
    assert (
        got.n_experts,
        got.experts_per_token,
        got.expert_dim,
        got.moe_layers,
        got.router_norm_topk,
        got.router_aux_loss_coef,
    ) == (4, 2, 48, (1, 2, 3), True, 0.01)
    ns.moe_layer_freq, ns.moe_router_pre_softmax = 2, True
    got = from_megatron(ns, 320, tmp_path)
    assert got.moe_layers == (0, 2) and got.dense_layers == (1, 3) and not got.router_norm_topk
    for key, value, expect in [
        ("moe_shared_expert_intermediate_size", 64, "shared experts"),
        ("moe_router_score_function", "sigmoid", "moe_router_score_function='sigmoid'"),
        ("moe_router_enable_expert_bias", True, "router expert biases"),
        ("moe_layer_freq", [1, 1], "lists 2 layers, num_layers is 4"),
        ("moe_layer_freq", "every", "neither a layer step nor a list"),
    ]:
        bad = megatron_args(args, tp=2, pp=1, padded=512)
        setattr(bad, key, value)
        with pytest.raises(UserError, match=expect):
            from_megatron(bad, 320, tmp_path)


@pytest.mark.parametrize(
    "tp,pp,ep,grouped", [(2, 2, 2, False), (1, 1, 2, False), (2, 1, 1, False), (2, 2, 2, True), (1, 1, 2, True)]
)
def test_legacy_megatron_moe_rank_files_convert_bit_exactly(tmp_path, tp, pp, ep, grouped):
    """Megatron-LM's legacy per-rank files of a mixture of experts (mp_rank_TT[_PPP][_EEE]: with pp 1
    the single suffix is the ep rank), each ep rank holding its SequentialMLP experts as
    local_experts.N, or its GroupedMLP weight1/weight2 (the experts transposed, back to back): the
    stacked experts, the router and the rest read back bit for bit."""
    from convert_writers import model_args, native_state, write_megatron
    from safetensors.torch import load_file

    from titan_pipe.config import ConvertConfig
    from titan_pipe.convert.api import convert_checkpoint

    args = model_args(
        n_experts=4,
        experts_per_token=2,
        moe_hidden_dim=48,
        dense_layers=(0,),
        qk_norm=True,
        head_dim=16,
        router_aux_loss_coef=0.01,
    )
    sd = native_state(args)
    src = write_megatron(sd, args, tmp_path / "src", tp=tp, pp=pp, ep=ep, fused_norms=False, grouped=grouped)
    dirs = sorted(p.name for p in (src / "iter_0000050").iterdir())
    assert len(dirs) == tp * pp * ep and (ep == 1 or dirs[1].endswith("_001"))
    convert_checkpoint(src, tmp_path / "out", ConvertConfig(naming="native"))
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert set(got) == set(sd)
    for k, v in sd.items():
        assert torch.equal(got[k].view(torch.uint8), v.contiguous().view(torch.uint8)), k


def test_legacy_megatron_moe_missing_ep_rank_is_one_line(tmp_path):
    import shutil

    from convert_writers import model_args, native_state, write_megatron

    from titan_pipe.convert.api import convert_checkpoint

    args = model_args(n_experts=4, experts_per_token=2, qk_norm=True, moe_hidden_dim=48, head_dim=16)
    src = write_megatron(native_state(args), args, tmp_path / "src", tp=1, pp=1, ep=2, fused_norms=False)
    shutil.rmtree(src / "iter_0000050" / "mp_rank_00_001")
    with pytest.raises(UserError, match=r"args say tp=1 pp=1 ep=2 but rank dirs \['mp_rank_00_001'\] are missing"):
        convert_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
