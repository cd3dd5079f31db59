"""torchrun driver for the planner's memory check: builds the trainer's parallel model under
several layouts in one launch, runs one AdamW step, and records what each rank really holds.

    torchrun --nproc_per_node=4 tests/plan_driver.py SPEC.json OUT.json

SPEC: {"models": {name: ModelArgs dict}, "layouts": [{"name", "model", "dp", "tp", "pp",
"schedule", "virtual_stages", "microbatches", "zero", "sequence_parallel", "measure_activations"}]}.
Rank 0 writes OUT.json: {layout name: [per-rank records in rank order]}; a record holds the rank's
mesh coordinates, local parameter elements and their storage bytes, gradient elements (and any
gradient whose local shape differs from its parameter's), optimizer state bytes and tensors, and
(if asked) the bytes autograd saves for backward in one forward.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titan_pipe.model.args import ModelArgs
from titan_pipe.training.data_parallel import plan_dp
from titan_pipe.training.optim import build_optimizer
from titan_pipe.training.parallel_dims import ParallelDims
from titan_pipe.training.parallelize import build_parallel_model
from titan_pipe.training.pipeline_parallel import build_schedule

B, T = 4, 64


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def saved_for_backward(part, tokens: torch.Tensor) -> int:
    """Bytes autograd saves for backward in forward + loss, once per storage (DTensors by their
    local tensor), parameters and buffers excluded."""
    with torch.no_grad():
        part(tokens)  # warm-up
    skip = {_local(p).untyped_storage().data_ptr() for p in part.parameters()}
    skip |= {b.untyped_storage().data_ptr() for b in part.buffers()}
    seen: dict[int, int] = {}

    def pack(t):
        try:
            st = _local(t).untyped_storage()
            ptr = st.data_ptr()
        except RuntimeError:  # a storage-less wrapper (e.g. an FSDP-freed parameter view)
            return t
        if ptr not in skip:
            seen.setdefault(ptr, st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(part(tokens), tokens)
    loss.backward()
    for p in part.parameters():
        p.grad = None
    return sum(seen.values())


def run_layout(spec: dict, args: ModelArgs) -> dict:
    dims = ParallelDims(dp=spec["dp"], tp=spec["tp"], pp=spec["pp"])
    mesh = dims.build_mesh("cpu")
    dp_rank, pp_rank, tp_rank = dims.coords(dist.get_rank())
    zero = spec["zero"]
    dp_plan = plan_dp(
        dp=dims.dp, tp=dims.tp, dp_mode="fsdp" if zero >= 2 else "ddp", zero_stage=2 if zero == 2 else None
    )
    model = build_parallel_model(
        args,
        mesh,
        schedule=spec["schedule"],
        virtual_stages=spec["virtual_stages"],
        sequence_parallel=spec["sequence_parallel"],
        dp_plan=dp_plan,
        seed=0,
    )
    g = torch.Generator().manual_seed(1 + dp_rank)
    tokens = torch.randint(0, args.vocab_size, (B, T), generator=g)
    record = {"dp_rank": dp_rank, "pp_rank": pp_rank, "tp_rank": tp_rank, "kind": dp_plan.kind}
    if spec.get("measure_activations"):
        record["saved_for_backward"] = saved_for_backward(model.parts[0], tokens)
    optimizers = [build_optimizer(list(m.parameters()), name="adamw", lr=1e-3, weight_decay=0.1) for m in model.modules]
    plan = model.stage_plan
    if dims.pp > 1:
        schedule = build_schedule(
            model.parts,
            plan,
            schedule=spec["schedule"],
            pp_mesh=mesh["pp"],
            n_microbatches=spec["microbatches"],
            loss_fn=loss_fn,
            device=torch.device("cpu"),
        )
        first, last = 0 in plan.local, plan.n_stages - 1 in plan.local
        schedule.step(*([tokens] if first else []), target=tokens if last else None, losses=[] if last else None)
    else:
        loss_fn(model.parts[0](tokens), tokens).backward()
    for opt in optimizers:
        opt.step()
    params = model.parameters()
    record["params"] = sum(_local(p).numel() for p in params)
    record["param_storage_bytes"] = sum(_local(p).untyped_storage().nbytes() for p in params)
    record["grads"] = sum(_local(p.grad).numel() for p in params if p.grad is not None)
    record["grad_shape_differs"] = [
        f"{name}: param {tuple(_local(p).shape)} grad {tuple(_local(p.grad).shape)} {getattr(p.grad, 'placements', '')}"
        for _, name, p in model.named_parameters()
        if p.grad is not None and _local(p.grad).shape != _local(p).shape
    ]
    states = [s for opt in optimizers for s in opt.state.values()]
    record["optimizer_tensors"] = len(states)
    record["optimizer_bytes"] = sum(
        _local(v).numel() * v.element_size() for s in states for v in s.values() if torch.is_tensor(v)
    )
    return record


def main(spec_path: str, out_path: str) -> None:
    dist.init_process_group("gloo")
    spec = json.loads(open(spec_path).read())
    models = {k: ModelArgs.from_dict(v) for k, v in spec["models"].items()}
    results = {}
    for lay in spec["layouts"]:
        rec = run_layout(lay, models[lay["model"]])
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, rec)
        results[lay["name"]] = gathered
    if dist.get_rank() == 0:
        with open(out_path + ".tmp", "w") as f:
            json.dump(results, f)
        import os

        os.replace(out_path + ".tmp", out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    from titan_pipe.processes.procs import exit_rank

    main(*sys.argv[1:3])
    exit_rank(0)  # no interpreter teardown for gloo's threads to abort (docs/training.md, Faults)
