"""DCP checkpoints saved by 4 gloo ranks (FSDP2 over dp 2 on top of TP 2: several chunks per
tensor, ``_StridedShard`` placements) convert bit-exactly to the single-process state dict.

One torchrun launch (tests/dcp_save_driver.py) writes both fixtures: a model-only save and a full
torchtitan-style save (model + optimizer + lr_scheduler + dataloader + train_state) of which only
the model is taken.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from convert_writers import hash_tree, model_args, native_state, to_interleaved
from titan_pipe.config import ConvertConfig
from titan_pipe.convert.api import convert_checkpoint
from titan_pipe.convert.inspect import inspect_checkpoint
from titan_pipe.io.hashing import file_digest
from titan_pipe.model.names import native_to_hf

pytestmark = pytest.mark.distributed
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("dcp4") / "ckpt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=4",
        str(HERE / "dcp_save_driver.py"),
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_fsdp_tp_model_save_converts_bit_exactly(saved, tmp_path):
    placements = json.loads((saved / "placements.json").read_text())
    assert placements["layers.0.attention.wq.weight"] == ["_S(0, 2)", "S(0)"]  # FSDP2 over TP rows
    assert placements["layers.0.attention.wo.weight"] == ["S(0)", "S(1)"]
    src = saved / "model_only"
    assert len(list(src.glob("*.distcp"))) == 4
    r = inspect_checkpoint(src=src)
    wq = next(p for p in r.params if p["name"] == "layers.0.attention.wq.weight")
    assert wq["reads"] == 4 and "4 chunks" in wq["split"]
    before = hash_tree(src)
    convert_checkpoint(src, tmp_path / "u")
    assert hash_tree(src) == before
    got = load_file(tmp_path / "u/model.safetensors")
    want = native_state(model_args())  # the single-process model, rotate-half q/k rows
    assert set(got) == {native_to_hf(k) for k in want}
    for k, v in want.items():
        assert torch.equal(_bits(got[native_to_hf(k)]), _bits(v)), k


def test_torchtitan_full_save_takes_only_the_model(saved, tmp_path):
    args = model_args()
    src = saved / "full/step-1"
    convert_checkpoint(src, tmp_path / "u", ConvertConfig(naming="native"))
    got = load_file(tmp_path / "u/model.safetensors")
    ref = load_file(saved / "full_reference.safetensors")  # rank 0's full_tensor()s, interleaved q/k
    assert set(got) == set(ref)
    for k, v in ref.items():
        g = got[k]
        if k.endswith("attention.wq.weight"):
            g = to_interleaved(g, args.n_heads)
        elif k.endswith("attention.wk.weight"):
            g = to_interleaved(g, args.kv_heads)
        assert torch.equal(_bits(g), _bits(v)), k
    prov = json.loads((tmp_path / "u/provenance.json").read_text())
    assert prov["source"]["format"] == "dcp" and prov["source"]["algorithm"] == "xxh3_128"
    assert prov["source"]["digests"] == {f.name: file_digest(f, algorithm="xxh3_128") for f in src.glob("*.distcp")}


def _chunk_boxes(d: Path) -> set:
    import pickle

    with open(d / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own fixture files: trusted here
    return {
        (k, tuple(c.offsets), tuple(c.sizes))
        for k, v in md.state_dict_metadata.items()
        if hasattr(v, "chunks")
        for c in v.chunks
    }


def test_megatron_core_torch_dist_save_converts_bit_exactly(saved, tmp_path):
    """megatron-core's own dist_checkpointing.save (tp 2 x pp 2 x virtual pp 2) -> the original
    weights; and the CI fixture writer (convert_writers.write_megatron_dist) lays out the very
    same chunks, so the test that runs without megatron-core checks the real format."""
    from convert_writers import write_megatron_dist

    skipped = saved / "megatron_skipped.txt"
    if skipped.exists():
        pytest.skip(f"megatron-core not usable here: {skipped.read_text()}")
    src = saved / "megatron"
    r = inspect_checkpoint(src=src)
    assert r.format == "megatron" and r.layout["backend"] == "torch_dist" and r.step == 50
    assert (r.layout["tp"], r.layout["pp"], r.layout["vpp"]) == (2, 2, 2)
    before = hash_tree(src)
    convert_checkpoint(src, tmp_path / "u")
    assert hash_tree(src) == before
    got = load_file(tmp_path / "u/model.safetensors")
    want = native_state(model_args())
    for k, v in want.items():
        assert torch.equal(_bits(got[native_to_hf(k)]), _bits(v)), k
    ours = write_megatron_dist(want, model_args(), tmp_path / "ours", tp=2, pp=2, vpp=2)
    assert _chunk_boxes(ours / "iter_0000050") == _chunk_boxes(src / "iter_0000050")


def test_megatron_core_qwen2_style_save_converts_bit_exactly(saved, tmp_path):
    """megatron-core's own GPTModel with add_qkv_bias=True (tp 2 x pp 2 x virtual pp 2), saved by
    dist_checkpointing: linear_qkv.bias de-fused per query group into the q/k/v biases, bit for bit;
    the CI fixture writer lays out the very same chunks."""
    from convert_writers import write_megatron_dist

    skipped = saved / "megatron_skipped.txt"
    if skipped.exists():
        pytest.skip(f"megatron-core not usable here: {skipped.read_text()}")
    src, args = saved / "megatron_qwen2", model_args(qkv_bias=True)
    before = hash_tree(src)
    convert_checkpoint(src, tmp_path / "u")
    assert hash_tree(src) == before
    got = load_file(tmp_path / "u/model.safetensors")
    want = native_state(args)
    assert "model.layers.0.self_attn.q_proj.bias" in got and set(got) == {native_to_hf(k) for k in want}
    for k, v in want.items():
        assert torch.equal(_bits(got[native_to_hf(k)]), _bits(v)), k
    assert json.loads((tmp_path / "u/config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    ours = write_megatron_dist(want, args, tmp_path / "ours", tp=2, pp=2, vpp=2)
    assert _chunk_boxes(ours / "iter_0000050") == _chunk_boxes(src / "iter_0000050")


@pytest.mark.parametrize("name", ["megatron_moe", "megatron_moe_grouped", "megatron_moe_singleton"])
def test_megatron_core_moe_save_converts_bit_exactly(saved, tmp_path, name):
    """megatron-core's own mixture-of-experts GPTModel (a dense layer, then MoELayers of SequentialMLP
    experts, or of GroupedMLP ones holding weight1/weight2 as Megatron's legacy files do; tp 2 x ep 2;
    q/k norms, experts narrower than the dense MLP), saved by dist_checkpointing: router, experts (the
    expert index an axis of its own, fc1 [gate; up] split over tp, experts over ep) and the rest read
    back bit for bit; the Hugging Face output is a Qwen3MoeForCausalLM whose logits in transformers
    equal the original weights' in our model. (The grouped case checks the legacy GroupedMLP layout
    the legacy reader assumes against megatron-core's own view of it. The singleton case is the
    same model saved with ``singleton_local_shards``: each expert under a key of its own, SwiGLU fc1
    as gate ``_w`` and up ``_v`` tensors, the dense layer's too.)"""
    from dcp_save_driver import MOE_ARGS
    from titan_pipe.model.transformer import build_model
    from transformers import AutoModelForCausalLM

    skipped = saved / "megatron_skipped.txt"
    if skipped.exists():
        pytest.skip(f"megatron-core not usable here: {skipped.read_text()}")
    src, args = saved / name, model_args(**MOE_ARGS)
    r = inspect_checkpoint(src=src)
    assert (r.format, r.layout["backend"], r.layout["tp"]) == ("megatron", "torch_dist", 2)
    before = hash_tree(src)
    convert_checkpoint(src, tmp_path / "n", ConvertConfig(naming="native"))
    convert_checkpoint(src, tmp_path / "hf")
    assert hash_tree(src) == before
    got, want = load_file(tmp_path / "n/model.safetensors"), native_state(args)
    assert set(got) == set(want) and "layers.1.moe.experts.w1" in got and "layers.0.feed_forward.w1.weight" in got
    for k, v in want.items():
        assert torch.equal(_bits(got[k]), _bits(v)), k
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32)
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    ours = build_model(args, seed=None)
    ours.load_state_dict(want)
    tokens = torch.randint(0, args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), rtol=0, atol=1e-5)
