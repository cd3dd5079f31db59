"""torchrun driver for the distributed training tests: runs several flows in one launch.

    torchrun --nproc_per_node=N tests/train_driver.py SPEC.json

SPEC: {"workdir": str, "runs": [{"name", "flow": {...flow.yaml dict...}, "resume": bool,
"copy_from": {"run": NAME, "step": S} (seed this run's checkpoints with another run's step S),
"save_init": bool (only build the model and save a step-0 checkpoint), "forward": {"run", "step"}
(forward-only logits of that checkpoint under this flow's layout -> workdir/NAME.safetensors)}]}. Every flow must have
dp*tp*pp = N. Rank 0 writes workdir/results.json: {name: {"metrics": [...jsonl records...]}}.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from safetensors.torch import save_file

from titan_pipe.records.checkpoint_format import ParallelLayout
from titan_pipe.config import load_flow
from titan_pipe.training import checkpoint as ckpt
from titan_pipe.training.data_parallel import plan_dp
from titan_pipe.training.parallel_dims import ParallelDims
from titan_pipe.training.parallelize import build_parallel_model
from titan_pipe.training.pipeline_parallel import forward_logits
from titan_pipe.training.trainer import Trainer
from titan_pipe.model.weights import open_weights


def save_init(cfg, run_root: Path) -> None:
    p = cfg.parallel
    mesh = ParallelDims(dp=p.dp, tp=p.tp, pp=p.pp).build_mesh("cpu")
    dp_plan = plan_dp(dp=p.dp, tp=p.tp, dp_mode=p.dp_mode, zero_stage=cfg.zero_stage)
    model = build_parallel_model(
        cfg.model.args(),
        mesh,
        schedule=p.pp_schedule,
        virtual_stages=p.virtual_stages,
        sequence_parallel=p.sequence_parallel,
        dp_plan=dp_plan,
        seed=cfg.train.seed,
    )
    ckpt.save_checkpoint(
        run_root / "checkpoints" / "step-000000",
        model=model,
        optimizers=None,
        train_state={"step": 0},
        parallel=ParallelLayout(dp=p.dp, tp=p.tp, pp=p.pp, pp_schedule=p.pp_schedule),
    )


def forward(cfg, step_dir: Path, out: Path) -> None:
    """Forward-only logits of a checkpoint under cfg's layout (the evaluator's path)."""
    p = cfg.parallel
    mesh = ParallelDims(dp=p.dp, tp=p.tp, pp=p.pp).build_mesh("cpu")
    weights = open_weights(step_dir)
    model = build_parallel_model(
        weights.args,
        mesh,
        schedule=p.pp_schedule,
        virtual_stages=p.virtual_stages,
        sequence_parallel=p.sequence_parallel,
        weights=weights,
    )
    tokens = torch.randint(0, weights.args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    logits = forward_logits(model.modules, model.stage_plan, tokens, pp_mesh=mesh["pp"], args=weights.args)
    if dist.get_rank() == 0:
        save_file({"tokens": tokens, "logits": logits.contiguous()}, str(out))


def check_base(trainer, cfg, out: Path) -> None:
    """Compare each frozen parameter's local shard with its init_from value (held in base_dtype) and
    count the optimizer states, rank by rank; rank 0 writes {differing: [...], compared, optimizer_keys}."""
    from torch.distributed.tensor import DTensor

    from titan_pipe.model.lora import is_adapter
    from titan_pipe.training.tied import source_name

    base = open_weights(cfg.init_from)
    differing, compared = [], 0
    for _, name, p in trainer.model.named_parameters():
        if is_adapter(name):
            continue
        local = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        want = base.full(source_name(name, cfg.model.args())).to(local.dtype)
        compared += 1
        if p.requires_grad or not torch.equal(local, want):
            differing.append(name)
    keys = sorted({k for opt in trainer.optimizers for st in opt.state.values() for k in st})
    n_state = sum(len(opt.state) for opt in trainer.optimizers)
    n_adapters = sum(1 for _, n, p in trainer.model.named_parameters() if is_adapter(n))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(
        gathered,
        {"differing": differing, "compared": compared, "state_entries": n_state, "adapters": n_adapters, "keys": keys},
    )
    if dist.get_rank() == 0:
        out.write_text(json.dumps(gathered))


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    work = Path(spec["workdir"])
    os.chdir(work)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    for run in spec["runs"]:
        name = run["name"]
        flow = dict(run["flow"], name=name, runs_dir=str(work / "runs"))
        flow_path = work / f"{name}.yaml"
        if rank == 0:
            flow_path.write_text(yaml.safe_dump(flow))
            if "copy_from" in run:
                src = work / "runs" / run["copy_from"]["run"] / "checkpoints"
                step = f"step-{run['copy_from']['step']:06d}"
                dst = work / "runs" / name / "checkpoints"
                dst.mkdir(parents=True, exist_ok=True)
                shutil.copytree(src / step, dst / step)
        dist.barrier()
        cfg = load_flow(flow_path)
        if run.get("save_init"):
            save_init(cfg, work / "runs" / name)
        elif "forward" in run:
            src = work / "runs" / run["forward"]["run"] / "checkpoints" / f"step-{run['forward']['step']:06d}"
            forward(cfg, src, work / f"{name}.safetensors")
        else:
            trainer = Trainer(cfg, base=work, resume=run.get("resume", False))
            trainer.train()
            if run.get("check_base"):  # LoRA: every frozen local shard still equals the init_from weights
                check_base(trainer, cfg, work / f"{name}.base.json")
        if rank == 0:
            mfile = work / "runs" / name / "metrics.jsonl"
            records = [json.loads(line) for line in mfile.read_text().splitlines()] if mfile.exists() else []
            results[name] = {"metrics": records}
            (work / "results.json").write_text(json.dumps(results, indent=1))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from titan_pipe.processes.procs import exit_rank

    main(sys.argv[1])
    exit_rank(0)  # no interpreter teardown for gloo's threads to abort (docs/training.md, Faults)
