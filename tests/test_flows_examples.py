"""The shipped example flow.yaml files: the Ascend 13B/70B configurations and tiny pass `titan-pipe validate`."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from titan_pipe.cli import app
from titan_pipe.config import load_flow

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize(
    "name, world, layout",
    [
        ("tiny", 8, (2, 2, 2)),
        ("llama2_13b_8npu", 8, (1, 8, 1)),
        ("llama2_70b_32npu", 32, (1, 8, 4)),
    ],
)
def test_example_validates(name, world, layout):
    path = EXAMPLES / name / "flow.yaml"
    r = CliRunner().invoke(app, ["validate", str(path), "--elsewhere"])
    assert r.exit_code == 0, r.output
    assert f"world size {world}" in r.output
    cfg = load_flow(path)
    assert (cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp) == layout


def test_ascend_examples_are_npu_bf16_with_checkpointing_and_one_retry_owner():
    for name, nnodes in (("llama2_13b_8npu", 1), ("llama2_70b_32npu", 4)):
        cfg = load_flow(EXAMPLES / name / "flow.yaml")
        assert cfg.device == "npu" and cfg.model.kernels == "npu_fused"
        assert cfg.precision.amp and cfg.precision.amp_dtype == "bfloat16"
        assert cfg.memory.activation_checkpointing
        assert cfg.launch.nnodes == nnodes and cfg.launch.nproc_per_node == 8
        retries = cfg.orchestration.train_retries(cfg.launch.max_restarts)
        assert (retries > 0) != (cfg.launch.max_restarts > 0)  # exactly one owner of rank failures
    multi = load_flow(EXAMPLES / "llama2_70b_32npu" / "flow.yaml")
    assert multi.launch.rdzv_endpoint and multi.launch.max_restarts > 0


def test_init_template_is_the_tiny_example():
    template = Path(__file__).resolve().parents[1] / "pipeline" / "templates" / "flow.yaml"
    assert template.read_text() == (EXAMPLES / "tiny" / "flow.yaml").read_text()
