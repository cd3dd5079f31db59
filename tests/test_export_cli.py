"""`titan-pipe export`: a static export end to end, and bad input -> one clear line, exit 1, nothing left."""

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from export_support import debug_model, write_unified
from titan_pipe.cli import app

ort = pytest.importorskip("onnxruntime")
runner = CliRunner()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model, args = debug_model()
    return write_unified(model, args, tmp_path_factory.mktemp("src") / "model"), model, args


def _run(*argv):
    return runner.invoke(app, ["export", *map(str, argv)])


def _leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_static_export_via_cli(model_dir, tmp_path):
    src, model, args = model_dir
    before = sorted(p.name for p in src.iterdir())
    res = _run(
        src,
        "-o",
        tmp_path / "out",
        "--static",
        "--batch",
        2,
        "--seq-len",
        12,
        "--cache-len",
        20,
        "--opset",
        15,
        "--precision-mode",
        "mixed_float16",
        "--data-files",
        1,
    )
    assert res.exit_code == 0, res.output
    assert "ATC: not_found" in res.output or "ATC: ok" in res.output
    out = tmp_path / "out"
    record = json.loads((out / "export.json").read_text())
    assert record["options"]["opset"] == 15 and record["options"]["dynamic"] is False
    assert record["options"]["cache_len"] == 20
    assert record["options"]["data_files"] == ["model.onnx.data"]  # --data-files 1: the weights in one file
    assert sorted(p.name for p in out.glob("*.data*")) == ["model.onnx.data"]
    data_mb = (out / "model.onnx.data").stat().st_size / 1e6
    assert f"weights {data_mb:.1f} MB in 1 external-data file(s)" in " ".join(res.output.split())
    assert record["graphs"]["model.onnx"]["inputs"]["input_ids"] == [2, 12]
    assert record["graphs"]["decode.onnx"]["inputs"]["past_key_values.0.key"] == [2, args.kv_heads, 20, args.head_dim]
    assert record["graphs"]["decode.onnx"]["outputs"]["present.0.key"] == [2, args.kv_heads, 20, args.head_dim]
    script = (out / "atc" / "command.sh").read_text()
    assert "--input_shape='input_ids:2,12;attention_mask:2,12;position_ids:2,12'" in script
    assert "--precision_mode_v2=mixed_float16" in script and "--dynamic_dims" not in script
    tokens = torch.randint(0, args.vocab_size, (2, 12))
    feeds = {
        "input_ids": tokens.numpy(),
        "attention_mask": np.ones((2, 12), np.int64),
        "position_ids": np.tile(np.arange(12), (2, 1)),
    }
    prefill = ort.InferenceSession(str(out / "model.onnx"))
    got, *present = prefill.run(None, feeds)
    with torch.no_grad():
        assert np.abs(got - model(tokens).numpy()).max() <= 1e-4
    # One decode step at slot 12 of the 20-slot cache.
    full = torch.cat([tokens, torch.randint(0, args.vocab_size, (2, 1))], dim=1)
    dec = ort.InferenceSession(str(out / "decode.onnx"))
    cache = [np.zeros((2, args.kv_heads, 20, args.head_dim), np.float32) for _ in present]
    for c, p in zip(cache, present):
        c[:, :, :12] = p
    mask = np.zeros((2, 20), np.int64)
    mask[:, :13] = 1
    names = [i.name for i in dec.get_inputs()][4:]
    step = dec.run(
        ["logits"],
        {
            "input_ids": full[:, 12:].numpy(),
            "position_ids": np.full((2, 1), 12),
            "attention_mask": mask,
            "write_index": np.full((2,), 12),
            **dict(zip(names, cache)),
        },
    )[0]
    with torch.no_grad():
        assert np.abs(step[:, 0] - model(full)[:, -1].numpy()).max() <= 1e-4
    assert sorted(p.name for p in src.iterdir()) == before  # the source is never touched
    assert _leftovers(tmp_path) == []

    res = _run(src, "-o", out)  # exists: refuse
    assert res.exit_code == 1 and "already exists; pass --overwrite" in res.output
    res = _run(src, "-o", out, "--overwrite", "--no-kv-cache", "--no-atc")
    assert res.exit_code == 0, res.output
    assert (
        not (out / "decode.onnx").exists()
        and json.loads((out / "export.json").read_text())["atc"]["status"] == "skipped"
    )


@pytest.mark.parametrize(
    "case,message",
    [
        ("no_config", "config.json: missing"),
        ("mismatch", "has shape"),
        ("opset16", "ATC takes ONNX opsets 11..15 only"),
        ("opset12", "the graphs need opset >= 14"),
        ("too_long", "exceeds the model's max_position_embeddings"),
        ("cache_small", "cache_len 32 is smaller than seq_len 32 + 1"),
        ("cache_large", "cache_len 300 exceeds the model's max_position_embeddings 256"),
        ("no_data_files", "--data-files 0: "),
        ("many_data_files", "--data-files 65: "),
    ],
)
def test_bad_input_fails_cleanly(model_dir, tmp_path, case, message):
    src, model, args = model_dir
    argv = []
    if case in ("no_config", "mismatch"):
        src = write_unified(model, args, tmp_path / "bad")
        if case == "no_config":
            (src / "config.json").unlink()
        else:
            cfg = json.loads((src / "config.json").read_text())
            cfg["hidden_size"], cfg["head_dim"] = 128, 32
            (src / "config.json").write_text(json.dumps(cfg))
    argv = {
        "opset16": ["--opset", 16],
        "opset12": ["--opset", 12],
        "too_long": ["--seq-len", 256],
        "cache_small": ["--cache-len", 32],
        "cache_large": ["--cache-len", 300],
        "no_data_files": ["--data-files", 0],
        "many_data_files": ["--data-files", 65],
    }.get(case, [])
    out = tmp_path / "out"
    res = _run(src, "-o", out, *argv)
    assert res.exit_code == 1
    assert message in res.output and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) <= 3  # one message (soft-wrapped at most)
    assert not out.exists() and _leftovers(tmp_path) == []


def test_out_dir_may_not_be_the_source(model_dir):
    src, _, _ = model_dir
    res = _run(src, "-o", src, "--overwrite")
    assert res.exit_code == 1 and "would contain or replace the source" in res.output
    assert (src / "model.safetensors").is_file()


def test_incompatible_operator_fails_the_export_and_leaves_nothing(model_dir, tmp_path, monkeypatch):
    from titan_pipe.convert.onnx import atc_ops

    ops = json.loads(atc_ops.OPS_FILE.read_text())
    del ops["operators"]["Range"]  # as if ATC did not list the op the causal mask is built from
    monkeypatch.setattr(atc_ops, "load_atc_ops", lambda: ops)
    monkeypatch.setattr("titan_pipe.convert.onnx.export.load_atc_ops", lambda: ops)
    src, _, _ = model_dir
    res = _run(src, "-o", tmp_path / "out", "--no-kv-cache")
    assert res.exit_code == 1
    assert "model.onnx: not ATC-compatible: node" in res.output and "(Range, 1x)" in res.output
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []
