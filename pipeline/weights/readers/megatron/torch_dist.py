"""Reader for Megatron-LM ``torch_dist`` checkpoints (megatron.core.dist_checkpointing), planned from metadata.

Tree: ``latest_checkpointed_iteration.txt`` + ``iter_XXXXXXX/`` holding ``metadata.json``
(``{"sharded_backend": "torch_dist", ...}``), ``common.pt`` (the non-sharded state: ``args``,
``iteration``, ``checkpoint_version``, ...) and a torch DCP checkpoint (``.metadata`` +
``__R_T.distcp``) of the sharded tensors under their megatron-core keys. Every rank's pieces are
chunks of *global* tensors, so TP, PP and virtual-PP need no rank arithmetic here:
- transformer-layer tensors are stacked: ``decoder.layers.self_attention.linear_qkv.weight`` has
  shape (num_layers, rows, cols) and each layer is a chunk at its global layer offset on axis 0
  (so pipeline and virtual stages are already placed); a chunk's layer k is addressed as a 2-D
  tensor of its own (its bytes start k * rows * cols elements into the chunk). Models with
  ``non_homogeneous_layers`` use per-layer keys ``decoder.layers.N.*`` instead; both are read;
- the fused QKV's rows (weight and bias) are the query groups in global order (each: its q
  heads, k head, v head), de-fused as for the legacy format (common.py);
- ``mlp.linear_fc1.weight`` (SwiGLU) is stored as [gate; up] of the whole FFN: rows < ffn go to
  w1, the rest to w3;
- a mixture of experts' routing layer (megatron-core's MoELayer, sequential or grouped experts:
  both save the same keys) holds ``mlp.router.weight`` (experts, dim) and its experts as
  ``mlp.experts.experts.linear_fc1.weight`` (experts, [gate; up], dim) and ``...linear_fc2.weight``
  (experts, dim, ffn), the expert index an axis of its own (chunks per expert, per tp split, per
  ep rank): they read into the stacked moe.experts.w1/w3/w2;
- saves made with ``singleton_local_shards`` keep each expert under a key of its own,
  ``mlp.experts.experts.{e}.linear_fc1.weight_w`` (gate) / ``_v`` (up) and ``...linear_fc2.weight``
  (e global, no expert axis: read as the stacked tensor's slice e), and a dense SwiGLU fc1 as
  ``mlp.linear_fc1.weight_w`` / ``_v`` (w1 / w3 whole);
- the vocabulary is padded; rows past the true size (``args.vocab_size``, ``--vocab-size`` or a
  tokenizer.json) are not read.
``common.pt`` is loaded with ``weights_only=True`` under common.py's allow-list
(``argparse.Namespace``, RNG numpy types, stand-ins for Megatron enums); nothing else unpickles.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from titan_pipe.records.checkpoint_format import Box
from titan_pipe.weights.readers import dcp
from titan_pipe.weights.readers.megatron.common import (
    FORMAT,
    Reads,
    arg,
    defuse_expert_fc1,
    defuse_fc1,
    defuse_qkv,
    fused_group,
    iter_dir,
    iteration,
    load_pickle,
    model_args,
    qkv_group_rows,
    rope_rows,
    tensor_plans,
    true_vocab,
    vocab_read,
)
from titan_pipe.io.safetensors_io import StoredTensor
from titan_pipe.weights.readers.torch_save import SavedTensor
from titan_pipe.weights.source_plan import Read, SourcePlan
from titan_pipe.errors import UserError
from titan_pipe.rules.values import INT
from titan_pipe.rules import limits
from titan_pipe.model.args import ModelArgs, check_fits
from titan_pipe.model.names import megatron_singleton, megatron_to_native
from titan_pipe.model.params import param_of

BACKEND_FILE = "metadata.json"
COMMON = "common.pt"
_MODEL_KEY = re.compile(r"^(embedding\.|decoder\.|output_layer\.)")
_STACKED = re.compile(r"^decoder\.layers\.(?!\d+\.)(.+)$")


def backend(d: Path) -> str | None:
    """The ``sharded_backend`` named by ``d/metadata.json``, or None when ``d`` holds no such file."""
    f = d / BACKEND_FILE
    if not f.is_file():
        return None
    try:
        meta = json.loads(f.read_text())
    except (ValueError, UnicodeDecodeError, OSError):
        return None
    return meta.get("sharded_backend") if isinstance(meta, dict) else None


def resolve(path: Path) -> Path | None:
    """The iteration dir of a torch_dist checkpoint: ``path`` itself, or the one its tracker names."""
    if backend(path):
        return path
    try:
        d = iter_dir(path)
    except (UserError, OSError):
        return None
    return d if d is not None and backend(d) else None


def looks_like(path: Path) -> bool:
    return resolve(path) is not None


def _layer_slices(file: str, key: str, s: SavedTensor, headers: dict, strided: dict) -> list[str]:
    """Register layer k of a stacked chunk as its own stored tensor ``key#k``; return the keys."""
    keys = []
    step = s.stride[0] * s.itemsize
    for k in range(s.shape[0]):
        sub = f"{key}#{k}"
        layer = SavedTensor(s.dtype, s.shape[1:], s.stride[1:], s.start + k * step, s.storage_start, s.storage_nbytes)
        headers.setdefault(file, {})[sub] = StoredTensor(s.dtype, layer.shape, layer.start, layer.nbytes)
        if not layer.row_major:
            strided[(file, sub)] = layer
        keys.append(sub)
    return keys


@dataclass
class _Plan(Reads):
    """The reads, and where each stored piece is (stacked chunks cut per layer)."""

    headers: dict[str, dict[str, StoredTensor]] = field(default_factory=dict)
    strided: dict[tuple[str, str], SavedTensor] = field(default_factory=dict)


def _open_iteration(path: Path) -> tuple[Path, dict, argparse.Namespace]:
    """(iteration dir, common state dict, Megatron args) of a torch_dist checkpoint."""
    d = resolve(path)
    if d is None:
        raise UserError(f"{path}: no {BACKEND_FILE} naming a sharded backend; not a Megatron torch_dist checkpoint")
    kind = backend(d)
    if kind != "torch_dist":
        raise UserError(
            f"{d / BACKEND_FILE}: sharded_backend {kind!r}; titan-pipe reads Megatron's "
            "'torch_dist' checkpoints (re-save zarr ones with --ckpt-format torch_dist)"
        )
    common = load_pickle(
        d / COMMON,
        missing="a torch_dist checkpoint keeps the model's args in it. Copy the complete iteration directory",
    )
    a = common.get("args")
    if a is None:
        raise UserError(
            f"{d / COMMON}: has no 'args'; titan-pipe needs the model's Megatron arguments saved in the checkpoint"
        )
    return d, common, a


def _stored_pieces(d: Path, md, n_layers: int, loc: dcp.ChunkLocator, acc: _Plan):
    """Every model chunk as 2-D (or 1-D) pieces: (megatron key with its global layer id, file,
    store key, offsets, lengths in the layer's tensor, dtype, megatron_singleton of the key or None).
    Stacked chunks are cut per layer; a singleton save's expert gets its expert index as a leading
    axis (3-D)."""
    for fqn, meta in md.state_dict_metadata.items():
        if not hasattr(meta, "chunks") or not _MODEL_KEY.match(fqn):
            continue  # _extra_state objects, optimizer, rng state ...
        dtype = dcp.convertible_dtype(meta, fqn, d / dcp.METADATA)
        stacked = _STACKED.match(fqn)
        if stacked and meta.size[0] != n_layers:
            raise UserError(
                f"{d / dcp.METADATA}: {fqn} stacks {meta.size[0]} layers but args say num_layers {n_layers}"
            )
        for chunk in meta.chunks:
            info = md.storage_data.get(dcp.MetadataIndex(fqn, chunk.offsets))
            if info is None:
                raise UserError(
                    f"{d / dcp.METADATA}: the chunk of {fqn} at {list(chunk.offsets)} has "
                    "no storage entry (no file holds it); the metadata is incomplete or corrupted"
                )
            if getattr(info, "transform_descriptors", None):
                raise UserError(
                    f"{dcp.data_path(d, info.relative_path)}: {fqn} is stored transformed "
                    f"({', '.join(info.transform_descriptors)}); titan-pipe reads plain DCP only"
                )
            file, s = loc.locate(fqn, info, meta.properties.dtype, tuple(chunk.sizes))
            key = f"{fqn}@{','.join(map(str, chunk.offsets))}"
            if stacked:
                offs, lens = tuple(chunk.offsets[1:]), tuple(chunk.sizes[1:])
                for k, sub in enumerate(_layer_slices(file, key, s, acc.headers, acc.strided)):
                    yield (
                        f"decoder.layers.{chunk.offsets[0] + k}.{stacked.group(1)}",
                        file,
                        sub,
                        offs,
                        lens,
                        dtype,
                        None,
                    )
            else:
                offs, lens = tuple(chunk.offsets), tuple(chunk.sizes)
                single = megatron_singleton(fqn)
                if single is not None and single[1] is not None:  # one expert: its index is the stacked axis
                    s = SavedTensor(
                        s.dtype,
                        (1, *s.shape),
                        (math.prod(s.shape), *s.stride),
                        s.start,
                        s.storage_start,
                        s.storage_nbytes,
                    )
                    offs, lens = (single[1], *offs), (1, *lens)
                acc.headers.setdefault(file, {})[key] = StoredTensor(dtype, s.shape, s.start, s.nbytes)
                if not s.row_major:
                    acc.strided[(file, key)] = s
                yield fqn, file, key, offs, lens, dtype, single


def _plan_piece(
    acc: _Plan,
    args: ModelArgs,
    name: str,
    file: str,
    key: str,
    offs: tuple,
    lens: tuple,
    dtype: str,
    *,
    rope: int | None,
    where: Path,
    whole: bool = False,
) -> None:
    """The reads one stored piece contributes (its box is ``offs``/``lens`` of Megatron's tensor);
    ``whole``: the piece is already of the native tensor (a singleton save's fc1 half or expert)."""
    fused = None if whole else fused_group(name)
    if fused is None:
        spec = param_of(name)
        read = (
            vocab_read(args, file, key, offs[0], lens[0])
            if spec.vocab_rows
            else Read(file, key, Box.full(lens), Box(offs, lens))
        )
        acc.add(name, read, dtype)
        return
    group, gid = fused
    if group == "expert_fc1":  # (experts, [gate; up] rows, dim)
        reads = defuse_expert_fc1(args, gid, file, key, offs, lens)
    elif group == "fc1":  # rows: [gate; up] of the whole FFN
        reads = defuse_fc1(args, gid, file, key, [(0, offs[0], lens[0])])
    else:  # rows: query groups in global order, each q heads | k | v
        rows = qkv_group_rows(args)
        if offs[0] % rows or lens[0] % rows or tuple(lens[1:]) != ((args.dim,) if group == "qkv" else ()):
            raise UserError(f"{where}: {key} rows {offs[0]}+{lens[0]} do not hold whole query groups of {rows} rows")
        reads = defuse_qkv(
            args,
            group,
            gid,
            file,
            key,
            first=offs[0] // rows,
            n_groups=lens[0] // rows,
            tail=tuple(lens[1:]),
            rope=rope,
        )
    for n, read in reads:
        acc.add(n, read, dtype)


def _virtual_stages(a, args: ModelArgs, d: Path) -> int | None:
    """Virtual pipeline stages per pp rank the checkpoint was saved with (informational), or None."""
    vpp = arg(a, "virtual_pipeline_model_parallel_size", INT, d, default=None, bound=limits.LAYERS)
    per = arg(a, "num_layers_per_virtual_pipeline_stage", INT, d, default=None, bound=limits.LAYERS)
    pp = arg(a, "pipeline_model_parallel_size", INT, d, default=1, bound=limits.PARALLEL)
    return vpp or (args.n_layers // pp // per if per else None)


def open_source(
    path: Path, *, vocab_size: int | None = None, model_config: Path | None = None, read_headers: bool = True
) -> tuple[SourcePlan, dcp.DcpStore]:
    """Plan a torch_dist checkpoint: args from common.pt, then every model chunk of .metadata."""
    d, common, a = _open_iteration(path)
    md = dcp.read_metadata(d)
    args = model_args(a, true_vocab(a, path, vocab_size), path, virtual_ok=True)
    check_fits(
        args, dcp.stored_bytes(md), source=f"{d / COMMON}: Megatron args", where=f"the tensors {d / dcp.METADATA} lists"
    )
    rope = rope_rows(a, args, d)
    acc = _Plan()
    with dcp.ChunkLocator(d) as loc:
        for mkey, file, key, offs, lens, dtype, single in _stored_pieces(d, md, args.n_layers, loc, acc):
            try:
                name = single[0] if single is not None else megatron_to_native(mkey, 0)
            except KeyError as e:
                raise UserError(
                    f"{d / dcp.METADATA}: {e.args[0]}; only megatron-core LLaMA-family layers are converted"
                ) from None
            if name is not None:
                _plan_piece(
                    acc,
                    args,
                    name,
                    file,
                    key,
                    offs,
                    lens,
                    dtype,
                    rope=rope,
                    where=d / dcp.METADATA,
                    whole=single is not None,
                )
        files = loc.files
    padded = arg(a, "padded_vocab_size", INT, d, default=0, bound=limits.VOCAB)

    def split(spec, reads) -> str:
        kind = f"{len(reads)} chunks" if len(reads) > 1 else "whole"
        return f"vocab padded to {padded or '?'}, {kind}" if spec.vocab_rows else kind

    plan = SourcePlan(
        FORMAT,
        d,
        args,
        tensor_plans(d, args, acc, split),
        files=files,
        step=iteration(common, d / COMMON),
        layout={
            "backend": "torch_dist",
            "tp": arg(a, "tensor_model_parallel_size", INT, d, default=1, bound=limits.PARALLEL),
            "pp": arg(a, "pipeline_model_parallel_size", INT, d, default=1, bound=limits.PARALLEL),
            "vpp": _virtual_stages(a, args, d),
            "checkpoint_version": common.get("checkpoint_version"),
            "padded_vocab_size": padded or None,
        },
    )
    plan.layout["chunks"] = sum(len(t.reads) for t in plan.tensors.values())
    return plan, dcp.DcpStore(d, acc.headers, acc.strided)
