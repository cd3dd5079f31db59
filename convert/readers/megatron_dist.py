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
- the fused QKV's rows are the query groups in global order (each: its q heads, k head, v head),
  split into wq/wk/wv rows as for the legacy format;
- ``mlp.linear_fc1.weight`` (SwiGLU) is stored as [gate; up] of the whole FFN: rows < ffn go to
  w1, the rest to w3;
- the vocabulary is padded; rows past the true size (``args.vocab_size``, ``--vocab-size`` or a
  tokenizer.json) are not read.
``common.pt`` is loaded with ``weights_only=True`` under the legacy reader's allow-list
(``argparse.Namespace``, RNG numpy types, stand-ins for Megatron enums); nothing else unpickles.
"""
from __future__ import annotations

import argparse
import json
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from titan_pipe.checkpoint_format import Box
from titan_pipe.convert.readers import dcp
from titan_pipe.convert.readers.store import StoredTensor
from titan_pipe.convert.readers.torch_save import SavedTensor
from titan_pipe.convert.source_plan import Read, SourcePlan, TensorPlan, check_accounted
from titan_pipe.dtypes import DTYPE_NAMES
from titan_pipe.errors import UserError
from titan_pipe.values import INT, read
from titan_pipe import limits
from titan_pipe.model.args import ModelArgs, check_fits
from titan_pipe.model.names import megatron_to_native
from titan_pipe.model.params import fused_parts, layer_name, native_names, native_shapes, param_of

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
    from titan_pipe.convert.readers.megatron import _iter_dir as iter_dir

    if backend(path):
        return path
    try:
        d = iter_dir(path)
    except (UserError, OSError):
        return None
    return d if d is not None and backend(d) else None


def looks_like(path: Path) -> bool:
    return resolve(path) is not None


def load_common(f: Path) -> dict:
    """common.pt through the allow-list only (torch.load weights_only=True + safe_globals)."""
    from titan_pipe.convert.readers.megatron import ALLOWED

    try:
        with torch.serialization.safe_globals(ALLOWED):
            obj = torch.load(f, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"{f}: missing; a torch_dist checkpoint keeps the model's args in it. "
                        "Copy the complete iteration directory") from None
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0][:200]
        raise UserError(f"{f}: refused to unpickle ({first}). titan-pipe loads Megatron files with "
                        "weights_only=True and an allow-list (titan_pipe.convert.readers.megatron ALLOWED); "
                        "the file holds a type outside it or is corrupted") from None
    except (RuntimeError, EOFError, ValueError, OSError) as e:
        raise UserError(f"{f}: not a readable torch file ({str(e).splitlines()[0][:160]}); it is "
                        "truncated or corrupted") from None
    if not isinstance(obj, dict):
        raise UserError(f"{f}: holds a {type(obj).__name__}, expected Megatron's common state dict")
    return obj


def _layer_slices(file: str, key: str, s: SavedTensor, headers: dict, strided: dict) -> list[str]:
    """Register layer k of a stacked chunk as its own stored tensor ``key#k``; return the keys."""
    keys = []
    step = s.stride[0] * s.dtype.itemsize
    for k in range(s.shape[0]):
        sub = f"{key}#{k}"
        layer = SavedTensor(s.dtype, s.shape[1:], s.stride[1:], s.start + k * step, s.storage_start,
                            s.storage_nbytes)
        headers.setdefault(file, {})[sub] = StoredTensor(DTYPE_NAMES[s.dtype], layer.shape, layer.start,
                                                         layer.nbytes)
        if not layer.row_major:
            strided[(file, sub)] = layer
        keys.append(sub)
    return keys


@dataclass
class _Plan:
    """What the chunks contribute, global tensor by global tensor, and where each stored piece is."""

    reads: dict[str, list[Read]] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)
    headers: dict[str, dict[str, StoredTensor]] = field(default_factory=dict)
    strided: dict[tuple[str, str], SavedTensor] = field(default_factory=dict)

    def add(self, name: str, read: Read, dtype: str) -> None:
        self.reads.setdefault(name, []).append(read)
        self.dtypes[name] = dtype


def _open_iteration(path: Path) -> tuple[Path, dict, argparse.Namespace]:
    """(iteration dir, common state dict, Megatron args) of a torch_dist checkpoint."""
    d = resolve(path)
    if d is None:
        raise UserError(f"{path}: no {BACKEND_FILE} naming a sharded backend; not a Megatron "
                        "torch_dist checkpoint")
    kind = backend(d)
    if kind != "torch_dist":
        raise UserError(f"{d / BACKEND_FILE}: sharded_backend {kind!r}; titan-pipe reads Megatron's "
                        "'torch_dist' checkpoints (re-save zarr ones with --ckpt-format torch_dist)")
    common = load_common(d / COMMON)
    a = common.get("args")
    if a is None:
        raise UserError(f"{d / COMMON}: has no 'args'; titan-pipe needs the model's Megatron "
                        "arguments saved in the checkpoint")
    return d, common, a


def _stored_pieces(d: Path, md, n_layers: int, loc: dcp.ChunkLocator, acc: _Plan):
    """Every model chunk as 2-D (or 1-D) pieces: (megatron key with its global layer id, file,
    store key, offsets, lengths in the layer's tensor, dtype). Stacked chunks are cut per layer."""
    for fqn, meta in md.state_dict_metadata.items():
        if not hasattr(meta, "chunks") or not _MODEL_KEY.match(fqn):
            continue  # _extra_state objects, optimizer, rng state ...
        dtype = DTYPE_NAMES.get(meta.properties.dtype)
        if dtype is None:
            raise UserError(f"{d / dcp.METADATA}: {fqn} has dtype {meta.properties.dtype}, not convertible")
        stacked = _STACKED.match(fqn)
        if stacked and meta.size[0] != n_layers:
            raise UserError(f"{d / dcp.METADATA}: {fqn} stacks {meta.size[0]} layers but args say "
                            f"num_layers {n_layers}")
        for chunk in meta.chunks:
            info = md.storage_data.get(dcp.MetadataIndex(fqn, chunk.offsets))
            if info is None:
                raise UserError(f"{d / dcp.METADATA}: the chunk of {fqn} at {list(chunk.offsets)} has "
                                "no storage entry (no file holds it); the metadata is incomplete or corrupted")
            if getattr(info, "transform_descriptors", None):
                raise UserError(f"{dcp.data_path(d, info.relative_path)}: {fqn} is stored transformed "
                                f"({', '.join(info.transform_descriptors)}); titan-pipe reads plain DCP only")
            file, s = loc.locate(fqn, info, meta.properties.dtype, tuple(chunk.sizes))
            key = f"{fqn}@{','.join(map(str, chunk.offsets))}"
            if stacked:
                offs, lens = tuple(chunk.offsets[1:]), tuple(chunk.sizes[1:])
                for k, sub in enumerate(_layer_slices(file, key, s, acc.headers, acc.strided)):
                    yield f"decoder.layers.{chunk.offsets[0] + k}.{stacked.group(1)}", file, sub, offs, lens, dtype
            else:
                acc.headers.setdefault(file, {})[key] = StoredTensor(dtype, s.shape, s.start, s.nbytes)
                if not s.row_major:
                    acc.strided[(file, key)] = s
                yield fqn, file, key, tuple(chunk.offsets), tuple(chunk.sizes), dtype


def _plan_piece(acc: _Plan, args: ModelArgs, name: str, file: str, key: str, offs: tuple, lens: tuple,
                dtype: str, *, rope: int | None, where: Path) -> None:
    """The reads one stored piece contributes (its box is ``offs``/``lens`` of Megatron's tensor)."""
    hd, qpg, dim, ffn = args.head_dim, args.n_heads // args.kv_heads, args.dim, args.hidden_dim
    if name.startswith("<qkv>"):  # rows: query groups in global order, each q heads | k | v
        gid, group_rows = int(name.split(":")[1]), (qpg + 2) * hd
        if offs[0] % group_rows or lens[0] % group_rows or lens[1] != dim:
            raise UserError(f"{where}: {key} rows {offs[0]}+{lens[0]} do not hold whole query groups "
                            f"of {group_rows} rows")
        parts = fused_parts("qkv")
        for g in range(lens[0] // group_rows):
            G, base = offs[0] // group_rows + g, g * group_rows
            for part, so, do, n in (("q", base, G * qpg * hd, qpg * hd), ("k", base + qpg * hd, G * hd, hd),
                                    ("v", base + (qpg + 1) * hd, G * hd, hd)):
                p = parts[part]
                acc.add(layer_name(gid, p), Read(file, key, Box((so, 0), (n, dim)), Box((do, 0), (n, dim)),
                                                 rope if p.rope else None), dtype)
    elif name.startswith("<fc1>"):  # rows: [gate; up] of the whole FFN
        gid, parts = int(name.split(":")[1]), fused_parts("fc1")
        for part, lo in (("gate", 0), ("up", ffn)):
            hit = Box(offs, lens).intersect(Box((lo, 0), (ffn, dim)))
            if hit is not None:
                acc.add(layer_name(gid, parts[part]),
                        Read(file, key, Box((hit.offsets[0] - offs[0], 0), hit.lengths),
                             Box((hit.offsets[0] - lo, 0), hit.lengths)), dtype)
    elif param_of(name).vocab_rows:
        hit = Box(offs, lens).intersect(Box((0, 0), (args.vocab_size, dim)))
        if hit is not None:  # rows past the true vocabulary are padding
            acc.add(name, Read(file, key, Box((hit.offsets[0] - offs[0], 0), hit.lengths), hit), dtype)
    else:
        acc.add(name, Read(file, key, Box.full(lens), Box(offs, lens)), dtype)


def _tensor_plans(d: Path, args: ModelArgs, padded: int, acc: _Plan) -> dict[str, TensorPlan]:
    tensors, shapes = {}, native_shapes(args)
    for name in native_names(args):
        if name not in acc.reads:
            raise UserError(f"{d}: no tensor for {name!r}; the checkpoint is incomplete")
        spec, reads = param_of(name), acc.reads[name]
        kind = (f"fused {spec.fused[0]}" if spec.fused else f"{len(reads)} chunks" if len(reads) > 1 else "whole")
        if spec.vocab_rows:
            kind = f"vocab padded to {padded or '?'}, {kind}"
        tensors[name] = TensorPlan(name, shapes[name], acc.dtypes[name],
                                   tuple(sorted(reads, key=lambda r: r.dst_box.offsets)), kind)
    return tensors


def open_source(path: Path, *, vocab_size: int | None = None, model_config: Path | None = None,
                read_headers: bool = True) -> tuple[SourcePlan, dcp.DcpStore]:
    """Plan a torch_dist checkpoint: args from common.pt, then every model chunk of .metadata."""
    from titan_pipe.convert.readers.megatron import _true_vocab as true_vocab
    from titan_pipe.convert.readers.megatron import arg, model_args

    d, common, a = _open_iteration(path)
    md = dcp.read_metadata(d)
    args = model_args(a, true_vocab(a, path, vocab_size), path, virtual_ok=True)
    check_fits(args, dcp.stored_bytes(md), source=f"{d / COMMON}: Megatron args",
               where=f"the tensors {d / dcp.METADATA} lists")
    rope = args.head_dim if getattr(a, "rotary_interleaved", False) else None
    acc = _Plan()
    with dcp.ChunkLocator(d) as loc:
        for mkey, file, key, offs, lens, dtype in _stored_pieces(d, md, args.n_layers, loc, acc):
            try:
                name = megatron_to_native(mkey, 0)
            except KeyError as e:
                raise UserError(f"{d / dcp.METADATA}: {e.args[0]}; only megatron-core LLaMA-style "
                                "layers are converted") from None
            if name is not None:
                _plan_piece(acc, args, name, file, key, offs, lens, dtype, rope=rope, where=d / dcp.METADATA)
        files = loc.files
    check_accounted(acc.reads, args, source=f"{d / COMMON}: Megatron args")
    padded = arg(a, "padded_vocab_size", INT, d, default=0, bound=limits.VOCAB)
    tp = arg(a, "tensor_model_parallel_size", INT, d, default=1, bound=limits.PARALLEL)
    pp = arg(a, "pipeline_model_parallel_size", INT, d, default=1, bound=limits.PARALLEL)
    per_vstage = arg(a, "num_layers_per_virtual_pipeline_stage", INT, d, default=None, bound=limits.LAYERS)
    vpp = arg(a, "virtual_pipeline_model_parallel_size", INT, d, default=None, bound=limits.LAYERS) or (
        args.n_layers // pp // per_vstage if per_vstage else None)
    plan = SourcePlan("megatron", d, args, _tensor_plans(d, args, padded, acc), files=files,
                      step=read(common, "iteration", INT, source=d / COMMON, default=0),
                      layout={"backend": "torch_dist", "tp": tp, "pp": pp, "vpp": vpp,
                              "checkpoint_version": common.get("checkpoint_version"),
                              "padded_vocab_size": padded or None})
    plan.layout["chunks"] = sum(len(t.reads) for t in plan.tensors.values())
    return plan, dcp.DcpStore(d, acc.headers, acc.strided)
