"""Fixed-capacity KV-cache decoding: a left-padded batch through the exported pair (static and
dynamic) against transformers' own greedy `generate` on each prompt alone, and bad input."""

import json

import numpy as np
import onnx
import pytest
import torch

from export_support import debug_model, write_unified
from titan_pipe.config import ExportConfig
from titan_pipe.convert.onnx.export import export_model
from titan_pipe.graphs.generation import generate, generate_padded, ort_session
from titan_pipe.errors import UserError

ort = pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers")

T, NEW, CACHE = 16, 24, 48


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The debug model (GQA: 4 query heads over 2 kv heads) exported static and dynamic."""
    root = tmp_path_factory.mktemp("decode")
    model, args = debug_model()
    src = write_unified(model, args, root / "model")
    static = export_model(
        src, root / "static", ExportConfig(dynamic=False, batch=2, seq_len=T, cache_len=CACHE, atc=False)
    )
    dynamic = export_model(src, root / "dynamic", ExportConfig(atc=False))
    return model, args, src, static, dynamic


def _sessions(result):
    return ort_session(result.onnx, threads=1), ort_session(result.decode_onnx, threads=1)


def _prompts(args):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, args.vocab_size, (n,), generator=g).tolist() for n in (T, T // 2)]


@pytest.fixture(scope="module")
def reference(pair):
    """Per prompt alone (no padding): transformers' greedy tokens, and our PyTorch model's logits
    for every generated position of that same sequence."""
    model, args, src, _, _ = pair
    hf = transformers.LlamaForCausalLM.from_pretrained(src, torch_dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    out = []
    for p in _prompts(args):
        ids = torch.tensor([p])
        with torch.no_grad():
            seq = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False, pad_token_id=0
            )[0]
            ours = model(seq[None, :-1])[0, len(p) - 1 :].numpy()
        assert seq.shape[0] == len(p) + NEW
        out.append((seq[len(p) :].numpy(), ours))
    return out


def test_static_graphs_have_every_dim_fixed(pair):
    _, args, _, static, _ = pair
    record = json.loads(static.export_json.read_text())
    for path in (static.onnx, static.decode_onnx):
        m = onnx.load(str(path), load_external_data=False)
        for vi in list(m.graph.input) + list(m.graph.output):
            dims = vi.type.tensor_type.shape.dim
            assert dims and all(d.HasField("dim_value") and d.dim_value > 0 for d in dims), vi.name
    dec = record["graphs"]["decode.onnx"]
    assert dec["inputs"]["attention_mask"] == [2, CACHE] and dec["inputs"]["write_index"] == [2]
    assert dec["inputs"]["past_key_values.0.key"] == [2, args.kv_heads, CACHE, args.head_dim]
    assert dec["outputs"]["present.0.key"] == [2, args.kv_heads, CACHE, args.head_dim]
    assert dec["outputs"]["logits"] == [2, 1, args.vocab_size]
    assert record["graphs"]["model.onnx"]["inputs"] == {
        "input_ids": [2, T],
        "attention_mask": [2, T],
        "position_ids": [2, T],
    }
    assert record["decode"]["cache_update"] == "whole_cache" and record["decode"]["cache_len"] == CACHE
    script = (static.out_dir / "atc" / "command.sh").read_text()
    assert "--dynamic_dims" not in script and "-1" not in script
    assert f"attention_mask:2,{CACHE};write_index:2;" in script


def test_layer_value_names_are_in_the_graph(pair):
    _, args, _, static, dynamic = pair
    for result in (static, dynamic):
        record = json.loads(result.export_json.read_text())
        for name in ("model.onnx", "decode.onnx"):
            entry = record["graphs"][name]
            values = {n.output[0] for n in onnx.load(str(result.out_dir / name), load_external_data=False).graph.node}
            for key in ("layer_outputs", "attn_outputs", "mlp_outputs"):
                assert len(entry[key]) == args.n_layers and set(entry[key]) <= values, key
            assert entry["layer_outputs"][-1] == f"layers.{args.n_layers - 1}.output"


@pytest.mark.parametrize("which", ["static", "dynamic"])
def test_left_padded_batch_generates_like_transformers(pair, reference, which):
    model, args, _, static, dynamic = pair
    prefill, decode = _sessions(static if which == "static" else dynamic)
    prompts = _prompts(args)
    gen = generate(prefill=prefill, decode=decode, prompts=prompts, max_new_tokens=NEW)
    for r, (ref_tokens, ref_logits) in enumerate(reference):
        assert np.array_equal(gen.new_tokens[r], ref_tokens), (which, r)
        assert np.abs(gen.logits[r] - ref_logits).max() <= 1e-4, (which, r)


def test_dynamic_graph_takes_other_batch_and_cache_sizes(pair, reference):
    """Three prompts (one batch of 3) against a cache larger than needed: same tokens."""
    _, args, _, _, dynamic = pair
    prefill, decode = _sessions(dynamic)
    prompts = _prompts(args)
    gen = generate(
        prefill=prefill,
        decode=decode,
        prompts=[prompts[1], prompts[0], prompts[1][:3]],
        max_new_tokens=6,
        cache_len=100,
    )
    assert np.array_equal(gen.new_tokens[0], reference[1][0][:6])
    assert np.array_equal(gen.new_tokens[1], reference[0][0][:6])


def test_static_batch_filled_and_split(pair, reference):
    """One prompt through a batch-2 static graph, then three: rows fill and split as needed."""
    _, args, _, static, _ = pair
    prefill, decode = _sessions(static)
    prompts = _prompts(args)
    one = generate(prefill=prefill, decode=decode, prompts=[prompts[1]], max_new_tokens=8)
    assert one.new_tokens.shape == (1, 8) and np.array_equal(one.new_tokens[0], reference[1][0][:8])
    three = generate(prefill=prefill, decode=decode, prompts=[prompts[0], prompts[1], prompts[0]], max_new_tokens=4)
    assert np.array_equal(three.new_tokens[2], reference[0][0][:4])


def test_teacher_forcing_feeds_the_given_tokens(pair, reference):
    _, args, _, _, dynamic = pair
    prefill, decode = _sessions(dynamic)
    forced = np.stack([reference[0][0], reference[1][0]])[:, :5].copy()
    forced[:, 2] = 7  # off the greedy path: the logits after it must follow the fed token
    gen = generate(prefill=prefill, decode=decode, prompts=_prompts(args), max_new_tokens=5, forced=forced)
    assert np.array_equal(gen.new_tokens, forced)
    model = pair[0]
    p = _prompts(args)[1]
    with torch.no_grad():
        ref = model(torch.tensor([p + forced[1, :4].tolist()]))[0, len(p) - 1 :].numpy()
    assert np.abs(gen.logits[1] - ref).max() <= 1e-4


def test_bad_generation_input(pair):
    _, args, _, static, dynamic = pair
    prefill, decode = _sessions(static)
    with pytest.raises(
        UserError,
        match=f"prompt 0 has {T + 1} tokens but the static prefill graph takes {T}; "
        f"shorten it or re-export with --seq-len {T + 1}",
    ):
        generate(prefill=prefill, decode=decode, prompts=[list(range(T + 1))], max_new_tokens=2)
    with pytest.raises(UserError, match=f"needs {T + CACHE} cache slots but the cache has {CACHE}.*--cache-len"):
        generate(prefill=prefill, decode=decode, prompts=[[1, 2]], max_new_tokens=CACHE + 1)
    with pytest.raises(UserError, match="prompt 1 is empty"):
        generate(prefill=prefill, decode=decode, prompts=[[1, 2], []], max_new_tokens=2)
    prefill, decode = _sessions(dynamic)
    ids = np.ones((2, 4), dtype=np.int64)
    with pytest.raises(UserError, match="attention_mask row 1 is all zeros"):
        generate_padded(
            prefill=prefill,
            decode=decode,
            input_ids=ids,
            attention_mask=np.array([[1, 1, 1, 1], [0, 0, 0, 0]]),
            max_new_tokens=2,
            cache_len=8,
        )
    with pytest.raises(UserError, match="attention_mask row 0 has padding after a real token"):
        generate_padded(
            prefill=prefill,
            decode=decode,
            input_ids=ids,
            attention_mask=np.array([[1, 0, 1, 1], [1, 1, 1, 1]]),
            max_new_tokens=2,
            cache_len=8,
        )


@pytest.mark.parametrize(
    "cache_len,message",
    [
        (T, f"cache_len {T} is smaller than seq_len {T} \\+ 1 .*pass --cache-len {T + 1} or more"),
        (257, "cache_len 257 exceeds the model's max_position_embeddings 256 .*pass --cache-len 256 or less"),
    ],
)
def test_bad_cache_len_writes_nothing(pair, tmp_path, cache_len, message):
    _, _, src, _, _ = pair
    with pytest.raises(UserError, match=message):
        export_model(src, tmp_path / "out", ExportConfig(seq_len=T, cache_len=cache_len, atc=False))
    assert list(tmp_path.iterdir()) == []
