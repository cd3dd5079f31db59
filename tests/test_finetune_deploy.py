"""A fine-tune through deploy: a Qwen3-shaped model saved by transformers with a chat template,
fine-tuned on chat records (train.mode sft, one process), converted back to a Hugging Face dir that
transformers loads with the same tokenizer and template (apply_chat_template -> generate runs),
exported and evaluated on the held-out conversations (answer-only perplexity): PASS."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml

from chat_fixtures import chat_records, train_tokenizer, write_jsonl
from flow_helpers import train_in_process
from titan_pipe.config import EvaluateConfig, ExportConfig
from titan_pipe.convert.api import convert_checkpoint
from titan_pipe.evaluate.api import evaluate_model
from titan_pipe.evaluate.batches import ValidationSplit, load_eval_data
from titan_pipe.convert.onnx.export import export_model

QWEN3 = {"flavour": "debug", "qk_norm": True, "head_dim": 32}


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    from convert_writers import native_state, write_hf
    from titan_pipe.config import parse_flow

    root = tmp_path_factory.mktemp("sft")
    args = parse_flow({"model": QWEN3}, base=root).model.args()
    write_hf(native_state(args, seed=5), args, root / "released")
    train_tokenizer(root / "released")
    write_jsonl(root / "chat.jsonl", chat_records(60))
    flow = root / "flow.yaml"
    flow.write_text(
        yaml.safe_dump(
            {
                "name": "sft",
                "runs_dir": str(root / "runs"),
                "device": "cpu",
                "model": QWEN3,
                "init_from": "released",
                "data": {"path": "chat.jsonl", "tokenizer": "released", "format": "chat", "val_fraction": 0.2},
                "train": {"mode": "sft", "steps": 3, "batch_size": 2, "seq_len": 192, "optimizer": {"lr": 1e-3}},
                "checkpoint": {"every": 3, "keep_last": 1},
            }
        )
    )
    cfg, res = train_in_process(flow)
    model = convert_checkpoint(res.checkpoint, root / "model")
    return {"root": root, "flow": flow, "cfg": cfg, "ckpt": res.checkpoint, "model": model.out_dir}


def test_the_tuned_model_loads_in_transformers_with_its_chat_template(tuned):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, out = tuned["root"], tuned["model"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (root / "released" / name).read_bytes()
    assert tuned["cfg"].train.optimizer.weight_decay == 0.0  # fine-tuning's default
    tok = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    messages = [{"role": "user", "content": "what is two plus three"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert tok.decode(ids["input_ids"][0]).endswith("<|im_start|>assistant\n")
    out_ids = model.generate(**ids, max_new_tokens=6, do_sample=False)
    assert out_ids.shape[1] == ids["input_ids"].shape[1] + 6 or tok.eos_token_id in out_ids[0].tolist()
    # the weights moved: training learned something, and the released dir is untouched
    released = AutoModelForCausalLM.from_pretrained(str(root / "released"), torch_dtype=torch.float32)
    assert not torch.equal(
        released.model.layers[0].self_attn.q_proj.weight, model.model.layers[0].self_attn.q_proj.weight
    )


def test_export_and_evaluate_pass_on_the_held_out_conversations(tuned):
    root = tuned["root"]
    onnx = export_model(tuned["model"], root / "onnx", ExportConfig(kv_cache=True, atc=False)).onnx
    split = ValidationSplit.of_flow(tuned["cfg"].data, root, root / "runs" / "sft")
    settings = EvaluateConfig(operators=False, batches=1, batch_size=2, seq_len=64, prompts=2, new_tokens=8)
    r = evaluate_model(out_dir=root / "report", model_dir=tuned["model"], onnx=onnx, split=split, settings=settings)
    report = json.loads((root / "report" / "report.json").read_text())
    assert r.passed, report.get("verdict")
    assert "answer tokens scored" in report["data"]["source"]
    # the held-out batches are the validation conversations the run prepared, scored on their answers
    ev = load_eval_data(
        data=None,
        model_dir=tuned["model"],
        vocab_size=320,
        n_batches=1,
        batch_size=2,
        seq_len=64,
        n_prompts=0,
        prompt_len=4,
        split=split,
    )
    assert ev.answers is not None and 0 < int(ev.answers[0].sum()) < ev.answers[0].numel()
    shutil.rmtree(root / "report")


def test_compiled_fine_tuning_follows_the_eager_curve(tuned):
    """train.compile with packed conversations (positions into every compiled block): the same loss
    at every step as eager, and each step's record says how many answer tokens the loss averaged."""
    root = tuned["root"]
    flow = yaml.safe_load(tuned["flow"].read_text())
    flow.update(name="sft_compiled")
    flow["train"].update(compile=True, compile_backend="aot_eager")
    (root / "compiled.yaml").write_text(yaml.safe_dump(flow))
    train_in_process(root / "compiled.yaml")
    eager = [json.loads(line) for line in (root / "runs" / "sft" / "metrics.jsonl").read_text().splitlines()]
    compiled = [
        json.loads(line) for line in (root / "runs" / "sft_compiled" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["loss"] for r in compiled] == pytest.approx([r["loss"] for r in eager], rel=1e-5)
    assert all(r["target_tokens"] > 0 for r in eager) and [r["target_tokens"] for r in eager] == [
        r["target_tokens"] for r in compiled
    ]
