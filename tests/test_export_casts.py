"""Export's casts without torch: titan_pipe.convert.casts against torch's Tensor.to, bit for bit, and the
exported weights bit-identical to what the torch path wrote (every dtype pair, edge values planted)."""

import errno
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
import xxhash

from export_support import debug_model, write_unified
from titan_pipe.config import ExportConfig
from titan_pipe.convert.casts import BLOCK, bits_dtype, cast_bits
from titan_pipe.convert.onnx import data_file
from titan_pipe.convert.onnx.export import export_model
from titan_pipe.model.params import initializer_names
from titan_pipe.graphs.graph_io import data_file_names
from titan_pipe.model import rope
from titan_pipe.model.args import FLAVOURS, resolve_args
from titan_pipe.model.names import native_to_hf
from titan_pipe.model.transformer import rope_cos_sin, rope_inv_freq

TORCH = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
INT = {"F32": torch.int32, "F16": torch.int16, "BF16": torch.int16}
PAIRS = [("F32", "F16"), ("BF16", "F16"), ("BF16", "F32"), ("F16", "F32")]


def torch_cast(bits: np.ndarray, src: str, dst: str) -> np.ndarray:
    """The reference: torch's own .to() on the same bits (a vector-width multiple: torch's vectorised path)."""
    x = torch.from_numpy(bits.view(np.int32 if src == "F32" else np.int16).copy()).view(TORCH[src])
    return x.to(TORCH[dst]).view(INT[dst]).numpy().view(bits_dtype(dst))


def f32_edge_bits() -> np.ndarray:
    """Every fp32 exponent with mantissas at each rounding boundary (ties, just above/below, all ones),
    both signs: fp16 subnormals, the overflow edge near 65520, infinities, quiet and signalling NaNs."""
    mant = {0, 1, 0x7FFFFF, 0x400000, 0x200000, 0x3FFFFF}
    for k in range(23):
        mant |= {(1 << k) - 1 & 0x7FFFFF, 1 << k, (1 << k) + 1, (3 << k) & 0x7FFFFF, ((1 << k) - 1) | 0x400000}
    mant |= set(np.random.default_rng(0).integers(0, 1 << 23, 64).tolist())
    m = np.array(sorted(mant), dtype=np.uint32)
    e = np.arange(256, dtype=np.uint32) << 23
    bits = (e[:, None] | m[None, :]).ravel()
    bits = np.concatenate([bits, bits | np.uint32(0x80000000)])
    return np.resize(bits, -(-len(bits) // 64) * 64)  # a multiple of any vector width


@pytest.mark.parametrize("src,dst", PAIRS)
def test_cast_matches_torch_on_edges_and_random_bits(src, dst):
    rng = np.random.default_rng(1)
    if src == "F32":
        bits = np.concatenate([f32_edge_bits(), rng.integers(0, 1 << 32, 1 << 18, dtype=np.uint64).astype(np.uint32)])
    else:  # every 16-bit pattern, then random ones past a BLOCK boundary
        bits = np.concatenate(
            [
                np.arange(1 << 16, dtype=np.uint32).astype(np.uint16),
                rng.integers(0, 1 << 16, BLOCK + 64, dtype=np.uint32).astype(np.uint16),
            ]
        )
    out = np.empty(len(bits), bits_dtype(dst))
    cast_bits(bits, src, out, dst)
    want = torch_cast(bits, src, dst)
    bad = np.flatnonzero(out != want)
    assert not len(bad), [(hex(bits[i]), hex(out[i]), hex(want[i])) for i in bad[:5]]


def test_f32_to_f16_rules_spelled_out():
    """The rules themselves, not only agreement: ties to even, subnormals, overflow to inf, NaNs quieted
    with their top payload bits and sign kept."""
    cases = {
        0x3F801000: 0x3C00,  # 1 + 2^-11: a tie, the even neighbour (1.0) wins
        0x3F803000: 0x3C02,  # 1 + 3*2^-11: a tie, rounds up to the even 1 + 2^-9
        0x3F801001: 0x3C01,  # just above the tie
        0x33800000: 0x0001,  # 2^-24: the smallest fp16 subnormal
        0x33000000: 0x0000,  # 2^-25: a tie with 0, which is even
        0x33000001: 0x0001,
        0x477FEFFF: 0x7BFF,  # just below 65520: 65504, the largest fp16
        0x477FF000: 0x7C00,  # 65520: a tie between 65504 and 65536, which overflows to inf
        0xFF800000: 0xFC00,
        0x7F800001: 0x7E00,  # signalling NaN, payload below fp16's reach: quiet NaN
        0xFF802000: 0xFE01,  # signalling NaN: quieted, top payload bits and sign kept
        0x7FC00000: 0x7E00,
    }
    bits = np.array(list(cases), dtype=np.uint32)
    out = np.empty(len(bits), np.uint16)
    cast_bits(bits, "F32", out, "F16")
    assert [hex(v) for v in out] == [hex(v) for v in cases.values()]


@pytest.mark.slow
def test_f32_to_f16_every_bit_pattern():
    """All 2^32 fp32 patterns (~11 min on the shared 2-core machine)."""
    step = 1 << 24
    out = np.empty(step, np.uint16)
    for start in range(0, 1 << 32, step):
        bits = np.arange(start, start + step, dtype=np.uint64).astype(np.uint32)
        cast_bits(bits, "F32", out, "F16")
        assert np.array_equal(out, torch_cast(bits, "F32", "F16")), hex(start)


def test_rope_frequencies_and_tables():
    """The numpy frequencies are the module's (bit for bit, every flavour, Llama-3.1 scaling); the
    exported tables are within one fp32 unit in the last place of the module's torch tables."""
    scaled = resolve_args(
        "debug",
        rope_theta=500000.0,
        rope_scaling={
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )
    for args in [*FLAVOURS.values(), scaled]:
        assert np.array_equal(rope_inv_freq(args).numpy(), rope.inv_freq(args))
        rows = min(args.max_seq_len, 2048)
        for ours, theirs in zip(rope.cos_sin(args, rows), rope_cos_sin(args, rows)):
            ulps = np.abs(ours.view(np.int32).astype(np.int64) - theirs.numpy().view(np.int32))
            assert ours.shape == tuple(theirs.shape) and ulps.max() <= 1


def test_rope_frequencies_match_the_float64_formula():
    """An independent reference for the Llama-3.1 scaling: the formula, element by element in Python floats."""
    import math

    args = resolve_args("llama3_8b")
    s, hd = args.rope_scaling, args.head_dim
    want = []
    for i in range(0, hd, 2):
        f = 1.0 / args.rope_theta ** (i / hd)
        wavelen = 2 * math.pi / f
        if wavelen > s.original_max_position_embeddings / s.low_freq_factor:
            f = f / s.factor
        elif wavelen >= s.original_max_position_embeddings / s.high_freq_factor:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            f = (1 - smooth) * f / s.factor + smooth * f
        want.append(f)
    assert np.allclose(rope.inv_freq(args), np.array(want, np.float32), rtol=2e-7, atol=0)


# -- the export's weights -------------------------------------------------------------------------


def plant_edges(model) -> None:
    """Values that exercise every cast rule in one weight: NaN payloads, infinities, fp16 subnormals and
    overflow, ties. (The model need not be usable: only the bytes are compared.)"""
    bits = torch.from_numpy(f32_edge_bits()[:4096].view(np.int32).copy()).view(torch.float32)
    w = model.layers["0"].feed_forward.w2.weight
    with torch.no_grad():
        w.view(-1)[: len(bits)] = bits


def exported_bytes(out_dir) -> dict[str, bytes]:
    """Initializer name -> its bytes in the data file the graph names for it."""
    graph = onnx.load(str(out_dir / "model.onnx"), load_external_data=False).graph
    data, out = {}, {}
    for t in graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: int(e.value) if e.key != "location" else e.value for e in t.external_data}
            raw = data.setdefault(info["location"], (out_dir / info["location"]).read_bytes())
            out[t.name] = raw[info["offset"] : info["offset"] + info["length"]]
    return out


@pytest.fixture(scope="module")
def edge_model():
    model, args = debug_model()
    plant_edges(model)
    return model, args


REFERENCE_DIGESTS = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}  # the packages' own, not ours


@pytest.mark.parametrize(
    "src,dst,digest,n_files",
    [
        ("bfloat16", "float16", "xxh3_128", 2),
        ("float32", "float16", "sha256", 1),
        ("float16", "float16", "xxh3_128", 3),
        ("bfloat16", "float32", "sha256", 2),
        ("float16", "float32", "xxh3_128", 1),
        ("float32", "float32", "sha256", 3),
        ("float16", "float16", "sha256", 2),
        ("bfloat16", "float16", "sha256", 5),
    ],
)
def test_exported_weights_are_the_torch_cast(edge_model, tmp_path, monkeypatch, src, dst, digest, n_files):
    """Every weight's bytes in its data file equal torch's .to(dst) of the stored tensor (the old
    path's bytes), through many small chunks so the pipeline's buffers turn over, each written in
    pwrite slices that end mid-element, over 1 to 5 data files; export.json's digest of every file is
    the hashing package's own digest of its bytes, with the algorithm asked for."""
    monkeypatch.setattr(data_file, "WINDOW", 8192)
    monkeypatch.setattr(data_file, "PIECE", 2048)
    monkeypatch.setattr(data_file, "WRITE_SLICE", 1000)
    model, args = edge_model
    unified = write_unified(model, args, tmp_path / "model", dtype=getattr(torch, src), shards=2)
    out = export_model(
        unified,
        tmp_path / "onnx",
        ExportConfig(dtype=dst, kv_cache=False, atc=False, digest=digest, data_files=n_files),
    )
    got = exported_bytes(out.out_dir)
    stored = {
        native_to_hf(k): v.to(getattr(torch, src)) for k, v in model.state_dict().items() if not k.startswith("rope_")
    }
    for init, native in initializer_names(args).items():
        want = stored[native_to_hf(native)].contiguous().to(getattr(torch, dst))
        assert got[init] == want.view(torch.uint8).numpy().tobytes(), init
    assert (
        got["rope_cos"]
        == rope.cos_sin(args, args.max_seq_len)[0].astype(np.float16 if dst == "float16" else np.float32).tobytes()
    )
    files = json.loads(out.export_json.read_text())["files"]
    assert {"model.onnx", *data_file_names(n_files)} <= set(files)
    assert sorted(p.name for p in out.out_dir.glob("*.data*")) == sorted(data_file_names(n_files))
    for name, entry in files.items():
        assert entry["algorithm"] == digest, name
        assert entry["digest"] == REFERENCE_DIGESTS[digest]((out.out_dir / name).read_bytes()).hexdigest(), name


def test_kernel_copy_refused_falls_back_to_pread(edge_model, tmp_path, monkeypatch):
    """A file system pair that refuses copy_file_range (EXDEV) gives the same bytes through pread/pwrite."""

    def refuse(*a, **k):
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    monkeypatch.setattr(data_file, "WINDOW", 8192)
    monkeypatch.setattr(data_file, "PIECE", 2048)
    monkeypatch.setattr(data_file, "WRITE_SLICE", 1000)
    model, args = edge_model
    unified = write_unified(model, args, tmp_path / "model")
    out = export_model(unified, tmp_path / "onnx", ExportConfig(kv_cache=False, atc=False))
    got = exported_bytes(out.out_dir)
    want = model.layers["1"].attention.wq.weight.detach().contiguous()
    assert got["layers.1.wq"] == want.view(torch.uint8).numpy().tobytes()


def test_more_data_files_than_cores_share_the_threads(edge_model, tmp_path, monkeypatch):
    """Three data files on a one-core host: one thread writes them in turn, and the bytes are the same."""
    import threading

    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    threads, run_lane = set(), data_file.DataWriter._run_lane

    def spy(self, lane):
        threads.add(threading.current_thread().name)
        return run_lane(self, lane)

    monkeypatch.setattr(data_file.DataWriter, "_run_lane", spy)
    model, args = edge_model
    unified = write_unified(model, args, tmp_path / "model")
    out = export_model(unified, tmp_path / "onnx", ExportConfig(kv_cache=False, atc=False, data_files=3))
    assert len(threads) == 1
    assert all((out.out_dir / f).stat().st_size > 0 for f in data_file_names(3))
    got = exported_bytes(out.out_dir)
    stored = {native_to_hf(k): v for k, v in model.state_dict().items() if not k.startswith("rope_")}
    for init, native in initializer_names(args).items():
        assert got[init] == stored[native_to_hf(native)].contiguous().view(torch.uint8).numpy().tobytes(), init


def test_source_truncated_during_export_fails_cleanly(tmp_path, monkeypatch):
    """A source that shrinks after planning: one clear error from the load thread, nothing left behind."""
    from titan_pipe.convert.onnx import weights
    from titan_pipe.errors import UserError

    model, args = debug_model()
    unified = write_unified(model, args, tmp_path / "model", dtype=torch.bfloat16)
    plan = weights.plan_weights

    def plan_then_truncate(opened):
        found = plan(opened)
        path = unified / "model.safetensors"
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
        return found

    import titan_pipe.convert.onnx.export as export_mod

    monkeypatch.setattr(export_mod, "plan_weights", plan_then_truncate)
    with pytest.raises(UserError, match="ended early"):
        export_model(unified, tmp_path / "onnx", ExportConfig(dtype="float16", kv_cache=False, atc=False))
    assert not (tmp_path / "onnx").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_export_imports_no_torch(tmp_path):
    """A pure cast export (bf16 -> fp16) never imports torch: the process that runs it checks."""
    model, args = debug_model()
    unified = write_unified(model, args, tmp_path / "model", dtype=torch.bfloat16)
    code = (
        "import sys; from pathlib import Path; from titan_pipe.config import ExportConfig; "
        "from titan_pipe.convert.onnx.export import export_model; "
        f"export_model(Path({str(unified)!r}), Path({str(tmp_path / 'onnx')!r}), "
        "ExportConfig(dtype='float16', atc=False)); print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert all((tmp_path / "onnx" / f).stat().st_size > 0 for f in data_file_names(ExportConfig().data_files))
