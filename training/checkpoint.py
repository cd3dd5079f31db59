"""Checkpoints: one safetensors file per (pp stage, tp rank) of TP-local shards plus manifest.json
(written LAST, marks the step complete), optimizer state beside it in torch DCP, and the
prune / resume logic (the newest complete one: titan_pipe.records.checkpoint_format.newest_complete). docs/checkpoint-format.md specifies the layout.

For a weights-only read under any layout (e.g. evaluation)::

    weights = CheckpointWeights(step_dir)            # titan_pipe.model.weights, global tensors
    model = build_parallel_model(weights.args, mesh, weights=weights)
    # or, into an already built ParallelModel:  load_checkpoint(step_dir, model)
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Replicate

from titan_pipe.io.atomic import atomic_file, copy_file, write_text
from titan_pipe.io.safetensors_io import save
from titan_pipe.records.checkpoint_format import (
    MANIFEST_NAME,
    STEP_DIR,
    CheckpointExtra,
    Chunk,
    FileInfo,
    Manifest,
    ParallelLayout,
    ParamSpec,
    is_complete,
    shard_file,
    split_box,
    step_dirs,
)
from titan_pipe.rules.dtypes import DTYPE_NAMES
from titan_pipe.errors import UserError
from titan_pipe.io.hashing import sha256_file
from titan_pipe.training.parallelize import ParallelModel, copy_global_values
from titan_pipe.model.params import param_of
from titan_pipe.model.sharding import tp_split_dim
from titan_pipe.model.weights import CheckpointWeights
from titan_pipe.training.tied import EMBEDDING, OUTPUT, alias_optimizer_keys, restore_copy_keys
from titan_pipe.training.zero1 import load_zero1_state, zero1_state

OPTIM_DIR = "optimizer"
TRAIN_STATE = "train_state.json"
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def tp_local(p: torch.Tensor) -> torch.Tensor:
    """The TP-local shard of a parameter, gathered over dp (collective over the param's mesh).

    FSDP2 on top of TP places parameters as (_StridedShard(0), Shard(d)) on (dp, tp): a dp rank's
    piece is not one box of the global tensor, so the dp dimension is made Replicate first.
    """
    if not isinstance(p, DTensor):
        return p.detach()
    names = p.device_mesh.mesh_dim_names or ()
    placements = [Replicate() if n in ("dp", "dp_mod_ep") else pl for n, pl in zip(names, p.placements)]
    if list(placements) != list(p.placements):
        p = p.redistribute(p.device_mesh, placements)
    return p.to_local().detach()


def _write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> FileInfo:
    """Write to a temp name in the same dir, then rename: a reader never sees half a file."""
    with atomic_file(path) as tmp:
        save({k: v.contiguous().cpu() for k, v in tensors.items()}, tmp)
    return FileInfo(size=path.stat().st_size, sha256=sha256_file(path))


def _copy_file(src: Path, path: Path) -> FileInfo:
    copy_file(src, path)
    return FileInfo(size=path.stat().st_size, sha256=sha256_file(path))


def optimizer_state(model: ParallelModel, optimizers: list) -> dict:
    """Flattened (FQN-keyed) optimizer state of every local part, merged; keys are disjoint.

    ZeRO-1 optimizers give the same keys for the parameters they own (training/zero1.py).
    """
    out: dict = {}
    for module, opt in zip(model.modules, optimizers):
        if isinstance(opt, ZeroRedundancyOptimizer):
            out.update(zero1_state(opt, {p: n for n, p in module.named_parameters()}))
        else:
            out.update(get_optimizer_state_dict(module, opt, options=_FLAT))
    if model.tied is not None:  # the output copy's state is the embedding's (equal by construction)
        out = alias_optimizer_keys(out, drop_copy=EMBEDDING in _local_names(model))
    return out


def _local_names(model: ParallelModel) -> set[str]:
    return {n for _, n, _ in model.named_parameters()}


def _set_optimizer_state(model: ParallelModel, optimizers: list, flat: dict) -> None:
    if model.tied is not None:
        flat = restore_copy_keys(flat, _local_names(model))
    for module, opt in zip(model.modules, optimizers):
        if isinstance(opt, ZeroRedundancyOptimizer):
            load_zero1_state(opt, {p: n for n, p in module.named_parameters()}, flat)
        else:
            set_optimizer_state_dict(module, opt, flat, options=_FLAT)


def rng_state() -> dict:
    return {"torch": torch.get_rng_state().tolist(), "python": repr(random.getstate())}


def save_checkpoint(
    step_dir: Path,
    *,
    model: ParallelModel,
    optimizers: list | None,
    train_state: dict,
    parallel: ParallelLayout,
    extra: CheckpointExtra = CheckpointExtra(),
    attach: dict[str, Path] | None = None,
    frozen_out: bool = False,
) -> Path:
    """Save a checkpoint of the whole model into ``step_dir``; collective, call on every rank.

    Order: shard files (dp-rank-0 of each (stage, tp rank)), optimizer DCP, train_state.json,
    then manifest.json by global rank 0 once everything else is on disk.
    ``extra``: the manifest's extra record (the trainer gives kernels and tokenizer; the optimizer,
    train state and attached files are filled in here).
    ``attach`` ({name in the step dir: source file}, e.g. the tokenizer) is copied in by rank 0
    before the manifest and listed with size and sha256 under ``extra.attached``; not in
    ``files``, which is the table of weight shards readers open as safetensors. ``frozen_out``: the
    parameters that take no gradient are left out (LoRA: ``extra`` references the frozen base, whose
    copy would be the whole model again).
    """
    step_dir = Path(step_dir)
    rank = dist.get_rank()
    mesh = model.mesh
    dp_rank, tp_rank, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank(), mesh["tp"].size()
    names = mesh.mesh_dim_names or ()
    ep, ep_rank = (mesh["ep"].size(), mesh["ep"].get_local_rank()) if "ep" in names else (1, 0)
    expert_writer = "ep" not in names or mesh["dp_mod_ep"].get_local_rank() == 0
    if rank == 0 and step_dir.exists():
        shutil.rmtree(step_dir)  # an incomplete earlier attempt at this step (no manifest)
    dist.barrier()

    specs: list[ParamSpec] = []
    files: dict[str, FileInfo] = {}
    per_file: dict[str, dict[str, torch.Tensor]] = {}
    for stage, name, p in model.named_parameters():
        if model.tied is not None and name == OUTPUT:
            continue  # the tied output copy is the embedding (training/tied.py): stored once, as that
        if frozen_out and not p.requires_grad:
            continue
        local = tp_local(p)
        shape = tuple(p.shape)
        split = ep > 1 and param_of(name).expert  # experts over ep: this ep rank's slice of dim 0
        tp_dim = tp_split_dim(name)
        box = split_box(shape, 0, ep, ep_rank) if split else split_box(shape, tp_dim, tp, tp_rank)
        if tuple(local.shape) != box.lengths:
            raise RuntimeError(
                f"{name}: local shard {tuple(local.shape)} != box {box.lengths} from "
                "titan_pipe.model.sharding; the TP plan and the sharding table disagree"
            )
        if not (expert_writer if split else dp_rank == 0):
            continue
        rel = shard_file(stage, tp_rank, ep_rank if split else None)
        per_file.setdefault(rel, {})[name] = local
        specs.append(
            ParamSpec(
                name=name,
                shape=shape,
                dtype=DTYPE_NAMES[local.dtype],
                tp_dim=tp_dim,
                stage=stage,
                chunks=[Chunk(rel, name, box)],
            )
        )
    for rel, tensors in per_file.items():
        files[rel] = _write_safetensors(tensors, step_dir / rel)

    if optimizers is not None:
        dcp.save({"optimizer": optimizer_state(model, optimizers)}, checkpoint_id=str(step_dir / OPTIM_DIR))
    if rank == 0:
        state = dict(train_state, rng=rng_state())
        write_text(step_dir / TRAIN_STATE, json.dumps(state, indent=1), fsync=True)
        attached = {name: _copy_file(src, step_dir / name) for name, src in sorted((attach or {}).items())}

    gathered: list | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object((specs, files), gathered, dst=0)
    if rank == 0:
        params: dict[str, ParamSpec] = {}
        all_files: dict[str, FileInfo] = {}
        for rank_specs, rank_files in gathered:
            all_files.update(rank_files)
            for spec in rank_specs:
                if spec.name in params:
                    params[spec.name].chunks.extend(spec.chunks)
                else:
                    params[spec.name] = spec
        manifest = Manifest(
            step=int(train_state["step"]),
            model=model.args.to_dict(),
            parallel=parallel,
            params=dict(sorted(params.items())),
            files=all_files,
            extra=replace(
                extra,
                optimizer=OPTIM_DIR if optimizers is not None else None,
                train_state=TRAIN_STATE,
                attached=attached,
            ),
        )
        manifest.validate()
        write_text(step_dir / MANIFEST_NAME, manifest.to_json(), fsync=True)
    dist.barrier()
    return step_dir


def load_checkpoint(step_dir: Path, model: ParallelModel) -> None:
    """Weights only: fill ``model``'s local shards from a checkpoint of any dp/tp/pp layout."""
    weights = CheckpointWeights(step_dir)
    for module in model.modules:
        copy_global_values(module, model.args, seed=0, weights=weights)


def load_train_state(step_dir: Path, model: ParallelModel, optimizers: list | None) -> dict:
    """Optimizer state (DCP, resharded to this layout) into ``optimizers``; returns train_state."""
    step_dir = Path(step_dir)
    if optimizers is not None:
        if not (step_dir / OPTIM_DIR).is_dir():
            raise UserError(
                f"{step_dir}: no {OPTIM_DIR}/ (saved with checkpoint.save_optimizer: false); "
                "--resume needs it; start a new run from these weights with init_from instead"
            )
        state = {"optimizer": optimizer_state(model, optimizers)}
        dcp.load(state, checkpoint_id=str(step_dir / OPTIM_DIR))
        _set_optimizer_state(model, optimizers, state["optimizer"])
    return json.loads((step_dir / TRAIN_STATE).read_text())


def prune(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints, and incomplete ones older
    than the newest complete one. Call when no save is in progress. Returns what was removed."""
    dirs = step_dirs(root)
    complete = [p for _, p in dirs if is_complete(p)]
    keep = set(complete[-keep_last:]) if keep_last > 0 else set()
    newest = complete[-1] if complete else None
    removed = []
    newest_step = int(STEP_DIR.match(newest.name).group(1)) if newest is not None else None
    for step, p in dirs:
        stale_partial = not is_complete(p) and newest is not None and step < newest_step
        if (is_complete(p) and p not in keep) or stale_partial:
            shutil.rmtree(p)
            removed.append(p)
    return removed
