"""benchmarks/device_check.py --dry-run: the accelerator check runs end to end on the CPU, so it cannot rot.

The same phases the device run takes (bare loop, trainer, compiled trainer, convert -> export ->
evaluate) on the debug model with the real run's features (tied embeddings, GQA, scaled RoPE),
compiled with aot_eager; the figures JSON holds every phase and its ratios.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "device_check.py"


def test_device_check_dry_run(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads((tmp_path / "device_check.json").read_text())
    phases = report["phases"]
    assert set(phases) == {
        "kernels",
        "loop",
        "trainer",
        "trainer_compiled",
        "trainer_float8",
        "torchtitan",
        "trainer_compiled_other_loss",
        "deploy",
    }
    assert not any("error" in p for p in phases.values()) and report["complete"] and report["required"] == []
    kern = phases["kernels"]
    assert (
        kern["all_ok"]
        and len(kern["rows"]) == 14
        and "experts grouped, skewed routing, bfloat16" in kern["rows"]
        and "grad" not in kern["rows"]["packed documents window=None torch.float32"]
    )
    # off Hopper: float8 is the one line that refuses it; the peer is skipped with a line saying so
    assert "compute capability 9.0 or later" in phases["trainer_float8"]["skipped"]
    assert "torchtitan peer runs on the accelerator only" in phases["torchtitan"]["skipped"]
    assert "trainer_float8: skipped" in proc.stdout and "torchtitan: skipped" in proc.stdout
    for name in ("loop", "trainer", "trainer_compiled"):
        p = phases[name]
        assert p["tokens_per_s"] > 0 and p["mfu"] > 0 and p["steps_timed"] >= 1 and len(p["losses"]) == 3
    # The same model, data and seed: the loop and the trainer take the same first step (bf16 autocast).
    assert abs(phases["loop"]["losses"][0] - phases["trainer"]["losses"][0]) <= 1e-3 * phases["loop"]["losses"][0]
    assert phases["trainer_compiled"]["compile_s"] > 0 and phases["trainer"]["compile_s"] == 0
    ours = ("trainer_vs_loop_tokens_per_s", "compiled_vs_eager_tokens_per_s", "compiled_vs_loop_tokens_per_s")
    assert all(report["ratios"][k] > 0 for k in ours)
    assert report["ratios"]["compiled_vs_torchtitan_compiled_tokens_per_s"] is None  # no peer figures off the GPU
    assert report["failed"] == []
    # the loss forms compared: auto picked chunked here, the other phase ran the full loss, same losses
    assert phases["trainer_compiled"]["loss_form"] == "chunked"
    assert phases["trainer_compiled_other_loss"]["loss_form"] == "full"
    assert report["ratios"]["loss_form_max_rel_diff"] <= 1e-2 and report["ratios"]["faster_loss"] in ("chunked", "full")
    assert phases["deploy"]["evaluate_passed"] is True and phases["deploy"]["export_s"] > 0
    assert report["spec"]["device"] == "cpu" and "torch" in report["environment"]
    assert "kept" not in proc.stdout


def test_device_check_fails_when_a_requested_phase_cannot_run(tmp_path):
    """float8 and the torchtitan peer are what the device call is for: requested (the default on the
    device, --require here) and unable to run, they fail the call with the reason in the JSON."""
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--dry-run",
            "--out",
            str(tmp_path),
            "--only",
            "kernels,trainer_float8,torchtitan",
            "--require",
            "trainer_float8,torchtitan",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert set(report["phases"]) == {"kernels", "trainer_float8", "torchtitan"} and report["complete"]
    assert report["phases"]["trainer_float8"]["required"] is True
    failed = report["failed"]
    assert len(failed) == 2 and failed[0].startswith("trainer_float8 was requested but could not run: precision.float8")
    assert failed[1].startswith(
        "torchtitan was requested but could not run: the torchtitan peer runs on the accelerator"
    )
    assert "FAILED: trainer_float8 was requested" in proc.stdout
    bad = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--only", "kernel"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert bad.returncode == 2 and "unknown phase(s) kernel" in bad.stderr


def test_device_check_writes_each_phase_as_it_finishes(tmp_path):
    """A call cut short keeps what finished: the JSON is rewritten after every phase, not at the end."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    dc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dc)
    report = dc.Report(tmp_path / "device_check.json", dict(dc.SPECS["dry-run"]), {"torchtitan"})
    on_disk = json.loads(report.path.read_text())
    assert on_disk["phases"] == {} and on_disk["complete"] is False and on_disk["required"] == ["torchtitan"]
    report.phase("loop", lambda: {"tokens_per_s": 5.0})
    report.phase("trainer", lambda: 1 / 0)
    on_disk = json.loads(report.path.read_text())
    assert on_disk["phases"]["loop"]["tokens_per_s"] == 5.0 and on_disk["complete"] is False
    assert on_disk["phases"]["trainer"]["error"].startswith("ZeroDivisionError")
    assert report.failures() == ["trainer: ZeroDivisionError: division by zero", "torchtitan not run"]
    assert not list(tmp_path.glob("*.tmp"))
