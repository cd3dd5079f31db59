"""torchrun entry: forward a training checkpoint under its own dp/tp/pp layout, save the outputs.

  python -m torch.distributed.run --nproc_per_node=N -m titan_pipe.training.sharded_forward \
      --checkpoint STEP_DIR --tokens TOKENS.safetensors --out DIR [--device cpu] [--streamed]

Evaluate starts this process (titan_pipe.records.sharded_outputs: the command line, the files written to
DIR and how they are read back). The model is built by ``build_parallel_model`` with the training
operators, and run by ``forward_logits``, the forward the training pipeline uses. ``--streamed``:
each rank keeps its decoder layers on meta and reads one at a time from its own shard files,
through the manifest, freeing it after its forward (training/layer_stream.py); the outputs are
bit-identical to the resident run. Every rank's peak RSS goes into done.json.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist


def _full(t):
    """A layer output as a plain full tensor (DTensor under sequence parallel)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _capture(pm) -> dict[int, torch.Tensor]:
    """Forward hooks on every decoder layer this rank holds: {layer id: its output (B, T, dim)}."""
    captured: dict[int, torch.Tensor] = {}
    for module in pm.modules:
        for key, layer in module.layers.items():
            layer.register_forward_hook(
                lambda _m, _i, out, i=int(key): captured.__setitem__(i, _full(out).detach().cpu())
            )
    return captured


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, type=Path)
    ap.add_argument("--tokens", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--streamed", action="store_true", help="one decoder layer materialised at a time")
    a = ap.parse_args(argv)
    from titan_pipe.processes.procs import rank_dies_with_launcher

    rank_dies_with_launcher()

    from titan_pipe.records import sharded_outputs as so
    from titan_pipe.records.checkpoint_format import open_checkpoint
    from titan_pipe.rules.devices import resolve_device, set_local_device
    from titan_pipe.processes.host_memory import peak_rss_bytes
    from titan_pipe.io.safetensors_io import load, save
    from titan_pipe.model.args import ModelArgs
    from titan_pipe.model.kernels import resolve_kernels
    from titan_pipe.model.weights import open_weights
    from titan_pipe.training.parallel_dims import ParallelDims
    from titan_pipe.training.parallelize import build_parallel_model
    from titan_pipe.training.pipeline_parallel import forward_logits

    manifest = open_checkpoint(a.checkpoint)
    args, p = ModelArgs.from_dict(manifest.model, source=Path(a.checkpoint) / "manifest.json"), manifest.parallel
    dims = ParallelDims(p.dp, p.tp, p.pp)
    device = resolve_device(a.device)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    set_local_device(device, local_rank)
    dist.init_process_group(device.backend)
    try:
        mesh = dims.build_mesh(device.type)
        # the training operators of this device: npu_fused on Ascend, the reference ops elsewhere
        kernels = resolve_kernels(manifest.extra.kernels or "auto", device.type)
        # a LoRA checkpoint runs as it trained: the frozen base and its adapters beside it, unmerged
        weights = open_weights(a.checkpoint, adapters_apart=not a.streamed)
        pm = build_parallel_model(
            args,
            mesh,
            device=device.torch_device(local_rank),
            schedule=p.pp_schedule,
            virtual_stages=p.virtual_stages,
            sequence_parallel=p.sequence_parallel,
            kernels=kernels,
            weights=weights,
            stream_layers=a.streamed,
            lora=getattr(weights, "lora", None) if not a.streamed else None,
        )
        captured = _capture(pm)
        batches = load(a.tokens)
        logits_out, hidden_out = {}, {}
        for i in range(len(batches)):
            tokens = batches[so.batch_key(i)].to(device.torch_device(local_rank))
            captured.clear()
            logits = forward_logits(pm.modules, pm.stage_plan, tokens, pp_mesh=mesh["pp"], args=args)
            logits_out[so.batch_key(i)] = _full(logits).detach().cpu().contiguous()
            hidden_out.update({so.hidden_key(i, j): h.contiguous() for j, h in captured.items()})
        rank = dist.get_rank()
        dp_rank, pp_rank, tp_rank = dims.coords(rank)
        if dp_rank == 0 and tp_rank == 0:
            save(hidden_out, a.out / so.hidden_file(pp_rank))
        if rank == 0:
            save(logits_out, a.out / so.LOGITS_FILE)
        peaks: list | None = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(peak_rss_bytes(), peaks, dst=0)  # after every file above: a barrier too
        if rank == 0:
            so.write_done(a.out, dims.pp, streamed=a.streamed, peak_rss=peaks)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from titan_pipe.processes.procs import exit_rank

    main()
    exit_rank(0)  # an exception above exits through Python as usual, with its traceback
