"""The torchrun entry point: ``python -m titan_pipe.training.train --flow FLOW [--resume]``.

The loop only: process group and mesh, this rank's model, optimizer, loader, then steps with
metrics and checkpoints. Everything else lives in the modules it calls.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from titan_pipe.checkpoint_format import newest_complete
from titan_pipe.config import ConfigError, FlowConfig, load_flow
from titan_pipe.devices import peak_memory_bytes, resolve_device, set_local_device
from titan_pipe.errors import UserError
from titan_pipe.model_args import flops_per_token
from titan_pipe.run_dir import RunDir
from titan_pipe.training import checkpoint as ckpt
from titan_pipe.training import metrics
from titan_pipe.training.amp import LossScaler, autocast
from titan_pipe.training.data import PackedLoader, prepare_data, tokenizer_files
from titan_pipe.training.data_parallel import plan_dp
from titan_pipe.training.kernels import resolve_kernels
from titan_pipe.training.optim import build_optimizer, build_scheduler, clip_grad_norm_
from titan_pipe.training.parallel_dims import ParallelDims
from titan_pipe.training.parallelize import build_parallel_model
from titan_pipe.training.pipeline_parallel import build_schedule
from titan_pipe.training.weights import check_compatible, open_weights
from titan_pipe.training.zero1 import build_zero1


def comm_env(cfg: FlowConfig, device_type: str) -> dict[str, str]:
    """Environment the collective library reads at init (set only where not already set).

    On Ascend, comm.fusion_buffer_mb sizes HCCL's shared buffer (HCCL_BUFFSIZE, MB).
    """
    env = {}
    if device_type == "npu":
        env["HCCL_BUFFSIZE"] = str(cfg.comm.fusion_buffer_mb)
    return env


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; logits (B, T, vocab) in fp32 for a stable softmax."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


@dataclass
class Fault:
    """Test hook (train.fail_at_step / fail_rank / fail_during): this rank dies with exit 1."""

    step: int | None
    rank: int
    during: str

    def due(self, step: int, rank: int, during: str) -> bool:
        return self.step == step and self.rank == rank and self.during == during

    @staticmethod
    def die() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _init_distributed(device) -> None:
    if not dist.is_initialized():
        set_local_device(device, int(os.environ.get("LOCAL_RANK", 0)))
        # On accelerators a gloo side-channel carries the small CPU collectives (per-step loss and
        # memory stats, checkpoint bookkeeping); the model's collectives go over nccl/hccl.
        backend = device.backend if device.type == "cpu" else f"cpu:gloo,{device.type}:{device.backend}"
        dist.init_process_group(backend)


def train(cfg: FlowConfig, *, base: Path, resume: bool = False) -> dict:
    """Run the training of ``cfg`` on the current torchrun world; returns the summary (rank 0's).

    base: the flow.yaml's directory (relative data/init_from paths). The run dir is
    ``cfg.run_dir()``. Works inside an existing process group too (several runs in one launch).
    """
    device = resolve_device(cfg.device)
    for k, v in comm_env(cfg, device.type).items():
        os.environ.setdefault(k, v)
    _init_distributed(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    p, t = cfg.parallel, cfg.train
    dims = ParallelDims(dp=p.dp, tp=p.tp, pp=p.pp)
    mesh = dims.build_mesh(device.type)
    torch_device = device.torch_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.manual_seed(t.seed)
    run = RunDir(cfg.run_dir())
    if rank == 0:
        run.root.mkdir(parents=True, exist_ok=True)
    if cfg.comm.stream_num != 1 and rank == 0:
        warnings.warn("comm.stream_num has no PyTorch-native equivalent; it is recorded, not applied",
                      stacklevel=2)

    args = cfg.model.args()
    kernels = resolve_kernels(cfg.model.kernels, device.type)
    data = prepare_data(path=cfg.data.path, tokenizer=cfg.data.tokenizer, text_key=cfg.data.text_key,
                        val_fraction=cfg.data.val_fraction, base=base, vocab_size=args.vocab_size)
    # Copied into every checkpoint so it names its tokenizer itself, not a path relative to flow.yaml.
    tok_files = tokenizer_files(data.tokenizer)
    dp_rank = mesh["dp"].get_local_rank()
    loader = PackedLoader(data.train, seq_len=t.seq_len, global_batch=t.batch_size, dp_rank=dp_rank,
                          dp_size=p.dp, seed=t.seed)

    latest = newest_complete(run.checkpoints, warn=True) if resume else None
    if resume and latest is None and rank == 0:
        warnings.warn(f"--resume: no complete checkpoint under {run.checkpoints}; starting fresh",
                      stacklevel=2)
    weights = None
    source = latest
    if source is None and cfg.init_from is not None:
        source = Path(cfg.init_from) if Path(cfg.init_from).is_absolute() else base / cfg.init_from
    if source is not None:
        weights = open_weights(source)
        check_compatible(weights.args, args, source)

    amp_on = cfg.precision.amp
    dp_plan = plan_dp(dp=p.dp, tp=p.tp, dp_mode=p.dp_mode, zero_stage=cfg.zero_stage,
                      offload=cfg.memory.optimizer_offload,
                      amp_dtype=cfg.precision.amp_dtype if amp_on else None,
                      gradient_sync_dtype=cfg.comm.gradient_sync_dtype,
                      fusion_buffer_mb=cfg.comm.fusion_buffer_mb, comm_overlap=cfg.comm.comm_overlap)
    ac_every = cfg.memory.activation_checkpointing_layers if cfg.memory.activation_checkpointing else None
    model = build_parallel_model(args, mesh, device=torch_device, schedule=p.pp_schedule,
                                 virtual_stages=p.virtual_stages, sequence_parallel=p.sequence_parallel,
                                 ac_every=ac_every, dp_plan=dp_plan, kernels=kernels, seed=t.seed,
                                 weights=weights)
    o = t.optimizer
    hparams = dict(name=o.name, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    if dp_plan.zero1:
        optimizers = [build_zero1(list(m.parameters()), mesh["dp"].get_group(), **hparams)
                      for m in model.modules]
    else:
        optimizers = [build_optimizer(list(m.parameters()), **hparams) for m in model.modules]
    schedulers = [build_scheduler(opt, warmup=t.warmup_steps, total=t.steps, min_ratio=t.lr_min_ratio)
                  for opt in optimizers]
    scaler = LossScaler.from_config(cfg.precision)

    start = 0
    if latest is not None:
        state = ckpt.load_train_state(latest, model, optimizers)
        for s, sd in zip(schedulers, state["scheduler"]):
            s.load_state_dict(sd)
        loader.load_state_dict(state["loader"])
        scaler.load_state_dict(state["scaler"])
        start = int(state["step"])

    plan = model.stage_plan
    has_first, has_last = 0 in plan.local, plan.n_stages - 1 in plan.local
    schedule = None
    if p.pp > 1:
        schedule = build_schedule(model.parts, plan, schedule=p.pp_schedule, pp_mesh=mesh["pp"],
                                  n_microbatches=p.n_microbatches, device=torch_device,
                                  loss_fn=lambda out, y: scaler.scale_loss(loss_fn(out, y)))
    params = model.parameters()
    # The injected fault is one transient failure: a resumed run (a retry) does not die again.
    fault = Fault(t.fail_at_step if start == 0 else None, t.fail_rank, t.fail_during)
    parallel_meta = {"dp": p.dp, "tp": p.tp, "pp": p.pp, "pp_schedule": p.pp_schedule,
                     "n_stages": plan.n_stages, "stages": plan.stages,
                     "stage_ranks": [s % p.pp for s in range(plan.n_stages)],
                     "sequence_parallel": p.sequence_parallel, "dp_mode": p.dp_mode,
                     "dp_kind": dp_plan.kind}

    amp_dtype = torch.float16 if cfg.precision.amp_dtype == "float16" else torch.bfloat16
    # Only rank 0 reports MFU; measuring the CPU peak on every rank would only contend for cores.
    peak, peak_source = (metrics.peak_flops(device, amp_dtype if amp_on else torch.float32)
                         if rank == 0 else (None, ""))
    fpt = flops_per_token(args, t.seq_len)
    tokens_per_step = t.batch_size * t.seq_len
    history: list[dict] = []
    with metrics.MetricsLogger(run.metrics, enabled=rank == 0) as logger, \
            metrics.TrainProgress(t.steps, enabled=rank == 0, log_every=t.log_every,
                                  initial_step=start) as progress:
        for step in range(start + 1, t.steps + 1):
            t0 = time.perf_counter()
            inputs, labels = (x.to(torch_device) for x in loader.next_batch())
            with autocast(device.type, enabled=amp_on, dtype=cfg.precision.amp_dtype):
                if schedule is not None:
                    losses: list = []
                    schedule.step(*([inputs] if has_first else []), target=labels if has_last else None,
                                  losses=losses if has_last else None)
                    local_loss = torch.stack(losses).mean().detach() / scaler.scale if has_last else None
                else:
                    loss = loss_fn(model.parts[0](inputs), labels)
            if schedule is None:
                scaler.scale_loss(loss).backward()  # outside autocast, as torch.amp recommends
                local_loss = loss.detach()
            if fault.due(step, rank, "step"):
                fault.die()
            found_inf = scaler.unscale_(params)
            grad_norm = None  # skipped step (fp16 overflow): no norm worth logging
            if not found_inf:
                grad_norm = float(clip_grad_norm_(params, t.grad_clip, mesh["pp"]))
                for opt in optimizers:
                    opt.step()
            scaler.update(found_inf)
            lr = schedulers[0].get_last_lr()[0]
            for s, opt in zip(schedulers, optimizers):
                opt.zero_grad(set_to_none=True)
                s.step()
            # Every holder of the last stage has the loss of its dp slice (tp ranks the same value).
            stats = torch.tensor([0.0 if local_loss is None else float(local_loss),
                                  float(peak_memory_bytes(device))], dtype=torch.float64)
            loss_sum = stats[:1].clone()
            dist.all_reduce(loss_sum)
            per_rank = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(per_rank, stats[1:].clone())  # peak memory of every rank, in rank order
            mem = max(float(m) for m in per_rank)
            dt = time.perf_counter() - t0
            tps = tokens_per_step / dt
            record = {"step": step, "loss": float(loss_sum) / (p.dp * p.tp), "lr": lr, "grad_norm": grad_norm,
                      "tokens_per_s": tps, "step_time_s": dt,
                      "mfu": metrics.mfu(tps, fpt, peak * world if peak else None),
                      "peak_mem_mb": mem / 2**20,
                      "peak_mem_mb_per_rank": [round(float(m) / 2**20, 1) for m in per_rank],
                      "loss_scale": scaler.scale,
                      "skipped": bool(found_inf)}
            history.append(record)
            if step % t.log_every == 0 or step == t.steps:
                logger.log(record)
            progress.update(step, record)

            dying_save = t.fail_during == "checkpoint" and t.fail_at_step == step  # same on all ranks
            if step % cfg.checkpoint.every == 0 or step == t.steps or dying_save:
                hook = fault.die if fault.due(step, rank, "checkpoint") else None
                state = {"step": step, "scheduler": [s.state_dict() for s in schedulers],
                         "loader": loader.state_dict(), "scaler": scaler.state_dict()}
                ckpt.save_checkpoint(run.checkpoint(step), model=model,
                                     optimizers=optimizers if cfg.checkpoint.save_optimizer else None,
                                     train_state=state, parallel=parallel_meta, fail_hook=hook,
                                     extra={"kernels": cfg.model.kernels,
                                            "tokenizer": "tokenizer.json" if tok_files else "byte"},
                                     attach=tok_files)
                if rank == 0:
                    ckpt.prune(run.checkpoints, cfg.checkpoint.keep_last)

    timed = history[1:] or history
    summary = {"final_loss": history[-1]["loss"] if history else None,
               "tokens_per_s": sum(r["tokens_per_s"] for r in timed) / len(timed) if timed else None,
               "mfu": history[-1]["mfu"] if history else None, "steps": t.steps,
               "start_step": start, "peak_flops_source": peak_source,
               "checkpoint": str(newest_complete(run.checkpoints, warn=True)) if rank == 0 else None}
    if rank == 0:
        (run.root / "summary.json").write_text(json.dumps(summary, indent=1))
    dist.barrier()
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m titan_pipe.training.train")
    ap.add_argument("--flow", required=True, type=Path, help="flow.yaml")
    ap.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    a = ap.parse_args(argv)
    try:
        cfg = load_flow(a.flow)
        train(cfg, base=a.flow.resolve().parent, resume=a.resume)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
