"""Faults and hostile values, round two (issue 35): each case as a user or a faulty machine meets it,
ending in one clean line and the right exit code, or the correct result; the input unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from titan_pipe.config import ConvertConfig, ExportConfig
from titan_pipe.cli import app

transformers = pytest.importorskip("transformers")


def cli(*argv) -> tuple[int, str]:
    r = CliRunner().invoke(app, [str(a) for a in argv])
    return r.exit_code, " ".join(r.output.split())


def _tied_llama(path: Path, *, head_delta: float | None) -> Path:
    """A tiny Llama saved by transformers with tie_word_embeddings: true; head_delta: store an
    lm_head.weight of embedding + delta (None: none stored, as save_pretrained writes a tie)."""
    cfg = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    if head_delta is not None:
        sd = load_file(path / "model.safetensors")
        emb = sd["model.embed_tokens.weight"]
        sd["lm_head.weight"] = (
            emb + head_delta * torch.randn(emb.shape, generator=torch.Generator().manual_seed(1))
            if head_delta
            else emb.clone()
        )
        save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _logits(model_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        return m(tokens).logits


@pytest.mark.parametrize("head_delta", [0.1, 0.0, None], ids=["different-head", "equal-head", "no-head"])
def test_a_tied_config_over_its_own_head_converts_as_transformers_reads_it(tmp_path, head_delta):
    """config.json says tied; a stored lm_head that differs from the embedding was dropped without a
    word (logits off by up to 1.13 against transformers' reading). Now: kept, and the written config
    says untied; a head equal to the embedding (or none) is the tie."""
    from titan_pipe.model.weights import SafetensorsWeights
    from titan_pipe.model.unified_dir import read_model_args

    src = _tied_llama(tmp_path / "src", head_delta=head_delta)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(2))
    want = _logits(src, tokens)
    code, out = cli("convert", src, "-o", tmp_path / "out")
    assert code == 0, out
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    untied = head_delta not in (None, 0.0)
    assert written["tie_word_embeddings"] is (not untied)
    assert ("lm_head.weight" in load_file(tmp_path / "out" / "model.safetensors")) is untied
    assert (_logits(tmp_path / "out", tokens) - want).abs().max().item() <= 1e-5
    # the same rule for init_from / evaluate (SafetensorsWeights) and export (read_model_args)
    assert read_model_args(src).tie_embeddings is (not untied)
    w = SafetensorsWeights(src)
    assert w.args.tie_embeddings is (not untied)
    if untied:
        assert torch.equal(w.full("output.weight"), load_file(src / "model.safetensors")["lm_head.weight"])
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before  # the source is never modified


# --- files we write never follow a link someone else placed -------------------------------------


@pytest.fixture(scope="module")
def hf_src(tmp_path_factory):
    from convert_writers import model_args, native_state, write_hf

    base = tmp_path_factory.mktemp("src")
    args = model_args()
    return write_hf(native_state(args), args, base / "hf")


def _one_line(code: int, text: str, want_code: int, *needles: str) -> None:
    assert code == want_code, text
    assert "Traceback" not in text
    for n in needles:
        assert n in text, (n, text)


def test_a_lock_symlink_beside_the_output_is_refused_and_its_target_untouched(hf_src, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / ".out.lock").symlink_to(victim)
    code, text = cli("convert", hf_src, "-o", tmp_path / "out")
    _one_line(code, text, 1, str(tmp_path / ".out.lock"), "symbolic link", "Remove it")
    assert victim.read_text() == "precious\n" and not (tmp_path / "out").exists()
    assert (tmp_path / ".out.lock").is_symlink()  # not ours: not removed either


def test_a_run_dir_lock_symlink_is_refused_and_its_target_keeps_its_bytes(tmp_path):
    from titan_pipe.processes.run_lock import LockPathInvalid, run_lock

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    (run / ".lock").symlink_to(victim)
    with pytest.raises(LockPathInvalid, match="symbolic link"):
        with run_lock(run, what="test"):
            pass
    assert victim.read_text() == "precious\n"


def test_a_directory_named_like_the_lock_is_named_as_the_lock(hf_src, tmp_path):
    (tmp_path / ".out.lock").mkdir()
    code, text = cli("convert", hf_src, "-o", tmp_path / "out")
    _one_line(code, text, 1, str(tmp_path / ".out.lock"), "is a directory")
    assert not (tmp_path / "out").exists()


def test_overwrite_onto_a_symlinked_output_leaves_no_old_link_and_the_target_intact(hf_src, tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    (tmp_path / "out").symlink_to(target)
    code, text = cli("convert", hf_src, "-o", tmp_path / "out", "--overwrite")
    assert code == 0, text
    assert (tmp_path / "out").is_dir() and not (tmp_path / "out").is_symlink()
    assert (target / "keep.txt").read_text() == "mine"
    assert not [p.name for p in tmp_path.iterdir() if ".old-" in p.name or ".tmp-" in p.name]


def test_a_lock_holders_text_is_printed_bounded(hf_src, tmp_path):
    """Foreign text in a held lock file (a 2 MB line) is cut to one short line."""
    import subprocess
    import sys

    lock = tmp_path / ".out.lock"
    lock.write_text("4242 " + "x" * 2_000_000 + "\n")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import fcntl, os, sys, time\n"
                f"fd = os.open({str(lock)!r}, os.O_RDWR)\n"
                "fcntl.flock(fd, fcntl.LOCK_EX)\n"
                "print('held', flush=True)\n"
                "time.sleep(60)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        code, text = cli("convert", hf_src, "-o", tmp_path / "out")
        _one_line(code, text, 1, "being written by PID 4242", "...")
        assert len(text) < 1500, len(text)
    finally:
        holder.kill()
        holder.wait()


def test_a_temp_file_name_taken_by_a_link_is_not_followed(tmp_path):
    import os

    from titan_pipe.io.atomic import temp_file, write_text

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "record.json"
    temp_file(out).symlink_to(victim)
    write_text(out, "{}")
    assert victim.read_text() == "precious\n" and out.read_text() == "{}"
    assert not os.path.lexists(temp_file(out))


@pytest.mark.parametrize("kind", ["symlink", "fifo", "dir"])
def test_logs_and_metrics_are_never_appended_through_a_link_or_to_a_non_file(tmp_path, kind):
    import os

    from titan_pipe.io.atomic import open_append
    from titan_pipe.io.faults import as_fault

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    log = tmp_path / "train.log"
    {"symlink": lambda: log.symlink_to(victim), "fifo": lambda: os.mkfifo(log), "dir": log.mkdir}[kind]()
    with pytest.raises(OSError) as e:
        open_append(log)
    assert victim.read_text() == "precious\n"
    fault = as_fault(e.value, path=log, what="the training log")
    assert fault is not None and str(log) in str(fault)


# --- every value from a file or flag checked where it is read -----------------------------------


def test_a_batch_the_demo_corpus_cannot_fill_is_refused_before_launch(tmp_path):
    import yaml

    flow = tmp_path / "flow.yaml"
    flow.write_text(
        yaml.safe_dump(
            {"name": "x", "runs_dir": str(tmp_path / "runs"), "device": "cpu", "train": {"batch_size": 1048576}}
        )
    )
    code, text = cli("train", flow)
    _one_line(code, text, 2, "data.path: null (the shipped demo corpus)", "train.batch_size 1048576")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "extra",
    ["oops", {"tokenizer": 7}, {"attached": {"tokenizer.json": {"size": "big"}}}],
    ids=["string", "tokenizer-int", "attached-size-str"],
)
def test_a_manifest_extra_of_the_wrong_type_is_one_line(hf_src, tmp_path, extra):
    """`"extra": "oops"` in a manifest was an AttributeError traceback (55 lines) in convert."""
    from titan_pipe.convert.api import convert_checkpoint

    ckpt = convert_checkpoint(hf_src, tmp_path / "ckpt", ConvertConfig(tp=2)).out_dir
    m = json.loads((ckpt / "manifest.json").read_text())
    m["extra"] = extra
    (ckpt / "manifest.json").write_text(json.dumps(m))
    code, text = cli("convert", ckpt, "-o", tmp_path / "out")
    _one_line(code, text, 1, str(ckpt / "manifest.json"), "extra")
    assert not (tmp_path / "out").exists()


def test_nan_and_inf_in_flow_yaml_and_numbers_yaml_reads_as_strings(tmp_path):
    flow = tmp_path / "flow.yaml"
    flow.write_text(
        "name: x\ndata:\n  blend:\n    - {path: a, weight: .inf}\ntrain:\n  optimizer: {lr: 1e-3}\n  grad_clip: .nan\n"
    )
    code, text = cli("validate", flow)
    _one_line(
        code,
        text,
        2,
        "data.blend.0.weight: Input should be a finite number",
        "train.grad_clip: Input should be a finite number",
        "train.optimizer.lr",
        "YAML read '1e-3' as a string: write a number with a dot",
    )


def test_every_unknown_key_is_listed_in_one_pass(tmp_path):
    flow = tmp_path / "flow.yaml"
    flow.write_text(
        "name: x\ndata: {zz1: 1}\nevaluate: {zz2: 1, thresholds: {float32: {zz3: 1}}}\nexport: {zz4: 1}\nzz5: 1\n"
    )
    code, text = cli("validate", flow)
    assert code == 2
    for key in ("data.zz1", "evaluate.zz2", "float32.zz3", "export.zz4", "zz5: unknown key"):
        assert key in text, (key, text)


def test_a_jsonl_record_with_its_text_field_twice_is_refused(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text(
        '{"text": "fine"}\n{"meta": {"text": "nested is fine"}, "text": "ok"}\n{"text": "first", "text": "second"}\n'
    )
    code, text = cli("data", "prepare", src, "-o", tmp_path / "out")
    _one_line(code, text, 1, f"{src}:3", "the field 'text' 2 times")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["negative-length", "overlapping-pointers", "permuted-documents"])
def test_a_damaged_index_is_refused_before_a_rank_starts(tmp_path, damage):
    """An .idx with a negative length, overlapping pointers or a permuted document index was accepted,
    and training read the .bin as one stream: not what the index describes."""
    import numpy as np
    import yaml

    from titan_pipe.tokens.indexed import HEADER, IndexWriter, read_header

    prefix = tmp_path / "d"
    w = IndexWriter(prefix, np.dtype(np.uint16))
    rng = np.random.default_rng(0)
    lengths = np.array([300, 200, 400, 250, 350], np.int64)
    w.add_chunk(rng.integers(0, 250, int(lengths.sum())).astype(np.uint16), lengths)
    w.finish()
    idx = tmp_path / "d.idx"
    raw = bytearray(idx.read_bytes())
    h = read_header(idx)
    s = h.n_sequences
    at_len, at_ptr, at_doc = HEADER.size, HEADER.size + 4 * s, HEADER.size + 12 * s
    if damage == "negative-length":
        raw[at_len + 4 : at_len + 8] = np.int32(-5).tobytes()
    elif damage == "overlapping-pointers":
        raw[at_ptr + 16 : at_ptr + 24] = np.int64(100).tobytes()  # sequence 2 starts inside sequence 0
    else:
        doc = np.frombuffer(bytes(raw[at_doc : at_doc + 8 * h.n_doc_entries]), np.int64).copy()
        doc[2], doc[3] = doc[3], doc[2]
        raw[at_doc : at_doc + 8 * h.n_doc_entries] = doc.tobytes()
    idx.write_bytes(bytes(raw))
    flow = tmp_path / "flow.yaml"
    flow.write_text(
        yaml.safe_dump(
            {
                "name": "x",
                "runs_dir": str(tmp_path / "runs"),
                "device": "cpu",
                "data": {"path": str(prefix)},
                "train": {"batch_size": 2, "seq_len": 16},
            }
        )
    )
    before = idx.read_bytes()
    for cmd in ("validate", "train"):
        code, text = cli(cmd, flow)
        assert code in (1, 2) and str(idx) in text and "Traceback" not in text, text
        assert {
            "negative-length": "cannot be negative",
            "overlapping-pointers": "back to back",
            "permuted-documents": "sequence order",
        }[damage] in text, text
    assert idx.read_bytes() == before and not (tmp_path / "runs").exists()


def test_a_killed_evaluates_scratch_dir_is_removed_by_the_next_one(tmp_path, monkeypatch):
    """kill -9 of `evaluate --checkpoint` left $TMPDIR/titan-eval-dist-* that no later run removed."""
    import os
    import subprocess
    import sys
    import tempfile

    from titan_pipe.io.atomic import _HOST, scratch_dir

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    tempfile.tempdir = None  # re-read TMPDIR
    try:
        dead = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
        ).stdout.strip()
        stale = tmp_path / f"titan-eval-dist-{_HOST}-{dead}-0badc0de"
        stale.mkdir()
        (stale / "tokens.safetensors").write_text("x")
        alive = tmp_path / f"titan-eval-dist-{_HOST}-{os.getppid()}-0badc0de"  # a live owner: kept
        alive.mkdir()
        with scratch_dir("titan-eval-dist") as mine:
            assert mine.is_dir() and mine.parent == tmp_path
            assert not stale.exists() and alive.exists()
        assert not mine.exists()
    finally:
        tempfile.tempdir = None


def test_more_data_files_than_tensors_writes_no_empty_file(hf_src, tmp_path):
    from titan_pipe.convert.onnx.export import export_model
    from titan_pipe.model.params import native_shapes
    from titan_pipe.model.unified_dir import read_model_args

    n = len(native_shapes(read_model_args(hf_src)))
    res = export_model(hf_src, tmp_path / "onnx", ExportConfig(kv_cache=False, atc=False, data_files=64))
    files = sorted((tmp_path / "onnx").glob("model.onnx.data*"))
    assert len(files) == min(64, n) and all(f.stat().st_size > 0 for f in files), [f.name for f in files]
    assert list(res.summary.data_files) == [f.name for f in files]


def test_an_output_inside_a_bind_mount_alias_of_the_source_is_refused_first(hf_src, tmp_path):
    """-o into the source through a bind mount (another name, the same directory) was found only after
    the whole conversion; now before a byte is written, by device and inode."""
    import shutil
    import subprocess

    src = tmp_path / "src"
    shutil.copytree(hf_src, src)
    alias = tmp_path / "alias"
    alias.mkdir()
    if subprocess.run(["mount", "--bind", str(src), str(alias)], capture_output=True).returncode != 0:
        pytest.skip("cannot bind-mount here")
    try:
        before = sorted(p.name for p in src.iterdir())
        code, text = cli("convert", src, "-o", alias / "out")
        _one_line(code, text, 1, "must lie outside the source")
        assert sorted(p.name for p in src.iterdir()) == before
    finally:
        subprocess.run(["umount", str(alias)], check=False)


@pytest.mark.distributed
def test_too_few_file_descriptors_for_torchrun_is_named_with_its_fix(tmp_path):
    """EMFILE in torchrun (ulimit -n 20) was reported as "torchrun exited with status 1"."""
    import resource
    import subprocess
    import sys

    import yaml

    flow = tmp_path / "flow.yaml"
    flow.write_text(
        yaml.safe_dump(
            {
                "name": "e",
                "runs_dir": str(tmp_path / "runs"),
                "device": "cpu",
                "parallel": {"dp": 1, "tp": 2, "pp": 1},
                "train": {"steps": 2, "batch_size": 2, "seq_len": 16},
            }
        )
    )
    p = subprocess.run(
        [sys.executable, "-m", "titan_pipe.cli", "train", str(flow)],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (20, 20)),
    )
    out = p.stdout + p.stderr
    errors = [ln for ln in out.splitlines() if ln.startswith("error")]
    assert p.returncode == 1 and len(errors) == 1, out[-3000:]
    assert "EMFILE" in errors[0] and "ulimit -n" in errors[0] and "Traceback" not in out, errors


@pytest.mark.parametrize("command", ["convert", "export", "inspect"])
def test_an_unreadable_weights_file_is_named_as_unreadable(hf_src, tmp_path, monkeypatch, command):
    """An unreadable weights file read as "No such file". (CI runs as root, who reads anything: the
    permission is taken away by the access check the readers make.)"""
    import os

    weights = hf_src / "model.safetensors"
    real = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode, **kw: False if str(p) == str(weights) and mode & os.R_OK else real(p, mode, **kw)
    )
    argv = {
        "convert": ("convert", hf_src, "-o", tmp_path / "out"),
        "export": ("export", hf_src, "-o", tmp_path / "out", "--no-atc"),
        "inspect": ("inspect", hf_src),
    }[command]
    code, text = cli(*argv)
    _one_line(code, text, 1, str(weights), "cannot be read by this user (permission denied)")
    assert "No such file" not in text and not (tmp_path / "out").exists()
