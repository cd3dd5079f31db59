"""Calibrate the planner by a measured run: the compute efficiency that reproduces its tokens/s, and
its peak memory against the memory model's (``titan-pipe plan --calibrate FILE``).

A measurement is a ``benchmarks/device_check.py`` report (``device_check.json``: its trainer phase,
or ``--calibrate-phase``; one device, dp = tp = pp = 1) or a training run's ``metrics.jsonl`` (its
run dir's flow.yaml gives the model and the layout). The estimate's step time is compute over
(peak x efficiency) plus what communication does not hide, so for a run whose step is compute the
efficiency that matches it is the assumed one scaled by measured / predicted tokens per second.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from titan_pipe.errors import UserError
from titan_pipe.training.planner.workload import Assumptions, Cluster, Layout, Workload


@dataclass(frozen=True)
class Measurement:
    source: str
    workload: Workload
    layout: Layout
    tokens_per_s: float
    peak_mem_bytes: float
    device: str | None = None  # where it was measured: cpu, cuda, npu (None: not recorded)


@dataclass(frozen=True)
class Calibration:
    measured: Measurement
    predicted_tokens_per_s: float  # at the assumed efficiency
    predicted_mem_bytes: float
    efficiency: float  # the one that reproduces the measured tokens/s

    def lines(self, assumed: float) -> list[str]:
        m = self.measured
        return [
            f"calibration from {m.source}: measured {m.tokens_per_s:,.0f} tokens/s, {m.peak_mem_bytes / 1e9:.1f} GB "
            f"peak; predicted at efficiency {assumed:.2f}: {self.predicted_tokens_per_s:,.0f} tokens/s "
            f"({self.predicted_tokens_per_s / m.tokens_per_s:.2f}x measured), "
            f"{self.predicted_mem_bytes / 1e9:.1f} GB ({self.predicted_mem_bytes / m.peak_mem_bytes:.2f}x measured)",
            f"efficiency set to {self.efficiency:.3f} (what reproduces the measured tokens/s)",
        ]


def _flow_workload(data: dict, source: str) -> tuple[Workload, Layout]:
    from titan_pipe.config import ConfigError, parse_flow

    try:
        cfg = parse_flow(data, source=source)
    except ConfigError as e:
        raise UserError(f"{source}: its flow does not validate: {e.lines[0]}") from None
    p, t = cfg.parallel, cfg.train
    w = Workload(cfg.model.args(), t.seq_len, t.batch_size, flavour=cfg.model.flavour)
    zero = {"fsdp": 3, "ddp": 0}[p.dp_mode] if cfg.zero_stage is None else {3: 3, 2: 2, 1: 0, 0: 0}[cfg.zero_stage]
    layout = Layout(
        dp=p.dp,
        tp=p.tp,
        pp=p.pp,
        schedule=p.pp_schedule,
        virtual_stages=p.virtual_stages if p.pp_schedule == "interleaved_1f1b" else 1,
        microbatches=p.n_microbatches,
        zero=zero,
        sequence_parallel=p.sequence_parallel,
        ac_every=cfg.memory.activation_checkpointing_layers if cfg.memory.activation_checkpointing else 0,
        amp_dtype=cfg.precision.amp_dtype if cfg.precision.amp else None,
        offload=cfg.memory.optimizer_offload == "cpu",
    )
    return w, layout


def read_measurement(path: Path, *, phase: str = "trainer") -> Measurement:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--calibrate {path}: not found; give a device_check.json or a run's metrics.jsonl")
    if path.suffix == ".jsonl":
        from titan_pipe.training.launch import summarize
        from titan_pipe.training.metrics import step_records

        flow = path.parent / "flow.yaml"
        if not flow.is_file():
            raise UserError(
                f"--calibrate {path}: no flow.yaml beside it (a run dir keeps one); calibrate from the "
                "run dir's metrics.jsonl"
            )
        import yaml

        data = yaml.safe_load(flow.read_text())
        w, layout = _flow_workload(data, str(flow))
        recs = step_records(path)
        tps = summarize(path)["tokens_per_s"]
        if not recs or not tps:
            raise UserError(f"--calibrate {path}: no timed steps in it")
        device = data.get("device") if isinstance(data, dict) else None
        return Measurement(
            str(path),
            w,
            layout,
            tps,
            max(r["peak_mem_mb"] for r in recs) * 2**20,
            device if isinstance(device, str) else None,
        )
    try:
        report = json.loads(path.read_text())
        spec, figures = report["spec"], report["phases"][phase]
        tps, mem = float(figures["tokens_per_s"]), float(figures["peak_mem_gb"]) * 1e9
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(
            f"--calibrate {path}: not a device_check.json with a finished {phase!r} phase ({e}); "
            "run benchmarks/device_check.py"
        ) from None
    flow = {
        "name": "calibration",
        "model": spec["model"],
        "train": {"batch_size": spec["batch"], "seq_len": spec["seq"]},
        "precision": {"amp": True, "amp_dtype": "bfloat16"},
    }
    w, layout = _flow_workload(flow, f"{path} (spec)")
    device = spec.get("device")
    return Measurement(f"{path} ({phase})", w, layout, tps, mem, device if isinstance(device, str) else None)


def calibrate(m: Measurement, cluster: Cluster, assume: Assumptions) -> Calibration:
    from titan_pipe.training.planner.search import estimate

    if m.device == "cpu":
        raise UserError(
            f"--calibrate {m.source}: measured on cpu, and {cluster.device} is an accelerator; "
            "calibrate from a device_check.json or metrics.jsonl measured on that device"
        )
    est = estimate(m.workload, m.layout, replace(cluster, n_devices=m.layout.world), assume, explain=False)
    eff = min(1.0, max(0.01, assume.compute_efficiency * m.tokens_per_s / est.tokens_per_s))
    return Calibration(m, est.tokens_per_s, est.memory.total, eff)
