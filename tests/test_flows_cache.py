"""Stage caching and selection as pure logic, and run_pipeline's orchestration with small stand-in stages.

No Prefect here: the stand-ins are plain callables writing real files, injected in place of the stage
tasks, so these tests pin what flows/ itself decides (keys, records, --from/--only/--force, resume).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from titan_pipe.records.checkpoint_format import newest_complete
from titan_pipe.config import FlowConfig, load_flow
from titan_pipe.errors import StageFailed, UserError
from titan_pipe.flows import cache
from titan_pipe.records.stage_summaries import (
    SUMMARIES,
    ConvertSummary,
    DataSummary,
    EvaluateSummary,
    ExportSummary,
    TrainSummary,
)
from titan_pipe.flows.tasks import (
    ConvertPaths,
    DataPaths,
    EvaluatePaths,
    ExportPaths,
    StageOutput,
    TrainPaths,
    resume_decision,
)
from titan_pipe.flows.stage_files import checkpoint_files
from titan_pipe.flows.train_to_deploy import listening, retryable, run_pipeline


# ---- keys and hashing -------------------------------------------------------------------------


def test_sha256_matches_hashlib_and_memo_skips_unchanged_files(tmp_path):
    import hashlib

    f = tmp_path / "a.bin"
    f.write_bytes(os.urandom(5000))
    memo = tmp_path / "memo.json"
    h = cache.FileHasher(memo)
    assert h.sha256(f) == hashlib.sha256(f.read_bytes()).hexdigest()
    h.save()
    h2 = cache.FileHasher(memo)
    assert h2.sha256(f) == hashlib.sha256(f.read_bytes()).hexdigest() and h2.hashed == 0
    f.write_bytes(b"changed")  # new size and mtime: must be re-read
    assert h2.sha256(f) == hashlib.sha256(b"changed").hexdigest() and h2.hashed == 1


def _cfg(tmp_path: Path, **over) -> FlowConfig:
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_text("the quick brown fox " * 50)
    data = {"name": "t", "runs_dir": str(tmp_path / "runs"), "data": {"path": str(corpus)}}
    for k, v in over.items():
        data.setdefault(k, {}).update(v) if isinstance(v, dict) else data.__setitem__(k, v)
    return FlowConfig.model_validate(data)


def test_train_key_follows_settings_and_data_but_not_placement_or_fault_hook(tmp_path):
    h, run = cache.FileHasher(), tmp_path / "runs" / "t"

    def key(cfg):
        return cache.stage_key(cache.stage_inputs("train", cfg, flow_dir=tmp_path, upstream={}), h, run)

    base = key(_cfg(tmp_path))
    assert key(_cfg(tmp_path)) == base
    assert key(_cfg(tmp_path, train={"steps": 21})) != base
    assert key(_cfg(tmp_path, parallel={"tp": 2})) != base
    assert key(_cfg(tmp_path, train={"log_every": 5})) == base
    assert key(_cfg(tmp_path, launch={"max_restarts": 1}, orchestration={"retries": 0})) == base
    assert key(_cfg(tmp_path, export={"opset": 15})) == base
    (tmp_path / "corpus.txt").write_text("other text " * 40)
    assert key(_cfg(tmp_path)) != base


def test_downstream_keys_follow_upstream_files_and_own_section(tmp_path):
    h, run = cache.FileHasher(), tmp_path / "runs" / "t"
    model = run / "model"
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"w1")
    (model / "config.json").write_text("{}")
    (model / "provenance.json").write_text('{"time": 1}')

    def key(cfg):
        return cache.stage_key(
            cache.stage_inputs(
                "export",
                cfg,
                flow_dir=tmp_path,
                upstream={"convert": StageOutput("convert", ConvertPaths(str(model)), [])},
            ),
            h,
            run,
        )

    base = key(_cfg(tmp_path))
    (model / "provenance.json").write_text('{"time": 2}')  # export does not read it
    assert key(_cfg(tmp_path)) == base
    assert key(_cfg(tmp_path, export={"opset": 15})) != base
    assert key(_cfg(tmp_path, train={"steps": 3})) == base
    (model / "model.safetensors").write_bytes(b"w2")
    assert key(_cfg(tmp_path)) != base


# ---- selection ----------------------------------------------------------------------------------


def test_plan_actions():
    A, R, U, S = cache.AUTO, cache.RUN, cache.REUSE, cache.SKIP
    assert cache.plan_actions() == dict(train=A, convert=A, export=A, evaluate=A)
    assert cache.plan_actions(force=True) == dict(train=R, convert=R, export=R, evaluate=R)
    assert cache.plan_actions(cache=False) == dict(train=R, convert=R, export=R, evaluate=R)
    assert cache.plan_actions(from_stage="export") == dict(train=U, convert=U, export=R, evaluate=R)
    assert cache.plan_actions(only="convert") == dict(train=U, convert=R, export=S, evaluate=S)
    assert cache.plan_actions(only="train", force=True) == dict(train=R, convert=S, export=S, evaluate=S)
    with pytest.raises(UserError, match="exclude each other"):
        cache.plan_actions(from_stage="export", only="train")
    with pytest.raises(UserError, match="'exprot' is not a stage"):
        cache.plan_actions(from_stage="exprot")


# ---- orchestration with stand-in stages --------------------------------------------------------


class StandIns:
    """Plain callables standing in for the four stages: they write real files and count calls."""

    def __init__(self, fail_train_times: int = 0, passed: bool = True):
        self.calls: list[str] = []
        self.data_calls = 0  # the data stage runs before train on raw text: counted apart
        self.resume_flags: list[bool] = []
        self.fail_train_times = fail_train_times
        self.passed = passed

    def data(self, *, flow_dir, cfg, out_dir):
        self.data_calls += 1
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "data.json").write_text(json.dumps({"tokenizer": cfg.data.tokenizer}))
        return StageOutput("data", DataPaths(str(out_dir)), outputs=[str(out_dir)], summary=DataSummary(tokens=1))

    def train(self, *, flow_path, cfg, resume):
        self.calls.append("train")
        self.resume_flags.append(resume)
        run = cfg.run_dir().resolve()
        if self.fail_train_times:
            self.fail_train_times -= 1
            raise StageFailed("rank 1 exited with 1")
        step = run / "checkpoints" / f"step-{cfg.train.steps:06d}"
        (step / "model").mkdir(parents=True, exist_ok=True)
        (step / "model" / "pp0-tp0.safetensors").write_bytes(f"weights lr={cfg.train.optimizer.lr}".encode())
        (step / "manifest.json").write_text("{}")
        (run / "metrics.jsonl").write_text(json.dumps({"step": cfg.train.steps, "loss": 2.0}) + "\n")
        return StageOutput(
            "train",
            TrainPaths(str(run), str(run / "metrics.jsonl"), str(step)),
            outputs=[str(step)],
            summary=TrainSummary(final_loss=2.0, tokens_per_s=1e3, steps=cfg.train.steps),
        )

    def convert(self, *, checkpoint, out_dir, settings):
        self.calls.append("convert")
        out_dir.mkdir(parents=True, exist_ok=True)
        data = (checkpoint / "model" / "pp0-tp0.safetensors").read_bytes()
        (out_dir / "model.safetensors").write_bytes(data + settings.dtype.encode())
        (out_dir / "config.json").write_text("{}")
        return StageOutput(
            "convert", ConvertPaths(str(out_dir)), outputs=[str(out_dir)], summary=ConvertSummary(files=2)
        )

    def export(self, *, model_dir, out_dir, settings):
        self.calls.append("export")
        out_dir.mkdir(parents=True, exist_ok=True)
        onnx = out_dir / "model.onnx"
        onnx.write_bytes((model_dir / "model.safetensors").read_bytes() + f"opset{settings.opset}".encode())
        return StageOutput(
            "export",
            ExportPaths(str(out_dir), str(onnx), str(out_dir / "export.json")),
            outputs=[str(out_dir)],
            summary=ExportSummary(atc_status="skipped: atc not on PATH"),
        )

    def evaluate(self, *, out_dir, checkpoint, model_dir, onnx, om, data, settings, split=None):
        self.calls.append("evaluate")
        out_dir.mkdir(parents=True, exist_ok=True)
        report = out_dir / "report.json"
        report.write_text(json.dumps({"passed": self.passed, "onnx": onnx.read_bytes().decode()}))
        return StageOutput(
            "evaluate",
            EvaluatePaths(str(out_dir), str(report)),
            outputs=[str(report)],
            summary=EvaluateSummary(passed=self.passed),
            passed=self.passed,
        )

    def tasks(self):
        return {
            "data": self.data,
            "train": self.train,
            "convert": self.convert,
            "export": self.export,
            "evaluate": self.evaluate,
        }


def _flow_yaml(tmp_path: Path, **over) -> Path:
    cfg = _cfg(tmp_path, **over)
    path = tmp_path / "flow.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_defaults=True)))
    return path


def test_second_run_is_all_cached_and_export_change_reruns_export_and_evaluate(tmp_path):
    s = StandIns()
    path = _flow_yaml(tmp_path)
    events = []
    with listening(events.append):
        first = run_pipeline(path, tasks=s.tasks(), publish=False)
    assert s.calls == ["train", "convert", "export", "evaluate"] and first.passed is True
    assert [e.status for e in events if e.stage == "train"] == ["running", "done"]
    s.calls.clear()
    second = run_pipeline(path, tasks=s.tasks(), publish=False)
    assert s.calls == [] and set(second.stages.values()) == {"cached"}
    assert second.outputs["evaluate"].paths == first.outputs["evaluate"].paths

    _flow_yaml(tmp_path, export={"opset": 15})
    third = run_pipeline(path, tasks=s.tasks(), publish=False)
    assert s.calls == ["export", "evaluate"]
    assert third.stages == dict(data="cached", train="cached", convert="cached", export="done", evaluate="done")
    assert "opset15" in (tmp_path / "runs/t/report/report.json").read_text()

    s.calls.clear()
    _flow_yaml(tmp_path, export={"opset": 15}, convert={"dtype": "float32"})
    run_pipeline(path, tasks=s.tasks(), publish=False)
    assert s.calls == ["convert", "export", "evaluate"]


def test_changed_or_deleted_output_reruns_the_stage(tmp_path):
    s = StandIns()
    path = _flow_yaml(tmp_path)
    run_pipeline(path, tasks=s.tasks(), publish=False)
    s.calls.clear()
    (tmp_path / "runs/t/onnx/model.onnx").write_bytes(b"tampered")
    run_pipeline(path, tasks=s.tasks(), publish=False)
    assert s.calls == ["export"]  # its output is restored bit-exactly, so evaluate's key is unchanged
    s.calls.clear()
    (tmp_path / "runs/t/.stages/convert.json").write_text("{not json")
    run_pipeline(path, tasks=s.tasks(), publish=False)
    assert s.calls == ["convert"]


def test_force_from_and_only(tmp_path):
    s = StandIns()
    path = _flow_yaml(tmp_path)
    with pytest.raises(UserError, match="train stage has no finished outputs"):
        run_pipeline(path, only="export", tasks=s.tasks(), publish=False)
    assert s.calls == [] and not (tmp_path / "runs/t/checkpoints").exists()
    run_pipeline(path, tasks=s.tasks(), publish=False)
    s.calls.clear()
    run_pipeline(path, force=True, tasks=s.tasks(), publish=False)
    assert s.calls == ["train", "convert", "export", "evaluate"]
    s.calls.clear()
    out = run_pipeline(path, from_stage="export", tasks=s.tasks(), publish=False)
    assert s.calls == ["export", "evaluate"] and out.stages["train"] == "reused"
    s.calls.clear()
    out = run_pipeline(path, only="convert", tasks=s.tasks(), publish=False)
    assert s.calls == ["convert"] and out.stages["export"] == "skipped" and out.passed is None


def test_failed_stage_leaves_no_record_and_failed_verdict_raises(tmp_path):
    s = StandIns(fail_train_times=1)
    path = _flow_yaml(tmp_path)
    events = []
    with listening(events.append), pytest.raises(StageFailed, match="rank 1"):
        run_pipeline(path, tasks=s.tasks(), publish=False)
    assert events[-1].stage == "train" and events[-1].status == "failed"
    assert cache.read_record(tmp_path / "runs/t", "train") is None
    bad = StandIns(passed=False)
    with pytest.raises(StageFailed, match="evaluation failed"):
        run_pipeline(path, tasks=bad.tasks(), publish=False)
    assert cache.read_record(tmp_path / "runs/t", "evaluate").result["passed"] is False
    with pytest.raises(StageFailed, match="evaluation failed"):  # cached, still a failing verdict
        run_pipeline(path, tasks=bad.tasks(), publish=False)
    assert bad.calls == ["train", "convert", "export", "evaluate"]


def test_interrupted_training_resumes_and_changed_training_starts_clean(tmp_path):
    path = _flow_yaml(tmp_path)
    run = tmp_path / "runs/t"
    s = StandIns()
    run_pipeline(path, only="train", tasks=s.tasks(), publish=False)
    assert s.resume_flags == [False]
    (run / ".stages/train.json").unlink()  # as if the flow died after the checkpoint, before the record
    run_pipeline(path, tasks=s.tasks(), publish=False)
    assert s.resume_flags == [False, True]
    _flow_yaml(tmp_path, train={"optimizer": {"lr": 0.01}})
    run_pipeline(path, tasks=s.tasks(), publish=False)
    assert s.resume_flags[-1] is False
    assert (run / "checkpoints.prev").is_dir() and (run / "metrics.prev.jsonl").is_file()


def test_resume_decision_and_retry_condition(tmp_path):
    assert newest_complete(tmp_path) is None
    for step, complete in ((5, True), (10, True), (15, False)):
        d = tmp_path / "checkpoints" / f"step-{step:06d}"
        d.mkdir(parents=True)
        if complete:
            (d / "manifest.json").write_text("{}")
    assert newest_complete(tmp_path).name == "step-000010"
    assert resume_decision(requested=False, attempt=2, run_dir=tmp_path)
    assert not resume_decision(requested=False, attempt=1, run_dir=tmp_path)
    assert not resume_decision(requested=True, attempt=3, run_dir=tmp_path / "empty")

    class State:
        def __init__(self, exc):
            self.exc = exc

        def result(self):
            raise self.exc

    assert retryable(None, None, State(StageFailed("rank died")))
    assert retryable(None, None, State(RuntimeError("launcher crashed")))
    assert not retryable(None, None, State(UserError("bad data path")))


def test_retry_owner_is_single(tmp_path):
    cfg = _cfg(tmp_path)
    assert cfg.orchestration.train_retries(cfg.launch.max_restarts) == 2
    cfg = _cfg(tmp_path, launch={"max_restarts": 2})
    assert cfg.orchestration.train_retries(cfg.launch.max_restarts) == 0
    path = tmp_path / "both.yaml"
    path.write_text(yaml.safe_dump({"launch": {"max_restarts": 1}, "orchestration": {"retries": 1}}))
    from titan_pipe.config import ConfigError

    with pytest.raises(ConfigError, match="twice over"):
        load_flow(path)


def test_explain_change_names_values_and_files():
    old = {"schema": 1, "section": {"train": {"steps": 20}}, "files": {"a.txt": "1", "b.txt": "2"}}
    new = {"schema": 1, "section": {"train": {"steps": 21}}, "files": {"a.txt": "9", "c.txt": "3"}}
    assert cache.explain_change(old, new) == [
        "train.steps: 20 -> 21",
        "input a.txt changed",
        "input b.txt is gone",
        "new input c.txt",
    ]
    assert cache.explain_change(None, new) == ["no earlier finished run"]


def test_checkpoint_inputs_are_the_manifest_and_its_weights_not_optimizer_state(tmp_path):
    ck = tmp_path / "step-000004"
    (ck / "model").mkdir(parents=True)
    (ck / "optimizer").mkdir()
    (ck / "model" / "pp0-tp0.safetensors").write_bytes(b"w")
    (ck / "optimizer" / "__0_0.distcp").write_bytes(b"o")
    from titan_pipe.records.checkpoint_format import FileInfo, Manifest, ParallelLayout

    manifest = Manifest(
        step=4,
        model={},
        parallel=ParallelLayout(),
        params={},
        files={"model/pp0-tp0.safetensors": FileInfo(1, "0" * 64)},
    )
    (ck / "manifest.json").write_text(manifest.to_json())
    assert checkpoint_files(ck) == [ck / "manifest.json", ck / "model" / "pp0-tp0.safetensors"]
    (ck / "manifest.json").write_text("not json")  # not our format: everything it holds
    assert len(checkpoint_files(ck)) == 3


def test_worker_node_joins_training_without_writing_records(tmp_path):
    from titan_pipe.flows.train_to_deploy import join_training

    path = _flow_yaml(tmp_path, parallel={"tp": 2}, launch={"nnodes": 2, "rdzv_endpoint": "node0:29500"})
    seen = []

    def train(*, flow_path, cfg, resume):
        seen.append(cfg.launch.node_rank)
        return StageOutput("train", TrainPaths("r", "m"), outputs=[])

    with pytest.raises(UserError, match="node_rank 0 must be 1..1"):
        join_training(path, node_rank=0, tasks={"train": train})
    out = join_training(path, node_rank=1, tasks={"train": train})
    assert seen == [1] and out.stages == {"train": "done"}
    assert not (tmp_path / "runs/t/.stages").exists()


def test_data_stage_runs_before_train_on_raw_text_only_and_is_cached(tmp_path):
    s = StandIns()
    path = _flow_yaml(tmp_path)
    first = run_pipeline(path, tasks=s.tasks(), publish=False)
    assert s.data_calls == 1 and list(first.stages) == ["data", "train", "convert", "export", "evaluate"]
    again = run_pipeline(path, tasks=s.tasks(), publish=False)
    assert s.data_calls == 1 and again.stages["data"] == "cached"
    (tmp_path / "corpus.txt").write_text("other text " * 40)  # new text: prepared again, trained again
    s.calls.clear()
    run_pipeline(path, tasks=s.tasks(), publish=False)
    assert s.data_calls == 2 and s.calls == ["train", "evaluate"]  # same stand-in weights: convert cached
    out = run_pipeline(path, from_stage="export", tasks=s.tasks(), publish=False)
    assert s.data_calls == 2 and "data" not in out.stages  # training not selected: nothing to prepare
    # token data (a prepared dir) needs no data stage
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    for name in ("data.json", "tokens.bin", "tokens.idx"):  # stand-in files: only their hashes are read here
        (prepared / name).write_text(name)
    _flow_yaml(tmp_path, data={"path": str(prepared)})
    out = run_pipeline(path, tasks=s.tasks(), publish=False)
    assert s.data_calls == 2 and "data" not in out.stages and out.stages["train"] == "done"


def test_every_stage_is_one_record_and_says_its_line():
    """The cache, the flow, the artifacts and the live table loop over titan_pipe.flows.stages: one
    record per stage, none spelled elsewhere."""
    from titan_pipe.flows.stages import BY_NAME

    assert tuple(BY_NAME) == (cache.DATA, *cache.STAGES) == tuple(SUMMARIES)
    assert DataSummary(tokens=112855, documents=9).line() == "112,855 tokens, 9 documents"
    train = TrainSummary(final_loss=5.93731, tokens_per_s=352.4, mfu=0.0265, steps=4)
    assert train.line() == "loss 5.9373, 352 tok/s, MFU 2.65%, 4 steps"
    assert ConvertSummary(tensors=93, bytes=12_500_000, files=1).line() == "93 tensors, 12.5 MB, 1 file(s)"
    assert ExportSummary(atc_status="not_found").line() == "ATC: not_found"
    assert (
        EvaluateSummary(passed=False).line() == "verdict FAIL" and EvaluateSummary(passed=True).line() == "verdict PASS"
    )


def test_a_stage_summary_is_typed_and_read_back_from_the_cache_record():
    """Each stage carries its own summary class; the cache's JSON reads back as that class (a field an
    older record lacks is its default, an unknown one is dropped); the wrong class is refused."""
    out = StageOutput(
        "convert",
        ConvertPaths("m"),
        outputs=["m"],
        summary=ConvertSummary(tensors=3, bytes=10, files=1, nonfinite=("w",), layout={"dp": 2}, stop_ids=[1, 2]),
    )
    back = StageOutput.from_json(json.loads(json.dumps(out.to_json())))
    assert back == out and back.summary.nonfinite == ("w",) and back.summary.layout == {"dp": 2}
    export = ExportSummary(data_files=("model.onnx.data",), graphs={"model.onnx": {"nodes": 9, "bytes": 1}})
    assert ExportSummary.of(json.loads(json.dumps(export.to_dict()))) == export
    old = {"stage": "train", "paths": {"run_dir": "r", "metrics": "m"}, "outputs": [], "summary": {"steps": 4, "x": 1}}
    assert StageOutput.from_json(old).summary == TrainSummary(steps=4)
    assert StageOutput("data", DataPaths("d"), outputs=[]).summary == DataSummary()
    with pytest.raises(TypeError, match="summary must be a TrainSummary"):
        StageOutput("train", TrainPaths("r", "m"), outputs=[], summary=DataSummary())
    with pytest.raises(ValueError, match="unknown stage 'deploy'"):
        cache.stage_inputs("deploy", None, flow_dir=Path("."), upstream={})
