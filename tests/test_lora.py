"""LoRA through every stage: the adapted forward against the merged-weight arithmetic, training on
2 gloo ranks (tp, tp + sequence parallel, FSDP, DDP, pp; resume) against a hand-written single-process
reference, the frozen base unchanged, only adapter states, checkpoints that hold the adapters and a
checked record of the base, convert's merge against PEFT's merge_and_unload and its adapter dir
loaded by PEFT, evaluate PASS on the merged deployment, the planner, and the refusals.
(dp2 x tp2 x pp2 is in test_training_parallel's 8-rank launch.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from convert_writers import model_args, native_state, write_hf
from test_untrusted_input import cli
from training_reference import lora_reference_run
from titan_pipe.config import ConfigError, ConvertConfig, EvaluateConfig, ExportConfig, parse_flow
from titan_pipe.convert.api import convert_checkpoint
from titan_pipe.errors import UserError
from titan_pipe.model.lora import LoRASpec, adapter_names, adapter_shapes, peft_key
from titan_pipe.model.names import native_to_hf
from titan_pipe.model.params import param_of
from titan_pipe.model.sharding import TP_PLAN, tp_split_dim
from titan_pipe.model.transformer import build_model
from titan_pipe.model.weights import open_weights

HERE = Path(__file__).parent
SPEC = LoRASpec(rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down"))
LORA = {"rank": 4, "alpha": 8, "targets": list(SPEC.targets)}


def _flow(base: Path, parallel: dict, **train) -> dict:
    return {
        "device": "cpu",
        "init_from": str(base),
        "parallel": parallel,
        "train": {
            "steps": 4,
            "batch_size": 8,
            "seq_len": 32,
            "warmup_steps": 1,
            "seed": 0,
            "grad_clip": 1.0,
            "optimizer": {"lr": 0.01, "weight_decay": 0.1},
            "lora": LORA,
            **train,
        },
        "checkpoint": {"every": 2, "keep_last": 3},
    }


RUNS = {
    "tp2": {"tp": 2},
    "tp2_sp": {"tp": 2, "sequence_parallel": True},
    "dp2_fsdp": {"dp": 2},
    "dp2_ddp": {"dp": 2, "dp_mode": "ddp"},
    "pp2": {"pp": 2, "microbatches": 2},
}


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    """One 2-rank launch: LoRA fine-tunes of a transformers-saved Llama (the base) in five layouts,
    the tp2 run resumed from its step 2 under FSDP, and a bf16-held base under AMP."""
    work = tmp_path_factory.mktemp("lora")
    args = model_args()
    write_hf(native_state(args, seed=3), args, work / "base")
    runs = [{"name": n, "flow": _flow(work / "base", par), "check_base": True} for n, par in RUNS.items()]
    runs.append(
        {
            "name": "tp2_to_dp2",
            "flow": _flow(work / "base", {"dp": 2}),
            "resume": True,
            "copy_from": {"run": "tp2", "step": 2},
        }
    )
    runs.append(
        {
            "name": "bf16_base",
            "check_base": True,
            "flow": dict(_flow(work / "base", {"dp": 2}), precision={"amp": True, "amp_dtype": "bfloat16"}),
        }
    )
    # fine-tuning on chat data (answers only, conversations packed apart) with adapters, tp2
    from chat_fixtures import chat_records, train_tokenizer, write_jsonl

    shutil.copytree(work / "base", work / "base_chat")
    train_tokenizer(work / "base_chat")
    write_jsonl(work / "chat" / "chat.jsonl", chat_records(80))
    sft = _flow(work / "base_chat", {"tp": 2}, mode="sft", seq_len=192)
    sft["data"] = {
        "path": str(work / "chat" / "chat.jsonl"),
        "tokenizer": str(work / "base_chat"),
        "format": "chat",
        "val_fraction": 0.1,
    }
    runs.append({"name": "sft_tp2", "flow": sft, "check_base": True})
    # a tied, biased base (Qwen2 / SmolLM2-shaped) in a pipeline: the output a frozen copy of the embedding
    tied = model_args(tie_embeddings=True, qkv_bias=True)
    write_hf(native_state(tied, seed=3), tied, work / "base_tied")
    runs.append(
        {"name": "tied_pp2", "flow": _flow(work / "base_tied", {"pp": 2, "microbatches": 2}), "check_base": True}
    )
    spec = work / "spec.json"
    spec.write_text(json.dumps({"workdir": str(work), "runs": runs}))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(HERE / "train_driver.py"),
            str(spec),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return work, json.loads((work / "results.json").read_text())


def _step(work: Path, run: str, step: int = 4) -> Path:
    return work / "runs" / run / "checkpoints" / f"step-{step:06d}"


# -- the model -----------------------------------------------------------------------------------


def test_adapted_forward_and_gradients_equal_the_merged_weight_arithmetic():
    """The model with adapters (B nonzero) against a plain model whose weights are W + (alpha / r) B A
    of the same two leaf tensors: equal logits, loss and gradients of A and B."""
    from torch.func import functional_call

    args = model_args()
    torch.manual_seed(0)
    m = build_model(args, lora=SPEC, seed=1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if ".lora." in n:
                p.normal_(0, 0.05)
    plain = build_model(args, seed=1)
    x = torch.randint(0, args.vocab_size, (2, 16))
    y = torch.randint(0, args.vocab_size, (2, 16))
    loss = torch.nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten())
    loss.backward()
    leaves = {n: p.detach().clone().requires_grad_() for n, p in m.named_parameters() if ".lora." in n}
    weights = dict(plain.named_parameters())
    for n in leaves:
        if n.endswith(".a.weight"):
            w = n.replace(".lora.", ".").replace(".a.weight", ".weight")
            weights[w] = weights[w] + SPEC.scale * leaves[n[: -len("a.weight")] + "b.weight"] @ leaves[n]
    ref = torch.nn.functional.cross_entropy(functional_call(plain, weights, (x,)).flatten(0, 1), y.flatten())
    ref.backward()
    assert abs(float(loss.detach()) - float(ref.detach())) < 1e-6
    grads = dict(m.named_parameters())
    for n, leaf in leaves.items():
        torch.testing.assert_close(grads[n].grad, leaf.grad, rtol=1e-4, atol=1e-7)
    # B starts at zero: a freshly seeded adapted model is the base
    fresh = build_model(args, lora=SPEC, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), plain(x), rtol=0, atol=0)


def test_adapters_have_rows_in_the_sharding_table():
    args = model_args()
    names = adapter_names(args, SPEC)
    assert len(names) == 2 * 7 * args.n_layers
    assert adapter_shapes(args, SPEC)["layers.0.attention.lora.wq.a.weight"] == (4, args.dim)
    assert adapter_shapes(args, SPEC)["layers.1.feed_forward.lora.w2.b.weight"] == (args.dim, 4)
    # beside a column-split base: A replicated, B split by rows; beside a row-split base: A by columns, B whole
    assert [tp_split_dim(f"layers.0.attention.lora.wq.{p}.weight") for p in "ab"] == [None, 0]
    assert [tp_split_dim(f"layers.0.feed_forward.lora.w2.{p}.weight") for p in "ab"] == [1, None]
    assert param_of("layers.3.attention.lora.wo.b.weight").tp == "replicate_output"
    assert {r.module for r in TP_PLAN if ".lora." in r.module} >= {
        "layers.*.attention.lora.wq.a",
        "layers.*.feed_forward.lora.w3.b",
    }
    hf = native_to_hf("layers.2.attention.wk.weight", "llama")
    assert (
        peft_key("layers.2.attention.lora.wk.a.weight", hf)
        == "base_model.model.model.layers.2.self_attn.k_proj.lora_A.weight"
    )


# -- training ------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_every_layout_equals_the_hand_written_reference(lora_runs):
    """tp2, tp2 + sequence parallel, FSDP, DDP and pp2: the loss and gradient norm of every step equal
    a single-process loop over W + (alpha/r) B A with AdamW on A and B alone."""
    work, res = lora_runs
    flow = yaml.safe_load((work / "tp2.yaml").read_text())
    ref = lora_reference_run(flow, base=work)
    for name in RUNS:
        got = res[name]["metrics"]
        for r, want_loss, want_norm in zip(got, ref["losses"], ref["grad_norms"]):
            assert abs(r["loss"] - want_loss) <= 1e-5 * want_loss, (name, r["step"], r["loss"], want_loss)
            assert abs(r["grad_norm"] - want_norm) <= 1e-4 * want_norm, (name, r["step"])
    assert ref["losses"][-1] < 0.85 * ref["losses"][0]  # the adapters learn
    weights = open_weights(_step(work, "dp2_ddp"), adapters_apart=True)
    for n, want in ref["adapters"].items():
        # AdamW divides by sqrt(v): an element whose gradients are near 0 magnifies float noise, so whole tensors
        assert (weights.full(n) - want).norm() <= 1e-3 * want.norm() + 1e-6, n


@pytest.mark.distributed
def test_the_base_stays_bit_identical_and_only_adapters_have_optimizer_state(lora_runs):
    work, _ = lora_runs
    n_adapters = len(adapter_names(model_args(), SPEC))
    for name in [*RUNS, "bf16_base", "sft_tp2", "tied_pp2"]:
        ranks = json.loads((work / f"{name}.base.json").read_text())
        assert all(r["differing"] == [] and r["compared"] > 0 for r in ranks), (name, ranks)
        assert all(r["state_entries"] == r["adapters"] > 0 for r in ranks), (name, ranks)
        assert sum(r["adapters"] for r in ranks) >= n_adapters
    manifest = json.loads((_step(work, "tp2") / "manifest.json").read_text())
    assert sorted(manifest["params"]) == sorted(adapter_names(model_args(), SPEC))  # no copy of the base
    base = manifest["extra"]["lora"]["base"]
    assert Path(base["path"]) == (work / "base").resolve()
    assert set(base["files"]) == {"config.json", "model.safetensors"}
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(_step(work, "tp2") / "optimizer")).read_metadata()
    states = {
        k[len("optimizer.state.") :].rsplit(".", 1)[0]
        for k in meta.state_dict_metadata
        if k.startswith("optimizer.state.")
    }
    assert states == set(adapter_names(model_args(), SPEC))


@pytest.mark.distributed
def test_a_tied_biased_base_in_a_pipeline_equals_the_reference_and_merges_like_peft(lora_runs, tmp_path):
    peft = pytest.importorskip("peft")
    import transformers

    work, res = lora_runs
    ref = lora_reference_run(yaml.safe_load((work / "tied_pp2.yaml").read_text()), base=work)
    got = [r["loss"] for r in res["tied_pp2"]["metrics"]]
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(got, ref["losses"])), (got, ref["losses"])
    step = _step(work, "tied_pp2")
    convert_checkpoint(step, tmp_path / "merged")
    convert_checkpoint(step, tmp_path / "adapter", ConvertConfig(lora="adapter"))
    base = transformers.AutoModelForCausalLM.from_pretrained(work / "base_tied", dtype=torch.float32).eval()
    with torch.no_grad():
        merged = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload().state_dict()
    mine = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert "lm_head.weight" not in mine and all(torch.equal(mine[k], merged[k]) for k in mine)


@pytest.mark.distributed
def test_fine_tuning_on_chat_data_with_adapters_learns_the_answers(lora_runs):
    """train.mode sft with train.lora: the answer-token loss falls, the adapters are the only change."""
    work, res = lora_runs
    losses = [r["loss"] for r in res["sft_tp2"]["metrics"]]
    assert len(losses) == 4 and losses[-1] < 0.9 * losses[0], losses
    assert all(r["target_tokens"] > 0 for r in res["sft_tp2"]["metrics"])
    manifest = json.loads((_step(work, "sft_tp2") / "manifest.json").read_text())
    assert "chat_template.jinja" in manifest["extra"]["attached"] or "tokenizer.json" in manifest["extra"]["attached"]


@pytest.mark.distributed
def test_inspect_and_validate_say_what_a_lora_run_is(lora_runs):
    from titan_pipe.convert.inspect import inspect_checkpoint

    work, _ = lora_runs
    r = inspect_checkpoint(src=_step(work, "tp2"))
    assert r.layout["lora"]["rank"] == 4 and r.layout["lora"]["base"] == str((work / "base").resolve())
    assert [p["name"] for p in r.params] == adapter_names(model_args(), SPEC)
    code, out = cli("validate", work / "tp2.yaml")
    assert code == 0 and "LoRA rank 4 on q, k, v, o, gate, up, down: 0.02M trained, the base frozen in float32" in out


@pytest.mark.distributed
def test_resume_under_another_layout_continues_the_curve(lora_runs):
    _, res = lora_runs
    want = [r["loss"] for r in res["tp2"]["metrics"]][2:]
    got = [r["loss"] for r in res["tp2_to_dp2"]["metrics"]]
    assert len(got) == 2 and all(abs(a - b) <= 1e-5 * b for a, b in zip(got, want))


@pytest.mark.distributed
def test_a_changed_base_is_refused_by_every_reader(lora_runs, tmp_path):
    work, _ = lora_runs
    moved = tmp_path / "base"
    shutil.copytree(work / "base", moved)
    step = tmp_path / "step"
    shutil.copytree(_step(work, "tp2"), step)
    m = json.loads((step / "manifest.json").read_text())
    m["extra"]["lora"]["base"]["path"] = str(moved)
    (step / "manifest.json").write_text(json.dumps(m))
    open_weights(step).full("layers.0.attention.wq.weight")  # the record points at an intact copy: read
    sd = load_file(str(moved / "model.safetensors"))
    key = next(iter(sd))
    sd[key] = sd[key] + 1
    save_file(sd, str(moved / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match="sha256|bytes"):
        open_weights(step)
    with pytest.raises(UserError):
        convert_checkpoint(step, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    shutil.rmtree(moved)
    with pytest.raises(UserError, match="not there"):
        open_weights(step)


def _tampered(work: Path, tmp_path: Path, edit) -> Path:
    step = tmp_path / "step"
    shutil.copytree(_step(work, "tp2"), step)
    m = json.loads((step / "manifest.json").read_text())
    edit(m["extra"]["lora"])
    (step / "manifest.json").write_text(json.dumps(m))
    return step


@pytest.mark.distributed
@pytest.mark.parametrize(
    "edit, expect",
    [
        (lambda r: r.update(rank=8), "LoRA record"),  # the record and the stored adapters disagree
        (lambda r: r.update(targets=["q", "v"]), "LoRA record"),
        (lambda r: r.update(rank="4"), "is not a whole number"),
        (lambda r: r.pop("base"), "no base record"),
        (lambda r: r["base"]["files"].update({"../../etc/passwd": {"size": 1, "sha256": "0" * 64}}), "base.files"),
        (lambda r: r["base"]["files"]["model.safetensors"].update(sha256="abc"), "base.files"),
        (lambda r: r["base"]["files"]["model.safetensors"].update(size=-1), "base.files"),
        (lambda r: r["base"].update(files={}), "base.path / base.files"),
    ],
)
def test_a_tampered_lora_record_is_one_line_from_every_reader(lora_runs, tmp_path, edit, expect):
    work, _ = lora_runs
    step = _tampered(work, tmp_path, edit)
    with pytest.raises(UserError, match=expect):
        open_weights(step)
    code, out = cli("convert", step, "-o", tmp_path / "out")
    assert code == 1 and expect in out and len(out.strip().splitlines()) == 1, out
    assert not (tmp_path / "out").exists()


@pytest.mark.distributed
def test_an_adapter_dir_is_one_unsharded_output(lora_runs, tmp_path):
    work, _ = lora_runs
    code, out = cli("convert", _step(work, "tp2"), "-o", tmp_path / "out", "--lora", "adapter", "--tp", "2")
    assert code == 1 and "drop --tp/--pp" in out
    code, out = cli("convert", _step(work, "tp2"), "-o", tmp_path / "out", "--lora", "fold")
    assert code == 1 and "--lora" in out and "merge" in out


# -- convert and PEFT ----------------------------------------------------------------------------


@pytest.mark.distributed
def test_merge_equals_peft_and_the_adapter_dir_loads_in_peft(lora_runs, tmp_path):
    """convert --lora adapter: PEFT loads it on the transformers base and gives our training model's
    logits; its merge_and_unload equals convert --lora merge; the merged dir's logits equal the adapted
    model's within float rounding."""
    peft = pytest.importorskip("peft")
    import transformers

    work, _ = lora_runs
    step = _step(work, "tp2")
    convert_checkpoint(step, tmp_path / "merged")
    convert_checkpoint(step, tmp_path / "adapter", ConvertConfig(lora="adapter"))
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (
        cfg["r"] == 4
        and cfg["lora_alpha"] == 8.0
        and set(cfg["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    )
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(2))
    adapted = open_weights(step, adapters_apart=True)
    ours = build_model(adapted.args, lora=adapted.lora, seed=None)
    ours.load_state_dict({n: adapted.full(n) for n in ours.state_dict() if not n.startswith("rope")}, strict=False)
    with torch.no_grad():
        want = ours(x)
        base = transformers.AutoModelForCausalLM.from_pretrained(work / "base", dtype=torch.float32).eval()
        pm = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        torch.testing.assert_close(pm(x).logits, want, rtol=1e-5, atol=1e-5)
        merged_ref = pm.merge_and_unload().state_dict()
        mine = load_file(str(tmp_path / "merged" / "model.safetensors"))
        for k, v in mine.items():
            torch.testing.assert_close(v, merged_ref[k], rtol=1e-6, atol=1e-7)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
        torch.testing.assert_close(hf(x).logits, want, rtol=1e-4, atol=1e-4)
    # the merged model differs from the base: the fine-tune is in it
    assert not torch.equal(
        mine["model.layers.0.self_attn.q_proj.weight"],
        load_file(str(work / "base" / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"],
    )
    prov = json.loads((tmp_path / "merged" / "provenance.json").read_text())
    assert any(f.endswith("model.safetensors") and str(work / "base") in f for f in prov["source"]["digests"])


@pytest.mark.distributed
def test_a_sharded_merge_reassembles_to_the_unified_merge(lora_runs, tmp_path):
    """convert --tp 2 --pp 2 of a LoRA checkpoint: the merged model in our layout, every region's B A
    term from its own rows and columns; back to one file it equals the unified merge bit for bit."""
    work, _ = lora_runs
    step = _step(work, "pp2")
    convert_checkpoint(step, tmp_path / "merged")
    convert_checkpoint(step, tmp_path / "sharded", ConvertConfig(tp=2, pp=2))
    convert_checkpoint(tmp_path / "sharded", tmp_path / "back")
    a = load_file(str(tmp_path / "merged" / "model.safetensors"))
    b = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.distributed
def test_merged_deployment_exports_and_evaluates_pass(lora_runs, tmp_path):
    """merge -> export -> evaluate: the sharded forward runs the adapters beside the frozen base
    (unmerged), compared per layer with the merged unified model and ONNX Runtime; the task row scores
    the base before the fine-tune."""
    pytest.importorskip("onnxruntime")
    from titan_pipe.convert.onnx.export import export_model
    from titan_pipe.evaluate.api import evaluate_model

    work, _ = lora_runs
    step = _step(work, "tp2")
    convert_checkpoint(step, tmp_path / "model")
    onnx = export_model(tmp_path / "model", tmp_path / "onnx", ExportConfig(atc=False)).onnx
    r = evaluate_model(
        out_dir=tmp_path / "report",
        checkpoint=step,
        model_dir=tmp_path / "model",
        onnx=onnx,
        settings=EvaluateConfig(batches=1, prompts=2, new_tokens=4),
    )
    assert r.passed, r.summary.verdict
    assert r.summary.comparisons["sharded_vs_unified"] == "pass"
    rows = {c["id"]: c for c in json.loads(r.report_json.read_text())["comparisons"]}
    assert "LoRA" in rows["sharded_vs_unified"]["title"]  # merged vs applied: the relative bounds
    after = r.summary.perplexity["torch float32 (model)"]
    assert r.summary.perplexity_before_finetune > 1.5 * after  # the fine-tune learned the held-out text


@pytest.mark.distributed
def test_validate_refuses_a_base_the_adapters_cannot_reference(lora_runs, tmp_path):
    """What the trainer would refuse before its first step, validate refuses first: a LoRA checkpoint
    as the base (its adapters apart) and a DCP checkpoint (no safetensors files to reference)."""
    from convert_writers import write_dcp

    work, _ = lora_runs
    dcp = write_dcp(native_state(model_args(), seed=3), model_args(), tmp_path / "dcp")
    for base, expect in ((_step(work, "tp2"), "is itself a LoRA checkpoint"), (dcp, "is a dcp checkpoint")):
        with pytest.raises(ConfigError, match=expect):
            parse_flow(_flow(base, {}), base=tmp_path)


@pytest.mark.distributed
def test_a_deployment_without_the_fine_tune_fails_evaluate(lora_runs, tmp_path):
    """The fault this round started from: a deployed model that is not the fine-tuned one must not pass.
    The base's weights under the merged model's config (the adapters dropped): evaluate against the LoRA
    checkpoint fails, at the sharded comparison's first layer."""
    pytest.importorskip("onnxruntime")
    from titan_pipe.convert.onnx.export import export_model
    from titan_pipe.evaluate.api import evaluate_model

    work, _ = lora_runs
    step = _step(work, "tp2")
    convert_checkpoint(step, tmp_path / "model")
    shutil.copyfile(work / "base" / "model.safetensors", tmp_path / "model" / "model.safetensors")
    onnx = export_model(tmp_path / "model", tmp_path / "onnx", ExportConfig(atc=False)).onnx
    r = evaluate_model(
        out_dir=tmp_path / "report",
        checkpoint=step,
        model_dir=tmp_path / "model",
        onnx=onnx,
        settings=EvaluateConfig(batches=1, prompts=2, new_tokens=4),
    )
    assert not r.passed and r.summary.comparisons["sharded_vs_unified"] == "fail"
    assert r.summary.first_failing_layer["layer"] == 0, r.summary.first_failing_layer


# -- config, CLI, planner ------------------------------------------------------------------------


def test_lora_flows_are_checked_before_training(tmp_path):
    args = model_args()
    write_hf(native_state(args, seed=3), args, tmp_path / "base")
    good = _flow(tmp_path / "base", {})
    assert parse_flow(good, base=tmp_path).train.lora.spec() == SPEC

    def refused(flow, match):
        with pytest.raises(ConfigError, match=match):
            parse_flow(flow, base=tmp_path)

    refused({**good, "init_from": None}, "set init_from to the model to adapt")
    refused({**good, "train": {**good["train"], "lora": {**LORA, "targets": ["q", "q"]}}}, "each target once")
    refused({**good, "train": {**good["train"], "lora": {**LORA, "targets": ["qkv"]}}}, "targets")
    refused({**good, "train": {**good["train"], "lora": {**LORA, "rank": 0}}}, "rank")
    refused({**good, "train": {**good["train"], "lora": {**LORA, "base_dtype": "bfloat16"}}}, "precision.amp")
    moe = {**good, "init_from": None, "model": {"flavour": "debug_moe"}}
    refused({**moe, "train": {**good["train"]}}, "experts, which take no adapters")


def test_cli_refusals_and_init(tmp_path):
    args = model_args()
    write_hf(native_state(args, seed=3), args, tmp_path / "base")
    code, out = cli("convert", tmp_path / "base", "-o", tmp_path / "out", "--lora", "adapter")
    assert code == 1 and "holds no LoRA adapters" in out
    code, out = cli("init", tmp_path / "x", "--lora", "8")
    assert code == 1 and "--sft" in out
    from chat_fixtures import train_tokenizer

    train_tokenizer(tmp_path / "base")
    code, out = cli("init", tmp_path / "proj", "--from", tmp_path / "base", "--sft", "--lora", "8", "--device", "cpu")
    assert code == 0, out
    flow = yaml.safe_load((tmp_path / "proj" / "flow.yaml").read_text())
    assert flow["train"]["lora"] == {
        "rank": 8,
        "alpha": 16,
        "dropout": 0.05,
        "targets": ["q", "k", "v", "o", "gate", "up", "down"],
    }
    assert flow["train"]["optimizer"]["lr"] == 2e-4 and flow["init_from"] == str(tmp_path / "base")


def test_lora_flops_leave_out_the_base_weight_gradients_in_the_trainer_and_the_planner():
    """6 N + attention for full training; 4 N + attention with the base frozen (no dW), the same in
    the trainer's MFU and the planner's step time."""
    from titan_pipe.model.args import FLAVOURS, count_params, flops_per_token
    from titan_pipe.model.lora import trained_flops_per_token
    from titan_pipe.training.planner.timing import rank_flops_per_token
    from titan_pipe.training.planner.workload import Layout

    args = FLAVOURS["qwen2.5_7b"]
    matmul = (flops_per_token(args, 0)) / 6  # N_matmul (plus the biases' adds / 6)
    assert trained_flops_per_token(args, 4096) == pytest.approx(flops_per_token(args, 4096) - 2 * matmul)
    assert 0.6 < trained_flops_per_token(args, 4096) / flops_per_token(args, 4096) < 0.75
    lay = Layout(1, 1, 1)
    assert rank_flops_per_token(args, 4096, lay, 0, frozen=True) == pytest.approx(trained_flops_per_token(args, 4096))
    assert count_params(args) > 7e9


def test_the_planner_fits_a_lora_fine_tune_where_full_fine_tuning_does_not():
    """Qwen2.5-7B on one 910B3 (64 GB): full fine-tuning needs its states on the host, LoRA rank 16
    fits on the card with the base held in bf16, adapter states only."""
    from titan_pipe.model.args import FLAVOURS
    from titan_pipe.training.planner.memory import memory_per_device
    from titan_pipe.training.planner.search import build_cluster, make_plan
    from titan_pipe.training.planner.workload import Layout, Workload

    cluster, _ = build_cluster("ascend910b", 1)
    full = Workload(FLAVOURS["qwen2.5_7b"], 4096, 4, flavour="qwen2.5_7b")
    lora = Workload(FLAVOURS["qwen2.5_7b"], 4096, 4, flavour="qwen2.5_7b", lora=LoRASpec(16, 32.0, SPEC.targets))
    on_card = [e for e in make_plan(full, cluster).ranked if not e.layout.offload]
    assert on_card == []
    best = make_plan(lora, cluster).best
    assert best is not None and not best.layout.offload
    lay = Layout(1, 1, 1, ac_every=1, zero=0)
    m_full, m_lora = memory_per_device(full, lay), memory_per_device(lora, lay)
    n = sum(a * b for a, b in adapter_shapes(lora.args, lora.lora).values())
    assert m_lora.optimizer == 8 * n + 4 * len(adapter_shapes(lora.args, lora.lora))
    assert m_lora.grads == 4 * n
    assert m_lora.params < 0.55 * m_full.params  # the base in bf16, not float32
