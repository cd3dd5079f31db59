"""A small flow.yaml for the flow tests: examples/tiny on 2 ranks (dp1 x tp2) with few steps."""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def small_flow(tmp: Path, name: str, **over) -> Path:
    """examples/tiny/flow.yaml on a 2-rank world with few steps (the example itself is 8 ranks);
    ``over``: section -> keys to update."""
    cfg = yaml.safe_load((REPO / "examples" / "tiny" / "flow.yaml").read_text())
    cfg.update(name=name, runs_dir=str(tmp / "runs"), device="cpu")
    cfg["parallel"].update(dp=1, tp=2, pp=1, microbatches=None)
    cfg["train"].update(steps=8, batch_size=4, seq_len=32)
    cfg["checkpoint"].update(every=4, keep_last=2)
    cfg["export"].update(seq_len=16)
    cfg["evaluate"].update(batches=1, batch_size=2, seq_len=16)
    cfg["orchestration"] = {"retries": 1, "retry_delay_s": 0}
    for section, values in over.items():
        cfg.setdefault(section, {}).update(values)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_in_process(flow: Path):
    """(its FlowConfig, run_training's result) of ``flow`` trained in this process as a one-rank
    torchrun world (the environment torchrun would set, undone afterwards)."""
    import pytest

    from titan_pipe.config import load_flow
    from titan_pipe.training.launch import run_training

    mp = pytest.MonkeyPatch()
    for k, v in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }.items():
        mp.setenv(k, v)
    try:
        cfg = load_flow(flow)
        return cfg, run_training(flow_path=flow, cfg=cfg)
    finally:
        mp.undo()
