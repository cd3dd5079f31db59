"""torchrun entry: forward a training checkpoint under its own dp/tp/pp layout, save the outputs.

  python -m torch.distributed.run --nproc_per_node=N -m titan_pipe.evaluate.sharded_forward \
      --checkpoint STEP_DIR --tokens TOKENS.safetensors --out DIR [--device cpu]

TOKENS holds ``batch.{i}`` (B, T) int64. Written to DIR: ``logits.safetensors`` (``batch.{i}``
(B, T, vocab), by global rank 0), ``hidden-pp{r}.safetensors`` (``batch.{i}.hidden.{layer}``
(B, T, dim) for the layers of pp rank r, by its dp0/tp0 rank), and ``done.json`` last.
The model is built by training's own ``build_parallel_model`` with the training operators, and
run by ``forward_logits``, the forward the training pipeline uses.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist


def _full(t):
    """A layer output as a plain full tensor (DTensor under sequence parallel)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, type=Path)
    ap.add_argument("--tokens", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)

    from safetensors.torch import load_file, save_file

    from titan_pipe.checkpoint_format import Manifest
    from titan_pipe.devices import resolve_device, set_local_device
    from titan_pipe.model.kernels import resolve_kernels
    from titan_pipe.model.args import ModelArgs
    from titan_pipe.training.parallel_dims import ParallelDims
    from titan_pipe.training.parallelize import build_parallel_model
    from titan_pipe.training.pipeline_parallel import forward_logits
    from titan_pipe.model.weights import open_weights

    manifest = Manifest.load(a.checkpoint)
    args = ModelArgs.from_dict(manifest.model, source=Path(a.checkpoint) / "manifest.json")
    p = manifest.parallel
    dims = ParallelDims(int(p.get("dp", 1)), int(p.get("tp", 1)), int(p.get("pp", 1)))
    device = resolve_device(a.device)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    set_local_device(device, local_rank)
    dist.init_process_group(device.backend)
    try:
        mesh = dims.build_mesh(device.type)
        # the training operators of this device: npu_fused on Ascend, the reference ops elsewhere
        kernels = resolve_kernels(manifest.extra.get("kernels", "auto"), device.type)
        # interleaved schedules hold n_stages / pp virtual stages per rank; the manifest records both
        n_stages = int(p.get("n_stages", len(p.get("stages", [])) or dims.pp))
        pm = build_parallel_model(args, mesh, device=device.torch_device(local_rank),
                                  schedule=p.get("pp_schedule", "1f1b"),
                                  virtual_stages=max(1, n_stages // dims.pp),
                                  sequence_parallel=bool(p.get("sequence_parallel", False)),
                                  kernels=kernels, weights=open_weights(a.checkpoint))
        captured: dict[int, torch.Tensor] = {}
        for module in pm.modules:
            for key, layer in module.layers.items():
                layer.register_forward_hook(
                    lambda _m, _i, out, i=int(key): captured.__setitem__(i, _full(out).detach().cpu()))
        batches = load_file(str(a.tokens))
        logits_out, hidden_out = {}, {}
        for i in range(len(batches)):
            tokens = batches[f"batch.{i}"].to(device.torch_device(local_rank))
            captured.clear()
            logits = forward_logits(pm.modules, pm.stage_plan, tokens, pp_mesh=mesh["pp"], args=args)
            logits_out[f"batch.{i}"] = _full(logits).detach().cpu().contiguous()
            hidden_out.update({f"batch.{i}.hidden.{j}": h.contiguous() for j, h in captured.items()})
        rank = dist.get_rank()
        dp_rank, pp_rank, tp_rank = dims.coords(rank)
        if dp_rank == 0 and tp_rank == 0:
            save_file(hidden_out, str(a.out / f"hidden-pp{pp_rank}.safetensors"))
        if rank == 0:
            save_file(logits_out, str(a.out / "logits.safetensors"))
        dist.barrier()
        if rank == 0:
            files = [f"hidden-pp{r}.safetensors" for r in range(dims.pp)]
            (a.out / "done.json").write_text(json.dumps({"hidden_files": files}))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
