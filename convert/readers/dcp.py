"""Reader for torch.distributed.checkpoint directories (.metadata + __R_N.distcp), torchtitan naming.

``.metadata`` (a pickle written by DCP) is read with a restricted unpickler that admits only DCP's
own metadata classes, torch.Size, dtypes and paths; each chunk's (file, byte offset, length) comes
from it, and a chunk's bytes (one ``torch.save`` payload) are loaded with ``weights_only=True`` when
the plan reaches it, one chunk at a time. Model-only exports have torchtitan names at the top
level; full training checkpoints have them under ``model.`` beside optimizer and train state,
which are skipped. torchtitan (like Meta) keeps q/k rows in interleaved RoPE order: those reads
carry ``rope_head_dim`` so the rows land in rotate-half order.

DCP holds no model config: head counts, eps and RoPE settings come from a ``params.json`` (Meta /
torchtitan) or ``config.json`` (Hugging Face) beside or above the checkpoint, or ``--model-config``;
dims, layer count, vocabulary and FFN size are read off the tensor shapes.
"""
from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import torch

from titan_pipe.checkpoint_format import Box
from titan_pipe.convert.readers.store import Store
from titan_pipe.convert.source_plan import Read, SourcePlan, TensorPlan
from titan_pipe.dtypes import DTYPE_NAMES
from titan_pipe.errors import UserError
from titan_pipe.model_args import ModelArgs, RopeScaling
from titan_pipe.names import TORCHTITAN_MODEL_PREFIX, from_hf_config, native_names

FORMAT = "dcp"
METADATA = ".metadata"
_ROPE_PERMUTED = (".attention.wq.weight", ".attention.wk.weight")


class _MetadataUnpickler(pickle.Unpickler):
    """Admit only what DCP metadata is made of; anything else is refused by name."""

    def find_class(self, module: str, name: str):
        ok = (module.startswith("torch.distributed.checkpoint.")
              or (module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)))
              or (module == "torch._utils" and name in ("_get_layout",))
              or (module == "torch.serialization" and name == "_get_layout")
              or (module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath",
                                                   "PureWindowsPath", "Path"))
              or (module == "collections" and name == "OrderedDict")
              or name == "_MEM_FORMAT_ENCODING")
        if not ok:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


def read_metadata(path: Path):
    f = path / METADATA
    try:
        with open(f, "rb") as fh:
            return _MetadataUnpickler(fh).load()
    except FileNotFoundError:
        raise UserError(f"{f}: missing; a DCP checkpoint needs its .metadata file") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError) as e:
        raise UserError(f"{f}: not a readable DCP metadata file ({e}); it is corrupted or not "
                        "written by torch.distributed.checkpoint") from None


def looks_like(path: Path) -> bool:
    return (path / METADATA).is_file() and any(path.glob("*.distcp"))


def _find_config(path: Path, model_config: Path | None) -> Path:
    if model_config is not None:
        if not model_config.is_file():
            raise UserError(f"{model_config}: --model-config file not found")
        return model_config
    for d in (path, path.parent, path.parent.parent):
        for name in ("params.json", "config.json"):
            if (d / name).is_file():
                return d / name
    raise UserError(f"{path}: a DCP checkpoint holds no model config; put a params.json (Meta/"
                    "torchtitan: n_heads, n_kv_heads, norm_eps, rope_theta) or a Hugging Face "
                    "config.json beside it, or pass --model-config FILE")


def model_args(cfg_path: Path, shapes: dict[str, tuple[int, ...]]) -> ModelArgs:
    """Head counts etc. from the config file; dims from the tensor shapes (they cannot disagree)."""
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise UserError(f"{cfg_path}: not valid JSON ({e})") from None
    if "hidden_size" in cfg:
        try:
            return from_hf_config(cfg, source=str(cfg_path))
        except ValueError as e:
            raise UserError(str(e)) from None
    try:
        n_layers = 1 + max(int(n.split(".")[1]) for n in shapes if n.startswith("layers."))
        vocab, dim = shapes["tok_embeddings.weight"]
        hidden = shapes["layers.0.feed_forward.w1.weight"][0]
        n_heads = int(cfg["n_heads"])
        scaling = None
        if cfg.get("use_scaled_rope") or cfg.get("rope_scaling"):
            s = cfg.get("rope_scaling") or {}
            scaling = RopeScaling(float(s.get("factor", 8.0)), float(s.get("low_freq_factor", 1.0)),
                                  float(s.get("high_freq_factor", 4.0)),
                                  int(s.get("original_max_position_embeddings", 8192)))
        return ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads,
                         n_kv_heads=int(cfg.get("n_kv_heads") or n_heads), vocab_size=vocab,
                         ffn_hidden_dim=hidden, norm_eps=float(cfg.get("norm_eps", 1e-5)),
                         rope_theta=float(cfg.get("rope_theta", 10000.0)), rope_scaling=scaling,
                         max_seq_len=int(cfg.get("max_seq_len", 4096)),
                         tie_embeddings="output.weight" not in shapes)
    except (KeyError, ValueError, IndexError) as e:
        raise UserError(f"{cfg_path}: cannot build the model config ({e!r} missing or malformed)") from None


class DcpStore(Store):
    """Chunks of a DCP checkpoint; keeps the one chunk last loaded (the plan reads it in row blocks)."""

    def __init__(self, root: Path, storage: dict[str, object]):
        super().__init__(root)
        self.storage = storage  # key -> _StorageInfo(relative_path, offset, length)
        self._cached: tuple[str, torch.Tensor] | None = None

    def _load(self, key: str) -> torch.Tensor:
        if self._cached and self._cached[0] == key:
            return self._cached[1]
        info = self.storage[key]
        f = self.root / info.relative_path
        try:
            with open(f, "rb") as fh:
                fh.seek(info.offset)
                raw = fh.read(info.length)
        except FileNotFoundError:
            raise UserError(f"{f}: missing; {METADATA} lists it. Copy the complete checkpoint") from None
        if len(raw) != info.length:
            raise UserError(f"{f}: truncated (chunk {key} needs bytes {info.offset}..{info.offset + info.length})")
        try:
            t = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises several types for a damaged zip payload
            raise UserError(f"{f}: chunk {key} at byte {info.offset} is corrupted ({type(e).__name__}: "
                            f"{str(e)[:120]})") from None
        self._cached = (key, t)
        return t

    def read_box(self, file: str, key: str, box: Box) -> torch.Tensor:
        x = self._load(key)
        for d, (o, n) in enumerate(zip(box.offsets, box.lengths)):
            x = x.narrow(d, o, n)
        return x


def open_source(path: Path, *, vocab_size: int | None = None, model_config: Path | None = None,
                read_headers: bool = True) -> tuple[SourcePlan, DcpStore]:
    md = read_metadata(path)
    sdm = md.state_dict_metadata
    prefixed = any(k.startswith(TORCHTITAN_MODEL_PREFIX) for k in sdm)
    tensor_meta = {}
    for fqn, meta in sdm.items():
        if not hasattr(meta, "chunks"):
            continue  # bytes: train state, lr scheduler...
        if prefixed:
            if not fqn.startswith(TORCHTITAN_MODEL_PREFIX):
                continue  # optimizer state and friends
            name = fqn[len(TORCHTITAN_MODEL_PREFIX):]
        else:
            name = fqn
        if name.startswith(("layers.", "tok_embeddings.", "norm.", "output.")) and "freqs_cis" not in name:
            tensor_meta[name] = (fqn, meta)
    if not tensor_meta:
        raise UserError(f"{path / METADATA}: holds no torchtitan model tensors (tok_embeddings, "
                        "layers.N...); is it a model checkpoint?")
    shapes = {n: tuple(m.size) for n, (_, m) in tensor_meta.items()}
    args = model_args(_find_config(path, model_config), shapes)
    if vocab_size is not None and vocab_size != args.vocab_size:
        raise UserError(f"--vocab-size {vocab_size} disagrees with the embedding of {path} "
                        f"({args.vocab_size} rows)")
    by_fqn: dict[str, list] = {}
    for idx, info in md.storage_data.items():
        by_fqn.setdefault(idx.fqn, []).append((idx, info))
    storage, tensors, files = {}, {}, set()
    for name in native_names(args):
        if name not in tensor_meta:
            raise UserError(f"{path / METADATA}: no tensor {name!r}; the checkpoint is incomplete "
                            "or its config disagrees")
        fqn, meta = tensor_meta[name]
        dtype = DTYPE_NAMES.get(meta.properties.dtype)
        if dtype is None:
            raise UserError(f"{path}: {fqn} has dtype {meta.properties.dtype}, not convertible")
        hd = args.head_dim if name.endswith(_ROPE_PERMUTED) else None
        reads = []
        for idx, info in sorted(by_fqn.get(fqn, []), key=lambda x: tuple(x[0].offset or ())):
            if getattr(info, "transform_descriptors", None):
                raise UserError(f"{path / info.relative_path}: {fqn} is stored compressed/transformed "
                                f"({info.transform_descriptors}); titan-pipe reads plain DCP only")
            chunk = next((c for c in meta.chunks if tuple(c.offsets) == tuple(idx.offset)), None)
            if chunk is None:
                raise UserError(f"{path / METADATA}: storage entry of {fqn} at {list(idx.offset)} "
                                "has no chunk; the metadata is corrupted")
            dst = Box(tuple(chunk.offsets), tuple(chunk.sizes))
            if hd and dst.offsets[0] % hd:
                raise UserError(f"{path}: {fqn} chunk at row {dst.offsets[0]} splits an attention head")
            key = f"{fqn}@{','.join(map(str, dst.offsets))}"
            storage[key] = info
            files.add(info.relative_path)
            reads.append(Read(info.relative_path, key, Box.full(dst.lengths), dst, hd))
        split = "whole" if len(reads) == 1 else f"{len(reads)} chunks"
        tensors[name] = TensorPlan(name, tuple(meta.size), dtype, tuple(reads),
                                   split + (", interleaved RoPE" if hd else ""))
    return (SourcePlan(FORMAT, path, args, tensors, files=sorted(files),
                       layout={"chunks": sum(len(t.reads) for t in tensors.values()),
                               "model_prefix": prefixed}),
            DcpStore(path, storage))
