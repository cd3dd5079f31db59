"""train.compile: torch.compile per transformer block matches the uncompiled trainer within the parity bounds.

Fast (default suite): one gloo rank, the debug model, eager vs aot_eager (dynamo + AOTAutograd
without code generation: seconds on CPU, where inductor takes about a minute per launch).
Slow: dp2 x tp2 on four gloo ranks with inductor (with activation checkpointing, and with sequence
parallelism), against the single-process reference (tests/training_reference.py): TP -> AC ->
compile -> FSDP as the trainer applies them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from titan_pipe.config import ConfigError, parse_flow
from titan_pipe.errors import UserError
from titan_pipe.training import compile as compile_mod

from test_training_parallel import assert_close, flow as parallel_flow
from training_reference import reference_run

HERE = Path(__file__).parent


def flow(parallel: dict | None = None, *, compile_backend: str | None = None, steps: int = 4, **sections) -> dict:
    """tests/test_training_parallel.py's flow (debug model, AdamW with clipping), ``steps`` long,
    checkpointing only at the end, compiled with ``compile_backend`` when given."""
    f = parallel_flow(parallel or {}, **sections)
    f["train"]["steps"] = steps
    f["checkpoint"] = {"every": 100, "keep_last": 1}
    if compile_backend:
        f["train"].update(compile=True, compile_backend=compile_backend)
    return f


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_driver(runs: list[dict], work: Path, nproc: int, env: dict | None = None) -> dict:
    """tests/train_driver.py over ``runs``: one plain process for one rank, torchrun otherwise."""
    work.mkdir(parents=True, exist_ok=True)
    spec = work / "spec.json"
    spec.write_text(json.dumps({"workdir": str(work), "runs": runs}))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(env or {}))
    if nproc == 1:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        cmd = [sys.executable, str(HERE / "train_driver.py"), str(spec)]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(HERE / "train_driver.py"),
            str(spec),
        ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads((work / "results.json").read_text())


def test_compiled_trainer_matches_eager_on_one_rank(tmp_path):
    res = run_driver(
        [{"name": "eager", "flow": flow()}, {"name": "compiled", "flow": flow(compile_backend="aot_eager")}],
        tmp_path,
        1,
    )
    eager, compiled = res["eager"]["metrics"], res["compiled"]["metrics"]
    assert_close([r["loss"] for r in compiled], [r["loss"] for r in eager])
    assert_close([r["grad_norm"] for r in compiled], [r["grad_norm"] for r in eager], what="grad norm")
    # The first step compiled (forward and backward graphs); later steps reuse them, nothing recompiles.
    assert compiled[0]["compile_s"] > 0 and all(r["compile_s"] == 0 for r in compiled[2:])
    assert all(r["compile_s"] == 0 for r in eager)
    summary = json.loads((tmp_path / "runs" / "compiled" / "summary.json").read_text())
    assert summary["compile_s"] == pytest.approx(sum(r["compile_s"] for r in compiled))


def test_compile_keeps_parameter_names_and_compiles_every_block():
    import torch

    from titan_pipe.model.args import resolve_args
    from titan_pipe.model.transformer import build_model

    model = build_model(resolve_args("debug"), seed=0)
    names = [n for n, _ in model.named_parameters()]
    assert compile_mod.apply_compile(model, "aot_eager") == [f"layers.{i}" for i in range(model.args.n_layers)]
    assert [n for n, _ in model.named_parameters()] == names
    ref = build_model(resolve_args("debug"), seed=0)
    x = torch.randint(0, model.args.vocab_size, (2, 16))
    with torch.no_grad():
        assert torch.allclose(model(x), ref(x), rtol=0, atol=1e-5)


def test_compile_config_and_backend_errors(monkeypatch):
    assert parse_flow(flow(compile_backend="aot_eager")).train.compile
    assert parse_flow(flow()).train.compile is False  # off by default
    with pytest.raises(ConfigError, match="train.compile_backend: 'aot_eager' has no effect"):
        parse_flow(dict(flow(), train=dict(flow()["train"], compile_backend="aot_eager")))
    with pytest.raises(ConfigError, match="train.compile_backend"):
        parse_flow(flow(compile_backend="tvm"))
    assert compile_mod.resolve_backend("auto", "cuda") == "inductor"
    assert compile_mod.resolve_backend("aot_eager", "cpu") == "aot_eager"
    monkeypatch.setattr(compile_mod.shutil, "which", lambda name: None)
    with pytest.raises(UserError, match="needs a C\\+\\+ compiler.*compile_backend: aot_eager"):
        compile_mod.resolve_backend("auto", "cpu")
    assert compile_mod.resolve_backend("aot_eager", "cpu") == "aot_eager"  # no compiler needed
    assert compile_mod.resolve_backend("auto", "cuda") == "inductor"  # nvcc/triton: not this check's business


def test_launch_preflight_refuses_inductor_without_a_compiler(tmp_path, monkeypatch):
    """validate/run/train refuse a compiled cpu flow this host cannot compile, before any rank starts."""
    from titan_pipe.training.preflight import check_before_launch

    data = dict(flow(compile_backend="inductor"), runs_dir=str(tmp_path / "runs"))
    monkeypatch.setattr(compile_mod.shutil, "which", lambda name: None)

    def problems(train: dict) -> list[str]:
        try:
            check_before_launch(
                parse_flow(dict(data, train=dict(data["train"], **train)), base=tmp_path),
                flow_path=tmp_path / "flow.yaml",
            )
        except ConfigError as e:
            return e.lines
        return []

    needs = "train.compile with the inductor backend on cpu needs a C++ compiler"
    assert [line for line in problems({}) if line.startswith(needs)]
    assert [line for line in problems({"compile_backend": "auto"}) if line.startswith(needs)]
    assert not [line for line in problems({"compile_backend": "aot_eager"}) if "train.compile" in line]
    assert not [line for line in problems({"compile": False, "compile_backend": "auto"}) if "train.compile" in line]


@pytest.mark.slow
@pytest.mark.distributed
def test_compiled_dp2_tp2_matches_single_process(tmp_path):
    """dp2 x tp2 (FSDP2 over TP DTensors) with inductor-compiled blocks, once with activation
    checkpointing and once with sequence parallelism, 8 steps each, against the plain single-process
    loop: losses and grad norms within 1e-4; then the same again reading the compile caches the first
    launch wrote (a rerun or --resume: AOTAutograd's cache made that one die with SIGSEGV)."""
    backend = "inductor" if compile_mod.cpp_compiler() else "aot_eager"
    ac = {"activation_checkpointing": True, "activation_checkpointing_layers": 1}
    runs = [
        {"name": "dp2_tp2_ac", "flow": flow({"dp": 2, "tp": 2}, compile_backend=backend, steps=8, memory=ac)},
        {
            "name": "dp2_tp2_sp",
            "flow": flow({"dp": 2, "tp": 2, "sequence_parallel": True}, compile_backend=backend, steps=8),
        },
    ]
    caches = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache")}  # this test's own, cold at first
    ref = reference_run(flow(steps=8), base=tmp_path)
    for launch in ("cold", "warm"):
        res = run_driver(runs, tmp_path / f"world4-{launch}", 4, env=caches)
        for run in runs:
            got = res[run["name"]]["metrics"]
            what = f"{run['name']} ({launch} caches)"
            assert_close([r["loss"] for r in got], ref["losses"], what=f"{what} loss")
            assert_close([r["grad_norm"] for r in got], ref["grad_norms"], what=f"{what} grad norm")
            assert got[0]["compile_s"] > 0
