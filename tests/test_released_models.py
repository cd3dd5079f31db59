"""Released models as they are: the published config.json values of SmolLM2, Qwen2.5, Qwen3, Llama-3.2,
Mistral v0.3, Mixtral and Qwen3-MoE (tests/released_configs.py) read field by field, written back
equal, taken as the model by a flow with only init_from, any model key that disagrees refused in one
line, an explicit null kept; their tokenizer, chat template and stop tokens carried by every conversion."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import yaml
from typer.testing import CliRunner

from released_configs import NAMES, PUBLISHED, reduced, released_dir
from titan_pipe.cli import app
from titan_pipe.config import ConfigError, parse_flow
from titan_pipe.model.args import FLAVOURS, RopeScaling
from titan_pipe.model.hf_config import from_hf_config, to_hf_config

# config.json key -> what ModelArgs holds of it (a property where the field is derived)
READ = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "kv_heads",
    "vocab_size": "vocab_size",
    "intermediate_size": "hidden_dim",
    "rms_norm_eps": "norm_eps",
    "rope_theta": "rope_theta",
    "max_position_embeddings": "max_seq_len",
    "tie_word_embeddings": "tie_embeddings",
    "head_dim": "head_dim",
    "num_local_experts": "n_experts",
    "num_experts": "n_experts",
    "num_experts_per_tok": "experts_per_token",
    "moe_intermediate_size": "expert_dim",
    "norm_topk_prob": "router_norm_topk",
    "router_aux_loss_coef": "router_aux_loss_coef",
    "sliding_window": "sliding_window",
}


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    root = tmp_path_factory.mktemp("released")
    return {n: released_dir(n, root / n) for n in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_published_configs_are_read_field_by_field_and_written_back_equal(name):
    cfg = reduced(name)
    args = from_hf_config(cfg, source=name)
    for key, field in READ.items():
        if key not in cfg or (key == "sliding_window" and cfg.get("use_sliding_window") is False):
            continue
        assert getattr(args, field) == cfg[key], (name, key)
    assert args.head_dim == cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    assert args.qkv_bias == (cfg["model_type"] == "qwen2")
    assert args.qk_norm == cfg["model_type"].startswith(("qwen3", "gemma3"))
    scaling = cfg.get("rope_scaling")
    assert args.rope_scaling == (
        None
        if scaling is None
        else RopeScaling(
            scaling["factor"],
            scaling["low_freq_factor"],
            scaling["high_freq_factor"],
            scaling["original_max_position_embeddings"],
        )
    )
    if cfg.get("use_sliding_window") is False:
        assert args.sliding_window is None  # Qwen's window key is there, switched off
    back = to_hf_config(args)
    for key in set(READ) | {
        "model_type",
        "architectures",
        "hidden_act",
        "rope_scaling",
        "mlp_only_layers",
        "decoder_sparse_step",
        "attention_bias",
        "mlp_bias",
    }:
        if key in cfg and not (key == "sliding_window" and cfg.get("use_sliding_window") is False):
            assert back[key] == cfg[key], (name, key, back[key], cfg[key])
    assert from_hf_config(back, source="back") == args


def test_the_published_values_are_the_flavours_where_titan_pipe_has_one():
    """The flavours of these models hold the published architecture (size included)."""
    for name, flavour in (
        ("Qwen2.5-0.5B-Instruct", "qwen2.5_0.5b"),
        ("Qwen3-0.6B", "qwen3_0.6b"),
        ("Mixtral-8x7B-v0.1", "mixtral_8x7b"),
        ("Qwen3-30B-A3B", "qwen3_30b_a3b"),
        ("gemma-3-1b-it", "gemma3_1b"),
    ):
        held = from_hf_config(PUBLISHED[name], source=name)
        assert held.family == PUBLISHED[name]["model_type"]  # kept, so it converts back as what it was
        assert replace(held, family=None) == FLAVOURS[flavour], name


def _flow(root, model=None, **over):
    raw = {
        "name": "ft",
        "runs_dir": str(root / "runs"),
        "device": "cpu",
        "init_from": "hf",
        "train": {"steps": 2, "batch_size": 2, "seq_len": 32},
        **over,
    }
    if model is not None:
        raw["model"] = model
    return raw


@pytest.fixture(scope="module")
def smol(released, tmp_path_factory):
    """A flow dir whose hf/ is the SmolLM2-shaped released dir."""
    import shutil

    root = tmp_path_factory.mktemp("smolflow")
    shutil.copytree(released["SmolLM2-135M-Instruct"], root / "hf")
    return root


def test_a_flow_with_only_init_from_takes_the_checkpoints_model(smol):
    cfg = parse_flow(_flow(smol), base=smol)
    assert cfg.model.args() == from_hf_config(json.loads((smol / "hf" / "config.json").read_text()))
    assert cfg.model.args().rope_scaling is None and cfg.model.args().rope_theta == 100000.0
    # the keys it states, equal to the checkpoint's, are accepted; a training-only one is used
    same = parse_flow(
        _flow(
            smol,
            {
                "rope_theta": 100000.0,
                "rope_scaling": None,
                "n_heads": 9,
                "tie_embeddings": True,
                "router_aux_loss_coef": 0.0,
            },
        ),
        base=smol,
    )
    assert same.model.args() == cfg.model.args()
    # the flow: Llama-3's flavour restated to SmolLM2's dims with rope_scaling: null is exact
    restated = parse_flow(
        _flow(
            smol,
            {
                "flavour": "llama3_8b",
                "rope_scaling": None,
                "rope_theta": 100000.0,
                "dim": 576,
                "n_layers": 2,
                "n_heads": 9,
                "n_kv_heads": 3,
                "vocab_size": 1152,
                "ffn_hidden_dim": 1536,
                "tie_embeddings": True,
            },
        ),
        base=smol,
    )
    assert restated.model.args() == cfg.model.args()
    with pytest.raises(ConfigError, match="model.flavour: llama3_8b brings rope_scaling {factor: 8.* vs null"):
        parse_flow(
            _flow(
                smol,
                {
                    "flavour": "llama3_8b",
                    "rope_theta": 100000.0,
                    "dim": 576,
                    "n_layers": 2,
                    "n_heads": 9,
                    "n_kv_heads": 3,
                    "vocab_size": 1152,
                    "ffn_hidden_dim": 1536,
                    "tie_embeddings": True,
                },
            ),
            base=smol,
        )


@pytest.mark.parametrize(
    "model, says",
    [
        ({"rope_theta": 500000.0}, "model.rope_theta: 500000 but init_from .*hf holds 100000"),
        ({"rope_scaling": {"factor": 8.0}}, "model.rope_scaling: {factor: 8, .*} but init_from .* holds null"),
        ({"norm_eps": 1e-6}, "model.norm_eps: 1e-06 but init_from .* holds 1e-05"),
        ({"sliding_window": 4096}, "model.sliding_window: 4096 but init_from .* holds null"),
        ({"tie_embeddings": False}, "model.tie_embeddings: false but init_from .* holds true"),
        # a flavour states every architecture value
        (
            {"flavour": "llama3_8b"},
            "model.flavour: llama3_8b brings dim 4096 vs 576, n_layers 32 vs 2, .*rope_theta "
            "500000 vs 100000, rope_scaling {factor: 8.* vs null",
        ),
    ],
)
def test_a_model_key_that_disagrees_with_the_checkpoint_is_refused_naming_both(smol, model, says):
    import re

    with pytest.raises(ConfigError) as e:
        parse_flow(_flow(smol, model), base=smol)

    assert any(re.search(says, line) for line in e.value.lines), e.value.lines


def test_validate_refuses_the_disagreement_in_one_line(smol):
    flow = smol / "flow.yaml"
    flow.write_text(yaml.safe_dump(_flow(smol, {"rope_theta": 500000.0})))
    r = CliRunner().invoke(app, ["validate", str(flow)])
    assert r.exit_code == 2 and "Traceback" not in r.output
    lines = [x for x in r.output.splitlines() if "model.rope_theta" in x]
    assert len(lines) == 1 and "500000" in lines[0] and "100000" in lines[0], r.output


def test_an_explicit_null_is_a_value_over_a_flavour():
    """rope_scaling: null over llama3_8b (which scales) means no scaling; sliding_window: null over
    mistral_7b means full attention; a null where no null is a value is refused."""
    a = parse_flow({"model": {"flavour": "llama3_8b", "rope_scaling": None}}).model.args()
    assert a.rope_scaling is None and FLAVOURS["llama3_8b"].rope_scaling is not None
    b = parse_flow({"model": {"flavour": "mistral_7b", "sliding_window": None}}).model.args()
    assert b.sliding_window is None and FLAVOURS["mistral_7b"].sliding_window == 4096
    assert parse_flow({"model": {"flavour": "llama3_8b"}}).model.args().rope_scaling is not None
    with pytest.raises(ConfigError, match="model: dim: null is no value of dim"):
        parse_flow({"model": {"flavour": "debug", "dim": None}})


def test_rope_scaling_null_over_a_scaled_flavour_trains_without_it(tmp_path):
    """The model a flow builds is the one it states: no scaling table in its RoPE."""
    from titan_pipe.model.rope import inv_freq
    from titan_pipe.model.transformer import build_model

    args = parse_flow(
        {
            "model": {
                "flavour": "llama3_8b",
                "rope_scaling": None,
                "dim": 64,
                "n_layers": 1,
                "n_heads": 4,
                "n_kv_heads": 2,
                "vocab_size": 320,
                "ffn_hidden_dim": 64,
            }
        }
    ).model.args()
    plain = 1.0 / (500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    assert torch.allclose(torch.from_numpy(inv_freq(args)).double(), plain, rtol=1e-6)
    m = build_model(args, seed=0)
    assert m is not None


def _same_files(a, b, names):
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


SIDE = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def test_hf_to_sharded_to_hf_keeps_weights_tokenizer_template_and_stop_tokens(released, tmp_path):
    """SmolLM2's 9 / 3 heads over tp 3 and 2 stages, back to Hugging Face: every tensor bit for bit,
    the tokenizer, its chat template and generation_config.json byte for byte, config.json's token
    ids and model_type as released."""
    from safetensors.torch import load_file

    from titan_pipe.config import ConvertConfig
    from titan_pipe.convert.api import convert_checkpoint

    src = released["SmolLM2-135M-Instruct"]
    sharded = convert_checkpoint(src, tmp_path / "tp3pp2", ConvertConfig(tp=3, pp=2))
    assert sharded.summary.tokenizer == "tokenizer.json" and sharded.summary.stop_ids == 2
    back = convert_checkpoint(tmp_path / "tp3pp2", tmp_path / "back").out_dir
    _same_files(src, back, SIDE)
    a, b = load_file(src / "model.safetensors"), load_file(back / "model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    cfg, got = json.loads((src / "config.json").read_text()), json.loads((back / "config.json").read_text())
    for key in (
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "model_type",
        "rope_theta",
        "rope_scaling",
        "tie_word_embeddings",
        "num_key_value_heads",
        "head_dim",
    ):
        assert got[key] == cfg[key], key


def test_a_source_without_a_tokenizer_gets_none_not_the_byte_tokenizer(released, tmp_path):
    import shutil

    from titan_pipe.config import ConvertConfig
    from titan_pipe.convert.api import convert_checkpoint

    src = tmp_path / "bare"
    shutil.copytree(released["Mistral-7B-v0.3"], src)
    for n in SIDE:
        (src / n).unlink()
    convert_checkpoint(src, tmp_path / "s", ConvertConfig(tp=2))
    r = CliRunner().invoke(app, ["convert", str(tmp_path / "s"), "-o", str(tmp_path / "back")])
    assert r.exit_code == 0, r.output
    assert "no tokenizer" in r.output and not (tmp_path / "back" / "tokenizer.json").exists()
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert cfg["model_type"] == "mistral" and cfg["eos_token_id"] == 2  # config.json's ids still travel
    assert json.loads((tmp_path / "back" / "provenance.json").read_text())["tokenizer"]["tokenizer"] is None


def test_generate_on_the_converted_model_stops_at_the_released_stop_tokens(released, tmp_path):
    """A model whose greedy choice is <|endoftext|> (id 0, the second of generation_config's stop ids
    [<|im_end|>, <|endoftext|>]; config.json names only 2): converted HF -> tp2 -> HF, transformers'
    generate stops after one token; without the carried generation_config.json it would run on."""
    import shutil

    import transformers
    from safetensors.torch import load_file, save_file

    from titan_pipe.config import ConvertConfig
    from titan_pipe.convert.api import convert_checkpoint

    src = tmp_path / "src"
    shutil.copytree(released["Mistral-7B-v0.3"], src)
    sd = load_file(src / "model.safetensors")
    sd["model.norm.weight"].zero_()  # every logit 0: greedy picks id 0
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    convert_checkpoint(src, tmp_path / "s", ConvertConfig(tp=2))
    out = convert_checkpoint(tmp_path / "s", tmp_path / "back").out_dir
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "one plus two"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    n = prompt["input_ids"].shape[1]
    gen = model.generate(**prompt, max_new_tokens=8)
    assert gen.shape[1] == n + 1 and gen[0, -1].item() == 0
    (out / "generation_config.json").unlink()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert model.generate(**prompt, max_new_tokens=8).shape[1] == n + 8  # the carried file is what stops it


def test_a_flow_with_only_init_from_fine_tunes_and_converts_with_the_released_files(released, tmp_path):
    """SmolLM2-shaped, sft on chat records, no model keys: the checkpoint and the converted model carry
    the released tokenizer, template, generation config and stop ids; the architecture is the released one."""
    import shutil

    from chat_fixtures import chat_records, write_jsonl
    from flow_helpers import train_in_process
    from titan_pipe.convert.api import convert_checkpoint

    shutil.copytree(released["SmolLM2-135M-Instruct"], tmp_path / "hf")
    write_jsonl(tmp_path / "chat.jsonl", chat_records(40))
    flow = tmp_path / "flow.yaml"
    flow.write_text(
        yaml.safe_dump(
            _flow(
                tmp_path,
                data={"path": "chat.jsonl", "tokenizer": "hf", "format": "chat", "val_fraction": 0.2},
                train={"mode": "sft", "steps": 2, "batch_size": 2, "seq_len": 192},
                checkpoint={"every": 2, "keep_last": 1},
            )
        )
    )
    cfg, res = train_in_process(flow)
    out = convert_checkpoint(res.checkpoint, tmp_path / "model").out_dir
    _same_files(tmp_path / "hf", out, SIDE)
    src_cfg, got = (
        json.loads((tmp_path / "hf" / "config.json").read_text()),
        json.loads((out / "config.json").read_text()),
    )
    for key in (
        "eos_token_id",
        "bos_token_id",
        "pad_token_id",
        "rope_theta",
        "rope_scaling",
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "tie_word_embeddings",
        "model_type",
        "rms_norm_eps",
    ):
        assert got[key] == src_cfg[key], key


@pytest.mark.parametrize("sft", [False, True])
def test_init_from_a_released_dir_writes_a_flow_for_that_model(released, tmp_path, sft):
    """No flavour needed, --device cpu accepted: the flow names init_from and the model's tokenizer,
    holds no model key, and validates with the released architecture; --sft says first what it needs."""
    src = released["SmolLM2-135M-Instruct"]
    r = CliRunner().invoke(
        app, ["init", str(tmp_path / "ex"), "--from", str(src), "--device", "cpu"] + (["--sft"] if sft else [])
    )
    assert r.exit_code == 0, r.output
    text = (tmp_path / "ex" / "flow.yaml").read_text()
    raw = yaml.safe_load(text)
    assert raw["init_from"] == str(src) and raw["data"]["tokenizer"] == str(src) and "flavour" not in raw["model"]
    assert raw["device"] == "cpu" and raw["parallel"]["dp"] * raw["parallel"]["tp"] * raw["parallel"]["pp"] == 1
    if sft:
        assert text.splitlines()[0].startswith("# Fine-tuning") and "Hugging Face dir" in text.splitlines()[0]
        assert raw["train"]["mode"] == "sft" and (tmp_path / "ex" / "chat.jsonl").is_file()
    cfg = parse_flow(raw, base=tmp_path / "ex")
    assert cfg.model.args() == from_hf_config(json.loads((src / "config.json").read_text()))
    v = CliRunner().invoke(app, ["validate", str(tmp_path / "ex" / "flow.yaml")])
    if sft:  # three sample conversations show the format; too few to train on, and validate says so
        assert v.exit_code == 2 and "data.path chat.jsonl (as prepared): 2 conversations" in v.output, v.output
    else:
        assert v.exit_code == 0 and f"model init_from {src}" in v.output, v.output


def test_a_tp_that_does_not_divide_the_heads_names_the_sizes_that_do(released, tmp_path):
    from titan_pipe.config import ConvertConfig
    from titan_pipe.convert.api import convert_checkpoint
    from titan_pipe.errors import UserError

    with pytest.raises(UserError, match="does not divide model n_heads=9 .*the tp sizes this model takes: 1, 3$"):
        convert_checkpoint(released["SmolLM2-135M-Instruct"], tmp_path / "o", ConvertConfig(tp=2))


def test_validate_refuses_an_sft_flow_whose_held_out_split_cannot_fill_evaluate(smol, tmp_path):
    """Knowable before training: the chat records rendered as the data stage will, the validation
    split counted against evaluate's batches."""
    import shutil

    from chat_fixtures import chat_records, write_jsonl

    shutil.copytree(smol / "hf", tmp_path / "hf")
    write_jsonl(tmp_path / "chat.jsonl", chat_records(40))
    raw = _flow(
        tmp_path,
        data={"path": "chat.jsonl", "tokenizer": "hf", "format": "chat", "val_fraction": 0.2},
        train={"mode": "sft", "steps": 2, "batch_size": 2, "seq_len": 256},
        evaluate={"batches": 2, "batch_size": 2, "seq_len": 256},
    )
    flow = tmp_path / "flow.yaml"
    flow.write_text(yaml.safe_dump(raw))
    r = CliRunner().invoke(app, ["validate", str(flow)])
    assert r.exit_code == 2, r.output
    line = [x for x in r.output.splitlines() if "data.val_fraction" in x]
    assert len(line) == 1 and "= 1,024" in line[0] and "give evaluate.data" in line[0], r.output
    raw["evaluate"] = {"batches": 1, "batch_size": 2, "seq_len": 64}
    flow.write_text(yaml.safe_dump(raw))
    r = CliRunner().invoke(app, ["validate", str(flow)])
    assert r.exit_code == 0, r.output


def test_a_flows_decode_cache_is_sized_to_the_run():
    """Not 4,096 slots for a run of 64-token windows: train.seq_len (or what export / evaluate need),
    within the model's positions; a cache_len written is kept."""
    cfg = parse_flow(
        {"train": {"seq_len": 64}, "export": {"seq_len": 16}, "evaluate": {"prompt_len": 16, "new_tokens": 16}}
    )
    assert cfg.export.cache_len is None and cfg.export_settings().cache_len == 64
    long = parse_flow({"model": {"flavour": "qwen3_0.6b"}, "train": {"seq_len": 8192}})
    assert long.export_settings().cache_len == 4096  # the default cap still holds
    assert parse_flow({"export": {"cache_len": 200}}).export_settings().cache_len == 200


@pytest.mark.parametrize("name", NAMES)
def test_each_released_model_goes_hf_to_sharded_to_hf_to_export_to_evaluate(released, tmp_path, name):
    """Each released architecture as published: HF -> sharded (tp 2 where its kv heads allow, else pp 2)
    -> HF bit for bit with its side files, our logits equal transformers' on the released dir, the
    fp32 export evaluated PASS against it."""
    import transformers
    from safetensors.torch import load_file

    from titan_pipe.config import ConvertConfig, EvaluateConfig, ExportConfig
    from titan_pipe.convert.api import convert_checkpoint
    from titan_pipe.convert.onnx.export import export_model
    from titan_pipe.evaluate.api import evaluate_model
    from titan_pipe.model.load import load_unified_model

    src = released[name]
    cfg = reduced(name)
    layout = ConvertConfig(tp=2) if cfg["num_key_value_heads"] % 2 == 0 else ConvertConfig(pp=2)
    convert_checkpoint(src, tmp_path / "sharded", layout)
    back = convert_checkpoint(tmp_path / "sharded", tmp_path / "back").out_dir
    _same_files(src, back, SIDE)
    a, b = load_file(src / "model.safetensors"), load_file(back / "model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), name
    assert json.loads((back / "config.json").read_text())["model_type"] == cfg["model_type"]
    tokens = torch.randint(0, cfg["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    with torch.no_grad():
        ref, got = hf(tokens).logits, load_unified_model(back)[0](tokens)
    assert (got - ref).abs().max().item() <= 1e-4, name
    onnx = export_model(back, tmp_path / "onnx", ExportConfig(seq_len=16, cache_len=48, atc=False)).onnx
    r = evaluate_model(
        out_dir=tmp_path / "rep",
        model_dir=back,
        onnx=onnx,
        settings=EvaluateConfig(
            batches=1, batch_size=2, seq_len=16, prompts=1, prompt_len=8, new_tokens=4, operators=False
        ),
    )
    assert r.passed, (name, r.summary.verdict)
