"""The training launcher: torchrun command and env, streaming and exit codes, the train CLI."""

from __future__ import annotations

import io
import json
import socket
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from typer.testing import CliRunner

from titan_pipe.cli import app
from titan_pipe.config import parse_flow
from titan_pipe.model.args import count_params
from titan_pipe.run_dir import RunDir
from titan_pipe.training.failure import failure_message, node_log, root_cause
from titan_pipe.training.launch import resume_flag, run_training, summarize
from titan_pipe.training.launch_command import build_torchrun_command, launch_env
from titan_pipe.training.slurm import first_slurm_host, inside_launch, reports, slurm_env
from titan_pipe.training.stream import stream_process
from titan_pipe.training.metrics import format_progress_line
from fault_shim import arm


def _cfg(**sections):
    data = {"name": "t", "device": "cpu", "model": {"flavour": "debug"}}
    data.update(sections)
    return parse_flow(data, base=Path.cwd())


def _write_flow(tmp_path: Path, **sections) -> Path:
    data = {"name": "t", "runs_dir": str(tmp_path / "runs"), "device": "cpu", "model": {"flavour": "debug"}}
    data.update(sections)
    path = tmp_path / "flow.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


# --- command and environment ----------------------------------------------------------------------


def test_single_node_command():
    cfg = _cfg(parallel={"dp": 2, "tp": 2, "pp": 1})
    cmd = build_torchrun_command(cfg, Path("/x/flow.yaml"), resume=False)
    assert cmd == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "4",
        "--nnodes",
        "1",
        "--node_rank",
        "0",
        "--standalone",
        "--max_restarts",
        "0",
        "--local-ranks-filter",
        "0",
        "-m",
        "titan_pipe.training.rank",
        "--flow",
        "/x/flow.yaml",
    ]
    cmd = build_torchrun_command(cfg, Path("/x/flow.yaml"), resume=True, log_dir=Path("/r/logs"))
    assert cmd[-1] == "--resume"
    i = cmd.index("--log_dir")
    assert cmd[i : i + 4] == ["--log_dir", "/r/logs", "--tee", "3"]


def test_multi_node_command():
    cfg = _cfg(
        name="big",
        parallel={"dp": 4, "tp": 2, "pp": 2},
        launch={"nnodes": 2, "node_rank": 1, "rdzv_endpoint": "10.0.0.1:29400", "max_restarts": 3},
    )
    cmd = build_torchrun_command(cfg, Path("/x/flow.yaml"), resume=False)
    assert "--standalone" not in cmd
    joined = " ".join(cmd)
    assert "--nproc_per_node 8 --nnodes 2 --node_rank 1 " in joined
    assert "--rdzv_backend c10d --rdzv_endpoint 10.0.0.1:29400 --rdzv_id big --max_restarts 3" in joined
    cfg = _cfg(parallel={"dp": 4}, launch={"nnodes": 2, "nproc_per_node": 2, "rdzv_endpoint": "h:1"})
    assert build_torchrun_command(cfg, Path("f"), resume=False)[4] == "2"


def test_resume_flag_with_torchrun_restarts(tmp_path):
    run = RunDir(tmp_path / "run")
    plain, restarts = _cfg(), _cfg(launch={"max_restarts": 2})
    assert resume_flag(plain, run, False) is False and resume_flag(plain, run, True) is True
    assert resume_flag(restarts, run, False) is True  # fresh run: a restart must not redo step 0..
    (run.checkpoint(4)).mkdir(parents=True)
    assert resume_flag(restarts, run, False) is True  # an incomplete step dir does not count
    (run.checkpoint(4) / "manifest.json").write_text("{}")
    assert resume_flag(restarts, run, False) is False  # ..but an old run's checkpoints are not resumed unasked
    assert resume_flag(restarts, run, True) is True


def test_each_node_has_its_own_log():
    run = RunDir(Path("/r/run"))
    assert node_log(_cfg(), run) == run.train_log
    cfg = _cfg(parallel={"dp": 4}, launch={"nnodes": 2, "node_rank": 1, "rdzv_endpoint": "h:1"})
    assert node_log(cfg, run) == Path("/r/run/train-node1.log")


def test_launch_env():
    cfg = _cfg(parallel={"dp": 2, "tp": 2})
    env = launch_env(cfg, "cpu", base={"PATH": "/bin"}, cpus=16)
    assert env["OMP_NUM_THREADS"] == "4" and env["PYTHONUNBUFFERED"] == "1" and env["PATH"] == "/bin"
    assert env["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "0"
    assert launch_env(cfg, "cpu", base={}, cpus=2)["OMP_NUM_THREADS"] == "1"
    assert launch_env(cfg, "cpu", base={"OMP_NUM_THREADS": "7"}, cpus=2)["OMP_NUM_THREADS"] == "7"
    assert "OMP_NUM_THREADS" not in launch_env(_cfg(), "cpu", base={}, cpus=2)  # one rank: untouched
    npu = launch_env(_cfg(comm={"fusion_buffer_mb": 200}), "npu", base={})
    assert npu["HCCL_BUFFSIZE"] == "200" and "OMP_NUM_THREADS" not in npu
    assert "HCCL_BUFFSIZE" not in launch_env(cfg, "cuda", base={})


def test_inside_launch_and_slurm_mapping():
    assert not inside_launch({"PATH": "/bin"})
    assert inside_launch({"LOCAL_RANK": "0"}) and inside_launch({"SLURM_PROCID": "3", "SLURM_NTASKS": "4"})
    # an sbatch script's own shell is task 0 of 1 step: titan-pipe spawns torchrun there
    assert not inside_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert inside_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "8"})
    cfg = _cfg(parallel={"dp": 4})
    env = slurm_env(
        {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]"}, cfg
    )
    assert env["RANK"] == "3" and env["WORLD_SIZE"] == "4" and env["LOCAL_RANK"] == "1"
    assert env["MASTER_ADDR"] == "gpu07"
    assert env["MASTER_PORT"] == "29500"
    cfg = _cfg(parallel={"dp": 4}, launch={"rdzv_endpoint": "head:1234"})
    env = slurm_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, cfg)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("head", "1234")
    assert slurm_env({"RANK": "0", "SLURM_PROCID": "0"}, cfg) == {}  # torchrun under srun wins
    assert reports({}) and reports({"RANK": "0"}) and not reports({"RANK": "1"})
    assert not reports({"SLURM_PROCID": "2"}) and reports({"RANK": "0", "SLURM_PROCID": "5"})
    assert first_slurm_host("a1,b2") == "a1" and first_slurm_host("n[3,5-6]") == "n3"


# --- streaming and exit status -------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import sys
    print("hello from the child")
    print("to stderr", file=sys.stderr)
    for s in (1, 2):
        print({line!r}.replace("@", str(s)), flush=True)
    sys.exit(3)
""")


def test_stream_process_tees_lines_and_returns_the_status(tmp_path):
    line = format_progress_line(0, 2, {"loss": 1.5, "mfu": None}).replace("step 0", "step @")
    code = CHILD.format(line=line)
    out, log = io.StringIO(), tmp_path / "logs" / "train.log"
    rc = stream_process([sys.executable, "-c", code], env=None, log_path=log, console=out, live=False)
    assert rc == 3
    text = log.read_text()
    assert text.startswith("# ") and "hello from the child" in text and "to stderr" in text
    assert "step 2/2 | loss 1.5000" in out.getvalue() and "to stderr" in out.getvalue()
    # a second launch appends (resume keeps the first run's log)
    assert (
        stream_process(
            [sys.executable, "-c", "print('again')"], env=None, log_path=log, console=io.StringIO(), live=False
        )
        == 0
    )
    assert "hello from the child" in log.read_text() and log.read_text().rstrip().endswith("again")
    # on a terminal the progress lines drive a bar, the rest prints above it
    live = io.StringIO()
    assert stream_process([sys.executable, "-c", code], env=None, log_path=log, console=live, live=True) == 3
    assert "hello from the child" in live.getvalue() and "2/2" in live.getvalue()


TORCHRUN_FAILURE = """
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
titan_pipe.training.rank FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-02_15:13:26
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 21225)  (SIGTERM)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_15:13:26
  host      : localhost
  rank      : 3 (local_rank: 1)
  exitcode  : 1 (pid: 21226)
============================================================
"""


def test_failure_message_names_the_root_cause_rank_and_its_logs(tmp_path):
    run = RunDir(tmp_path / "run")
    (run.root / "logs" / "job_x" / "attempt_0" / "1").mkdir(parents=True)
    (run.root / "logs" / "job_x" / "attempt_0" / "0").mkdir(parents=True)
    old = "# earlier launch\n" + TORCHRUN_FAILURE.replace("rank      : 3", "rank      : 7")
    run.train_log.write_text(old)
    offset = run.train_log.stat().st_size
    with run.train_log.open("a") as f:
        f.write("# this launch\n" + TORCHRUN_FAILURE)
    assert root_cause(TORCHRUN_FAILURE) == (3, 1, 1)
    msg = failure_message(1, run, 0, offset)
    assert "torchrun exited with status 1" in msg and str(run.train_log) in msg
    assert "rank 3 failed first (exit code 1)" in msg
    assert str(run.root / "logs" / "job_x" / "attempt_0" / "1" / "stderr.log") in msg
    assert root_cause("plain output") is None
    assert failure_message(2, run, 0, run.train_log.stat().st_size).endswith(str(run.train_log))


def test_summarize_reads_metrics(tmp_path):
    path = tmp_path / "metrics.jsonl"
    recs = [
        {"step": 1, "loss": 5.0, "tokens_per_s": 10.0, "mfu": 0.1},
        {"step": 2, "loss": 4.0, "tokens_per_s": 30.0, "mfu": 0.3},
        {"step": 3, "loss": 3.0, "tokens_per_s": 50.0, "mfu": 0.5},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"step": 4, "lo')
    s = summarize(path)
    assert (s.final_loss, s.tokens_per_s, s.mfu, s.steps) == (3.0, 40.0, pytest.approx(0.4), 3)
    assert summarize(tmp_path / "none.jsonl").steps == 0
    # a resumed run that restarted from step 1 logs steps 2.. again: the later records win
    with path.open("a") as f:
        f.write("\n" + json.dumps({"step": 2, "loss": 3.5, "tokens_per_s": 70.0, "mfu": 0.7}) + "\n")
    s = summarize(path)
    assert s.steps == 3 and s.final_loss == 3.0 and s.tokens_per_s == 60.0


# --- the CLI and real runs -----------------------------------------------------------------------


def test_cli_refuses_a_bad_flow_before_starting(tmp_path):
    path = _write_flow(tmp_path, parallel={"dp": 3, "tp": 5}, train={"stepz": 3})
    r = CliRunner().invoke(app, ["train", str(path)])
    assert r.exit_code == 2, r.output
    assert "train.stepz: unknown key" in r.output
    assert not (tmp_path / "runs").exists()
    r = CliRunner().invoke(app, ["train", str(tmp_path / "missing.yaml")])
    assert r.exit_code == 2 and "file not found" in r.output
    if not torch.cuda.is_available():  # a valid flow for a device this machine lacks: exit 1, nothing made
        path = _write_flow(tmp_path, device="cuda")
        r = CliRunner().invoke(app, ["train", str(path)])
        assert r.exit_code == 1 and "device: cuda, but CUDA is not available" in r.output
        assert not (tmp_path / "runs").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_in_process_run_inside_an_existing_launch(tmp_path, monkeypatch):
    """RANK/WORLD_SIZE set (as torchrun sets them): the trainer runs here, no subprocess."""
    flow = _write_flow(
        tmp_path, train={"steps": 3, "batch_size": 2, "seq_len": 16, "seed": 1}, checkpoint={"every": 2, "keep_last": 1}
    )
    for k, v in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }.items():
        monkeypatch.setenv(k, v)
    from titan_pipe.config import load_flow

    cfg = load_flow(flow)
    res = run_training(flow_path=flow, cfg=cfg)
    assert res.run_dir == (tmp_path / "runs" / "t").resolve()
    assert res.checkpoint.name == "step-000003" and (res.checkpoint / "manifest.json").is_file()
    assert [p.name for p in (res.run_dir / "checkpoints").iterdir()] == ["step-000003"]  # keep_last 1
    assert res.summary.steps == 3 and res.summary.final_loss > 0
    assert res.summary.plot == str(res.run_dir / "metrics.png")
    assert (res.run_dir / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    assert (res.run_dir / "flow.yaml").read_text() == flow.read_text()
    assert not (res.run_dir / "train.log").exists()  # nothing was spawned
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(Exception, match="WORLD_SIZE=2"):
        run_training(flow_path=flow, cfg=cfg)

    # Disk room on --resume: step 3 is kept (keep_last 1), so 10 steps save 4 more (4, 6, 8, 10) but
    # only one is new on disk at once; a fresh run of the same flow would hold two.
    from titan_pipe.training import preflight

    longer = load_flow(
        _write_flow(
            tmp_path,
            train={"steps": 10, "batch_size": 2, "seq_len": 16, "seed": 1},
            checkpoint={"every": 2, "keep_last": 1},
        )
    )
    each = 12 * count_params(longer.model.args())
    monkeypatch.setattr(preflight, "free_bytes", lambda path: int(1.5 * each))
    assert preflight.disk_problem(longer, resume=True) is None
    fresh = preflight.disk_problem(longer, resume=False)
    assert fresh and "saves 5 checkpoint(s)" in fresh and "up to 2 new at once" in fresh, fresh


def test_checkpoints_written_counts_the_trainers_save_steps():
    from titan_pipe.records.checkpoint_format import checkpoints_written, is_save_step

    for steps in range(1, 40):
        for every in (1, 2, 3, 7, 10, 50):
            for start in range(0, steps + 2):
                want = sum(is_save_step(s, steps=steps, every=every) for s in range(start + 1, steps + 1))
                assert checkpoints_written(steps, every, start) == want, (steps, every, start)


def test_train_refuses_a_run_whose_checkpoints_cannot_fit(tmp_path, monkeypatch):
    """Less free disk than the checkpoints on it at once: exit 2 before anything is made, the figures
    and the fixes named; validate (which may run away from the cluster) is not held to this host."""
    from titan_pipe.io.faults import human
    from titan_pipe.training import preflight

    flow = _write_flow(tmp_path, train={"steps": 20}, checkpoint={"every": 10, "keep_last": 2})
    n = count_params(parse_flow(yaml.safe_load(flow.read_text()), base=tmp_path).model.args())
    each = 4 * n * 3  # fp32 weights and AdamW's two fp32 moments
    monkeypatch.setattr(preflight, "free_bytes", lambda path: each + each // 2)
    r = CliRunner().invoke(app, ["train", str(flow)])
    assert r.exit_code == 2, r.output
    out = " ".join(r.output.split())
    assert "checkpoint: the disk holding" in out and f"{human(each + each // 2)} free" in out, out
    assert f"saves 2 checkpoint(s) of about {human(each)} ({n:,} parameters" in out, out
    assert f"up to 2 new at once (checkpoint.keep_last 2 plus the one being written), {human(2 * each)}" in out
    assert "lower checkpoint.keep_last, set checkpoint.save_optimizer: false" in out
    assert not (tmp_path / "runs").exists()
    assert CliRunner().invoke(app, ["validate", str(flow)]).exit_code == 0
    # without the optimizer state two checkpoints fit; one save (10 steps) fits with it
    for sections in (
        {"train": {"steps": 20}, "checkpoint": {"every": 10, "save_optimizer": False}},
        {"train": {"steps": 10}, "checkpoint": {"every": 10}},
        {"train": {"steps": 20, "optimizer": {"name": "sgd"}}, "checkpoint": {"every": 10}},
    ):
        cfg = parse_flow(yaml.safe_load(_write_flow(tmp_path, **sections).read_text()), base=tmp_path)
        assert preflight.disk_problem(cfg) is None, sections
    # --resume onto a damaged manifest: one line from the resume check, none from this one, no traceback
    flow = _write_flow(tmp_path, train={"steps": 20}, checkpoint={"every": 10, "keep_last": 2})
    bad = tmp_path / "runs" / "t" / "checkpoints" / "step-000010"
    bad.mkdir(parents=True)
    (bad / "manifest.json").write_text("{not json")
    r = CliRunner().invoke(app, ["train", str(flow), "--resume"])
    assert r.exit_code == 2 and "--resume:" in r.output and "checkpoint: the disk" not in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception


@pytest.mark.distributed
def test_train_cli_end_to_end_tp2(tmp_path, monkeypatch):
    """`titan-pipe train` spawns torchrun with 2 gloo ranks (tp=2): metrics, checkpoint, status."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.chdir(tmp_path)
    flow = _write_flow(
        tmp_path,
        train={"steps": 3, "batch_size": 4, "seq_len": 32, "seed": 0},
        parallel={"dp": 1, "tp": 2, "pp": 1},
        checkpoint={"every": 2, "keep_last": 2},
    )
    r = CliRunner().invoke(app, ["train", str(flow)])
    assert r.exit_code == 0, r.output
    run = tmp_path / "runs" / "t"
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in recs] == [1, 2, 3]
    assert all(x["loss"] > 0 and x["tokens_per_s"] > 0 for x in recs)
    # byte tokenizer on the debug model starts near ln(320) and learns
    assert 4.5 < recs[0]["loss"] < 7.5 and recs[-1]["loss"] < recs[0]["loss"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002", "step-000003"]
    ck = run / "checkpoints" / "step-000003"
    manifest = json.loads((ck / "manifest.json").read_text())
    assert manifest  # written last: its presence marks the step complete
    files = sorted(p.name for p in (ck / "model").glob("*.safetensors"))
    assert files == ["pp0-tp0.safetensors", "pp0-tp1.safetensors"]
    with safe_open(str(ck / "model" / "pp0-tp0.safetensors"), "pt") as f:
        assert len(list(f.keys())) > 0
    log = (run / "train.log").read_text()
    assert "step 3/3" in log and "torch.distributed.run" in log
    assert "done: steps 3" in r.output and "step-000003" in r.output and "metrics.png" in r.output
    # a failing rank (fault injection) makes `titan-pipe train` exit non-zero and names the log
    flow = _write_flow(tmp_path, name="bad", train={"steps": 3, "batch_size": 2, "seq_len": 16})
    with pytest.MonkeyPatch.context() as mp:
        arm(mp, "1:0:step")
        r = CliRunner().invoke(app, ["train", str(flow)])
    assert r.exit_code != 0
    assert "torchrun exited with status" in r.output and "train.log" in r.output
    assert "rank 0 failed first (exit code 1)" in r.output and "stderr.log" in r.output


class _ClosedPipe(io.StringIO):
    def write(self, s):
        raise BrokenPipeError


def test_stream_process_outlives_a_closed_console(tmp_path):
    log = tmp_path / "train.log"
    code = "import sys\nfor i in range(3): print(i)\nsys.exit(4)"
    rc = stream_process([sys.executable, "-c", code], env=None, log_path=log, console=_ClosedPipe(), live=False)
    assert rc == 4 and log.read_text().splitlines()[-3:] == ["0", "1", "2"]


def test_one_run_dir_rule_when_flow_yaml_is_elsewhere(tmp_path, monkeypatch):
    """A relative runs_dir is taken from the cwd by training, validate and every pre-launch check (they
    once took it from flow.yaml's dir): --resume with another model.dim is refused before launch with
    the run's flow.yaml record untouched, and a flow.yaml on a read-only mount validates."""
    import os

    from titan_pipe.config import ConfigError, load_flow
    from titan_pipe.training import preflight

    conf, work = tmp_path / "conf", tmp_path / "work"
    conf.mkdir()
    work.mkdir()
    monkeypatch.chdir(work)
    data = {
        "name": "t",
        "runs_dir": "runs",
        "device": "cpu",
        "model": {"flavour": "debug"},
        "train": {"steps": 2, "batch_size": 2, "seq_len": 16, "seed": 1},
        "checkpoint": {"every": 2},
    }
    flow = conf / "flow.yaml"
    flow.write_text(yaml.safe_dump(data))
    for k, v in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }.items():
        monkeypatch.setenv(k, v)
    res = run_training(flow_path=flow, cfg=load_flow(flow))
    assert res.run_dir == (work / "runs" / "t").resolve() and not (conf / "runs").exists()
    record = (res.run_dir / "flow.yaml").read_text()
    wider = conf / "wider.yaml"
    wider.write_text(yaml.safe_dump({**data, "model": {"flavour": "debug", "dim": 128}}))
    with pytest.raises(ConfigError) as e:
        preflight.check_before_launch(load_flow(wider), flow_path=wider, resume=True)
    assert any(line.startswith("--resume:") and "dim" in line for line in e.value.lines), e.value.lines
    r = CliRunner().invoke(app, ["train", str(wider), "--resume"])
    assert r.exit_code == 2 and "--resume:" in r.output, r.output
    assert (res.run_dir / "flow.yaml").read_text() == record  # the rejected config replaced nothing
    # flow.yaml on a read-only mount (a ConfigMap): the run goes to ./runs, which is writable
    real_access = os.access
    monkeypatch.setattr(
        preflight.os,
        "access",
        lambda p, mode, **kw: (
            False if mode & os.W_OK and Path(p).resolve().is_relative_to(conf) else real_access(p, mode, **kw)
        ),
    )
    r = CliRunner().invoke(app, ["validate", str(flow)])
    assert r.exit_code == 0, r.output
