"""load_unified_model: HF / native names, single / sharded files, transformers dirs, and bad input."""

import json

import pytest
import torch
from safetensors.torch import save_file

from export_support import debug_model, write_unified
from titan_pipe.model.load import load_unified_model
from titan_pipe.errors import UserError
from titan_pipe.model.hf_config import from_hf_config, to_hf_config


def _same_params(a, b):
    sa, sb = dict(a.named_parameters()), dict(b.named_parameters())
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("hf_names,shards", [(True, 1), (False, 1), (True, 3)])
def test_round_trip_is_bit_exact(tmp_path, hf_names, shards):
    model, args = debug_model()
    write_unified(model, args, tmp_path / "m", hf_names=hf_names, shards=shards)
    got, got_args = load_unified_model(tmp_path / "m")
    assert got_args == from_hf_config(to_hf_config(args)) and got_args.hidden_dim == args.hidden_dim
    _same_params(got, model)
    tokens = torch.randint(0, args.vocab_size, (2, 11))
    with torch.no_grad():
        assert torch.equal(got(tokens), model(tokens))


def test_tied_embeddings_and_dtype_cast(tmp_path):
    model, args = debug_model(tie_embeddings=True)
    write_unified(model, args, tmp_path / "m", dtype=torch.bfloat16)
    got, _ = load_unified_model(tmp_path / "m")
    assert got.tok_embeddings.weight.dtype == torch.bfloat16
    assert got.output.weight is got.tok_embeddings.weight
    got32, _ = load_unified_model(tmp_path / "m", dtype="float32")
    assert got32.output.weight.dtype == torch.float32
    assert torch.equal(got32.tok_embeddings.weight, model.tok_embeddings.weight.to(torch.bfloat16).float())


def test_transformers_save_pretrained_dir(tmp_path):
    transformers = pytest.importorskip("transformers")
    _, args = debug_model()
    cfg = transformers.LlamaConfig(
        **{k: v for k, v in to_hf_config(args).items() if k not in ("architectures", "torch_dtype")}
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ours, _ = load_unified_model(tmp_path / "hf")
    tokens = torch.randint(0, args.vocab_size, (2, 13))
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max().item() <= 1e-5


def test_missing_config(tmp_path):
    model, args = debug_model()
    d = write_unified(model, args, tmp_path / "m")
    (d / "config.json").unlink()
    with pytest.raises(UserError, match="config.json: missing"):
        load_unified_model(d)


def test_no_weights_or_pickle_only(tmp_path):
    model, args = debug_model()
    d = write_unified(model, args, tmp_path / "m")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(UserError, match="found pytorch_model.bin.*safetensors only"):
        load_unified_model(d)


def test_shape_mismatch_names_tensor_and_file(tmp_path):
    model, args = debug_model()
    d = write_unified(model, args, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 128  # weights were written with 192
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        UserError,
        match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight' "
        r"has shape \[.*\], but .*config\.json implies",
    ):
        load_unified_model(d)


def test_missing_and_extra_tensors(tmp_path):
    model, args = debug_model()
    d = write_unified(model, args, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 5
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"missing from the weights, e\.g\. 'layers\.4\."):
        load_unified_model(d)
    cfg["num_hidden_layers"] = 3
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=r"tensor 'model\.layers\.3\..*' has no place"):
        load_unified_model(d)


def test_unknown_tensor_name(tmp_path):
    model, args = debug_model()
    d = write_unified(model, args, tmp_path / "m")
    from safetensors.torch import load_file

    sd = load_file(str(d / "model.safetensors"))
    sd["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)  # no family has an o_proj bias
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(UserError, match=r"o_proj\.bias' is not a parameter of a model family"):
        load_unified_model(d)
    # a Qwen2 bias beside a config without them: a known name with no place in this model
    del sd["model.layers.0.self_attn.o_proj.bias"]
    sd["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(UserError, match=r"q_proj\.bias' has no place in the model of"):
        load_unified_model(d)
