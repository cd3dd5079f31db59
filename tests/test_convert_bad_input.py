"""Bad input to `titan-pipe convert`: one clear error naming the file, exit 1, no output, source untouched."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

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
from titan_pipe.cli import app
from titan_pipe.convert.api import convert_checkpoint
from titan_pipe.convert.hashing import sha256_file

pytest.importorskip("transformers")
runner = CliRunner()


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A model as a Hugging Face dir, a tp2/pp2 titan checkpoint of it, and its weights."""
    base = tmp_path_factory.mktemp("good")
    args = model_args()
    sd = native_state(args)
    hf = write_hf(sd, args, base / "hf")
    convert_checkpoint(hf, base / "titan", ConvertConfig(tp=2, pp=2))
    return {"args": args, "sd": sd, "hf": hf, "titan": base / "titan"}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _run(*argv: str):
    return runner.invoke(app, [str(a) for a in argv])


def _fails(src: Path, out: Path, *extra, expect: str, names: Path | str | None = None):
    """Convert must exit 1 with one error line containing ``expect`` and the file; nothing left."""
    before = hash_tree(src) if src.is_dir() else None
    r = _run("convert", src, "-o", out, *extra)
    text = r.output + (r.stderr if r.stderr_bytes is not None else "")
    assert r.exit_code == 1, text
    assert "Traceback" not in text and text.count("error") >= 1, text
    assert expect in text, text
    assert str(names if names is not None else src) in text, text
    assert not out.exists() or not any(out.iterdir()), f"partial output left in {out}"
    assert not list(out.parent.glob(f".{out.name}.tmp-*")), "temporary output left behind"
    if before is not None:
        assert hash_tree(src) == before, "the source was modified"
    return text


def _edit_manifest(ckpt: Path, fn) -> None:
    m = json.loads((ckpt / "manifest.json").read_text())
    fn(m)
    (ckpt / "manifest.json").write_text(json.dumps(m))


def test_missing_shard(good, tmp_path):
    src = _copy(good["titan"], tmp_path / "src")
    (src / "model/pp1-tp1.safetensors").unlink()
    _fails(src, tmp_path / "out", expect="missing shard", names=src / "model/pp1-tp1.safetensors")


def test_truncated_shard(good, tmp_path):
    src = _copy(good["titan"], tmp_path / "src")
    f = src / "model/pp0-tp1.safetensors"
    os.truncate(f, f.stat().st_size - 100)
    _fails(src, tmp_path / "out", expect="truncated", names=f)


def test_truncated_hf_file(good, tmp_path):
    src = _copy(good["hf"], tmp_path / "src")
    f = src / "model.safetensors"
    os.truncate(f, f.stat().st_size // 2)
    _fails(src, tmp_path / "out", expect="truncated", names=f)


def test_corrupted_header(good, tmp_path):
    src = _copy(good["hf"], tmp_path / "src")
    f = src / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.seek(8)
        fh.write(b"\x00\xff garbage")
    _fails(src, tmp_path / "out", expect="corrupted", names=f)


def test_corrupted_data_fails_sha256(good, tmp_path):
    src = _copy(good["titan"], tmp_path / "src")
    f = src / "model/pp1-tp0.safetensors"
    with open(f, "r+b") as fh:
        fh.seek(f.stat().st_size - 10)
        fh.write(b"\x13\x37")
    _fails(src, tmp_path / "out", expect="sha256", names=f)


def test_manifest_sha256_mismatch(good, tmp_path):
    src = _copy(good["titan"], tmp_path / "src")
    _edit_manifest(src, lambda m: m["files"]["model/pp0-tp0.safetensors"].update(sha256="0" * 64))
    _fails(src, tmp_path / "out", expect="does not match the manifest", names=src / "model/pp0-tp0.safetensors")


def test_shard_shape_disagrees_with_manifest(good, tmp_path):
    src = _copy(good["titan"], tmp_path / "src")
    f = src / "model/pp0-tp1.safetensors"
    tensors = load_file(f)
    tensors["layers.0.attention.wq.weight"] = tensors["layers.0.attention.wq.weight"][:-8].clone()
    save_file(tensors, f)
    _edit_manifest(
        src, lambda m: m["files"]["model/pp0-tp1.safetensors"].update(size=f.stat().st_size, sha256=sha256_file(f))
    )
    _fails(src, tmp_path / "out", expect="says F32 [32, 64]", names=f)


def test_two_ranks_claim_the_same_box(good, tmp_path):
    src = _copy(good["titan"], tmp_path / "src")

    def dup(m):
        chunks = m["params"]["layers.1.attention.wq.weight"]["chunks"]
        chunks[1]["offsets"] = list(chunks[0]["offsets"])
        chunks[1]["lengths"] = [40, 64]

    _edit_manifest(src, dup)
    _fails(src, tmp_path / "out", expect="overlapping", names=src / "manifest.json")


def test_box_left_uncovered(good, tmp_path):
    src = _copy(good["titan"], tmp_path / "src")
    _edit_manifest(src, lambda m: m["params"]["layers.2.feed_forward.w2.weight"]["chunks"].pop())
    _fails(src, tmp_path / "out", expect="missing", names=src / "manifest.json")


def test_empty_dir(tmp_path):
    (tmp_path / "empty").mkdir()
    _fails(tmp_path / "empty", tmp_path / "out", expect="empty")


def test_unknown_format(tmp_path):
    src = tmp_path / "weird"
    src.mkdir()
    (src / "weights.bin").write_bytes(b"\x00" * 64)
    _fails(src, tmp_path / "out", expect="unknown checkpoint format")


def test_wrong_explicit_from(good, tmp_path):
    _fails(good["titan"], tmp_path / "out", "--source-format", "megatron", expect="--source-format titan")
    _fails(good["hf"], tmp_path / "out", "--source-format", "dcp", expect="looks like a hf")


def test_non_empty_output_needs_overwrite(good, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    r = _run("convert", good["titan"], "-o", out)
    assert r.exit_code == 1 and "--overwrite" in r.output and str(out) in r.output
    assert (out / "keep.txt").read_text() == "mine"
    r = _run("convert", good["titan"], "-o", out, "--overwrite")
    assert r.exit_code == 0, r.output
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()


def test_disk_full_mid_write(good, tmp_path):
    """A file-size limit below the model size: the writer hits EFBIG part way through."""
    out = tmp_path / "out"
    code = (
        "import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000)); "
        "from titan_pipe.cli import app; sys.argv = ['titan-pipe'] + sys.argv[1:]; app()"
    )
    before = hash_tree(good["titan"])
    r = subprocess.run(
        [sys.executable, "-c", code, "convert", str(good["titan"]), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "300"},
    )
    assert r.returncode == 1, r.stderr
    assert "disk filled up" in r.stderr and str(out / "model.safetensors") in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists() and not list(tmp_path.glob(".out*"))
    assert hash_tree(good["titan"]) == before


def test_megatron_needs_true_vocab(good, tmp_path):
    src = write_megatron(good["sd"], good["args"], tmp_path / "meg", tp=2, pp=1, with_vocab=False)
    _fails(src, tmp_path / "out", expect="--vocab-size")
    r = _run("convert", src, "-o", tmp_path / "out", "--vocab-size", "320")
    assert r.exit_code == 0, r.output
    assert torch.equal(
        load_file(tmp_path / "out/model.safetensors")["model.embed_tokens.weight"], good["sd"]["tok_embeddings.weight"]
    )


def test_megatron_missing_rank(good, tmp_path):
    src = write_megatron(good["sd"], good["args"], tmp_path / "meg", tp=2, pp=2)
    shutil.rmtree(src / "iter_0000050/mp_rank_01_001")
    _fails(src, tmp_path / "out", expect="mp_rank_01_001", names=src / "iter_0000050")


def test_megatron_refuses_unlisted_pickle_type(good, tmp_path):
    src = write_megatron(good["sd"], good["args"], tmp_path / "meg", tp=1, pp=1)
    f = src / "iter_0000050/mp_rank_00/model_optim_rng.pt"
    ck = torch.load(f, weights_only=False)
    ck["args"].tokenizer_obj = Path("/etc/passwd")  # a type outside the allow-list
    torch.save(ck, f)
    _fails(src, tmp_path / "out", expect="refused to unpickle", names=f)


def test_dcp_without_model_config(good, tmp_path):
    ckpt = write_dcp(good["sd"], good["args"], tmp_path / "dcp")
    (tmp_path / "dcp/params.json").unlink()
    _fails(ckpt, tmp_path / "out", expect="--model-config")
    cfg = tmp_path / "params.json"
    cfg.write_text(json.dumps({"n_heads": 8, "n_kv_heads": 4, "norm_eps": 1e-5}))
    r = _run("convert", ckpt, "-o", tmp_path / "out", "--model-config", cfg)
    assert r.exit_code == 0, r.output


def test_dcp_metadata_with_a_callable_outside_the_allow_list(good, tmp_path):
    """A .metadata whose pickle would call a DCP function that writes files is refused by name."""
    import pickle

    class Hostile:
        def __reduce__(self):
            from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

            return (dcp_to_torch_save, (str(tmp_path / "dcp/step-3"), str(tmp_path / "written.pt")))

    ckpt = write_dcp(good["sd"], good["args"], tmp_path / "dcp")
    (ckpt / ".metadata").write_bytes(pickle.dumps(Hostile()))
    _fails(
        ckpt,
        tmp_path / "out",
        expect="refusing to load torch.distributed.checkpoint.format_utils",
        names=ckpt / ".metadata",
    )
    assert not (tmp_path / "written.pt").exists()


def test_dcp_corrupted_metadata(good, tmp_path):
    ckpt = write_dcp(good["sd"], good["args"], tmp_path / "dcp")
    (ckpt / ".metadata").write_bytes(b"\x80\x04junk")
    _fails(ckpt, tmp_path / "out", expect="DCP metadata", names=ckpt / ".metadata")


def _edit_dcp_metadata(ckpt: Path, fn) -> None:
    import pickle

    with open(ckpt / ".metadata", "rb") as f:
        md = pickle.load(f)  # the test's own fixture
    fn(md)
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)


def test_dcp_missing_distcp_file(good, tmp_path):
    src = write_megatron_dist(good["sd"], good["args"], tmp_path / "meg", tp=2, pp=2, vpp=None)
    f = src / "iter_0000050/__3_0.distcp"
    f.unlink()
    _fails(src, tmp_path / "out", expect="missing", names=f)
    ckpt = write_dcp(good["sd"], good["args"], tmp_path / "dcp")
    (ckpt / "__0_0.distcp").unlink()
    _fails(ckpt, tmp_path / "out", expect="missing", names=ckpt / "__0_0.distcp")


def test_dcp_metadata_names_an_absent_item(good, tmp_path):
    ckpt = write_dcp(good["sd"], good["args"], tmp_path / "dcp")

    def drop(md):
        idx = next(i for i in md.storage_data if i.fqn == "model.layers.2.feed_forward.w2.weight")
        del md.storage_data[idx]

    _edit_dcp_metadata(ckpt, drop)
    _fails(ckpt, tmp_path / "out", expect="has no storage entry", names=ckpt / ".metadata")


def test_dcp_chunk_past_end_of_file(good, tmp_path):
    ckpt = write_dcp(good["sd"], good["args"], tmp_path / "dcp", full=False)
    f = ckpt / "__0_0.distcp"
    os.truncate(f, f.stat().st_size - 1000)
    _fails(ckpt, tmp_path / "out", expect="runs past the end of the file", names=f)


def test_dcp_storage_path_outside_the_checkpoint(good, tmp_path):
    ckpt = write_dcp(good["sd"], good["args"], tmp_path / "dcp")

    def escape(md):
        idx = next(i for i in md.storage_data if i.fqn == "model.norm.weight")
        md.storage_data[idx].relative_path = "../../etc/passwd"

    _edit_dcp_metadata(ckpt, escape)
    _fails(ckpt, tmp_path / "out", expect="must stay inside its directory", names=ckpt / ".metadata")


def test_dcp_chunk_not_a_saved_tensor(good, tmp_path):
    ckpt = write_dcp(good["sd"], good["args"], tmp_path / "dcp", full=False)

    def shift(md):
        idx = next(i for i in md.storage_data if i.fqn == "layers.1.attention.wo.weight")
        md.storage_data[idx].offset += 7
        md.storage_data[idx].length -= 7

    _edit_dcp_metadata(ckpt, shift)
    _fails(ckpt, tmp_path / "out", expect="not a torch.save archive", names=ckpt / "__0_0.distcp")


def test_torch_dist_without_common_pt(good, tmp_path):
    src = write_megatron_dist(good["sd"], good["args"], tmp_path / "meg")
    f = src / "iter_0000050/common.pt"
    f.unlink()
    _fails(src, tmp_path / "out", expect="missing", names=f)


def test_torch_dist_common_pt_with_unlisted_pickle_type(good, tmp_path):
    from convert_writers import megatron_args

    ns = megatron_args(good["args"], tp=2, pp=2, padded=512, vpp=2)
    ns.tokenizer_obj = Path("/etc/passwd")  # a type outside the allow-list
    src = write_megatron_dist(
        good["sd"], good["args"], tmp_path / "meg", common={"args": ns, "iteration": 50, "checkpoint_version": 3.0}
    )
    _fails(src, tmp_path / "out", expect="refused to unpickle", names=src / "iter_0000050/common.pt")


def test_torch_dist_wrong_backend(good, tmp_path):
    src = write_megatron_dist(good["sd"], good["args"], tmp_path / "meg")
    (src / "iter_0000050/metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    _fails(src, tmp_path / "out", expect="'zarr'", names=src / "iter_0000050/metadata.json")


def test_bad_options(good, tmp_path):
    _fails(good["hf"], tmp_path / "o1", "--dtype", "int4", expect="--dtype", names="int4")
    _fails(good["hf"], tmp_path / "o2", "--max-shard-size", "lots", expect="--max-shard-size", names="lots")
    _fails(good["hf"], tmp_path / "o5", "--digest", "md5", expect="--digest", names="md5")
    _fails(good["hf"], tmp_path / "o3", "--tp", "3", expect="--tp 3 does not divide", names=good["hf"])
    _fails(good["hf"], good["hf"] / "inside", expect="outside the source", names=good["hf"])


def test_inspect_cli(good):
    r = _run("inspect", good["titan"])
    assert r.exit_code == 0, r.output
    assert "format titan" in r.output and "layers.3.feed_forward.w2.weight" in r.output
    assert "dim 1 in 2" in r.output
    r = _run("inspect", good["titan"] / "nope")
    assert r.exit_code == 1 and "does not exist" in r.output
