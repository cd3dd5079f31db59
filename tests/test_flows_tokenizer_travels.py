"""The tokenizer and the held-out split travel with the model: train -> checkpoint -> convert -> evaluate.

One in-process training run (dp1 tp1 pp1, a few steps) on a custom corpus with a real BPE
tokenizer.json given relative to flow.yaml; the checkpoint, the converted dir and evaluation must
all use that tokenizer, and a flow's evaluation must score the validation split training cut.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from flow_helpers import train_in_process
from titan_pipe.records.checkpoint_format import Manifest
from titan_pipe.config import EvaluateConfig
from titan_pipe.convert.api import convert_checkpoint
from titan_pipe.errors import UserError
from titan_pipe.evaluate.api import evaluate_model
from titan_pipe.evaluate.batches import ValidationSplit, load_eval_data, pick_tokenizer
from titan_pipe.flows.train_to_deploy import _call_stage
from titan_pipe.io.hashing import sha256_file
from titan_pipe.tokens.tokenizer import build_tokenizer

FAST = EvaluateConfig(operators=False, batches=1, batch_size=2, seq_len=32, prompts=1, new_tokens=4)


def _corpus(root: Path) -> Path:
    """Text unlike the shipped corpus (numbers spelled out), so a wrong default corpus shows."""
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    root.mkdir(parents=True)
    for k in range(2):
        lines = [" ".join(words[(i * 7 + j * 3 + k) % 10] for j in range(12)) for i in range(120)]
        (root / f"part{k}.txt").write_text("\n".join(lines) + "\n")
    return root


def _train_bpe(corpus: Path, out: Path) -> Path:
    """A real byte-level BPE tokenizer.json (+ tokenizer_config.json naming bos/eos) from `tokenizers`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train([str(p) for p in sorted(corpus.glob("*.txt"))], trainer)
    out.mkdir(parents=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return out / "tokenizer.json"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("travel")
    corpus = _corpus(root / "corpus")
    tok = _train_bpe(corpus, root / "tok")
    flow = root / "flow.yaml"
    flow.write_text(
        yaml.safe_dump(
            {
                "name": "t",
                "runs_dir": str(root / "runs"),
                "device": "cpu",
                "model": {"flavour": "debug"},
                "data": {"path": "corpus", "tokenizer": "tok/tokenizer.json", "val_fraction": 0.2},
                "train": {"steps": 2, "batch_size": 2, "seq_len": 16, "seed": 1},
                "checkpoint": {"every": 2, "keep_last": 1},
            }
        )
    )
    cfg, res = train_in_process(flow)
    model = convert_checkpoint(res.checkpoint, root / "model")
    return {"root": root, "flow": flow, "cfg": cfg, "tok": tok, "ckpt": res.checkpoint, "model": model}


def test_checkpoint_carries_the_tokenizer(trained):
    ckpt, tok = trained["ckpt"], trained["tok"]
    assert (ckpt / "tokenizer.json").read_bytes() == tok.read_bytes()
    assert (ckpt / "tokenizer_config.json").read_bytes() == (tok.parent / "tokenizer_config.json").read_bytes()
    m = Manifest.load(ckpt)
    assert m.extra.tokenizer == "tokenizer.json"  # relative to the step dir, not the flow's path
    assert vars(m.extra.attached["tokenizer.json"]) == {"size": tok.stat().st_size, "sha256": sha256_file(tok)}
    assert set(m.extra.attached) == {"tokenizer.json", "tokenizer_config.json"}
    assert all(f.endswith(".safetensors") for f in m.files)  # 'files' stays the weight-shard table
    assert pick_tokenizer(None, ckpt) == str(ckpt / "tokenizer.json")


def test_convert_copies_the_tokenizer_byte_identical(trained):
    r, tok = trained["model"], trained["tok"]
    assert (r.out_dir / "tokenizer.json").read_bytes() == tok.read_bytes()
    assert (r.out_dir / "tokenizer_config.json").read_bytes() == (tok.parent / "tokenizer_config.json").read_bytes()
    assert r.out_dir / "tokenizer.json" in r.files
    prov = json.loads((r.out_dir / "provenance.json").read_text())
    assert prov["tokenizer"] == {
        "tokenizer": "tokenizer.json",
        "files": {
            "tokenizer.json": sha256_file(tok),
            "tokenizer_config.json": sha256_file(tok.parent / "tokenizer_config.json"),
        },
    }
    assert "tokenizer.json" in prov["output"]["files"]
    # an HF dir as source: its tokenizer files come along too
    again = convert_checkpoint(r.out_dir, trained["root"] / "model2")
    assert (again.out_dir / "tokenizer.json").read_bytes() == tok.read_bytes()
    assert json.loads((again.out_dir / "provenance.json").read_text())["tokenizer"]["tokenizer"] == "tokenizer.json"


def test_convert_refuses_a_replaced_tokenizer(trained, tmp_path):
    bad = tmp_path / "step"
    shutil.copytree(trained["ckpt"], bad)
    data = bytearray((bad / "tokenizer.json").read_bytes())
    data[-2:-1] = b" " if data[-2:-1] != b" " else b"\n"  # same size, other bytes
    (bad / "tokenizer.json").write_bytes(bytes(data))
    with pytest.raises(UserError, match="tokenizer.json: sha256 .* records"):
        convert_checkpoint(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_flow_evaluates_on_its_own_validation_split_with_the_trained_tokenizer(trained):
    cfg, flow = trained["cfg"], trained["flow"]
    seen = {}

    def evaluate(**kw):  # the real evaluate_model, without the ONNX graph this test did not export
        seen.update(kw)
        return evaluate_model(
            out_dir=kw["out_dir"], model_dir=kw["model_dir"], data=kw["data"], split=kw["split"], settings=FAST
        )

    from titan_pipe.flows.tasks import ConvertPaths, ExportPaths, StageOutput, TrainPaths

    root = trained["root"]
    upstream = {
        "train": StageOutput(
            "train", TrainPaths(str(root / "runs" / "t"), str(root / "m.jsonl"), str(trained["ckpt"])), []
        ),
        "convert": StageOutput("convert", ConvertPaths(str(trained["model"].out_dir)), []),
        "export": StageOutput(
            "export", ExportPaths(str(root), str(root / "model.onnx"), str(root / "export.json")), []
        ),
    }
    r = _call_stage(
        "evaluate",
        evaluate,
        cfg=cfg.model_copy(update={"evaluate": FAST}),
        flow_path=flow,
        flow_dir=flow.parent,
        run_dir=trained["root"] / "runs" / "t",
        upstream=upstream,
        resume=False,
    )
    assert seen["data"] is None
    assert seen["split"] == ValidationSplit(corpus=flow.parent / "corpus", val_fraction=0.2, text_key="text")
    report = json.loads(r.report_json.read_text())
    assert report["data"]["tokenizer"] == str(trained["model"].out_dir / "tokenizer.json")
    assert str(flow.parent / "corpus") in report["data"]["source"]

    # the batches are the start of the very documents training held out (same tokenizer, same fraction):
    # 20% of two equal files held out as whole documents is the last file, encoded by the tokenizer itself
    tok = build_tokenizer(str(trained["tok"]))
    held_out = tok.encode((flow.parent / "corpus" / "part1.txt").read_text()) + [tok.eos_id]
    ev = load_eval_data(
        data=None,
        model_dir=trained["model"].out_dir,
        vocab_size=320,
        n_batches=1,
        batch_size=2,
        seq_len=32,
        n_prompts=0,
        prompt_len=4,
        split=seen["split"],
    )
    assert torch.cat(ev.batches).flatten().tolist() == held_out[:64]
    # read from the run's prepared copy (what training read), and the same when tokenized here
    prepared = trained["root"] / "runs" / "t" / "data"
    assert seen["split"].prepared == prepared and (prepared / "data.json").is_file()
    raw = load_eval_data(
        data=None,
        model_dir=trained["model"].out_dir,
        vocab_size=320,
        n_batches=1,
        batch_size=2,
        seq_len=32,
        n_prompts=0,
        prompt_len=4,
        split=ValidationSplit(corpus=flow.parent / "corpus", val_fraction=0.2),
    )
    assert torch.equal(torch.cat(raw.batches), torch.cat(ev.batches))

    # evaluate.data set: that file, used whole, and no split
    held = trained["root"] / "held.txt"
    held.write_text("nine eight seven six five four three two one zero\n" * 20)
    seen.clear()
    _call_stage(
        "evaluate",
        evaluate,
        cfg=cfg.model_copy(update={"evaluate": FAST.model_copy(update={"data": "held.txt"})}),
        flow_path=flow,
        flow_dir=flow.parent,
        run_dir=trained["root"] / "runs" / "t",
        upstream=upstream,
        resume=False,
    )
    assert seen["data"] == held and seen["split"] is None


def test_data_and_split_together_is_refused(trained, tmp_path):
    held = tmp_path / "held.txt"
    held.write_text("one two\n")
    with pytest.raises(UserError, match="both given"):
        evaluate_model(
            out_dir=tmp_path / "rep",
            model_dir=trained["model"].out_dir,
            data=held,
            split=ValidationSplit(),
            settings=FAST,
        )
    with pytest.raises(UserError, match="data.path .*nope: does not exist"):
        evaluate_model(
            out_dir=tmp_path / "rep2",
            model_dir=trained["model"].out_dir,
            split=ValidationSplit(corpus=tmp_path / "nope"),
            settings=FAST,
        )


def test_cli_config_without_data_uses_the_flows_split(trained, tmp_path):
    from typer.testing import CliRunner

    from titan_pipe.cli import app

    out = tmp_path / "rep"
    r = CliRunner().invoke(
        app,
        [
            "evaluate",
            "--model-dir",
            str(trained["model"].out_dir),
            "--config",
            str(trained["flow"]),
            "--no-operators",
            "--batches",
            "1",
            "-o",
            str(out),
        ],
    )
    # no candidate given, so the verdict is FAIL (exit 1), but the report says what text was used
    assert r.exit_code == 1 and "nothing was compared" in r.output, r.output
    data = json.loads((out / "report.json").read_text())["data"]
    assert str(trained["flow"].parent / "corpus") in data["source"] and "last 20%" in data["source"]
    held = tmp_path / "held.txt"
    held.write_text("nine eight seven six five four three two one zero\n" * 20)
    r = CliRunner().invoke(
        app,
        [
            "evaluate",
            "--model-dir",
            str(trained["model"].out_dir),
            "--config",
            str(trained["flow"]),
            "--data",
            str(held),
            "--no-operators",
            "--batches",
            "1",
            "-o",
            str(tmp_path / "rep2"),
        ],
    )
    assert r.exit_code == 1 and "nothing was compared" in r.output, r.output
    assert json.loads((tmp_path / "rep2" / "report.json").read_text())["data"]["source"] == str(held)
