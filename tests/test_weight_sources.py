"""One weight-source layer (titan_pipe.weights): init_from, the trainer and evaluate open a torchtitan
DCP step and a Megatron-LM checkpoint through the same readers convert uses — every tensor equal to
the weights written, a rank's box read alone, training starting from them under tp and pp, evaluate
taking the DCP as its reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from convert_writers import model_args, native_state, write_dcp, write_megatron
from titan_pipe.records.checkpoint_format import Box
from titan_pipe.config import EvaluateConfig, ExportConfig
from titan_pipe.convert.api import convert_checkpoint
from titan_pipe.errors import UserError
from titan_pipe.model.args import model_differences
from titan_pipe.model.stated import checkpoint_args
from titan_pipe.model.transformer import build_model
from titan_pipe.model.weights import PlannedWeights, open_weights

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    args = model_args()
    sd = native_state(args, seed=4)
    return {
        "root": root,
        "args": args,
        "sd": sd,
        "dcp": write_dcp(sd, args, root / "dcp"),
        "megatron": write_megatron(sd, args, root / "megatron", tp=2, pp=2),
    }


@pytest.mark.parametrize("fmt", ["dcp", "megatron"])
def test_every_tensor_reads_as_written(sources, fmt):
    w = open_weights(sources[fmt])
    assert isinstance(w, PlannedWeights)
    assert model_differences(checkpoint_args(sources[fmt]), sources["args"]) == []
    for name, want in sources["sd"].items():
        assert torch.equal(w.full(name), want), name  # torchtitan's interleaved q/k rows reordered, Megatron de-fused
    # a tp rank's box: the rows of its heads only, through the same reads
    q = "layers.1.attention.wq.weight"
    assert torch.equal(w.box(q, Box((32, 0), (32, 64))), sources["sd"][q][32:64])
    w.close()


def test_a_directory_of_nothing_is_one_line(tmp_path):
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(UserError, match="torch DCP / torchtitan step"):
        open_weights(tmp_path)


@pytest.mark.distributed
def test_training_starts_from_a_dcp_and_a_megatron_checkpoint(sources):
    """init_from each, under tp2 and pp2: the first step's loss is that of the written weights in one
    process (the model read through the same readers as convert's)."""
    root = sources["root"]
    base = {
        "device": "cpu",
        "train": {"steps": 1, "batch_size": 8, "seq_len": 32, "warmup_steps": 1, "seed": 0},
        "checkpoint": {"every": 1, "keep_last": 1},
    }
    runs = [
        {"name": f"{fmt}_{lay}", "flow": dict(base, init_from=str(sources[fmt]), parallel=par)}
        for fmt in ("dcp", "megatron")
        for lay, par in (("tp2", {"tp": 2}), ("pp2", {"pp": 2, "microbatches": 2}))
    ]
    (root / "spec.json").write_text(json.dumps({"workdir": str(root), "runs": runs}))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(HERE / "train_driver.py"),
            str(root / "spec.json"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    res = json.loads((root / "results.json").read_text())
    from titan_pipe.config import parse_flow
    from training_reference import training_loader

    cfg = parse_flow(dict(base, init_from=str(sources["dcp"]), parallel={}), base=root)
    x, y = training_loader(cfg, base=root, prepared=root / "ref-data").next_batch()
    model = build_model(sources["args"], seed=None)
    model.load_state_dict(sources["sd"])
    with torch.no_grad():
        want = float(torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()))
    for r in runs:
        got = res[r["name"]]["metrics"][0]["loss"]
        assert abs(got - want) <= 1e-5 * want, (r["name"], got, want)


@pytest.mark.distributed
@pytest.mark.parametrize("fmt", ["dcp", "megatron"])
def test_evaluate_takes_a_dcp_or_megatron_checkpoint_as_its_reference(sources, tmp_path, fmt):
    """evaluate --checkpoint DCP|Megatron --model-dir (convert's output) --onnx: the checkpoint, read in
    one process, is the reference the deployment is compared with; the sharded row says why it does
    not run."""
    pytest.importorskip("onnxruntime")
    from titan_pipe.convert.onnx.export import export_model
    from titan_pipe.evaluate.api import evaluate_model

    convert_checkpoint(sources[fmt], tmp_path / "model")
    onnx = export_model(tmp_path / "model", tmp_path / "onnx", ExportConfig(atc=False)).onnx
    r = evaluate_model(
        out_dir=tmp_path / "report",
        checkpoint=sources[fmt],
        model_dir=tmp_path / "model",
        onnx=onnx,
        settings=EvaluateConfig(batches=1, prompts=2, new_tokens=4),
    )
    assert r.passed, r.summary.verdict
    st = r.summary.comparisons
    assert st["torch_vs_onnx"] == "pass" and st["sharded_vs_unified"].startswith("skipped: the --checkpoint is not")
    rep = json.loads(r.report_json.read_text())
    onnx_row = next(c for c in rep["comparisons"] if c["id"] == "torch_vs_onnx")
    assert fmt in onnx_row["reference"]
