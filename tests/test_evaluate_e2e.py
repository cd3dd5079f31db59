"""End to end: the debug model trained with (tp2, pp2), converted, exported, evaluated — every
comparison runs and passes; a corrupted unified model is caught at its layer by comparison 1."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("onnxruntime")

from titan_pipe.config import ExportConfig
from titan_pipe.config import EvaluateConfig, load_flow  # noqa: E402
from titan_pipe.convert.api import convert_checkpoint  # noqa: E402
from titan_pipe.convert.onnx.export import export_model
from titan_pipe.evaluate.api import evaluate_model  # noqa: E402
from titan_pipe.training.launch import run_training  # noqa: E402

FLOW = """
name: e2e
runs_dir: {runs}
device: cpu
model: {{flavour: debug}}
train: {{steps: 2, batch_size: 4, seq_len: 32, warmup_steps: 1}}
parallel: {{dp: 1, tp: 2, pp: 2, pp_schedule: 1f1b, microbatches: 2}}
checkpoint: {{every: 2, keep_last: 1}}
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    flow = root / "flow.yaml"
    flow.write_text(FLOW.format(runs=root / "runs"))
    result = run_training(flow_path=flow, cfg=load_flow(flow))
    model_dir = root / "model"
    convert_checkpoint(result.checkpoint, model_dir)
    onnx = export_model(model_dir, root / "onnx", ExportConfig(kv_cache=True, expose_hidden=True, atc=False)).onnx
    return {"root": root, "checkpoint": result.checkpoint, "model_dir": model_dir, "onnx": onnx}


@pytest.mark.distributed
def test_tp2_pp2_every_comparison_runs_and_passes(trained):
    out = trained["root"] / "report"
    r = evaluate_model(
        out_dir=out,
        checkpoint=trained["checkpoint"].parent.parent,  # the run dir: its newest complete step is taken
        model_dir=trained["model_dir"],
        onnx=trained["onnx"],
        settings=EvaluateConfig(batches=1, prompts=2, new_tokens=6),
    )
    assert r.passed, r.summary.verdict
    st = r.summary.comparisons
    for cid in ("sharded_vs_unified", "torch_vs_onnx", "onnx_kv_decode", "operators", "task"):
        assert st[cid] == "pass", (cid, st[cid])
    assert st["om"] == "skipped: no Ascend runtime" and st["npu_fused"] == "skipped: no NPU"
    rep = json.loads(r.report_json.read_text())
    sharded = next(c for c in rep["comparisons"] if c["id"] == "sharded_vs_unified")
    assert sharded["reference"] == f"torchrun tp2 pp2 ({trained['checkpoint'].name})"
    assert [row["tensor"] for row in sharded["rows"]] == ["hidden.0", "hidden.1", "hidden.2", "hidden.3", "logits"]
    assert sharded["rows"][-1]["metrics"]["max_abs"] <= 1e-5  # TP reduction order only
    ppl = r.summary.perplexity
    assert len(ppl) == 3 and max(ppl.values()) / min(ppl.values()) - 1 < 1e-5
    gen = next(c for c in rep["comparisons"] if c["id"] == "task")["details"]["generation"]
    assert len(gen) == 2 and all(g["identical"] for g in gen.values())  # prefill re-run and KV-cache decode
    for name in (
        "report.json",
        "report.md",
        "report.html",
        "tensors.csv",
        "operators.csv",
        "layer_error.png",
        "logits_error.png",
    ):
        assert (out / name).is_file(), name


@pytest.mark.slow
@pytest.mark.distributed
def test_swapped_rows_in_unified_model_fail_at_that_layer(trained, tmp_path):
    bad = tmp_path / "bad_model"
    bad.mkdir()
    for f in Path(trained["model_dir"]).iterdir():
        if f.suffix != ".safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(Path(trained["model_dir"]) / "model.safetensors"))
    key = "model.layers.3.mlp.up_proj.weight"
    w = weights[key].clone()
    w[[0, 1]] = w[[1, 0]]
    weights[key] = w
    save_file(weights, str(bad / "model.safetensors"))
    r = evaluate_model(
        out_dir=tmp_path / "rep",
        checkpoint=trained["checkpoint"],
        model_dir=bad,
        settings=EvaluateConfig(batches=1, prompts=0, operators=False),
    )
    assert not r.passed
    assert r.summary.first_failing_layer == {
        **r.summary.first_failing_layer,
        "layer": 3,
        "comparison": "sharded_vs_unified",
    }
    assert torch.equal(load_file(str(Path(trained["model_dir"]) / "model.safetensors"))[key][0], w[1])


@pytest.mark.distributed
def test_checkpoint_and_model_dir_of_different_models_are_refused(trained, tmp_path):
    from safetensors.torch import save_file as save

    from titan_pipe.model.names import native_to_hf
    from titan_pipe.model.hf_config import to_hf_config
    from titan_pipe.errors import UserError
    from titan_pipe.model.transformer import build_model
    from titan_pipe.model.args import resolve_args

    args = resolve_args("debug", n_layers=2)
    other = tmp_path / "other"
    other.mkdir()
    save(
        {native_to_hf(k): v for k, v in build_model(args, seed=0).state_dict().items()},
        str(other / "model.safetensors"),
    )
    (other / "config.json").write_text(json.dumps(to_hf_config(args)))
    with pytest.raises(UserError, match="the models disagree .*n_layers 4 vs 2"):
        evaluate_model(
            out_dir=tmp_path / "rep",
            checkpoint=trained["checkpoint"],
            model_dir=other,
            settings=EvaluateConfig(batches=1, operators=False),
        )


@pytest.mark.distributed
def test_single_process_model_from_checkpoint_equals_converted_model(trained):
    from titan_pipe.evaluate.runners.pytorch import LayeredModel

    tokens = torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(0))
    a = LayeredModel.from_path(trained["checkpoint"]).run(tokens)
    b = LayeredModel.from_path(trained["model_dir"]).run(tokens)
    assert torch.equal(a.logits, b.logits)
    assert all(torch.equal(x, y) for x, y in zip(a.hidden, b.hidden)) and len(a.hidden) == 4


@pytest.mark.distributed
def test_layer_streamed_sharded_forward_equals_resident(trained):
    """The tp2 pp2 checkpoint under torchrun with every rank holding one decoder layer at a time (read
    from its own shard files through the manifest): the same logits and hidden states, bit for bit."""
    from titan_pipe.evaluate.runners.sharded import DistributedRunner

    batches = [torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    resident, streamed = DistributedRunner(trained["checkpoint"]), DistributedRunner(trained["checkpoint"])
    streamed.streamed = True
    a, b = resident.run_all(batches), streamed.run_all(batches)
    assert resident.ran["streamed"] is False and streamed.ran["streamed"] is True
    assert len(streamed.ran["peak_rss"]) == 4 and min(streamed.ran["peak_rss"]) > 0
    for x, y in zip(a, b):
        assert torch.equal(x.logits, y.logits)
        assert len(x.hidden) == len(y.hidden) == 4
        assert all(torch.equal(h, g) for h, g in zip(x.hidden, y.hidden))


@pytest.mark.distributed
def test_streamed_evaluation_streams_the_sharded_forward_too(trained, tmp_path):
    # 1.6MB: the 4 ranks holding every layer (~1.5 MB + a batch's values) do not fit, one layer each (~1.4 MB) does
    r = evaluate_model(
        out_dir=tmp_path / "rep",
        checkpoint=trained["checkpoint"],
        model_dir=trained["model_dir"],
        settings=EvaluateConfig(batches=1, operators=False, max_memory="1.6MB"),
    )
    assert r.summary.memory_mode == "streamed"
    assert r.summary.comparisons["sharded_vs_unified"] == "pass", r.summary.verdict
    rep = json.loads(r.report_json.read_text())
    assert rep["memory"]["largest"] == "sharded forward (4 ranks, one layer each)"  # the ranks are counted
    sharded = rep["memory"]["sharded"]
    assert sharded["mode"] == "streamed" and sharded["ranks"] == 4 and len(sharded["peak_rss_per_rank"]) == 4
    row = next(c for c in rep["comparisons"] if c["id"] == "sharded_vs_unified")
    assert row["reference"].startswith("torchrun tp2 pp2") and "one layer at a time" in row["reference"]
    assert "sharded forward: streamed, 4 ranks" in r.summary.memory_line
    assert "sharded forward: streamed, 4 ranks, peak RSS" in (tmp_path / "rep" / "report.md").read_text()


def test_sharded_memory_estimate_counts_each_rank_from_the_sharding_table():
    from titan_pipe.records.checkpoint_format import ParallelLayout
    from titan_pipe.evaluate.runners.sharded import pp_rank_bytes
    from titan_pipe.model.args import resolve_args
    from titan_pipe.model.params import native_shapes
    from titan_pipe.model.sharding import tp_split_dim

    args = resolve_args("debug", n_layers=6)
    sizes = {n: 4 * torch.Size(s).numel() for n, s in native_shapes(args).items()}
    layer = sum(v for n, v in sizes.items() if n.startswith("layers.0."))
    assert pp_rank_bytes(args, ParallelLayout()) == [(sum(sizes.values()), sum(sizes.values()) - 5 * layer)]
    per = pp_rank_bytes(args, ParallelLayout(tp=2, pp=3))  # 2 layers per pp rank, the ends at each side
    local = sum(v // (2 if tp_split_dim(n) is not None else 1) for n, v in sizes.items() if n.startswith("layers.0."))
    assert [r - s for r, s in per] == [local] * 3  # streamed: one of its two layers, its TP half
    ends = [sizes["tok_embeddings.weight"] // 2, 0, sizes["norm.weight"] + sizes["output.weight"] // 2]
    assert [st for _, st in per] == [local + e for e in ends]  # the middle rank holds no end


@pytest.mark.distributed
def test_a_failing_rank_is_told_by_its_own_lines(trained, monkeypatch):
    """When the ranks fail, the error carries what the failing rank wrote (its stderr, kept by torchrun
    in the exchange dir), not only torchrun's summary of signals and exit codes. The ranks here run a
    module that refuses the sharded forward's arguments."""
    from titan_pipe.records import sharded_outputs
    from titan_pipe.errors import StageFailed
    from titan_pipe.evaluate.runners.sharded import DistributedRunner

    monkeypatch.setattr(sharded_outputs, "MODULE", "json.tool")
    runner = DistributedRunner(trained["checkpoint"], timeout_s=300)
    with pytest.raises(StageFailed) as e:
        runner.run_all([torch.zeros(1, 4, dtype=torch.long)])
    text = str(e.value)
    # the rank torchrun names as the root cause: whichever failed first (rank 2 under load, not always 0)
    head = re.search(r"\nrank (\d+):\n", text)
    assert "failed (exit" in text and head is not None, text
    block = []
    for line in text[head.end() :].splitlines():
        if not line.startswith("  "):
            break
        block.append(line)
    assert any("json.tool: error:" in line for line in block), text  # the rank's own words
    assert "Root Cause" in text  # and torchrun's summary after them
