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
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads((tmp_path / "device_check.json").read_text())
    phases = report["phases"]
    assert set(phases) == {"kernels", "loop", "trainer", "trainer_compiled", "trainer_float8", "torchtitan", "deploy"}
    assert not any("error" in p for p in phases.values())
    kern = phases["kernels"]
    assert kern["all_ok"] and len(kern["rows"]) == 13 and "grad" not in kern["rows"]["packed documents window=None torch.float32"]
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
    assert phases["deploy"]["evaluate_passed"] is True and phases["deploy"]["export_s"] > 0
    assert report["spec"]["device"] == "cpu" and "torch" in report["environment"]
    assert "kept" not in proc.stdout
