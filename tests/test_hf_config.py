"""config.json in both layouts transformers writes (4.x: top-level rope_theta / rope_scaling;
>= 5: rope_parameters), plain RoPE and Llama-3.1 scaling in each: titan-pipe's model loaded from
the directory computes the logits transformers' own LlamaForCausalLM computes from the same
directory (the independent reference), and `titan-pipe convert` carries the RoPE settings over.
The >= 5 layout is what the installed transformers 5 saves; the 4.x layout is written by hand from
its documented keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from convert_writers import model_args
from titan_pipe.convert.api import convert_checkpoint
from titan_pipe.errors import UserError
from titan_pipe.model.args import RopeScaling
from titan_pipe.model.hf_config import from_hf_config
from titan_pipe.model.load import load_unified_model
from titan_pipe.model.unified_dir import read_model_args

transformers = pytest.importorskip("transformers")

THETA = 500000.0
SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}  # below max_position_embeddings 256, as transformers asks


def _dims(args) -> dict:
    return {
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": False,
    }


def _model_dir(out: Path, *, layout: str, scaled: bool) -> Path:
    """A Hugging Face LLaMA dir whose config.json is in ``layout`` ("4.x" or "5.x")."""
    args = model_args()
    if layout == "5.x":  # transformers' own save: rope_parameters, no top-level rope_theta
        rope = {"rope_type": "default", "rope_theta": THETA} if not scaled else {**SCALING, "rope_theta": THETA}
        cfg = transformers.LlamaConfig(**_dims(args), rope_parameters=rope)
    else:
        cfg = transformers.LlamaConfig(**_dims(args))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(out, safe_serialization=True)
    saved = json.loads((out / "config.json").read_text())
    if layout == "5.x":
        assert "rope_parameters" in saved and "rope_theta" not in saved  # the real >= 5 layout
    else:  # the 4.x keys, written by hand: top-level rope_theta and rope_scaling
        saved.pop("rope_parameters", None)
        saved.update({"rope_theta": THETA, "rope_scaling": dict(SCALING) if scaled else None})
        (out / "config.json").write_text(json.dumps(saved))
    return out


@pytest.mark.parametrize("layout", ["4.x", "5.x"])
@pytest.mark.parametrize("scaled", [False, True])
def test_both_layouts_load_as_transformers_reads_them(tmp_path, layout, scaled):
    src = _model_dir(tmp_path / "hf", layout=layout, scaled=scaled)
    args = read_model_args(src)
    assert args.rope_theta == THETA
    assert args.rope_scaling == (RopeScaling(8.0, 1.0, 4.0, 32) if scaled else None)
    ref = transformers.LlamaForCausalLM.from_pretrained(src).eval()
    ours, _ = load_unified_model(src)
    tokens = torch.randint(0, args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(tokens) - ref(tokens).logits).abs().max().item() <= 1e-5
    out = convert_checkpoint(src, tmp_path / "out").out_dir
    assert read_model_args(out) == args  # convert keeps theta and scaling, whatever the layout read


def test_layouts_that_disagree_are_refused():
    base = {**_dims(model_args()), "model_type": "llama"}
    with pytest.raises(
        UserError, match="rope_parameters.rope_theta = 500000.0 disagrees with the top-level rope_theta 10000"
    ):
        from_hf_config(
            {**base, "rope_theta": 10000.0, "rope_parameters": {"rope_type": "default", "rope_theta": THETA}}
        )
    with pytest.raises(UserError, match="rope_scaling = .* disagrees with rope_parameters"):
        from_hf_config(
            {**base, "rope_scaling": SCALING, "rope_parameters": {"rope_type": "default", "rope_theta": THETA}}
        )
    with pytest.raises(UserError, match="rope_parameters.rope_type = 'yarn' is not supported"):
        from_hf_config({**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": THETA, "factor": 4.0}})
    with pytest.raises(UserError, match="holds per-layer-type RoPE settings"):
        from_hf_config({**base, "rope_parameters": {"full_attention": {"rope_type": "default"}}})
    agree = from_hf_config(
        {**base, "rope_theta": THETA, "rope_scaling": SCALING, "rope_parameters": {**SCALING, "rope_theta": THETA}}
    )
    assert agree.rope_theta == THETA and agree.rope_scaling.factor == 8.0


@pytest.mark.parametrize(
    "key,value,expect",
    [
        ("tie_word_embeddings", "false", "tie_word_embeddings = 'false' is a string, not true or false"),
        ("num_hidden_layers", 4.7, "num_hidden_layers = 4.7 is not a whole number"),
        ("num_hidden_layers", 4.0, "num_hidden_layers = 4.0 has a decimal point"),
        ("num_hidden_layers", True, "num_hidden_layers = True is a boolean, not an integer"),
        ("hidden_size", None, "hidden_size = None is null, not an integer"),
        ("num_hidden_layers", 10_000_000, "num_hidden_layers = 10000000 exceeds titan-pipe's limit of 1024"),
        ("max_position_embeddings", 2**30, "max_position_embeddings = 1073741824 exceeds titan-pipe's limit"),
        ("rms_norm_eps", float("nan"), "rms_norm_eps = nan is not a finite number"),
        ("hidden_act", "gelu", "hidden_act = 'gelu' is not supported"),
        ("attention_bias", "no", "attention_bias = 'no' is a string"),
    ],
)
def test_values_are_typed_strictly(key, value, expect):
    cfg = {**_dims(model_args()), "model_type": "llama", key: value}
    with pytest.raises(UserError) as e:
        from_hf_config(cfg, source="x/config.json")
    msg = str(e.value)
    assert msg.startswith("x/config.json: ") and expect in msg and "\n" not in msg, msg


@pytest.mark.parametrize(
    "model_type,key,value,expect",
    [
        ("mistral", "sliding_window", "8", "sliding_window = '8' is a string, not an integer"),
        ("mistral", "sliding_window", 0, "sliding_window = 0 must be >= 1"),
        ("qwen2", "use_sliding_window", "true", "use_sliding_window = 'true' is a string, not true or false"),
        ("qwen2", "layer_types", "sliding_attention", "layer_types = 'sliding_attention' must list 4 entries"),
        ("qwen3", "head_dim", 4.0, "head_dim = 4.0 has a decimal point"),
        ("qwen3", "attention_bias", 1, "attention_bias = 1 is an integer, not true or false"),
        (
            "qwen2_moe",
            "model_type",
            "qwen2_moe",
            "architecture Qwen2MoeForCausalLM (mixture of experts) is not supported",
        ),
        ("llama", "model_type", 2, "model_type = 2 is an integer, not a string"),
    ],
)
def test_family_keys_are_typed_strictly(model_type, key, value, expect):
    """The keys that tell the families apart (titan_pipe.model.families) are read as strictly as the dims."""
    cfg = {
        **_dims(model_args()),
        "model_type": model_type,
        "sliding_window": 8,
        "use_sliding_window": True,
        "max_window_layers": 0,
        key: value,
    }
    with pytest.raises(UserError) as e:
        from_hf_config(cfg, source="x/config.json")
    msg = str(e.value)
    assert msg.startswith("x/config.json: ") and expect in msg and "\n" not in msg, msg
    if model_type != "qwen2_moe" and key != "model_type":  # the same file with the key as written by us loads
        assert from_hf_config(
            {
                **cfg,
                key: {
                    "sliding_window": 8,
                    "use_sliding_window": True,
                    "head_dim": 16,
                    "attention_bias": False,
                    "layer_types": ["sliding_attention"] * 4,
                }[key],
            }
        )
