"""Exported graphs in ONNX Runtime against our PyTorch model (and transformers), on the debug model."""

import json

import numpy as np
import onnx
import pytest
import torch
import xxhash

from export_support import debug_model, hidden_states, write_unified
from titan_pipe.config import ExportConfig
from titan_pipe.convert.onnx.export import export_model
from titan_pipe.graphs.graph_io import data_file_names
from titan_pipe.graphs.generation import generate_padded
from titan_pipe.io.safetensors_io import read_header

ort = pytest.importorskip("onnxruntime")

FP16_MAX_ABS = 1e-2  # fp16 graph vs fp32 PyTorch on the debug model (observed ~2e-3; logits up to ~4)


def _session(path):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _feeds(tokens) -> dict:
    """Prefill inputs for unpadded sequences: every token real, positions 0..T-1."""
    ids = np.asarray(tokens, dtype=np.int64)
    b, t = ids.shape
    return {
        "input_ids": ids,
        "attention_mask": np.ones((b, t), np.int64),
        "position_ids": np.tile(np.arange(t, dtype=np.int64), (b, 1)),
    }


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The debug model, exported once: dynamic fp32, KV cache, hidden-state outputs."""
    root = tmp_path_factory.mktemp("export")
    model, args = debug_model()
    src = write_unified(model, args, root / "model")
    result = export_model(src, root / "onnx", ExportConfig(expose_hidden=True, atc=False))
    return model, args, result


@pytest.mark.parametrize("batch,seq", [(1, 1), (1, 17), (3, 5), (2, 64)])
def test_dynamic_prefill_matches_pytorch(exported, batch, seq):
    model, args, result = exported
    sess = _session(result.onnx)
    tokens = torch.randint(0, args.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seq))
    outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, _feeds(tokens))))
    with torch.no_grad():
        ref = model(tokens).numpy()
        ref_hidden = [h.numpy() for h in hidden_states(model, tokens)]
    assert outs["logits"].shape == ref.shape
    assert np.abs(outs["logits"] - ref).max() <= 1e-4
    for i, h in enumerate(ref_hidden):
        assert np.abs(outs[f"hidden.{i}"] - h).max() <= 1e-4, i
    assert outs["present.0.key"].shape == (batch, args.kv_heads, seq, args.head_dim)


def test_prefill_then_greedy_decode_matches_full_sequence(exported):
    """Aligned prompts through the fixed-capacity cache loop vs re-running the full sequence in PyTorch."""
    model, args, result = exported
    prefill, decode = _session(result.onnx), _session(result.decode_onnx)
    prompt = torch.randint(0, args.vocab_size, (2, 7), generator=torch.Generator().manual_seed(5))
    steps = 6
    seq = prompt.clone()
    ref_logits = []
    with torch.no_grad():
        for _ in range(steps):
            last = model(seq)[:, -1]
            ref_logits.append(last.numpy())
            seq = torch.cat([seq, last.argmax(-1, keepdim=True)], dim=1)
    gen = generate_padded(
        prefill=prefill,
        decode=decode,
        input_ids=prompt.numpy(),
        attention_mask=np.ones((2, 7), np.int64),
        max_new_tokens=steps,
        cache_len=7 + steps - 1,
    )
    assert np.abs(gen.logits - np.stack(ref_logits, axis=1)).max() <= 1e-4
    assert np.array_equal(gen.new_tokens, seq[:, 7:].numpy())


def test_export_never_loads_the_model(tmp_path, monkeypatch):
    """The graphs are built from config.json and the safetensors headers; weights are streamed."""
    import titan_pipe.model.load as unified

    def refuse(*a, **k):
        raise AssertionError("export loaded the whole model")

    monkeypatch.setattr(unified, "load_unified_model", refuse)
    model, args = debug_model()
    src = write_unified(model, args, tmp_path / "model")
    result = export_model(src, tmp_path / "onnx", ExportConfig(kv_cache=False, atc=False, hash_weights=False))
    files = json.loads(result.export_json.read_text())["files"]
    for name in data_file_names(ExportConfig().data_files):
        assert files[name]["digest"] is None  # --no-hash-weights: the one pass skipped
    assert files["model.onnx"] == {
        "bytes": result.onnx.stat().st_size,
        "algorithm": "xxh3_128",
        "digest": xxhash.xxh3_128(result.onnx.read_bytes()).hexdigest(),
    }
    tokens = torch.randint(0, args.vocab_size, (1, 9))
    with torch.no_grad():
        assert np.abs(_session(result.onnx).run(["logits"], _feeds(tokens))[0] - model(tokens).numpy()).max() <= 1e-4


def test_graph_is_atc_shaped(exported):
    _, _, result = exported
    record = json.loads(result.export_json.read_text())
    for path in (result.onnx, result.decode_onnx):
        m = onnx.load(str(path), load_external_data=False)
        opset = [i.version for i in m.opset_import if i.domain in ("", "ai.onnx")][0]
        assert opset == 14 and all(i.domain in ("", "ai.onnx") for i in m.opset_import)
        kinds = {n.op_type for n in m.graph.node}
        assert not kinds & {"LayerNormalization", "RMSNormalization", "RotaryEmbedding", "Trilu", "Einsum"}
        assert {"Pow", "ReduceMean", "Sqrt", "Div"} <= kinds  # RMSNorm, decomposed
        for node in m.graph.node:  # no operator newer than the declared opset
            assert onnx.defs.get_schema(node.op_type, opset).since_version <= opset
        banned = {onnx.TensorProto.BFLOAT16, onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128}
        assert not {t.data_type for t in m.graph.initializer} & banned
        ops = {o["op_type"]: o["count"] for o in record["graphs"][path.name]["operators"]}
        assert ops["Gemm"] == sum(n.op_type == "Gemm" for n in m.graph.node) == 7 * 4 + 1  # 7 linears/layer + head
        assert "Transpose" not in {
            n.op_type for n in m.graph.node if any(i in {t.name for t in m.graph.initializer} for i in n.input)
        }
    assert record["graphs"]["model.onnx"]["inputs"] == {
        "input_ids": ["batch", "seq"],
        "attention_mask": ["batch", "seq"],
        "position_ids": ["batch", "seq"],
    }
    for name, info in record["files"].items():  # the default digest, by the xxhash package itself
        assert info["algorithm"] == "xxh3_128"
        assert xxhash.xxh3_128((result.out_dir / name).read_bytes()).hexdigest() == info["digest"]
    assert record["atc"]["status"] == "skipped" and result.atc_status == "skipped"
    assert (result.out_dir / "atc" / "command.sh").is_file()


def test_fp16_graph_within_tolerance(tmp_path):
    model, args = debug_model()
    src = write_unified(model, args, tmp_path / "model")
    result = export_model(src, tmp_path / "onnx", ExportConfig(dtype="float16", kv_cache=False, atc=False))
    assert result.decode_onnx is None and not (tmp_path / "onnx" / "decode.onnx").exists()
    m = onnx.load(str(result.onnx))
    assert {t.data_type for t in m.graph.initializer if t.name.startswith("layers.")} == {onnx.TensorProto.FLOAT16}
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    got = _session(result.onnx).run(["logits"], _feeds(tokens))[0]
    with torch.no_grad():
        ref = model(tokens).numpy()
    assert got.dtype == np.float16
    assert np.abs(got.astype(np.float32) - ref).max() <= FP16_MAX_ABS


def test_transformers_checkpoint_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from titan_pipe.model.hf_config import to_hf_config

    _, args = debug_model()
    cfg = transformers.LlamaConfig(
        **{k: v for k, v in to_hf_config(args).items() if k not in ("architectures", "torch_dtype")}
    )
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    result = export_model(tmp_path / "hf", tmp_path / "onnx", ExportConfig(kv_cache=False, atc=False))
    tokens = torch.randint(0, args.vocab_size, (2, 19), generator=torch.Generator().manual_seed(4))
    got = _session(result.onnx).run(["logits"], _feeds(tokens))[0]
    with torch.no_grad():
        ref = hf(tokens).logits.numpy()
    assert np.abs(got - ref).max() <= 1e-4


def test_weights_streamed_into_shared_data_files(exported, tmp_path):
    """Both graphs point every weight at the same page-aligned bytes of one of the data files; the
    tensors of a file do not overlap, the files' sizes are within one tensor of each other, and the
    bytes are the safetensors tensor's, bit for bit (fp32 -> fp32)."""
    model, args, result = exported
    src = result.out_dir.parent / "model" / "model.safetensors"
    header, _ = read_header(src)
    names = data_file_names(ExportConfig().data_files)
    assert len(names) == 2 and names[0].startswith("model.onnx.data")
    places = {}
    for path in (result.onnx, result.decode_onnx):
        m = onnx.load(str(path), load_external_data=False)
        for t in m.graph.initializer:
            if t.data_location != onnx.TensorProto.EXTERNAL:
                continue
            info = {e.key: e.value for e in t.external_data}
            assert info["location"] in names and int(info["offset"]) % 4096 == 0
            place = (info["location"], int(info["offset"]), int(info["length"]))
            assert places.setdefault(t.name, place) == place
    assert sorted(p.name for p in result.out_dir.iterdir() if "onnx" in p.name) == sorted(
        ["decode.onnx", "model.onnx", *names]
    )
    sizes = {f: (result.out_dir / f).stat().st_size for f in names}
    for f in names:
        spans = sorted((off, off + n) for loc, off, n in places.values() if loc == f)
        assert spans and all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), f  # no overlap
        assert spans[-1][1] == sizes[f]
    assert abs(sizes[names[0]] - sizes[names[1]]) <= max(n for _, _, n in places.values()) + 4096
    data = {f: (result.out_dir / f).read_bytes() for f in names}
    raw = src.read_bytes()
    checked = set()
    for name, stored in (
        ("layers.2.w2", "model.layers.2.mlp.down_proj.weight"),
        ("tok_embeddings.weight", "model.embed_tokens.weight"),
        ("layers.1.wq", "model.layers.1.self_attn.q_proj.weight"),
        ("layers.3.w1", "model.layers.3.mlp.gate_proj.weight"),
    ):
        loc, off, n = places[name]
        s = header[stored]
        assert data[loc][off : off + n] == raw[s.start : s.start + s.nbytes], name
        checked.add(loc)
    assert checked == set(names)  # the tensors compared lie in both files

    bf16 = write_unified(model, args, tmp_path / "bf16", dtype=torch.bfloat16)
    out = export_model(bf16, tmp_path / "onnx", ExportConfig(kv_cache=False, atc=False))
    init = next(t for t in onnx.load(str(out.onnx)).graph.initializer if t.name == "layers.1.wq")
    want = model.layers["1"].attention.wq.weight.detach().to(torch.bfloat16).float().numpy()
    assert np.array_equal(onnx.numpy_helper.to_array(init), want)


def test_tied_embeddings_and_llama3_rope(tmp_path):
    model, args = debug_model(
        tie_embeddings=True,
        n_kv_heads=4,
        rope_theta=500000.0,
        rope_scaling={
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )
    src = write_unified(model, args, tmp_path / "model")
    result = export_model(src, tmp_path / "onnx", ExportConfig(kv_cache=False, atc=False))
    tokens = torch.randint(0, args.vocab_size, (2, 100), generator=torch.Generator().manual_seed(7))
    got = _session(result.onnx).run(["logits"], _feeds(tokens))[0]
    with torch.no_grad():
        assert np.abs(got - model(tokens).numpy()).max() <= 1e-4
