"""Exported graphs in ONNX Runtime against our PyTorch model (and transformers), on the debug model."""
import json

import numpy as np
import onnx
import pytest
import torch

from export_support import debug_model, hidden_states, write_unified
from titan_pipe.convert.onnx.export import export_model
from titan_pipe.convert.onnx.files import gather_external_data, share_external_data
from titan_pipe.hashing import sha256_file

ort = pytest.importorskip("onnxruntime")

FP16_MAX_ABS = 1e-2  # fp16 graph vs fp32 PyTorch on the debug model (observed ~2e-3; logits up to ~4)


def _session(path):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The debug model, exported once: dynamic fp32, KV cache, hidden-state outputs."""
    root = tmp_path_factory.mktemp("export")
    model, args = debug_model()
    src = write_unified(model, args, root / "model")
    result = export_model(model_dir=src, out_dir=root / "onnx", expose_hidden=True, run_atc=False)
    return model, args, result


@pytest.mark.parametrize("batch,seq", [(1, 1), (1, 17), (3, 5), (2, 64)])
def test_dynamic_prefill_matches_pytorch(exported, batch, seq):
    model, args, result = exported
    sess = _session(result.onnx)
    tokens = torch.randint(0, args.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seq))
    outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"input_ids": tokens.numpy()})))
    with torch.no_grad():
        ref = model(tokens).numpy()
        ref_hidden = [h.numpy() for h in hidden_states(model, tokens)]
    assert outs["logits"].shape == ref.shape
    assert np.abs(outs["logits"] - ref).max() <= 1e-4
    for i, h in enumerate(ref_hidden):
        assert np.abs(outs[f"hidden.{i}"] - h).max() <= 1e-4, i
    assert outs["present.0.key"].shape == (batch, args.kv_heads, seq, args.head_dim)


def test_prefill_then_greedy_decode_matches_full_sequence(exported):
    model, args, result = exported
    prefill, decode = _session(result.onnx), _session(result.decode_onnx)
    past_names = [i.name for i in decode.get_inputs()][1:]
    n_layers = args.n_layers
    prompt = torch.randint(0, args.vocab_size, (2, 7), generator=torch.Generator().manual_seed(5))
    steps = 6

    # Reference: greedy generation by re-running the full sequence in PyTorch.
    seq = prompt.clone()
    ref_logits = []
    with torch.no_grad():
        for _ in range(steps):
            last = model(seq)[:, -1]
            ref_logits.append(last.numpy())
            seq = torch.cat([seq, last.argmax(-1, keepdim=True)], dim=1)

    outs = prefill.run(None, {"input_ids": prompt.numpy()})
    logits, past = outs[0][:, -1], outs[1:1 + 2 * n_layers]
    tokens = [prompt.numpy()]
    for step in range(steps):
        assert np.abs(logits - ref_logits[step]).max() <= 1e-4, step
        nxt = logits.argmax(-1)[:, None].astype(np.int64)
        tokens.append(nxt)
        outs = decode.run(None, {"input_ids": nxt, **dict(zip(past_names, past))})
        logits, past = outs[0][:, -1], outs[1:1 + 2 * n_layers]
        assert past[0].shape[2] == prompt.shape[1] + step + 1
    assert np.array_equal(np.concatenate(tokens, axis=1), seq.numpy())


def test_decode_several_new_tokens_at_once(exported):
    model, args, result = exported
    prefill, decode = _session(result.onnx), _session(result.decode_onnx)
    past_names = [i.name for i in decode.get_inputs()][1:]
    full = torch.randint(0, args.vocab_size, (3, 12), generator=torch.Generator().manual_seed(9))
    past = prefill.run(None, {"input_ids": full[:, :8].numpy()})[1:1 + 2 * args.n_layers]
    got = decode.run(["logits"], {"input_ids": full[:, 8:].numpy(), **dict(zip(past_names, past))})[0]
    with torch.no_grad():
        ref = model(full)[:, 8:].numpy()
    assert np.abs(got - ref).max() <= 1e-4


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
        assert ops["MatMul"] == sum(n.op_type == "MatMul" for n in m.graph.node)
        assert "Transpose" not in {n.op_type for n in m.graph.node
                                   if any(i in {t.name for t in m.graph.initializer} for i in n.input)}
    assert record["graphs"]["model.onnx"]["inputs"] == {"input_ids": ["batch", "seq"]}
    for name, info in record["files"].items():
        assert sha256_file(result.out_dir / name) == info["sha256"]
    assert record["atc"]["status"] == "skipped" and result.atc_status == "skipped"
    assert (result.out_dir / "atc" / "command.sh").is_file()


def test_fp16_graph_within_tolerance(tmp_path):
    model, args = debug_model()
    src = write_unified(model, args, tmp_path / "model")
    result = export_model(model_dir=src, out_dir=tmp_path / "onnx", dtype="float16", kv_cache=False,
                          run_atc=False)
    assert result.decode_onnx is None and not (tmp_path / "onnx" / "decode.onnx").exists()
    m = onnx.load(str(result.onnx))
    assert {t.data_type for t in m.graph.initializer if t.name.startswith("layers.")} == {onnx.TensorProto.FLOAT16}
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    got = _session(result.onnx).run(["logits"], {"input_ids": tokens.numpy()})[0]
    with torch.no_grad():
        ref = model(tokens).numpy()
    assert got.dtype == np.float16
    assert np.abs(got.astype(np.float32) - ref).max() <= FP16_MAX_ABS


def test_transformers_checkpoint_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from titan_pipe.names import to_hf_config

    _, args = debug_model()
    cfg = transformers.LlamaConfig(**{k: v for k, v in to_hf_config(args).items()
                                      if k not in ("architectures", "torch_dtype")})
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    result = export_model(model_dir=tmp_path / "hf", out_dir=tmp_path / "onnx", kv_cache=False, run_atc=False)
    tokens = torch.randint(0, args.vocab_size, (2, 19), generator=torch.Generator().manual_seed(4))
    got = _session(result.onnx).run(["logits"], {"input_ids": tokens.numpy()})[0]
    with torch.no_grad():
        ref = hf(tokens).logits.numpy()
    assert np.abs(got - ref).max() <= 1e-4


def test_external_data_gathered_and_shared(exported, tmp_path):
    """The >2 GB path on small graphs: one tensor per file (as the exporter writes them) -> one .data
    file, then the decode graph pointed at the prefill graph's data file; results unchanged."""
    _, args, result = exported
    for name in ("model.onnx", "decode.onnx"):  # each in its own scratch dir, as export does
        scratch = tmp_path / f".{name}.scratch"
        scratch.mkdir()
        onnx.save_model(onnx.load(str(result.out_dir / name)), str(scratch / name), save_as_external_data=True,
                        all_tensors_to_one_file=False, size_threshold=0)
        assert len(list(scratch.iterdir())) > 10
        gather_external_data(scratch / name)
        for f in scratch.iterdir():
            f.rename(tmp_path / f.name)
        scratch.rmdir()
    data = tmp_path / "model.onnx.data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode.onnx", "decode.onnx.data", "model.onnx",
                                                         "model.onnx.data"]
    saved = share_external_data(tmp_path / "model.onnx", tmp_path / "decode.onnx")
    assert saved > 0.9 * data.stat().st_size and not (tmp_path / "decode.onnx.data").exists()
    onnx.checker.check_model(str(tmp_path / "decode.onnx"), full_check=True)
    tokens = torch.randint(0, args.vocab_size, (2, 6)).numpy()
    ref = _session(result.onnx).run(None, {"input_ids": tokens})
    got = _session(tmp_path / "model.onnx").run(None, {"input_ids": tokens})
    assert all(np.array_equal(a, b) for a, b in zip(ref, got))
    names = [i.name for i in _session(result.decode_onnx).get_inputs()]
    feed = {"input_ids": tokens[:, :1], **dict(zip(names[1:], ref[1:1 + 2 * args.n_layers]))}
    assert all(np.array_equal(a, b) for a, b in zip(_session(result.decode_onnx).run(None, feed),
                                                    _session(tmp_path / "decode.onnx").run(None, feed)))


def test_tied_embeddings_and_llama3_rope(tmp_path):
    model, args = debug_model(tie_embeddings=True, n_kv_heads=4, rope_theta=500000.0,
                              rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 32})
    src = write_unified(model, args, tmp_path / "model")
    result = export_model(model_dir=src, out_dir=tmp_path / "onnx", kv_cache=False, run_atc=False)
    tokens = torch.randint(0, args.vocab_size, (2, 100), generator=torch.Generator().manual_seed(7))
    got = _session(result.onnx).run(["logits"], {"input_ids": tokens.numpy()})[0]
    with torch.no_grad():
        assert np.abs(got - model(tokens).numpy()).max() <= 1e-4
