"""A checkpoint trained with (dp2, tp2, pp2), converted, loads into transformers with our logits.

One short torchrun launch (8 gloo ranks, 2 steps). The reference is our own model filled from the
shards by the trainer's manifest reader (titan_pipe.model.weights), not by the converter.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import yaml

from titan_pipe.config import ConvertConfig
from titan_pipe.convert.api import convert_checkpoint
from titan_pipe.model.transformer import build_model
from titan_pipe.model.weights import CheckpointWeights

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

FLOW = {
    "name": "conv3d",
    "device": "cpu",
    "model": {"flavour": "debug"},
    "parallel": {"dp": 2, "tp": 2, "pp": 2, "pp_schedule": "1f1b", "microbatches": 2},
    "train": {
        "steps": 2,
        "batch_size": 4,
        "seq_len": 16,
        "warmup_steps": 1,
        "seed": 0,
        "optimizer": {"name": "adamw", "lr": 0.002},
    },
    "checkpoint": {"every": 2, "keep_last": 1},
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    work = tmp_path_factory.mktemp("conv3d")
    flow = dict(FLOW, runs_dir=str(work / "runs"))
    (work / "flow.yaml").write_text(yaml.safe_dump(flow))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=8",
        "-m",
        "titan_pipe.training.rank",
        "--flow",
        str(work / "flow.yaml"),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return work / "runs" / "conv3d"


def test_trained_3d_checkpoint_converts_to_transformers(trained, tmp_path):
    step = trained / "checkpoints" / "step-000002"
    assert (step / "manifest.json").is_file()
    # the run dir itself is accepted: its newest complete checkpoint is converted
    res = convert_checkpoint(trained, tmp_path / "hf")
    assert res.summary.step == 2 and res.summary.layout["dp"] == 2
    weights = CheckpointWeights(step)
    ours = build_model(weights.args, seed=None)
    ours.load_state_dict({n: weights.full(n) for n in weights.names()}, strict=False)
    ours.eval()
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    tokens = torch.randint(0, weights.args.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(tokens).logits - ours(tokens)).abs().max().item()
    assert diff <= 1e-5
    # trained on the byte tokenizer: its Hugging Face form sits beside the weights, so AutoTokenizer
    # loads the model dir and encodes as training did
    from titan_pipe.tokens.tokenizer import ByteTokenizer

    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "Four score — naïve café, 東京 🚀\n\ttabs and  spaces\x00\x7f"
    assert tok(text, add_special_tokens=False)["input_ids"] == ByteTokenizer().encode(text)
    assert tok.decode(ByteTokenizer().encode(text)) == text
    assert (tok.bos_token_id, tok.eos_token_id) == (ByteTokenizer.bos_id, ByteTokenizer.eos_id)
    # and resharded to (tp1, pp2), then unified: the same bytes
    convert_checkpoint(step, tmp_path / "pp2", ConvertConfig(tp=1, pp=2))
    convert_checkpoint(tmp_path / "pp2", tmp_path / "hf2")
    assert (tmp_path / "hf/model.safetensors").read_bytes() == (tmp_path / "hf2/model.safetensors").read_bytes()
