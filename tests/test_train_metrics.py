"""Training metrics: JSONL logger, peak FLOPs lookup/measurement, MFU, progress lines."""

from __future__ import annotations

import io
import json
import time

import pytest
import torch

from titan_pipe.rules.devices import Device
from titan_pipe.training.metrics import (
    MetricsLogger,
    TrainProgress,
    format_progress_line,
    measure_cpu_peak,
    mfu,
    peak_flops,
    profile_peak,
    read_metrics,
)
from titan_pipe.training.rank_records import PROGRESS_TAG, RECORDS_ENV, progress_line, read_progress


def test_logger_appends_flushed_lines_and_disabled_writes_nothing(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    log = MetricsLogger(path, enabled=True)
    log.log({"step": 1, "loss": torch.tensor(2.5), "mfu": None})
    # flushed: readable while the logger is still open
    assert json.loads(path.read_text().splitlines()[0]) == {"step": 1, "loss": 2.5, "mfu": None}
    log.log({"step": 2, "loss": float("nan")})
    log.close()
    recs = read_metrics(path)
    assert [r["step"] for r in recs] == [1, 2] and recs[1]["loss"] == "nan"
    # a torn last line (killed writer) is skipped, earlier records kept
    with path.open("a") as f:
        f.write('{"step": 3, "lo')
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    off = tmp_path / "off" / "metrics.jsonl"
    MetricsLogger(off, enabled=False).log({"step": 1})
    assert not off.exists() and not off.parent.exists()


@pytest.mark.parametrize(
    "name,dtype,tflops",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.0),
        ("NVIDIA A100-SXM4-80GB", torch.float16, 312.0),
        ("Ascend910B3", torch.bfloat16, 294.9),
        ("Ascend910B1", torch.bfloat16, 373.9),
        ("NVIDIA H200", torch.bfloat16, 989.5),  # the SXM part (what the device tool lends)
        ("NVIDIA H200 NVL", torch.bfloat16, 835.5),  # not the SXM figure: the longer key wins
        ("NVIDIA H20", torch.bfloat16, 148.0),  # not H200's
        ("NVIDIA L40S", torch.float16, 362.05),
        ("NVIDIA B200", torch.bfloat16, 2250.0),
    ],
)
def test_profile_peak_known_devices(name, dtype, tflops):
    peak, source = profile_peak(name, dtype)
    assert peak == pytest.approx(tflops * 1e12) and "TFLOPS" in source


def test_unknown_accelerator_is_reported_not_guessed():
    peak, source = profile_peak("Mystery Accelerator 9000", torch.bfloat16)
    assert peak is None and source == "unknown device Mystery Accelerator 9000: MFU not reported"
    peak, source = profile_peak("NVIDIA H100 80GB HBM3", torch.float32)
    assert peak is None and "no float32 peak" in source
    # no CUDA runtime on this machine: the device cannot be named, so no MFU
    if not torch.cuda.is_available():
        peak, source = peak_flops(Device("cuda", "nccl"), torch.bfloat16)
        assert peak is None and source.startswith("unknown device cuda")


def test_cpu_peak_is_measured_and_bounds_an_independent_matmul():
    peak, source = peak_flops(Device("cpu", "gloo"), torch.float32)
    assert "measured" in source and peak > 1e8
    n = 256
    a, b = torch.randn(n, n), torch.randn(n, n)
    t0 = time.perf_counter()
    for _ in range(5):
        torch.mm(a, b)
    achieved = 5 * 2 * n**3 / (time.perf_counter() - t0)
    # the measured best-case peak is a ceiling (with slack for a busy 2-core machine)
    assert achieved < 3 * peak
    assert measure_cpu_peak(torch.float32, n=128, seconds=0.05) > 0


def test_mfu_arithmetic():
    assert mfu(1000.0, 6e9, 12e12) == pytest.approx(0.5)
    assert mfu(1000.0, 6e9, None) is None
    assert mfu(float("nan"), 6e9, 1e12) is None


def test_progress_line_for_a_person_and_the_record_for_the_launcher():
    m = {"loss": 3.14159, "lr": 1e-3, "tokens_per_s": 12345.0, "mfu": 0.0123, "peak_memory_bytes": 512 * 1024**2}
    line = format_progress_line(7, 20, m)
    assert line == "step 7/20 | loss 3.1416 | lr 1.000e-03 | 12345 tok/s | MFU 1.23% | peak mem 512.0 MiB"
    step, total, got = read_progress(progress_line(7, 20, m))
    assert (step, total) == (7, 20) and got == m  # the record keeps full precision
    assert format_progress_line(step, total, got) == line
    assert read_progress("[default0]:" + progress_line(1, 2, {"mfu": None}))[2] == {}
    assert read_progress(progress_line(1, 2, {"loss": float("nan")}))[2] == {"loss": None}  # JSON has no NaN
    # a person's line, a torchrun warning, a tag inside another line, broken JSON: not records
    for other in (
        line,
        "[rank0]: some warning",
        "WARNING " + progress_line(1, 2, {}),
        PROGRESS_TAG + "{",
        PROGRESS_TAG + '{"step": "1", "total": 2}',
        PROGRESS_TAG + "[1, 2]",
    ):
        assert read_progress(other) is None, other


def test_progress_plain_lines_off_a_terminal(monkeypatch):
    monkeypatch.delenv(RECORDS_ENV, raising=False)
    out = io.StringIO()
    with TrainProgress(5, enabled=True, log_every=2, stream=out) as p:
        for s in range(1, 6):
            p.update(s, {"loss": 1.0 / s, "mfu": None})
    lines = out.getvalue().splitlines()
    assert [x.split("/")[0] for x in lines] == ["step 2", "step 4", "step 5"]  # every 2nd and the last
    quiet = io.StringIO()
    with TrainProgress(5, enabled=False, stream=quiet) as p:
        p.update(1, {"loss": 1.0})
    assert quiet.getvalue() == ""
    # under a launcher that reads records (it named a record dir), the same steps as records
    monkeypatch.setenv(RECORDS_ENV, "/somewhere")
    out = io.StringIO()
    with TrainProgress(5, enabled=True, log_every=2, stream=out) as p:
        for s in range(1, 6):
            p.update(s, {"loss": 1.0 / s, "mfu": None})
    assert [read_progress(x)[0] for x in out.getvalue().splitlines()] == [2, 4, 5]


def test_progress_live_bar_renders():
    out = io.StringIO()
    with TrainProgress(3, enabled=True, stream=out, live=True) as p:
        for s in range(1, 4):
            p.update(s, {"loss": 2.0, "tokens_per_s": 100.0, "mfu": 0.5})
    text = out.getvalue()
    assert "train" in text and "3/3" in text and "MFU 50.00%" in text


def test_plot_metrics_writes_a_png(tmp_path):
    from titan_pipe.training.metrics import plot_metrics

    path = tmp_path / "metrics.jsonl"
    with MetricsLogger(path, enabled=True) as log:
        for s in range(1, 6):
            log.log({"step": s, "loss": 6.0 / s, "tokens_per_s": 100.0 * s, "mfu": 0.01 * s})
    out = plot_metrics(path, tmp_path / "metrics.png")
    assert out == tmp_path / "metrics.png"
    png = out.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert not (tmp_path / "metrics.png.tmp").exists()
    assert plot_metrics(tmp_path / "missing.jsonl", tmp_path / "x.png") is None
    assert not (tmp_path / "x.png").exists()


def test_tensorboard_events_hold_every_logged_step(tmp_path, monkeypatch):
    """metrics.tensorboard: true -> rank 0's scalars per step, read back with TensorBoard's own reader
    and equal to metrics.jsonl's."""
    import json
    import socket

    import yaml
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from titan_pipe.config import load_flow
    from titan_pipe.training.launch import run_training

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        monkeypatch.setenv(k, v)
    flow = tmp_path / "flow.yaml"
    flow.write_text(
        yaml.safe_dump(
            {
                "name": "tb",
                "runs_dir": str(tmp_path / "runs"),
                "device": "cpu",
                "model": {"flavour": "debug"},
                "metrics": {"tensorboard": True},
                "train": {"steps": 3, "batch_size": 2, "seq_len": 16, "seed": 1},
            }
        )
    )
    res = run_training(flow_path=flow, cfg=load_flow(flow))
    events = EventAccumulator(str(res.run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "perf/tokens_per_s",
        "perf/mfu",
        "memory/peak_mem_mb",
    } <= tags, tags
    jsonl = [json.loads(line) for line in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    for tag, key in (("train/loss", "loss"), ("train/lr", "lr"), ("memory/peak_mem_mb", "peak_mem_mb")):
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert got == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in jsonl], tag


def test_tensorboard_without_the_package_is_refused_before_launch(tmp_path, monkeypatch):
    import importlib.util

    import yaml
    from typer.testing import CliRunner

    from titan_pipe.cli import app

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    flow = tmp_path / "flow.yaml"
    flow.write_text(
        yaml.safe_dump(
            {"name": "tb", "runs_dir": str(tmp_path / "runs"), "device": "cpu", "metrics": {"tensorboard": True}}
        )
    )
    r = CliRunner().invoke(app, ["validate", str(flow)])
    assert r.exit_code == 2 and "metrics.tensorboard: the tensorboard package is not installed" in r.output
    assert "pip install tensorboard" in r.output and not (tmp_path / "runs").exists()
