"""flow.yaml validation: every bad value gets one line naming the key, the value and the fix."""

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from titan_pipe.cli import app
from titan_pipe.config import ConfigError, load_flow, parse_flow

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny" / "flow.yaml"


def _example() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def test_example_and_template_are_valid():
    cfg = load_flow(EXAMPLE)
    assert cfg.parallel.world_size == 8
    load_flow(ROOT / "pipeline" / "templates" / "flow.yaml")


@pytest.mark.parametrize(
    "patch, expect",
    [
        ({"trian": {}}, "trian: unknown key"),
        ({"train": {"stepz": 3}}, "train.stepz: unknown key"),
        ({"parallel": {"dp": 2, "tp": 3, "pp": 1}, "launch": {"nproc_per_node": 6}}, "does not divide model n_heads=4"),
        ({"parallel": {"dp": 1, "tp": 4, "pp": 1}}, "does not divide model n_kv_heads=2"),
        ({"parallel": {"dp": 1, "tp": 1, "pp": 8, "microbatches": 8}}, "needs at least 8 layers"),
        ({"parallel": {"dp": 1, "tp": 1, "pp": 4, "microbatches": 2}}, "microbatches: 2 < pp=4"),
        ({"launch": {"nproc_per_node": 4}}, "!= dp*tp*pp = 2*2*2 = 8"),
        ({"precision": {"amp": True, "amp_dtype": "float16"}}, "float16 AMP needs loss scaling"),
        ({"data": {"path": "no/such/corpus.txt"}}, "data.path: 'no/such/corpus.txt' does not exist"),
        ({"model": {"flavour": "llama9"}}, "flavour 'llama9' is unknown"),
        ({"model": {"flavour": "debug", "kernels": "fused"}}, "model.kernels"),
        ({"device": "cpu", "model": {"flavour": "debug", "kernels": "npu_fused"}}, "npu_fused needs device npu"),
        ({"export": {"opset": 18}}, "export.opset"),
        ({"evaluate": {"max_memory": "lots"}}, "evaluate.max_memory"),
        ({"convert": {"max_shard_size": "lots"}}, "convert.max_shard_size"),  # convert would refuse it after training
        ({"convert": {"tp": 2}}, "convert.tp: 2 is for converting other checkpoints"),
        ({"convert": {"digest": "sha256"}}, "convert.digest: 'sha256' is for converting other checkpoints"),
        ({"convert": {"digest": "md5"}}, "convert.digest"),
        ({"train": {"compile_backend": "aot_eager"}}, "train.compile_backend: 'aot_eager' has no effect"),
        ({"train": {"compile": True, "compile_backend": "tvm"}}, "train.compile_backend"),
    ],
)
def test_bad_values_get_one_clear_line(patch, expect, tmp_path):
    data = _example()
    for k, v in patch.items():
        data[k] = {**data[k], **v} if isinstance(v, dict) and isinstance(data.get(k), dict) else v
    with pytest.raises(ConfigError) as e:
        parse_flow(data, base=tmp_path)
    assert any(expect in line for line in e.value.lines), e.value.lines


def test_validate_command_exit_codes(tmp_path):
    runner = CliRunner()
    ok = runner.invoke(app, ["validate", str(EXAMPLE)])
    assert ok.exit_code == 0, ok.output
    assert "ok" in ok.output
    bad = tmp_path / "flow.yaml"
    data = _example()
    data["parallel"]["tp"] = 3
    bad.write_text(yaml.safe_dump(data))
    res = runner.invoke(app, ["validate", str(bad)])
    assert res.exit_code == 2
    assert "Traceback" not in res.output
    missing = runner.invoke(app, ["validate", str(tmp_path / "nope.yaml")])
    assert missing.exit_code == 2


def test_init_writes_a_valid_flow_and_refuses_to_overwrite(tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["init", str(tmp_path / "proj")])
    assert res.exit_code == 0, res.output
    assert load_flow(tmp_path / "proj" / "flow.yaml").name == "proj"  # the project's own run dir, not the example's
    again = runner.invoke(app, ["init", str(tmp_path / "proj")])
    assert again.exit_code == 1 and "already exists" in again.output


def test_data_blend_and_token_data_paths(tmp_path):
    from titan_pipe.training.prepare import prepare

    (tmp_path / "src").mkdir()
    for i in range(2):
        (tmp_path / "src" / f"{i}.txt").write_text(f"text {i} " * 20)
    prepare(sources=[tmp_path / "src"], out_dir=tmp_path / "prep", tokenizer="byte", progress=False)
    ok = parse_flow(
        {"data": {"blend": [{"path": "prep", "weight": 0.7}, {"path": "prep/tokens", "weight": 0.3}]}}, base=tmp_path
    )
    assert [b.weight for b in ok.data.blend] == [0.7, 0.3]
    assert parse_flow({"data": {"path": "prep/tokens.idx"}}, base=tmp_path).data.path == "prep/tokens.idx"
    for data, expect in [
        ({"path": "prep", "blend": [{"path": "prep", "weight": 1}]}, "path and blend both given"),
        ({"blend": []}, "blend is empty"),
        ({"blend": [{"path": "prep", "weight": 0}]}, "data.blend.0.weight: Input should be greater than 0"),
        ({"blend": [{"path": "src", "weight": 1}]}, "data.blend[0].path: 'src' (resolved to"),
        ({"path": "prep/nope"}, "data.path: 'prep/nope' does not exist"),
    ]:
        with pytest.raises(ConfigError) as e:
            parse_flow({"data": data}, base=tmp_path)
        assert any(expect in line for line in e.value.lines), e.value.lines
