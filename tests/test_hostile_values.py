"""Hostile and broken values, from files and from the command line: each is refused in ONE line
naming the file (or flag), the key, the value and the fix, with no traceback, exit 1 (flow.yaml:
exit 2), and nothing written: the tree around the command is byte for byte what it was.

Model files (config.json, manifest.json, params.json, Megatron args), flow.yaml (types, bounds,
duplicate keys, alias bombs, what training would meet before its first step) and CLI numbers
(planner search space, export and evaluate sizes), cron strings and a dead Prefect API.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from convert_writers import model_args, native_state, write_dcp, write_hf
from test_untrusted_input import copy, edit_json, refused
from titan_pipe.config import ConvertConfig
from titan_pipe.convert.api import convert_checkpoint
from titan_pipe.errors import UserError
from titan_pipe.rules.limits import Bound
from titan_pipe.model.hf_config import to_hf_config

pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    base = tmp_path_factory.mktemp("good")
    args = model_args()  # dim 64, 8 heads, 4 layers: another shape than the debug flavour
    sd = native_state(args)
    hf = write_hf(sd, args, base / "hf")
    convert_checkpoint(hf, base / "titan", ConvertConfig(tp=2, pp=2))
    convert_checkpoint(hf, base / "model")
    return {"args": args, "sd": sd, "hf": hf, "titan": base / "titan", "model": base / "model"}


def _config(src: Path, **changes) -> Path:
    edit_json(src / "config.json", lambda c: c.update(changes))
    return src


# --- config.json ----------------------------------------------------------------------------------


def test_config_naming_fewer_layers_than_the_weights(good, tmp_path):
    """Was: 2 of 4 layers converted, exit 0. Now the first tensor without a place is named."""
    src = _config(copy(good["hf"], tmp_path / "src"), num_hidden_layers=2)
    refused(
        tmp_path,
        "convert",
        src,
        "-o",
        tmp_path / "out",
        out=tmp_path / "out",
        expect=("config.json", "'model.layers.2.", "has no place", "(2 layers", "fix the config"),
    )
    refused(
        tmp_path,
        "export",
        src,
        "-o",
        tmp_path / "onnx",
        out=tmp_path / "onnx",
        expect=("model.layers.2.", "has no place", "do not belong together"),
    )


def test_string_false_is_not_a_boolean(good, tmp_path):
    """Was: "false" read as true, the output head dropped."""
    src = _config(copy(good["hf"], tmp_path / "src"), tie_word_embeddings="false")
    refused(
        tmp_path,
        "convert",
        src,
        "-o",
        tmp_path / "out",
        out=tmp_path / "out",
        expect=("config.json: tie_word_embeddings = 'false' is a string", "without quotes"),
    )


def test_fractional_layer_count(good, tmp_path):
    src = _config(copy(good["hf"], tmp_path / "src"), num_hidden_layers=4.7)
    refused(
        tmp_path,
        "export",
        src,
        "-o",
        tmp_path / "out",
        out=tmp_path / "out",
        expect=("num_hidden_layers = 4.7 is not a whole number", "whole number"),
    )


def test_null_dimension(good, tmp_path):
    src = _config(copy(good["hf"], tmp_path / "src"), hidden_size=None)
    refused(
        tmp_path,
        "convert",
        src,
        "-o",
        tmp_path / "out",
        out=tmp_path / "out",
        expect=("hidden_size = None is null", "give hidden_size a value"),
    )


def test_ten_million_layers_fail_at_once(good, tmp_path):
    """Was: 80-100 s and 9.5 GB before failing."""
    src = _config(copy(good["hf"], tmp_path / "src"), num_hidden_layers=10_000_000)
    t0 = time.monotonic()
    for cmd in ("convert", "export"):
        refused(
            tmp_path,
            cmd,
            src,
            "-o",
            tmp_path / "out",
            out=tmp_path / "out",
            expect=("num_hidden_layers = 10000000 exceeds titan-pipe's limit of 1024", "1..1024"),
        )
    assert time.monotonic() - t0 < 20


def test_huge_max_position_embeddings(good, tmp_path):
    """Was: 4.2 GB of RoPE tables allocated by export."""
    src = _config(copy(good["hf"], tmp_path / "src"), max_position_embeddings=2**26)
    refused(
        tmp_path,
        "export",
        src,
        "-o",
        tmp_path / "out",
        out=tmp_path / "out",
        expect=("max_position_embeddings = 67108864 exceeds titan-pipe's limit of 1048576", "RoPE"),
    )


# --- manifest.json, params.json, Megatron args ------------------------------------------------------


def test_manifest_model_value_as_a_string(good, tmp_path):
    src = copy(good["titan"], tmp_path / "src")
    edit_json(src / "manifest.json", lambda m: m["model"].update(n_layers="4"))
    refused(
        tmp_path,
        "convert",
        src,
        "-o",
        tmp_path / "out",
        out=tmp_path / "out",
        expect=("manifest.json: model.n_layers = '4' is a string, not an integer",),
    )


def test_manifest_listing_a_parameter_the_model_lacks(good, tmp_path):
    src = copy(good["titan"], tmp_path / "src")

    # its own stored tensor (one stored tensor is never two pieces: that is refused as damage)
    shard = src / "model" / "pp0-tp0.safetensors"
    tensors = load_file(shard)
    tensors["layers.9.attention_norm.weight"] = tensors["layers.0.attention_norm.weight"].clone()
    save_file(tensors, shard)

    def extra(m):
        p = json.loads(json.dumps(m["params"]["layers.0.attention_norm.weight"]))
        p["chunks"] = [{**p["chunks"][0], "key": "layers.9.attention_norm.weight"}]  # the tp0 replica only
        m["params"]["layers.9.attention_norm.weight"] = p
        m["files"]["model/pp0-tp0.safetensors"] = {
            "size": shard.stat().st_size,
            "sha256": hashlib.sha256(shard.read_bytes()).hexdigest(),
        }

    edit_json(src / "manifest.json", extra)
    refused(
        tmp_path,
        "convert",
        src,
        "-o",
        tmp_path / "out",
        out=tmp_path / "out",
        expect=("manifest.json", "'layers.9.attention_norm.weight'", "has no place"),
    )


def test_manifest_file_size_as_a_float(good, tmp_path):
    src = copy(good["titan"], tmp_path / "src")
    edit_json(src / "manifest.json", lambda m: m["files"]["model/pp0-tp0.safetensors"].update(size=1e3))
    refused(
        tmp_path,
        "inspect",
        src,
        expect=("manifest.json: files.model/pp0-tp0.safetensors.size = 1000.0", "has a decimal point"),
    )


def test_dcp_params_json_with_a_float_head_count(good, tmp_path):
    ckpt = write_dcp(good["sd"], good["args"], tmp_path / "dcp")
    edit_json(ckpt.parent / "params.json", lambda p: p.update(n_heads=8.0))
    refused(
        tmp_path,
        "convert",
        ckpt,
        "-o",
        tmp_path / "out",
        out=tmp_path / "out",
        expect=("params.json: n_heads = 8.0 has a decimal point", "trained with"),
    )


def test_dcp_config_naming_fewer_layers(good, tmp_path):
    ckpt = write_dcp(good["sd"], good["args"], tmp_path / "dcp")
    (ckpt.parent / "params.json").unlink()
    cfg = to_hf_config(good["args"])
    cfg["num_hidden_layers"] = 3
    (ckpt / "config.json").write_text(json.dumps(cfg))
    refused(
        tmp_path,
        "convert",
        ckpt,
        "-o",
        tmp_path / "out",
        out=tmp_path / "out",
        expect=("config.json", "layers.3.", "has no place"),
    )


def test_megatron_args_typed_strictly(tmp_path):
    from titan_pipe.weights.readers.megatron.common import model_args as megatron_model_args

    a = argparse.Namespace(num_attention_heads=8, hidden_size=64, num_layers=4.0, ffn_hidden_size=192)
    with pytest.raises(UserError) as e:
        megatron_model_args(a, 320, tmp_path)
    assert str(e.value) == (
        f"{tmp_path}: Megatron args: num_layers = 4.0 has a decimal point; an integer is "
        "needed; re-save the checkpoint from Megatron-LM"
    )
    a.num_layers, a.add_bias_linear = 4, "False"
    with pytest.raises(UserError, match="add_bias_linear = 'False' is a string, not true or false"):
        megatron_model_args(a, 320, tmp_path)
    a.add_bias_linear, a.qk_layernorm = False, 1  # the family switches too: no int for a flag
    with pytest.raises(UserError, match="qk_layernorm = 1 is an integer, not true or false"):
        megatron_model_args(a, 320, tmp_path)
    a.qk_layernorm, a.window_size = True, (7.5, 0)
    with pytest.raises(UserError, match=r"window_size = \(7.5, 0\) is not a pair of integers"):
        megatron_model_args(a, 320, tmp_path)


# --- flow.yaml --------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _run_in_tmp(tmp_path, monkeypatch):
    """Each case runs where its flow.yaml lies: a relative runs_dir is taken from the cwd (one rule
    for every command and check), so its runs land in tmp_path, never in the checkout."""
    monkeypatch.chdir(tmp_path)


def _flow(tmp_path: Path, text: str) -> Path:
    flow = tmp_path / "flow.yaml"
    flow.write_text(text)
    return flow


def test_duplicate_key(tmp_path):
    flow = _flow(tmp_path, "name: a\ntrain:\n  steps: 3\n  seq_len: 32\n  steps: 4\n")
    refused(tmp_path, "validate", flow, code=2, expect=(str(flow), "key 'steps' appears twice (lines 3 and 5)"))


def test_alias_bomb_is_refused_at_once_without_printing_it(tmp_path):
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, cur in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{cur}: &{cur} [" + ",".join([f"*{prev}"] * 9) + "]")
    flow = _flow(tmp_path, "\n".join(lines + ["model: *i\n"]))
    assert flow.stat().st_size < 600
    t0 = time.monotonic()
    line = refused(tmp_path, "run", flow, code=2, expect=("expands to more than 100,000 values", "aliases"))
    assert time.monotonic() - t0 < 10 and "lol" not in line


@pytest.mark.parametrize(
    "text,expect",
    [
        ("parallel: {sequence_parallel: 'false'}\n", "parallel.sequence_parallel: Input should be a valid boolean"),
        ("train: {steps: '5'}\n", "train.steps: Input should be a valid integer (got '5')"),
        ("model: {max_seq_len: 2000000}\n", "model.max_seq_len: Input should be less than or equal to 1048576"),
        ("model: {max_seq_len: 1.0e+9}\n", "model.max_seq_len: Input should be a valid integer (got 1000000000.0)"),
        ("export: {opset: 12}\n", "export: opset 12: the graphs need opset >= 14"),
        ("evaluate: {seq_len: 300}\n", "evaluate.seq_len: 300 exceeds model max_seq_len=256"),
        (
            "export: {seq_len: 256}\n",
            "export: seq_len 256 (+1 decode step) exceeds the model's max_position_embeddings",
        ),
        (
            "model: {flavour: debug, qk_norm: true, qkv_bias: true}\n",
            "model.qk_norm: true together with qkv_bias: no Hugging Face architecture has both",
        ),
        (
            "model: {flavour: debug, sliding_window: 0}\n",
            "model.sliding_window: Input should be greater than or equal to 1",
        ),
    ],
)
def test_flow_values_one_line_each(tmp_path, text, expect):
    flow = _flow(tmp_path, "name: v\ndevice: cpu\n" + text)
    refused(tmp_path, "validate", flow, code=2, expect=(str(flow), expect))


def test_init_from_of_another_shape_is_refused_before_launch(good, tmp_path):
    # the flavour, written, states n_heads 4; the checkpoint holds 8 (without model keys it is the model)
    flow = _flow(
        tmp_path, f"name: v\ndevice: cpu\nmodel: {{flavour: debug}}\ntrain: {{steps: 1}}\ninit_from: {good['hf']}\n"
    )
    refused(
        tmp_path,
        "train",
        flow,
        code=2,
        expect=("model.flavour: debug brings n_heads 4 vs 8, kv_heads 2 vs 4", "remove model.flavour"),
    )
    assert not (tmp_path / "runs").exists()


def test_resume_of_another_shape_keeps_the_run_record(good, tmp_path):
    """Was: the refused --resume overwrote runs/<name>/flow.yaml after torchrun had started."""
    run = tmp_path / "runs" / "v"
    shutil.copytree(good["titan"], run / "checkpoints" / "step-000001")
    (run / "flow.yaml").write_text("# the record of the run that made step 1\n")
    flow = _flow(tmp_path, "name: v\ndevice: cpu\ntrain: {steps: 2}\n")
    refused(
        tmp_path,
        "train",
        flow,
        "--resume",
        code=2,
        expect=("--resume:", "step-000001 holds another model shape", "n_heads=8 there vs 4 in flow.yaml"),
    )
    assert (run / "flow.yaml").read_text().startswith("# the record")


def test_corpus_smaller_than_one_batch(tmp_path):
    (tmp_path / "tiny.txt").write_text("hello world\n")
    flow = _flow(tmp_path, "name: v\ndevice: cpu\ndata: {path: tiny.txt}\ntrain: {batch_size: 8, seq_len: 64}\n")
    for cmd in ("validate", "run"):  # run: before Prefect or any run dir
        refused(
            tmp_path,
            cmd,
            flow,
            code=2,
            expect=("data.path: tiny.txt gives at most 24 training tokens", "= 513", "lower train.batch_size"),
        )
    assert not (tmp_path / "runs").exists()


def test_prepared_data_smaller_than_one_batch(tmp_path):
    from test_untrusted_input import cli

    (tmp_path / "a.txt").write_text("hello world, " * 20)
    (tmp_path / "b.txt").write_text("and more text " * 20)
    code, text = cli("data", "prepare", tmp_path / "a.txt", tmp_path / "b.txt", "-o", tmp_path / "prepared")
    assert code == 0, text
    flow = _flow(tmp_path, "name: v\ndevice: cpu\ndata: {path: prepared}\ntrain: {batch_size: 8, seq_len: 64}\n")
    refused(
        tmp_path,
        "validate",
        flow,
        code=2,
        expect=("data.path: ", "prepared (train) gives 261 training tokens", "= 513"),
    )


def test_runs_dir_that_is_a_file(tmp_path):
    (tmp_path / "runs").write_text("not a directory\n")
    flow = _flow(tmp_path, "name: v\ndevice: cpu\nruns_dir: runs\n")
    refused(tmp_path, "train", flow, code=2, expect=("runs_dir: 'runs' cannot hold the run dir", "is a file"))


# --- command-line numbers, cron, the Prefect API ------------------------------------------------------


def test_plan_device_count_is_bounded(tmp_path):
    """Was: minutes of search."""
    t0 = time.monotonic()
    refused(
        tmp_path,
        "plan",
        "--model",
        "llama2_70b",
        "--devices",
        1_000_000,
        "--device",
        "ascend910b",
        expect=("--devices 1000000: exceeds titan-pipe's limit of 65536", "1..65536"),
    )
    assert time.monotonic() - t0 < 10


def test_plan_search_space_is_bounded(tmp_path):
    refused(
        tmp_path,
        "plan",
        "--model",
        "llama2_70b",
        "--devices",
        55440,
        "--nodes",
        6930,
        "--device",
        "ascend910b",
        expect=(
            "candidate layouts of 55440 devices exceed the planner's limit of 50,000",
            "narrow the search with --tp, --pp or --dp",
        ),
    )


def test_export_sequence_length_is_bounded(good, tmp_path):
    refused(
        tmp_path,
        "export",
        good["model"],
        "-o",
        tmp_path / "out",
        "--seq-len",
        10**9,
        out=tmp_path / "out",
        expect=("--seq-len 1000000000: exceeds titan-pipe's limit of 1048576",),
    )


def test_evaluate_batches_are_bounded(good, tmp_path):
    refused(
        tmp_path,
        "evaluate",
        "--model-dir",
        good["model"],
        "-o",
        tmp_path / "rep",
        "--batches",
        10**9,
        out=tmp_path / "rep",
        expect=("--batches 1000000000: exceeds titan-pipe's limit of 65536",),
    )


def test_an_enormous_data_record(good, tmp_path, monkeypatch):
    """Was: one 700 MB line made evaluate take 5.6 GB. The limit is lowered here to keep the file small."""
    import titan_pipe.tokens.sources as sources

    monkeypatch.setattr(sources, "RECORD_BYTES", Bound(0, 4096, "test limit"))
    data = tmp_path / "held.jsonl"
    data.write_text(json.dumps({"text": "short"}) + "\n" + json.dumps({"text": "x" * 10_000}) + "\n")
    refused(
        tmp_path,
        "evaluate",
        "--model-dir",
        good["model"],
        "-o",
        tmp_path / "rep",
        "--data",
        data,
        "--no-operators",
        out=tmp_path / "rep",
        expect=(f"{data}:2: a record of at least 10012 bytes, over the limit of 4096 bytes", "split it"),
    )


def test_cron_with_seven_fields_is_not_served(tmp_path):
    refused(
        tmp_path,
        "schedule",
        REPO / "examples" / "tiny" / "flow.yaml",
        "--cron",
        "0 0 2 * * * *",
        code=2,
        expect=("--cron '0 0 2 * * * *' is not a cron expression of five fields (it has 7)",),
    )


def test_unreachable_prefect_api_is_one_line(good, tmp_path, monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    refused(
        tmp_path,
        "convert",
        good["hf"],
        "-o",
        tmp_path / "out",
        "--flow",
        out=tmp_path / "out",
        expect=("Prefect API http://127.0.0.1:9/api (PREFECT_API_URL) is unreachable", "unset PREFECT_API_URL"),
    )
