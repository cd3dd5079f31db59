"""Hostile inputs across convert / inspect / export / evaluate / run: every one is refused with ONE
line naming the file, the value and the fix (exit 1; config: exit 2), nothing is written, and the
tree around it (the source included) is byte-for-byte what it was. Plus the run-dir lock.

Fixtures are built once per module (a tiny Hugging Face model, our tp2/pp2 checkpoint and unified
model dir of it); each test copies what it corrupts into its own tmp dir and hashes that whole dir
before and after.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from convert_writers import model_args, native_state, write_dcp, write_hf, write_megatron
from titan_pipe.config import ConvertConfig, ExportConfig
from titan_pipe.cli import app
from titan_pipe.convert.api import convert_checkpoint
from titan_pipe.errors import UserError
from titan_pipe.graphs.graph_io import data_file_names
from titan_pipe.processes.run_lock import ENV, LOCK_NAME, RunDirBusy, run_lock

pytest.importorskip("transformers")
runner = CliRunner()


# --- helpers ------------------------------------------------------------------------------------


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under ``root`` without following links: files by sha256, links by target,
    directories and FIFOs by kind (reading a FIFO would block, so it is never opened)."""
    out = {}
    for d, dirs, files in os.walk(root, followlinks=False):
        for name in dirs + files:
            p = Path(d) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "link:" + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            elif p.is_fifo():
                out[rel] = "fifo"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def cli(*argv) -> tuple[int, str]:
    r = runner.invoke(app, [str(a) for a in argv])
    extra = [ln for ln in (r.stderr.splitlines() if r.stderr_bytes is not None else []) if ln not in r.output]
    text = r.output + "".join(ln + "\n" for ln in extra)
    return r.exit_code, text


def refused(watch: Path, *argv, code: int = 1, expect: str | tuple[str, ...], out: Path | None = None) -> str:
    """The command exits ``code`` with exactly one line holding every ``expect`` string, no
    traceback, ``out`` (if given) absent, and nothing under ``watch`` changed."""
    before = snapshot(watch)
    got, text = cli(*argv)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert got == code, text
    assert len(lines) == 1, f"expected one line, got {len(lines)}:\n{text}"
    assert "Traceback" not in text
    for e in (expect,) if isinstance(expect, str) else expect:
        assert e in text, f"{e!r} not in {text!r}"
    if out is not None:
        assert not out.exists(), f"{out} was created"
    assert snapshot(watch) == before, "files changed"
    return lines[0]


def edit_json(path: Path, fn) -> None:
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


def rename_shard(m: dict, old: str, new: str) -> None:
    """Point a manifest's ``files`` entry and every chunk of ``old`` at the name ``new``."""
    m["files"][new] = m["files"].pop(old)
    for p in m["params"].values():
        for c in p["chunks"]:
            if c["file"] == old:
                c["file"] = new


def rewrite_header(path: Path, fn) -> None:
    """Apply ``fn`` to a safetensors file's JSON header in place (data bytes kept)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    fn(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


# --- fixtures (once per module) -----------------------------------------------------------------


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    base = tmp_path_factory.mktemp("good")
    args = model_args()
    sd = native_state(args)
    hf = write_hf(sd, args, base / "hf")
    convert_checkpoint(hf, base / "titan", ConvertConfig(tp=2, pp=2))
    convert_checkpoint(hf, base / "model")
    sharded = write_hf(sd, args, base / "hf_sharded", max_shard_size="200KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    return {"args": args, "sd": sd, "hf": hf, "titan": base / "titan", "model": base / "model", "hf_sharded": sharded}


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


# --- our manifest: files / chunks[].file ----------------------------------------------------------


def test_manifest_shard_outside_the_checkpoint(good, tmp_path):
    src = copy(good["titan"], tmp_path / "src")
    shutil.copy(src / "model/pp0-tp0.safetensors", tmp_path / "outside.safetensors")

    edit_json(src / "manifest.json", lambda m: rename_shard(m, "model/pp0-tp0.safetensors", "../outside.safetensors"))
    refused(
        tmp_path,
        "convert",
        src,
        "-o",
        tmp_path / "out",
        out=tmp_path / "out",
        expect=(str(src / "manifest.json"), "'../outside.safetensors'", "'..' component", "fix the entry"),
    )


def test_manifest_absolute_shard_even_without_verify(good, tmp_path):
    src = copy(good["titan"], tmp_path / "src")
    edit_json(src / "manifest.json", lambda m: m["files"].__setitem__("/etc/hostname", {"size": 1, "sha256": "0" * 64}))
    refused(
        tmp_path,
        "convert",
        src,
        "-o",
        tmp_path / "out",
        "--no-verify",
        out=tmp_path / "out",
        expect=(str(src / "manifest.json"), "'/etc/hostname'", "absolute path"),
    )


def test_inspect_refuses_a_dotdot_shard_too(good, tmp_path):
    src = copy(good["titan"], tmp_path / "src")
    edit_json(
        src / "manifest.json",
        lambda m: rename_shard(m, "model/pp1-tp1.safetensors", "model/../../src/model/pp1-tp1.safetensors"),
    )
    refused(tmp_path, "inspect", src, expect=(str(src / "manifest.json"), "'..' component"))


def test_manifest_shard_through_a_symlinked_directory(good, tmp_path):
    src = copy(good["titan"], tmp_path / "src")
    elsewhere = tmp_path / "elsewhere"
    (src / "model").rename(elsewhere)
    (src / "model").symlink_to(elsewhere, target_is_directory=True)
    refused(
        tmp_path,
        "convert",
        src,
        "-o",
        tmp_path / "out",
        out=tmp_path / "out",
        expect=("symlinked directory that leads outside", str(src)),
    )


def test_manifest_shard_that_is_a_fifo_does_not_hang(good, tmp_path):
    src = copy(good["titan"], tmp_path / "src")
    f = src / "model/pp1-tp0.safetensors"
    f.unlink()
    os.mkfifo(f)
    refused(
        tmp_path,
        "convert",
        src,
        "-o",
        tmp_path / "out",
        out=tmp_path / "out",
        expect=("'model/pp1-tp0.safetensors'", "is a FIFO, not a regular file"),
    )


def test_symlink_loops_in_a_checkpoint(good, tmp_path):
    src = copy(good["titan"], tmp_path / "src")
    shard = src / "model/pp0-tp1.safetensors"
    shard.unlink()
    shard.symlink_to("pp0-tp1.safetensors")  # points at itself
    refused(
        tmp_path,
        "convert",
        src,
        "-o",
        tmp_path / "out",
        out=tmp_path / "out",
        expect=("'model/pp0-tp1.safetensors'", "cannot be examined", "symbolic links"),
    )
    shutil.rmtree(src / "model")
    (src / "model").symlink_to("model", target_is_directory=True)  # a directory loop
    refused(tmp_path, "inspect", src, expect=("'model/pp0-tp0.safetensors'", "symlink loop"))


def test_manifest_that_is_not_an_object(good, tmp_path):
    src = copy(good["titan"], tmp_path / "src")
    (src / "manifest.json").write_text("[1, 2, 3]")
    refused(
        tmp_path,
        "convert",
        src,
        "-o",
        tmp_path / "out",
        out=tmp_path / "out",
        expect=(str(src / "manifest.json"), "JSON list"),
    )


def test_init_from_weights_refuse_a_dotdot_chunk(good, tmp_path):
    """init_from / resume / evaluate --checkpoint read a manifest through CheckpointWeights."""
    from titan_pipe.model.weights import open_weights

    src = copy(good["titan"], tmp_path / "src")
    edit_json(src / "manifest.json", lambda m: rename_shard(m, "model/pp0-tp1.safetensors", "../../x.safetensors"))
    before = snapshot(tmp_path)
    with pytest.raises(UserError, match=r"manifest.json: shard '../../x.safetensors' has a '..' component"):
        open_weights(src)
    assert snapshot(tmp_path) == before


# --- Hugging Face: model.safetensors.index.json weight_map ---------------------------------------


def test_hf_index_points_outside(good, tmp_path):
    src = copy(good["hf_sharded"], tmp_path / "src")
    idx = src / "model.safetensors.index.json"
    edit_json(idx, lambda d: d["weight_map"].update({"model.norm.weight": "../../etc/passwd"}))
    refused(
        tmp_path,
        "convert",
        src,
        "-o",
        tmp_path / "out",
        out=tmp_path / "out",
        expect=(str(idx), "'../../etc/passwd'", "weight_map"),
    )


def test_export_refuses_an_absolute_index_entry(good, tmp_path):
    src = copy(good["hf_sharded"], tmp_path / "src")
    idx = src / "model.safetensors.index.json"
    edit_json(idx, lambda d: d["weight_map"].update({"lm_head.weight": "/etc/hostname"}))
    refused(
        tmp_path,
        "export",
        src,
        "-o",
        tmp_path / "onnx",
        "--no-atc",
        out=tmp_path / "onnx",
        expect=(str(idx), "'/etc/hostname'", "absolute path"),
    )


def test_inspect_index_weight_map_not_an_object(good, tmp_path):
    src = copy(good["hf_sharded"], tmp_path / "src")
    idx = src / "model.safetensors.index.json"
    edit_json(idx, lambda d: d.__setitem__("weight_map", ["model-00001-of-00002.safetensors"]))
    refused(tmp_path, "inspect", src, expect=(str(idx), "'weight_map' must be a non-empty object"))


def test_hf_cache_symlinks_to_blobs_are_followed(good, tmp_path):
    """The layout of ~/.cache/huggingface/hub: snapshot files are symlinks into ../../blobs."""
    repo = tmp_path / "models--tiny"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in good["hf_sharded"].iterdir():
        blob = blobs / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    code, text = cli("convert", snap, "-o", tmp_path / "out")
    assert code == 0, text
    got = load_file(tmp_path / "out/model.safetensors")
    assert torch.equal(got["model.norm.weight"], good["sd"]["norm.weight"])


def test_tokenizer_symlinked_to_a_private_file_is_not_copied(good, tmp_path):
    """A link in a downloaded model (git and tar carry them) must not pull a private file into the
    converted model dir, which users publish."""
    (tmp_path / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    src = copy(good["hf"], tmp_path / "src")
    (src / "tokenizer.json").symlink_to(os.path.relpath(tmp_path / "id_rsa", src))
    refused(
        tmp_path,
        "convert",
        src,
        "-o",
        tmp_path / "out",
        out=tmp_path / "out",
        expect=(str(src), "'tokenizer.json' is a symlink to", "id_rsa", "cp -L"),
    )


def test_weights_symlinked_outside_a_plain_dir(good, tmp_path):
    src = copy(good["hf"], tmp_path / "src")
    (src / "model.safetensors").rename(tmp_path / "weights.bin")
    (src / "model.safetensors").symlink_to(tmp_path / "weights.bin")
    refused(tmp_path, "inspect", src, expect=("'model.safetensors' is a symlink to", "outside"))


# --- DCP .metadata storage paths; Megatron directory discovery --------------------------------


def test_dcp_storage_path_outside(good, tmp_path):
    ckpt = write_dcp(good["sd"], good["args"], tmp_path / "dcp")
    meta = ckpt / ".metadata"
    md = pickle.loads(meta.read_bytes())
    first = next(k for k in md.storage_data if k.fqn == "model.norm.weight")
    md.storage_data[first] = dataclasses.replace(md.storage_data[first], relative_path="../../stolen.distcp")
    meta.write_bytes(pickle.dumps(md))
    refused(
        tmp_path,
        "convert",
        ckpt,
        "-o",
        tmp_path / "out",
        out=tmp_path / "out",
        expect=(str(meta), "'../../stolen.distcp'", "storage file"),
    )


def test_megatron_iteration_dir_symlinked_outside(good, tmp_path):
    src = write_megatron(good["sd"], good["args"], tmp_path / "meg", tp=1, pp=1)
    it = src / "iter_0000050"
    it.rename(tmp_path / "elsewhere")
    it.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    refused(
        tmp_path,
        "convert",
        src,
        "-o",
        tmp_path / "out",
        out=tmp_path / "out",
        expect=("'iter_0000050'", "symlinked directory leading outside", str(src)),
    )


def test_megatron_pickle_refusal_is_one_line(good, tmp_path):
    src = write_megatron(good["sd"], good["args"], tmp_path / "meg", tp=1, pp=1)
    f = src / "iter_0000050/mp_rank_00/model_optim_rng.pt"
    ck = torch.load(f, weights_only=False)
    ck["args"].tokenizer_obj = Path("/etc/passwd")
    torch.save(ck, f)
    line = refused(
        tmp_path,
        "convert",
        src,
        "-o",
        tmp_path / "out",
        out=tmp_path / "out",
        expect=(str(f), "refused to unpickle", "Unsupported global: GLOBAL pathlib.PosixPath"),
    )
    assert "\x1b[" not in line and "weights_only` set to `False`" not in line


# --- safetensors headers that lie -----------------------------------------------------------------


def shard_holding(src: Path, *keys: str) -> Path:
    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    files = {weight_map[k] for k in keys}
    assert len(files) == 1, files
    return src / files.pop()


def test_header_with_overlapping_data_ranges(good, tmp_path):
    src = copy(good["hf_sharded"], tmp_path / "src")
    f = shard_holding(src, "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight")

    def overlap(h):
        h["model.layers.0.self_attn.o_proj.weight"]["data_offsets"] = list(
            h["model.layers.0.self_attn.q_proj.weight"]["data_offsets"]
        )

    rewrite_header(f, overlap)
    refused(
        tmp_path,
        "convert",
        src,
        "-o",
        tmp_path / "out",
        out=tmp_path / "out",
        expect=(str(f), "overlap", "model.layers.0.self_attn.q_proj.weight"),
    )


def test_header_that_lies_about_the_dtype(good, tmp_path):
    src = copy(good["hf_sharded"], tmp_path / "src")
    f = shard_holding(src, "model.layers.1.input_layernorm.weight")
    rewrite_header(f, lambda h: h["model.layers.1.input_layernorm.weight"].update(dtype="F16"))
    refused(
        tmp_path, "inspect", src, expect=(str(f), "'model.layers.1.input_layernorm.weight'", "does not match its shape")
    )


def test_header_offsets_past_the_end_of_the_file(good, tmp_path):
    """A header naming bytes past the end of the file: the core's header check refuses it, one line."""
    src = copy(good["hf"], tmp_path / "src")
    f = src / "model.safetensors"

    def far(h):
        e = h["model.norm.weight"]
        size = e["data_offsets"][1] - e["data_offsets"][0]
        e["data_offsets"] = [10**9, 10**9 + size]

    rewrite_header(f, far)
    refused(
        tmp_path,
        "convert",
        src,
        "-o",
        tmp_path / "out",
        out=tmp_path / "out",
        expect=(str(f), "truncated: tensor 'model.norm.weight' ends at byte", "Copy the file again"),
    )


def test_duplicate_key_inside_one_header(good, tmp_path):
    src = copy(good["hf_sharded"], tmp_path / "src")
    f = shard_holding(src, "model.layers.1.input_layernorm.weight")
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    head = raw[8 : 8 + n].decode().rstrip()
    entry = json.dumps({"dtype": "F32", "shape": [1], "data_offsets": [0, 4]})
    head = head[:-1] + f', "model.layers.1.input_layernorm.weight": {entry}}}'
    head += " " * (-len(head) % 8)
    f.write_bytes(struct.pack("<Q", len(head)) + head.encode() + raw[8 + n :])
    refused(tmp_path, "inspect", src, expect=(str(f), "'model.layers.1.input_layernorm.weight' appears twice"))


def test_duplicate_tensor_across_shards(good, tmp_path):
    src = copy(good["hf_sharded"], tmp_path / "src")
    shards = sorted(src.glob("model-*.safetensors"))
    a, b = load_file(shards[0]), load_file(shards[-1])
    stolen = next(k for k in a if k not in b)
    b[stolen] = torch.zeros_like(a[stolen])  # a second, different copy of the same tensor
    save_file(b, shards[-1], metadata={"format": "pt"})
    refused(
        tmp_path,
        "convert",
        src,
        "-o",
        tmp_path / "out",
        out=tmp_path / "out",
        expect=(f"{stolen!r} is also stored in", shards[0].name, shards[-1].name),
    )


def test_nan_and_inf_weights_are_named(good, tmp_path):
    """Non-finite weights are not an input error, but never pass silently: a warning names them."""
    src = copy(good["hf"], tmp_path / "src")
    sd = load_file(src / "model.safetensors")
    sd["model.layers.2.mlp.down_proj.weight"][3, 5] = float("nan")
    sd["model.norm.weight"][0] = float("inf")
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    before = snapshot(src)
    code, text = cli("convert", src, "-o", tmp_path / "out")
    assert code == 0, text
    warning = [ln for ln in text.splitlines() if "NaN/Inf" in ln]
    assert len(warning) == 1, text
    assert "model.layers.2.mlp.down_proj.weight" in warning[0] and "model.norm.weight" in warning[0]
    assert snapshot(src) == before


def test_inf_from_a_cast_and_nan_in_a_pickled_source_are_named(good, tmp_path):
    """Tensors assembled in memory (dtype casts, DCP's torch.save chunks) are checked as they pass."""
    sd = dict(good["sd"])
    sd["layers.1.attention.wk.weight"] = sd["layers.1.attention.wk.weight"].clone()
    sd["layers.1.attention.wk.weight"][0, 0] = 1e6  # beyond float16's 65504
    sd["layers.3.feed_forward.w1.weight"] = sd["layers.3.feed_forward.w1.weight"].clone()
    sd["layers.3.feed_forward.w1.weight"][1, 1] = float("-inf")
    hf = write_hf(sd, good["args"], tmp_path / "hf")
    code, text = cli("convert", hf, "-o", tmp_path / "half", "--dtype", "float16")
    assert code == 0 and "model.layers.1.self_attn.k_proj.weight" in text and "NaN/Inf values in 2" in text, text
    sd["layers.0.attention.wv.weight"] = torch.full_like(sd["layers.0.attention.wv.weight"], float("nan"))
    ckpt = write_dcp(sd, good["args"], tmp_path / "dcp")
    code, text = cli("convert", ckpt, "-o", tmp_path / "from_dcp")
    assert (
        code == 0
        and "NaN/Inf values in 2 tensor(s): model.layers.0.self_attn.v_proj.weight, model.layers.3.mlp.gate_proj"
        in text
    ), text  # 1e6 is finite in float32


# --- outputs that would replace a run dir ----------------------------------------------------------


@pytest.fixture
def run_dir(tmp_path):
    rd = tmp_path / "runs" / "exp"
    (rd / "checkpoints" / "step-000010").mkdir(parents=True)
    (rd / "flow.yaml").write_text("name: exp\n")
    (rd / "metrics.jsonl").write_text('{"step": 1}\n')
    return rd


def test_convert_overwrite_cannot_replace_a_run_dir(good, tmp_path, run_dir):
    refused(
        tmp_path,
        "convert",
        good["hf"],
        "-o",
        run_dir,
        "--overwrite",
        expect=(str(run_dir), "is a run dir", f"{run_dir}/model"),
    )


def test_export_into_a_run_dir_itself(good, tmp_path, run_dir):
    refused(tmp_path, "export", good["model"], "-o", run_dir, "--overwrite", "--no-atc", expect="is a run dir")


def test_report_dir_that_is_a_run_dir(good, tmp_path, run_dir):
    refused(tmp_path, "evaluate", "--model-dir", good["model"], "-o", run_dir, expect=(str(run_dir), "is a run dir"))


# --- evaluate: ONNX external data, export.json, --config data path --------------------------------


def _graph_with_external(onnx_dir: Path, location: str) -> Path:
    """input_ids -> logits (a Gather from an embedding held as external data at ``location``)."""
    import onnx
    from onnx import TensorProto, helper

    onnx_dir.mkdir(parents=True, exist_ok=True)
    emb = TensorProto(name="emb", data_type=TensorProto.FLOAT, dims=[320, 8])
    emb.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", "0"), ("length", str(320 * 8 * 4))):
        e = emb.external_data.add()
        e.key, e.value = k, v
    graph = helper.make_graph(
        [helper.make_node("Gather", ["emb", "input_ids"], ["logits"])],
        "g",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "t"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "t", 8])],
        initializer=[emb],
    )
    path = onnx_dir / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)]), str(path))
    return path


def test_onnx_external_data_outside_its_dir(good, tmp_path):
    (tmp_path / "secret.bin").write_bytes(os.urandom(320 * 8 * 4))
    g = _graph_with_external(tmp_path / "onnx", "../secret.bin")
    refused(
        tmp_path,
        "evaluate",
        "--model-dir",
        good["model"],
        "--onnx",
        g,
        "-o",
        tmp_path / "rep",
        out=tmp_path / "rep",
        expect=(str(g), "'../secret.bin'", "external data location of tensor 'emb'"),
    )


def test_onnx_external_data_absolute(good, tmp_path):
    g = _graph_with_external(tmp_path / "onnx", "/etc/hostname")
    refused(
        tmp_path,
        "evaluate",
        "--model-dir",
        good["model"],
        "--onnx",
        g,
        "-o",
        tmp_path / "rep",
        out=tmp_path / "rep",
        expect=(str(g), "'/etc/hostname'", "absolute path"),
    )


def test_onnx_runner_checks_before_onnxruntime_opens_the_graph(tmp_path):
    from titan_pipe.evaluate.runners.ort import OnnxRuntimeRunner

    (tmp_path / "secret.bin").write_bytes(b"\0" * (320 * 8 * 4))
    g = _graph_with_external(tmp_path / "onnx", "../secret.bin")
    with pytest.raises(UserError, match="'..' component"):
        OnnxRuntimeRunner(g)


def test_export_record_naming_a_graph_outside(good, tmp_path):
    g = _graph_with_external(tmp_path / "onnx", "model.onnx.data")
    (tmp_path / "onnx" / "model.onnx.data").write_bytes(b"\0" * (320 * 8 * 4))
    rec = tmp_path / "onnx" / "export.json"
    rec.write_text(json.dumps({"format": "titan-pipe-export/1", "graphs": {"../../model.onnx": {}}, "files": {}}))
    refused(
        tmp_path,
        "evaluate",
        "--model-dir",
        good["model"],
        "--onnx",
        g,
        "-o",
        tmp_path / "rep",
        out=tmp_path / "rep",
        expect=(str(rec), "'../../model.onnx'", "graphs entry"),
    )


@pytest.mark.parametrize("digest", ["xxh3_128", "sha256"])
def test_evaluate_refuses_a_data_file_that_is_not_the_exported_one(good, tmp_path, digest):
    """export.json's digest of each data file, re-computed with its recorded algorithm before any work:
    one flipped byte (same size) in the last of them is refused in one line naming the file; the
    export itself is kept."""
    cli_ok = cli("export", good["model"], "-o", tmp_path / "onnx", "--no-atc", "--no-kv-cache", "--digest", digest)
    assert cli_ok[0] == 0, cli_ok[1]
    data = tmp_path / "onnx" / data_file_names(ExportConfig().data_files)[-1]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    refused(
        tmp_path,
        "evaluate",
        "--model-dir",
        good["model"],
        "--onnx",
        tmp_path / "onnx" / "model.onnx",
        "-o",
        tmp_path / "rep",
        out=tmp_path / "rep",
        expect=(str(data), f"its {digest} digest does not match", "re-export"),
    )


def test_onnx_that_is_not_onnx(good, tmp_path):
    g = tmp_path / "model.onnx"
    g.write_bytes(b"\x08\x07PK\x03\x04 not a protobuf \xff" * 50)
    refused(
        tmp_path,
        "evaluate",
        "--model-dir",
        good["model"],
        "--onnx",
        g,
        "-o",
        tmp_path / "rep",
        out=tmp_path / "rep",
        expect=(str(g), "not an ONNX model"),
    )


def test_evaluate_config_data_path_outside_the_flow_dir(good, tmp_path):
    (tmp_path / "private.txt").write_text("not for evaluation\n" * 100)
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    flow = cfg_dir / "flow.yaml"
    flow.write_text("evaluate: {data: ../private.txt}\n")
    refused(
        tmp_path,
        "evaluate",
        "--model-dir",
        good["model"],
        "--config",
        flow,
        "-o",
        tmp_path / "rep",
        out=tmp_path / "rep",
        expect=(str(flow), "evaluate.data '../private.txt'", "--data FILE"),
    )


# --- run / config -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,why",
    [
        ("..", "parent of runs_dir"),
        (".", "runs_dir itself"),
        (".hidden", "starts with a dot"),
        ("a/b", "one path component"),
        ("x" * 65, "at most 64"),
    ],
)
def test_run_names_that_are_not_one_plain_component(tmp_path, name, why):
    flow = tmp_path / "flow.yaml"
    flow.write_text(json.dumps({"name": name, "runs_dir": "runs"}))
    for cmd in ("validate", "train", "run"):
        line = refused(tmp_path, cmd, flow, code=2, expect=(str(flow), "name:", why, "use a name like"))
    assert not (tmp_path / "runs").exists() and not (tmp_path / LOCK_NAME).exists()
    assert "'run'" in line or "'hidden'" in line or "'a-b'" in line or "'xxxx" in line


def test_ten_megabyte_yaml(tmp_path):
    flow = tmp_path / "flow.yaml"
    flow.write_text("name: big\n" + "# padding padding padding\n" * 400_000)
    refused(tmp_path, "run", flow, code=2, expect=(str(flow), "MB, larger than a flow file can be"))


def test_non_utf8_yaml(tmp_path):
    flow = tmp_path / "flow.yaml"
    flow.write_bytes("name: r\u00e9sum\u00e9\n".encode("latin-1"))
    refused(tmp_path, "validate", flow, code=2, expect=(str(flow), "not UTF-8", "save the file as UTF-8"))


def test_deeply_nested_yaml(tmp_path):
    flow = tmp_path / "flow.yaml"
    flow.write_text("model: " + "[" * 20_000 + "]" * 20_000 + "\n")
    refused(tmp_path, "run", flow, code=2, expect=(str(flow), "nested too deeply"))


# --- the run-dir lock -------------------------------------------------------------------------------

HOLDER = (
    "import sys, time\nfrom titan_pipe.processes.run_lock import run_lock\n"
    "with run_lock(sys.argv[1], what='test holder'):\n    print('held', flush=True)\n    time.sleep(300)\n"
)


def _hold(run_dir: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout.readline().strip() == "held"
    return p


def test_second_writer_fails_at_once_naming_the_holder(good, tmp_path):
    """Real processes: the holder, then `titan-pipe train` and `titan-pipe run` on the same run dir."""
    flow = tmp_path / "flow.yaml"
    flow.write_text("name: exp\nruns_dir: runs\ndevice: cpu\ntrain: {steps: 1}\n")
    holder = _hold(tmp_path / "runs" / "exp")
    try:
        before = snapshot(tmp_path)
        t0 = time.monotonic()
        env = {**os.environ, "COLUMNS": "400"}
        writers = {
            cmd: subprocess.Popen(
                [sys.executable, "-m", "titan_pipe.cli", cmd, str(flow)],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for cmd in ("train", "run")
        }
        for cmd, proc in writers.items():
            out, err = proc.communicate(timeout=300)
            lines = [ln for ln in (out + err).splitlines() if ln.strip() and not ln.startswith("training ")]
            assert proc.returncode == 1, out + err
            assert len(lines) == 1 and f"in use by PID {holder.pid} (test holder)" in lines[0], (cmd, lines)
        took = time.monotonic() - t0
        assert snapshot(tmp_path) == before and not (tmp_path / "runs/exp/train.log").exists()
        assert took < 150  # fails at once (the time is the CLI's imports), never waits for the holder
        # a stage command writing into the same run dir is refused too (in process)
        refused(
            tmp_path,
            "convert",
            good["hf"],
            "-o",
            tmp_path / "runs/exp/model",
            out=tmp_path / "runs/exp/model",
            expect=(str((tmp_path / "runs/exp").resolve()), f"PID {holder.pid}"),
        )
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the holder died without unlocking: the kernel released its flock, so the lock is free
    with run_lock(tmp_path / "runs" / "exp", what="after"):
        assert (tmp_path / "runs/exp" / LOCK_NAME).read_text().startswith(f"{os.getpid()} after")


def test_lock_is_reentrant_in_process_and_for_children_only(tmp_path):
    d = tmp_path / "run"
    child = (
        "import sys\nfrom titan_pipe.processes.run_lock import run_lock\n"
        "with run_lock(sys.argv[1], what='child'):\n    print('child ok')\n"
    )
    with run_lock(d, what="outer"):
        with run_lock(d, what="inner"):  # titan-pipe run -> train in the same process
            assert (d / LOCK_NAME).read_text().startswith(f"{os.getpid()} outer")
        inherited = subprocess.run([sys.executable, "-c", child, str(d)], capture_output=True, text=True, timeout=120)
        assert inherited.returncode == 0 and "child ok" in inherited.stdout, inherited.stderr
        stranger = subprocess.run(
            [sys.executable, "-c", child, str(d)],
            capture_output=True,
            text=True,
            timeout=120,
            env={k: v for k, v in os.environ.items() if k != ENV},
        )
        assert stranger.returncode != 0 and f"in use by PID {os.getpid()} (outer)" in stranger.stderr
    assert ENV not in os.environ
    # a stale variable (its PID no longer holds the lock) does not let anyone skip the lock
    os.environ[ENV] = f"{d.resolve()}=1"
    try:
        with run_lock(d, what="fresh"):
            assert (d / LOCK_NAME).read_text().startswith(f"{os.getpid()} fresh")
            with pytest.raises(RunDirBusy):
                _busy_elsewhere(d)
    finally:
        os.environ.pop(ENV, None)


def _busy_elsewhere(d: Path) -> None:
    """Try the lock from a second open file description, as another process would."""
    import fcntl

    fd = os.open(d / LOCK_NAME, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise RunDirBusy("held") from None
    finally:
        os.close(fd)
