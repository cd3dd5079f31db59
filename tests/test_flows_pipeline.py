"""The real flow end to end under prefect_test_harness: four real stages, artifacts, verdict, cache, fault retry.

One flow run of a small world (dp1 tp2 pp1, debug model) is shared by the module; the later tests
re-run it (all cached), change one export setting (export + evaluate re-run), and kill a training
rank mid-run through the trainer's fault hook (the Prefect retry resumes; the final weights equal
the uninterrupted run's, bit for bit, fp32 on CPU).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file
from typer.testing import CliRunner

from titan_pipe.cli import app
from titan_pipe.flows import cache

from flow_helpers import small_flow as _test_flow
from fault_shim import arm

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.distributed


def _client():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def _last_flow_run(client):
    from prefect.client.schemas.sorting import FlowRunSort

    return client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)[0]


def _records(run_dir: Path) -> dict:
    return {s: cache.read_record(run_dir, s) for s in cache.STAGES}


def _weights(step_dir: Path) -> dict:
    return {f.name: load_file(f) for f in sorted((step_dir / "model").glob("*.safetensors"))}


@pytest.fixture(scope="module")
def first(prefect_harness, tmp_path_factory):
    from prefect.settings import PREFECT_LOGGING_TO_API_ENABLED, temporary_settings

    tmp = tmp_path_factory.mktemp("flow")
    path = _test_flow(tmp, "tinyci")
    with temporary_settings(updates={PREFECT_LOGGING_TO_API_ENABLED: True}):
        result = CliRunner().invoke(app, ["run", str(path)])
    with _client() as client:
        run = _last_flow_run(client)
    return path, tmp / "runs" / "tinyci", result, run


def test_whole_flow_runs_publishes_every_artifact_and_passes(first):
    path, run_dir, result, flow_run = first
    assert result.exit_code == 0, result.output[-4000:]
    assert "verdict: PASS" in result.output
    for stage in cache.STAGES:
        assert f"{stage:>8} done" in result.output
    assert flow_run.state.is_completed()
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, LogFilterFlowRunId

    with _client() as client:
        arts = {
            a.key: a
            for a in client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id]))
            )
        }
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run.id])))
    for key in (
        "tinyci-train-metrics",
        "tinyci-convert-summary",
        "tinyci-export-operators",
        "tinyci-export-summary",
        "tinyci-evaluate-report",
        "tinyci-train-files",
    ):
        assert key in arts, sorted(arts)
    metrics = {row["metric"]: row["value"] for row in json.loads(arts["tinyci-train-metrics"].data)}
    assert {"final loss", "tokens/s", "MFU", "steps"} <= set(metrics) and metrics["steps"] == 8
    ops = {row["operator"] for row in json.loads(arts["tinyci-export-operators"].data)}
    assert {"MatMul", "Softmax"} <= ops
    assert arts["tinyci-evaluate-report"].data.startswith("# Evaluation verdict: **PASS**")
    messages = [log.message for log in logs]
    assert any("resuming" in m or "training from step 0" in m for m in messages)
    # rank-0 torchrun output reached the run logs through the train.log follower
    train_log = (run_dir / "train.log").read_text().splitlines()
    assert any(line.strip() and line.strip() in messages for line in train_log[-20:])
    recs = _records(run_dir)
    assert all(recs.values()) and recs["evaluate"].result["passed"] is True


def test_second_run_hits_the_cache_for_every_stage(first):
    path, run_dir, _, _ = first
    before = _records(run_dir)
    result = CliRunner().invoke(app, ["run", str(path)])
    assert result.exit_code == 0, result.output[-4000:]
    for stage in cache.STAGES:
        assert f"{stage:>8} cached" in result.output
    assert "verdict: PASS" in result.output
    after = _records(run_dir)
    assert {s: r.finished_at for s, r in after.items()} == {s: r.finished_at for s, r in before.items()}


def test_changing_one_export_setting_reruns_export_and_evaluate_only(first):
    path, run_dir, _, _ = first
    before = _records(run_dir)
    changed = _test_flow(path.parent, "tinyci", export={"opset": 15})
    result = CliRunner().invoke(app, ["run", str(changed)])
    assert result.exit_code == 0, result.output[-4000:]
    for stage, status in (("train", "cached"), ("convert", "cached"), ("export", "done"), ("evaluate", "done")):
        assert f"{stage:>8} {status}" in result.output
    after = _records(run_dir)
    assert after["train"].finished_at == before["train"].finished_at
    assert after["convert"].finished_at == before["convert"].finished_at
    assert after["export"].key != before["export"].key and after["evaluate"].key != before["evaluate"].key
    assert json.loads((run_dir / "onnx" / "export.json").read_text())["options"]["opset"] == 15


def test_killed_rank_is_retried_and_resumes_to_the_same_weights(first, monkeypatch):
    path, run_dir, _, _ = first
    faulty = _test_flow(path.parent, "tinyfault")
    arm(monkeypatch, "6:1:step")  # rank 1 dies at step 6 (tests/fault_shim)
    result = CliRunner().invoke(app, ["run", str(faulty), "--only", "train"])
    assert result.exit_code == 0, result.output[-4000:]
    with _client() as client:
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        run = _last_flow_run(client)
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
    train_runs = [t for t in task_runs if t.name.startswith("train")]
    assert len(train_runs) == 1 and train_runs[0].run_count == 2  # failed once, retried once
    fault_dir = path.parent / "runs" / "tinyfault"
    assert cache.read_record(fault_dir, "train").result["summary"]["start_step"] == 4  # resumed, not step 0
    launches = [
        ln
        for ln in (fault_dir / "train.log").read_text().splitlines()
        if "torch.distributed.run" in ln and ln.startswith("# ")
    ]
    assert len(launches) == 2 and not launches[0].endswith("--resume") and launches[1].endswith("--resume")
    final = fault_dir / "checkpoints" / "step-000008"
    assert (final / "manifest.json").is_file()
    got, want = _weights(final), _weights(run_dir / "checkpoints" / "step-000008")
    assert got.keys() == want.keys()
    for f in want:
        assert got[f].keys() == want[f].keys()
        for k in want[f]:
            assert want[f][k].dtype == got[f][k].dtype and bool((want[f][k] == got[f][k]).all()), (f, k)


def test_bad_flow_yaml_fails_before_anything_starts(prefect_harness, tmp_path):
    bad = tmp_path / "flow.yaml"
    bad.write_text(f"name: broken\nruns_dir: {tmp_path / 'runs'}\nparallel: {{tp: 3}}\ntrain: {{stepz: 3}}\n")
    with _client() as client:
        n_before = len(client.read_flow_runs())
        result = CliRunner().invoke(app, ["run", str(bad)])
        n_after = len(client.read_flow_runs())
    assert result.exit_code == 2
    assert "train.stepz: unknown key" in result.output
    assert not (tmp_path / "runs").exists() and n_after == n_before
    result = CliRunner().invoke(
        app, ["run", str(REPO / "examples/tiny/flow.yaml"), "--from", "export", "--only", "train"]
    )
    assert result.exit_code == 2 and "exclude each other" in result.output


def test_run_tracked_wraps_a_library_call_in_a_flow_run(prefect_harness, tmp_path):
    from titan_pipe.errors import UserError
    from titan_pipe.flows.track import run_tracked

    f = tmp_path / "x.bin"
    f.write_bytes(b"abc")
    digest = run_tracked("hash", cache.sha256_file, path=f)
    assert digest == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with _client() as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["titan-pipe-hash-cli"])))
    assert len(runs) == 1 and runs[0].state.is_completed(), runs

    def bad(**_):
        raise UserError("x.yaml: bad value; fix it")

    with pytest.raises(UserError, match="bad value"):
        run_tracked("bad", bad, path=f)
