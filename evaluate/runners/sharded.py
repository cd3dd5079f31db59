"""The training checkpoint under its own dp/tp/pp layout: training's sharded forward process."""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import torch

from titan_pipe.io.atomic import scratch_dir
from titan_pipe.processes import procs
from titan_pipe.records import sharded_outputs
from titan_pipe.records.checkpoint_format import ParallelLayout, is_complete
from titan_pipe.errors import StageFailed, UserError
from titan_pipe.evaluate.runners.outputs import Outputs
from titan_pipe.model.args import ModelArgs
from titan_pipe.model.params import native_shapes
from titan_pipe.model.sharding import layer_id, split_stages, stage_of, stage_ranks, stages_per_rank, tp_split_dim
from titan_pipe.io.safetensors_io import save


def pp_rank_bytes(args: ModelArgs, layout: ParallelLayout) -> list[tuple[int, int]]:
    """(resident, streamed) float32 parameter bytes one rank of each pp rank holds under ``layout``
    (a checkpoint's ParallelLayout), from the declared parameter list and sharding table: resident
    every parameter of its stages, streamed its ends (embedding, norm, output) plus its largest
    decoder layer. Every dp x tp rank of a pp rank holds as much (a TP-split parameter 1/tp of it)."""
    n_stages = layout.pp * stages_per_rank(layout.pp, layout.pp_schedule, layout.virtual_stages)
    stages, owner = split_stages(args.n_layers, n_stages), stage_ranks(n_stages, layout.pp)
    ends, layers = [0] * layout.pp, [dict() for _ in range(layout.pp)]
    for name, shape in native_shapes(args).items():
        n = 4 * math.prod(shape) // (layout.tp if tp_split_dim(name) is not None else 1)
        r, lid = owner[stage_of(name, stages)], layer_id(name)
        if lid is None:
            ends[r] += n
        else:
            layers[r][lid] = layers[r].get(lid, 0) + n
    return [(e + sum(ls.values()), e + max(ls.values(), default=0)) for e, ls in zip(ends, layers)]


class DistributedRunner:
    """The training checkpoint under its own dp/tp/pp layout: torchrun + the training operators.

    Starts training's sharded forward process (titan_pipe.records.sharded_outputs: ``python -m
    torch.distributed.run --nproc_per_node=dp*tp*pp -m titan_pipe.training.sharded_forward``) once
    for all batches (start-up dominates on CPU) and reads back logits and per-layer hidden states
    from the safetensors files it writes. ``streamed`` (set from the memory plan: evaluate's
    streamed mode) passes ``--streamed``: each rank then holds one of its decoder layers at a time,
    read from its own shard files through the manifest. ``ran`` is what the process reported:
    ``{"streamed": bool, "peak_rss": [bytes per rank]}``.
    """

    def __init__(self, checkpoint: Path, *, device: str = "cpu", timeout_s: float = 900):
        from titan_pipe.records.checkpoint_format import open_checkpoint

        checkpoint = Path(checkpoint)
        if not is_complete(checkpoint):
            raise UserError(
                f"{checkpoint}: no manifest.json, so not a complete titan-pipe checkpoint; pass "
                "runs/<name>/checkpoints/step-XXXXXX (the manifest is written last)"
            )
        self.manifest = open_checkpoint(checkpoint)  # the reader init_from and convert start from
        self.args = ModelArgs.from_dict(self.manifest.model, source=checkpoint / "manifest.json")
        self.layout = self.manifest.parallel
        self.checkpoint, self.device, self.timeout_s = checkpoint, device, timeout_s
        self.dtype = "float32"
        self.streamed = False
        self.ran: dict | None = None

    @property
    def label(self) -> str:
        where = "" if self.device == "cpu" else f", {self.device}"
        how = ", one layer at a time" if self.streamed else ""
        return f"torchrun tp{self.layout.tp} pp{self.layout.pp} ({self.checkpoint.name}{where}{how})"

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def memory_needs(self, *, batches: int, batch_size: int, seq_len: int) -> tuple[int, int]:
        """(resident, streamed) bytes all ranks together hold for the model: each rank's parameters
        (pp_rank_bytes) plus the logits and hidden states it keeps for every batch; not the ranks'
        Python processes themselves (~0.3 GB each with torch imported)."""
        kept = 4 * batches * batch_size * seq_len * (self.args.vocab_size + self.args.n_layers * self.args.dim)
        per_pp = pp_rank_bytes(self.args, self.layout)
        ranks = self.layout.dp * self.layout.tp
        return tuple(ranks * sum(b[k] + kept for b in per_pp) for k in (0, 1))

    def run_all(self, batches: list[torch.Tensor]) -> list[Outputs]:
        """All batches in one torchrun launch; StageFailed with the ranks' last log lines on error."""
        with scratch_dir("titan-eval-dist") as tmp:  # a killed run's is removed by the next one
            save(
                {sharded_outputs.batch_key(i): b.contiguous() for i, b in enumerate(batches)},
                tmp / sharded_outputs.TOKENS_FILE,
            )
            cmd = sharded_outputs.command(
                world_size=self.world_size,
                checkpoint=self.checkpoint,
                out_dir=tmp,
                device=self.device,
                streamed=self.streamed,
            )
            env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
            try:
                # guarded: the ranks die with this process, on a timeout or an interrupt too
                proc = procs.run(cmd, capture_output=True, text=True, timeout=self.timeout_s, env=env)
            except subprocess.TimeoutExpired:
                raise StageFailed(
                    f"sharded forward of {self.checkpoint} timed out after {self.timeout_s:.0f}s"
                ) from None
            if proc.returncode != 0:
                said = proc.stdout + proc.stderr
                ranks = sharded_outputs.failing_ranks_lines(tmp, said)
                tail = "\n".join(said.strip().splitlines()[-15:])
                told = "\n".join(ranks) + "\n" if ranks else ""
                raise StageFailed(
                    f"sharded forward of {self.checkpoint} failed (exit {proc.returncode}):\n{told}{tail}"
                )
            got = sharded_outputs.read_outputs(tmp, n_batches=len(batches), n_layers=self.args.n_layers)
            done = sharded_outputs.read_done(tmp)
        self.ran = {"streamed": bool(done.get("streamed")), "peak_rss": list(done.get("peak_rss", []))}
        return [Outputs(logits, hidden) for logits, hidden in got]

    def run(self, tokens: torch.Tensor) -> Outputs:
        return self.run_all([tokens])[0]
