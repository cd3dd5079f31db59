"""One source per choice: flow.yaml validation and the stage that acts on a choice agree on every
value of every set (titan_pipe.rules.choices), and the export defaults are the same in the config, the
CLI and the stage. Plus the two bugs the copies caused: export.opset 12 passed validation but the
export stage refused it; pp 1 + interleaved_1f1b on a one-layer model was refused by validation
though the trainer builds one stage."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from titan_pipe.rules import choices
from titan_pipe.config import ConfigError, ExportConfig, parse_flow
from titan_pipe.convert.onnx import atc
from titan_pipe.convert.onnx.atc_ops import load_atc_ops
from titan_pipe.convert.onnx.export import export_model, plan_export
from titan_pipe.weights.source_plan import SourcePlan, TensorPlan, plan_unified
from titan_pipe.errors import UserError
from titan_pipe.model.args import FLAVOURS
from titan_pipe.model.kernels import resolve_kernels
from titan_pipe.model.sharding import stages_per_rank
from titan_pipe.training.data_parallel import plan_dp
from titan_pipe.training.optim import build_optimizer
from titan_pipe.training.pipeline_parallel import plan_stages

DEBUG = FLAVOURS["debug"]  # max_seq_len 256
OUTSIDERS = ("", "other", "AUTO")  # values in no set


def config_ok(data: dict, tmp_path) -> bool:
    try:
        parse_flow({"name": "c", "device": "cpu", **data}, base=tmp_path)
    except ConfigError:
        return False
    return True


def stage_ok(fn, *args, **kw) -> bool:
    try:
        fn(*args, **kw)
    except (UserError, ValueError, KeyError):
        return False
    return True


def test_kernels_agree(tmp_path):
    for k in choices.KERNELS + OUTSIDERS:
        cfg = config_ok({"model": {"flavour": "debug", "kernels": k}}, tmp_path)
        stage = stage_ok(resolve_kernels, k, "cpu")  # the trainer on a CPU flow.yaml
        assert cfg == stage, k


def test_schedules_agree(tmp_path):
    for s in choices.PP_SCHEDULES + OUTSIDERS:
        cfg = config_ok(
            {"parallel": {"pp": 2, "pp_schedule": s, "microbatches": 2}, "launch": {"nproc_per_node": 2}}, tmp_path
        )
        assert cfg == stage_ok(plan_stages, DEBUG.n_layers, 2, 0, s, 2), s


@pytest.mark.parametrize(
    "pp,schedule,v,layers",
    [
        (1, "interleaved_1f1b", 2, 1),
        (1, "interleaved_1f1b", 4, 3),
        (2, "interleaved_1f1b", 2, 3),
        (2, "interleaved_1f1b", 2, 4),
        (2, "1f1b", 2, 2),
        (4, "gpipe", 2, 3),
    ],
)
def test_stage_counts_agree(tmp_path, pp, schedule, v, layers):
    """validate accepts a layout exactly when the trainer's stage plan can be built."""
    cfg = config_ok(
        {
            "model": {"flavour": "debug", "n_layers": layers},
            "parallel": {"pp": pp, "pp_schedule": schedule, "virtual_stages": v, "microbatches": 4},
            "train": {"batch_size": 8},
            "launch": {"nproc_per_node": pp},
        },
        tmp_path,
    )
    assert cfg == stage_ok(plan_stages, layers, pp, 0, schedule, v), (pp, schedule, v, layers)
    assert len(plan_stages(1, 1, 0, "interleaved_1f1b", 2).stages) == 1  # the trainer's one stage
    assert stages_per_rank(pp, schedule, v) == (v if schedule == choices.INTERLEAVED and pp > 1 else 1)


def test_interleaved_on_one_layer_without_pp_validates(tmp_path):
    assert config_ok(
        {"model": {"flavour": "debug", "n_layers": 1}, "parallel": {"pp": 1, "pp_schedule": "interleaved_1f1b"}},
        tmp_path,
    )


def _plan_export(**options):
    """The export stage's own rules on raw values: a section built without pydantic's checks."""
    from titan_pipe.config import ExportConfig

    return plan_export(DEBUG, ExportConfig.model_construct(**options))


def test_precision_modes_agree(tmp_path):
    for m in choices.PRECISION_MODES + OUTSIDERS:
        cfg = config_ok({"export": {"precision_mode": m}}, tmp_path)
        assert cfg == stage_ok(_plan_export, precision_mode=m), m
        assert cfg == stage_ok(
            atc.atc_invocation,
            graph="model.onnx",
            inputs=[],
            soc_version="x",
            precision_mode=m,
            dynamic=False,
            batch=1,
            seq_len=8,
            max_len=16,
            weight_bytes=1,
            decode=False,
        ), m


def test_digests_agree(tmp_path):
    """export.digest: validate refuses exactly what the export stage and the hashing core refuse."""
    from titan_pipe.io.hashing import DIGESTS, new_hasher

    assert ExportConfig().digest in DIGESTS
    for d in DIGESTS + OUTSIDERS:
        cfg = config_ok({"export": {"digest": d}}, tmp_path)
        assert cfg == stage_ok(_plan_export, digest=d), d
        assert cfg == stage_ok(new_hasher, d), d


def test_export_opsets_and_lengths_agree(tmp_path):
    """Every opset, and seq/cache lengths around the model's 256 positions: validate == export."""
    for opset in range(0, 25):
        assert config_ok({"export": {"opset": opset}}, tmp_path) == stage_ok(_plan_export, opset=opset), opset
    for seq, cache, kv in [
        (255, None, True),
        (256, None, True),
        (256, None, False),
        (32, 32, True),
        (32, 33, True),
        (32, 256, True),
        (32, 257, True),
        (10**9, None, True),
        (0, None, True),
    ]:
        cfg = config_ok({"export": {"seq_len": seq, "cache_len": cache, "kv_cache": kv}}, tmp_path)
        assert cfg == stage_ok(_plan_export, seq_len=seq, cache_len=cache, kv_cache=kv), (seq, cache, kv)
    for dtype in ("float32", "float16", "bfloat16", "int8"):
        assert config_ok({"export": {"dtype": dtype}}, tmp_path) == stage_ok(_plan_export, dtype=dtype), dtype
    for n in (-1, 0, 1, 2, 64, 65):
        ok = config_ok({"export": {"data_files": n}}, tmp_path)
        assert ok == stage_ok(_plan_export, data_files=n) == (1 <= n <= 64), n


def test_export_opset_12_is_refused_by_validate(tmp_path):
    with pytest.raises(ConfigError) as e:
        parse_flow({"name": "c", "export": {"opset": 12}}, base=tmp_path)
    assert len(e.value.lines) == 1 and "export.opset" in e.value.lines[0] and "opset 12" in e.value.lines[0]


def test_compile_backends_agree(tmp_path):
    from titan_pipe.training.compile import resolve_backend

    for b in choices.COMPILE_BACKENDS + OUTSIDERS:
        cfg = config_ok({"train": {"compile": True, "compile_backend": b}}, tmp_path)
        assert cfg == stage_ok(resolve_backend, b, "cuda"), b  # cuda: no host compiler or TorchAir asked for


def test_namings_agree(tmp_path):
    src = SourcePlan(
        "hf",
        tmp_path,
        DEBUG,
        {"tok_embeddings.weight": TensorPlan("tok_embeddings.weight", (320, 64), "F32", ())},
        files=[],
    )
    for n in choices.NAMINGS + OUTSIDERS:
        assert config_ok({"convert": {"naming": n}}, tmp_path) == stage_ok(plan_unified, src, naming=n), n


def test_dp_modes_optimizers_and_offload_agree(tmp_path):
    for mode in choices.DP_MODES + OUTSIDERS:
        assert config_ok({"parallel": {"dp_mode": mode}}, tmp_path) == (mode in choices.DP_MODES)
        if mode in choices.DP_MODES:
            plan_dp(dp=2, tp=1, dp_mode=mode, zero_stage=None)
    p = [torch.nn.Parameter(torch.zeros(2))]
    for name in choices.OPTIMIZERS + OUTSIDERS:
        cfg = config_ok({"train": {"optimizer": {"name": name}}}, tmp_path)
        assert cfg == stage_ok(build_optimizer, p, name=name, lr=0.1), name
    for off in choices.OFFLOADS + OUTSIDERS:
        assert config_ok({"memory": {"optimizer_offload": off}}, tmp_path) == (off in choices.OFFLOADS)


def test_export_options_are_the_sections_fields_spelled_once():
    """`titan-pipe export`'s options are ExportConfig's fields: the same defaults, one option per field
    and nothing else but the paths, --overwrite and --flow; export_model takes the section."""
    cfg = ExportConfig()
    assert inspect.signature(export_model).parameters["settings"].default == cfg  # the stage takes the section
    assert len(inspect.signature(export_model).parameters) <= 4
    from titan_pipe.cli import app

    command = next(c for c in app.registered_commands if c.name == "export").callback
    params = inspect.signature(command).parameters
    assert set(params) == set(ExportConfig.model_fields) | {"model_dir", "out_dir", "overwrite", "flow"}
    for key in ExportConfig.model_fields:
        assert params[key].default.default == getattr(cfg, key), key  # str-valued enums equal their value
    assert params["atc"].default.param_decls == ("--atc/--no-atc",)
    assert params["dynamic"].default.param_decls == ("--dynamic/--static",)
    assert params["seq_len"].default.help == ExportConfig.model_fields["seq_len"].description


def test_convert_and_inspect_options_are_the_sections_fields_spelled_once():
    """`titan-pipe convert`'s options are ConvertConfig's fields with its defaults (and the paths,
    --overwrite, --flow); `inspect` takes three of them, the same flags; the stage takes the section."""
    from titan_pipe.cli import app
    from titan_pipe.config import ConvertConfig
    from titan_pipe.convert.api import convert_checkpoint

    stage = inspect.signature(convert_checkpoint).parameters
    assert stage["settings"].default == ConvertConfig() and len(stage) <= 4
    command = next(c for c in app.registered_commands if c.name == "convert").callback
    params = inspect.signature(command).parameters
    assert set(params) == set(ConvertConfig.model_fields) | {"src", "out", "overwrite", "flow"}
    d = ConvertConfig()
    for key in ConvertConfig.model_fields:
        assert params[key].default.default == getattr(d, key), key
    assert params["source_format"].default.param_decls == ("--source-format",)
    assert params["source_config"].default.param_decls == ("--model-config",)
    look = inspect.signature(next(c for c in app.registered_commands if c.name == "inspect").callback).parameters
    assert {k: look[k].default.param_decls for k in ("source_format", "vocab_size", "source_config")} == {
        k: params[k].default.param_decls for k in ("source_format", "vocab_size", "source_config")
    }


def test_a_bad_flag_is_one_line_naming_the_flag(tmp_path):
    """A value the section refuses, given as a flag, names the flag (not the field)."""
    from typer.testing import CliRunner

    from titan_pipe.cli import app

    r = CliRunner().invoke(app, ["convert", str(tmp_path), "-o", str(tmp_path / "o"), "--source-format", "pickle"])
    assert r.exit_code == 1 and "--source-format: " in r.output and "'pickle'" in r.output, r.output
    assert not (tmp_path / "o").exists()


def test_plan_and_init_options_are_their_requests_fields(tmp_path):
    """`plan`'s and `init`'s options are PlanRequest's and InitRequest's fields (their defaults, a
    bound field's range): written once, a bad value the section's one line naming the flag (exit 1),
    nothing written."""
    from typer.testing import CliRunner

    from titan_pipe.cli import app
    from titan_pipe.commands.example import InitRequest
    from titan_pipe.training.planner.request import PlanRequest

    for name, cls, own in (("plan", PlanRequest, set()), ("init", InitRequest, {"directory"})):
        command = next(c for c in app.registered_commands if (c.name or c.callback.__name__) == name).callback
        params = inspect.signature(command).parameters
        assert set(params) == set(cls.model_fields) | own, name
        for key, f in cls.model_fields.items():
            assert params[key].default.default == (... if f.is_required() else f.default), (name, key)
    runner = CliRunner()
    for argv, said in (
        (["plan", "--model", "debug", "--devices", "0", "--device", "a100"], "--devices 0: must be >= 1"),
        (["plan", "--model", "debug", "--devices", "8", "--device", "a100", "--efficiency", "3"], "--efficiency:"),
        (["plan", "--model", "debug", "--devices", "8", "--device", "a100", "--lora", "5000"], "--lora 5000"),
        (["plan", "--model", "debug", "--devices", "8", "--device", "a100", "--calibrate-phase", "x"], "'x'"),
        (["init", str(tmp_path / "i"), "--devices", "70000"], "--devices 70000"),
        (["init", str(tmp_path / "i"), "--sft", "--lora", "0"], "--lora 0"),
    ):
        r = runner.invoke(app, argv)
        assert r.exit_code == 1 and said in r.output and len(r.output.strip().splitlines()) == 1, (argv, r.output)
    assert not (tmp_path / "i").exists()


def test_atc_window_matches_the_operator_list():
    assert tuple(load_atc_ops()["atc_opset_window"]) == choices.ATC_OPSET_WINDOW
    lo, hi = choices.ATC_OPSET_WINDOW
    assert all(lo <= o <= hi for o in choices.EXPORT_OPSETS)
    assert json.loads(json.dumps(choices.EXPORT_OPSETS)) == [14, 15]


def test_devices_agree_with_the_cli():
    """evaluate's --device takes the section's devices, not given by default (--config's or the section's)."""
    from titan_pipe.cli import app

    command = next(c for c in app.registered_commands if c.name == "evaluate").callback
    device = inspect.signature(command).parameters["device"]
    assert device.default.default is None  # not given: --config's evaluate.device, or the section's
    assert f"({' | '.join(choices.DEVICES)})" in device.default.help
    assert "default: evaluate.device, cpu]" in device.default.help


def test_flavours_and_families_agree(tmp_path):
    """Every flavour validates and its config.json names a family the reader takes back as the same
    model; a model_type outside FAMILIES is refused by the reader."""
    from titan_pipe.model.args import model_differences
    from titan_pipe.model.families import FAMILIES
    from titan_pipe.model.hf_config import from_hf_config, to_hf_config

    written = set()
    for name, args in FLAVOURS.items():
        assert config_ok({"model": {"flavour": name}}, tmp_path), name
        cfg = to_hf_config(args)
        written.add(cfg["model_type"])
        assert not model_differences(from_hf_config(cfg), args), name
    assert written == set(FAMILIES)  # every family has a flavour
    for kind in OUTSIDERS:
        assert not stage_ok(from_hf_config, {**to_hf_config(DEBUG), "model_type": kind}), kind


@pytest.mark.parametrize(
    "flag, value, says",
    [
        ("--batches", "-5", "--batches -5: must be >= 1"),
        ("--max-memory", "lots", "'lots' is not a size"),
        ("--dtype", "int4", "--dtype: Input should be 'auto', 'float32', 'float16' or 'bfloat16' (got 'int4')"),
        ("--device", "tpu", "--device: Input should be"),
    ],
)
def test_evaluate_flags_are_checked_as_the_flow_yaml_section_is(tmp_path, flag, value, says):
    """evaluate's options are the evaluate section's fields: a bad value is refused before anything is
    read, in one line naming the flag (it once built its config with model_copy, which skipped the rules)."""
    from typer.testing import CliRunner

    from titan_pipe.cli import app

    r = CliRunner().invoke(app, ["evaluate", "-o", str(tmp_path / "rep"), "--model-dir", str(tmp_path), flag, value])
    assert r.exit_code == 1 and says in " ".join(r.output.split()), r.output
    assert "Traceback" not in r.output and not (tmp_path / "rep").exists()


def test_data_prepare_options_are_the_data_sections_fields():
    """`titan-pipe data prepare`'s tokenizer / split / chat options are flow.yaml's data keys: the same
    names, defaults and bounds (a --val-fraction of 1.5 is the section's one line naming the flag)."""
    from typer.testing import CliRunner

    from titan_pipe.commands.data import PREPARE_OPTIONS, prepare
    from titan_pipe.config import DataConfig

    params = inspect.signature(prepare).parameters
    d = DataConfig()
    for key in PREPARE_OPTIONS:
        assert params[key].default.default == getattr(d, key), key
        assert params[key].default.param_decls == ("--" + key.replace("_", "-"),), key
    from titan_pipe.cli import app

    r = CliRunner().invoke(app, ["data", "prepare", "x.txt", "-o", "out", "--val-fraction", "1.5"])
    assert r.exit_code == 1 and "--val-fraction: Input should be less than 1 (got 1.5)" in r.output, r.output
