"""Convert round trips: split -> merge bit-exact, resharding, every source format to the same bytes,
and transformers loading the result with our model's logits."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from convert_writers import (
    hash_tree,
    model_args,
    native_state,
    write_dcp,
    write_hf,
    write_megatron,
    write_megatron_dist,
)
from titan_pipe.config import ConvertConfig
from titan_pipe.records.checkpoint_format import Manifest
from titan_pipe.convert.api import convert_checkpoint
from titan_pipe.convert.inspect import inspect_checkpoint
from titan_pipe.weights.read import deinterleave_rope
from titan_pipe.tokens.model_files import TOKEN_ID_KEYS
from titan_pipe.model.names import native_to_hf
from titan_pipe.records.provenance import Provenance
from titan_pipe.model.transformer import build_model

transformers = pytest.importorskip("transformers")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _assert_same_weights(out_dir, sd, *, naming="hf"):
    got = load_file(out_dir / "model.safetensors")
    want = {native_to_hf(k) if naming == "hf" else k: v for k, v in sd.items()}
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(_bits(got[k]), _bits(v)), k


@pytest.fixture(scope="module")
def weights():
    args = model_args()
    return args, native_state(args)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, weights):
    args, sd = weights
    return write_hf(sd, args, tmp_path_factory.mktemp("hf") / "model")


@pytest.fixture(scope="module")
def tp4pp2(tmp_path_factory, hf_dir):
    out = tmp_path_factory.mktemp("t42") / "ckpt"
    convert_checkpoint(hf_dir, out, ConvertConfig(tp=4, pp=2))
    return out


def test_split_merge_bit_exact_every_kind(tp4pp2, weights, tmp_path):
    """HF -> tp4/pp2 shards (column, row, vocab splits; replicated norms) -> unified == original."""
    args, sd = weights
    m = Manifest.load(tp4pp2)
    assert m.parallel.tp == 4 and m.parallel.pp == 2
    assert m.params["layers.0.attention.wo.weight"].tp_dim == 1
    assert m.params["layers.0.attention.wq.weight"].tp_dim == 0
    assert m.params["tok_embeddings.weight"].stage == 0 and m.params["output.weight"].stage == 1
    # a shard holds exactly its local box of the global tensor
    with safe_open(tp4pp2 / "model/pp0-tp1.safetensors", "pt") as f:
        assert torch.equal(f.get_tensor("layers.0.attention.wo.weight"), sd["layers.0.attention.wo.weight"][:, 16:32])
        assert torch.equal(f.get_tensor("tok_embeddings.weight"), sd["tok_embeddings.weight"][80:160])
        assert "output.weight" not in f.keys()
    out = tmp_path / "u"
    res = convert_checkpoint(tp4pp2, out)
    _assert_same_weights(out, sd)
    prov = json.loads((out / "provenance.json").read_text())
    # checked against the manifest's sha256s, so those are what it records, whatever convert.digest says
    assert prov["source"]["format"] == "titan" and prov["source"]["algorithm"] == "sha256"
    assert prov["source"]["digests"] == {f: e.sha256 for f, e in m.files.items()} and len(m.files) == 8
    assert res.summary.tensors == len(sd)


def test_sharded_output_reads_back_through_the_trainer(tp4pp2, weights):
    """The trainer's manifest reader (init_from / resume weights) assembles our --tp/--pp output."""
    from titan_pipe.model.weights import CheckpointWeights, check_compatible

    args, sd = weights
    w = CheckpointWeights(tp4pp2)
    check_compatible(w.args, args, tp4pp2)  # same dims (multiple_of is folded into ffn_hidden_dim)
    assert set(w.names()) == set(sd)
    for name, t in sd.items():
        assert torch.equal(_bits(w.full(name)), _bits(t)), name


def test_reshard_then_unify_equals_direct(tp4pp2, tmp_path):
    convert_checkpoint(tp4pp2, tmp_path / "direct")
    convert_checkpoint(tp4pp2, tmp_path / "t2", ConvertConfig(tp=2, pp=1))
    assert sorted(p.name for p in (tmp_path / "t2/model").iterdir()) == ["pp0-tp0.safetensors", "pp0-tp1.safetensors"]
    convert_checkpoint(tmp_path / "t2", tmp_path / "via")
    assert (tmp_path / "direct/model.safetensors").read_bytes() == (tmp_path / "via/model.safetensors").read_bytes()
    assert (tmp_path / "direct/config.json").read_bytes() == (tmp_path / "via/config.json").read_bytes()


def test_source_digests_are_the_chosen_algorithms(hf_dir, tmp_path):
    """A Hugging Face dir's files are recorded with convert.digest: xxh3_128 by default, sha256 (what
    sha256sum prints) on request; a bit flip changes the record; the output is the same either way."""
    import hashlib
    import shutil

    import xxhash

    refs = {"xxh3_128": lambda b: xxhash.xxh3_128(b).hexdigest(), "sha256": lambda b: hashlib.sha256(b).hexdigest()}
    files = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    for digest, ref in refs.items():
        out = tmp_path / digest
        convert_checkpoint(hf_dir, out, ConvertConfig(digest=digest) if digest == "sha256" else ConvertConfig())
        src = Provenance.load(out).source
        assert (src.algorithm, src.verified) == (digest, True)
        assert {f: src.digests[f] for f in files} == {f: ref((hf_dir / f).read_bytes()) for f in files}
    assert (tmp_path / "xxh3_128/model.safetensors").read_bytes() == (
        tmp_path / "sha256/model.safetensors"
    ).read_bytes()
    flipped = shutil.copytree(hf_dir, tmp_path / "flipped")
    with open(flipped / files[0], "r+b") as f:  # the last byte of the data: a value, not the header
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    convert_checkpoint(flipped, tmp_path / "f")
    assert (
        Provenance.load(tmp_path / "f").source.digests[files[0]]
        != Provenance.load(tmp_path / "xxh3_128").source.digests[files[0]]
    )


def test_tied_embeddings_round_trip(tmp_path):
    args = model_args(tie_embeddings=True)
    sd = native_state(args, seed=3)
    hf = write_hf(sd, args, tmp_path / "hf")
    convert_checkpoint(hf, tmp_path / "s", ConvertConfig(tp=2, pp=2))
    assert "output.weight" not in Manifest.load(tmp_path / "s").params
    convert_checkpoint(tmp_path / "s", tmp_path / "u")
    _assert_same_weights(tmp_path / "u", sd)
    cfg = json.loads((tmp_path / "u/config.json").read_text())
    assert cfg["tie_word_embeddings"] is True
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "u")
    assert torch.equal(model.lm_head.weight, sd["tok_embeddings.weight"])


def test_every_source_format_gives_identical_bytes(tmp_path, weights, hf_dir, tp4pp2):
    args, sd = weights
    sources = {
        "hf": hf_dir,
        "titan": tp4pp2,
        "dcp": write_dcp(sd, args, tmp_path / "dcp_full", full=True),
        "dcp_model_only": write_dcp(sd, args, tmp_path / "dcp_model", full=False),
        "dcp_safetensors_items": write_dcp(sd, args, tmp_path / "dcp_st", full=False, safetensors_items=True),
        "megatron": write_megatron(sd, args, tmp_path / "meg", tp=2, pp=2, fused_norms=True),
        "megatron_standalone_norms": write_megatron(sd, args, tmp_path / "meg2", tp=4, pp=1, fused_norms=False),
        "megatron_torch_dist": write_megatron_dist(sd, args, tmp_path / "megd", tp=2, pp=2, vpp=2),
        "megatron_torch_dist_tp4": write_megatron_dist(sd, args, tmp_path / "megd4", tp=4, pp=1, vpp=None),
    }
    outputs = {}
    for name, src in sources.items():
        before = hash_tree(src)
        res = convert_checkpoint(src, tmp_path / f"out_{name}")
        assert hash_tree(src) == before, f"{name}: source modified"
        config = json.loads((res.out_dir / "config.json").read_text())
        ids = {k: config.pop(k) for k in TOKEN_ID_KEYS if k in config}  # what the source's config.json names
        outputs[name] = ((res.out_dir / "model.safetensors").read_bytes(), config)
        # the ids travel where the format records them (a Hugging Face config.json, our manifest)
        assert ids == (
            {
                k: v
                for k, v in json.loads((sources["hf"] / "config.json").read_text()).items()
                if k in TOKEN_ID_KEYS and v is not None
            }
            if name in ("hf", "titan")
            else {}
        ), name
    ref = outputs.pop("hf")
    _assert_same_weights(tmp_path / "out_hf", sd)
    for name, got in outputs.items():
        assert got[0] == ref[0], f"{name}: model.safetensors differs from the Hugging Face source's"
        assert got[1] == ref[1], f"{name}: config.json differs"
    prov = json.loads((tmp_path / "out_megatron/provenance.json").read_text())
    assert prov["source"]["step"] == 50 and prov["source"]["layout"]["padded_vocab_size"] == 512


def test_transformers_logits_equal_ours(tp4pp2, weights, tmp_path):
    args, sd = weights
    convert_checkpoint(tp4pp2, tmp_path / "u")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "u", attn_implementation="eager").eval()
    ours = build_model(args, seed=None)
    ours.load_state_dict(sd)
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        diff = (hf(tokens).logits - ours.eval()(tokens)).abs().max().item()
    assert diff <= 1e-5


def test_dtype_cast_and_sharded_output(hf_dir, weights, tmp_path):
    args, sd = weights
    res = convert_checkpoint(
        hf_dir, tmp_path / "bf", ConvertConfig(dtype="bfloat16", max_shard_size="200KB", naming="hf")
    )
    index = json.loads((tmp_path / "bf/model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    got = {}
    for s in shards:
        got.update(load_file(tmp_path / "bf" / s))
    for k, v in sd.items():
        assert torch.equal(_bits(got[native_to_hf(k)]), _bits(v.to(torch.bfloat16))), k
    assert json.loads((tmp_path / "bf/config.json").read_text())["torch_dtype"] == "bfloat16"
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "bf")
    assert model.model.layers[1].mlp.down_proj.weight.dtype == torch.bfloat16
    assert len([f for f in res.files if f.suffix == ".safetensors"]) == len(shards)


def test_native_naming(tp4pp2, weights, tmp_path):
    convert_checkpoint(tp4pp2, tmp_path / "n", ConvertConfig(naming="native"))
    _assert_same_weights(tmp_path / "n", weights[1], naming="native")


def test_a_native_named_dir_converts_and_exports(tp4pp2, weights, tmp_path):
    """What ``convert --naming native`` writes is a unified dir every stage reads (it once was
    refused by convert: "no native name for Hugging Face parameter"): it converts back to HF names
    and to shards bit for bit, and export plans the same initializers from it as from the HF dir."""
    from titan_pipe.model.unified_dir import open_unified

    args, sd = weights
    native = tmp_path / "native"
    convert_checkpoint(tp4pp2, native, ConvertConfig(naming="native"))
    convert_checkpoint(native, tmp_path / "hf")
    _assert_same_weights(tmp_path / "hf", sd)
    convert_checkpoint(native, tmp_path / "shards", ConvertConfig(tp=2, pp=2))
    convert_checkpoint(tmp_path / "shards", tmp_path / "back", ConvertConfig(naming="native"))
    _assert_same_weights(tmp_path / "back", sd, naming="native")
    a, b = open_unified(native), open_unified(tmp_path / "hf")
    assert a.args == b.args and set(a.params) == set(b.params) == set(sd)
    assert {n: (p.stored.shape, p.stored.dtype) for n, p in a.params.items()} == {
        n: (p.stored.shape, p.stored.dtype) for n, p in b.params.items()
    }


def test_rope_deinterleave_matches_meta_convention(weights):
    """Interleaved RoPE on Meta rows == rotate-half RoPE on the de-interleaved rows."""
    args, _ = weights
    hd = args.head_dim
    x = torch.randn(3, hd, generator=torch.Generator().manual_seed(0))  # 3 positions, one head
    w = torch.randn(hd, hd, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(3, dtype=torch.float32)[:, None]
    freqs = pos / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
    q_meta = x @ w.T  # interleaved pairs (2i, 2i+1) rotate together
    qc = torch.view_as_complex(q_meta.view(3, hd // 2, 2)) * torch.polar(torch.ones_like(freqs), freqs)
    meta_rot = torch.view_as_real(qc).reshape(3, hd)
    q_hf = x @ deinterleave_rope(w, hd).T
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    rot_half = torch.cat([-q_hf[:, hd // 2 :], q_hf[:, : hd // 2]], -1)
    hf_rot = q_hf * cos + rot_half * sin
    # the same rotation, rows in the two orders
    assert torch.allclose(deinterleave_rope(meta_rot.T, hd).T, hf_rot, atol=1e-6)


def test_inspect_reads_no_data(tp4pp2, tmp_path, weights):
    args, sd = weights
    meg = write_megatron(sd, args, tmp_path / "meg", tp=2, pp=2)
    r = inspect_checkpoint(src=meg)
    assert r.format == "megatron" and r.layout["tp"] == 2 and r.step == 50
    wq = next(p for p in r.params if p["name"] == "layers.3.attention.wq.weight")
    assert wq["shape"] == [64, 64] and wq["split"] == "fused qkv" and wq["reads"] == 4
    r = inspect_checkpoint(src=write_megatron_dist(sd, args, tmp_path / "megd", tp=2, pp=2, vpp=2) / "iter_0000050")
    assert r.format == "megatron" and r.layout["backend"] == "torch_dist" and r.layout["vpp"] == 2
    wq = next(p for p in r.params if p["name"] == "layers.3.attention.wq.weight")
    assert wq["split"] == "fused qkv" and wq["reads"] == 4
    r = inspect_checkpoint(src=tp4pp2)
    assert r.total_bytes == sum(v.numel() * 4 for v in sd.values())


def test_row_split_scatter_in_small_blocks_and_short_reads(tp4pp2, weights, tmp_path, monkeypatch):
    """Row-split tensors assembled by scatter reads in many small blocks, a few iovecs per call and
    preadv returning short counts mid-run, still give the original bytes."""
    import os

    from titan_pipe.convert import reshard

    args, sd = weights
    real = os.preadv
    calls = {"n": 0}

    def short_preadv(fd, bufs, offset):  # at most 7 bytes per call: always stops inside a run
        calls["n"] += 1
        return real(fd, [memoryview(bufs[0])[:7]], offset)

    monkeypatch.setattr(reshard, "BLOCK_BYTES", 512)
    monkeypatch.setattr(reshard, "IOV_MAX", 3)
    monkeypatch.setattr(reshard.os, "preadv", short_preadv)
    out = tmp_path / "u"
    convert_checkpoint(tp4pp2, out, ConvertConfig(verify=False))
    monkeypatch.undo()
    assert calls["n"] > 0
    _assert_same_weights(out, sd)


def test_box_runs_match_numpy():
    """box_runs gives the byte offsets numpy's own indexing of the box reads, in row-major order."""
    import numpy as np

    from titan_pipe.records.checkpoint_format import Box
    from titan_pipe.convert.reshard import box_runs

    shape, box = (4, 6, 5), Box((1, 2, 1), (2, 3, 3))  # last dim partial: a run per (i, j)
    offs, run = box_runs(shape, box, 2)
    idx = np.arange(np.prod(shape)).reshape(shape)[1:3, 2:5, 1:4].reshape(-1, 3)
    assert run == 6 and offs.tolist() == (idx[:, 0] * 2).tolist()
    offs, run = box_runs(shape, Box((1, 2, 0), (2, 3, 5)), 2)  # whole last dim: runs merge over dim 1
    assert run == 30 and offs.tolist() == [(30 + 10) * 2, (60 + 10) * 2]
    offs, run = box_runs((8, 6), Box((0, 3), (8, 3)), 4)
    assert run == 12 and offs.tolist() == [(r * 6 + 3) * 4 for r in range(8)]
    offs, run = box_runs((8, 6), Box((2, 0), (3, 6)), 1)  # whole rows: one run
    assert run == 18 and offs.tolist() == [12]


def test_rope_row_runs_match_deinterleave():
    """The scatter offsets of the RoPE reorder put every row where deinterleave_rope puts it."""
    import numpy as np

    from titan_pipe.records.checkpoint_format import Box
    from titan_pipe.convert.reshard import rope_row_runs

    hd, shape = 8, (40, 3)
    box = Box((8, 0), (24, 3))  # three heads, starting at row 8 of the block
    offs, run = rope_row_runs(shape, box, 2, hd)
    assert run == 6
    src = torch.arange(24 * 3, dtype=torch.int16).view(24, 3)
    buf = np.zeros(40 * 3, dtype=np.int16)
    for j, o in enumerate(offs.tolist()):  # what preadv does: source rows in order, to offs[j]
        buf[o // 2 : o // 2 + 3] = src[j].numpy()
    assert torch.equal(torch.from_numpy(buf).view(40, 3)[8:32], deinterleave_rope(src, hd))
    assert rope_row_runs(shape, Box((0, 0), (8, 2)), 2, hd)[1] == 0  # not whole rows: torch path
