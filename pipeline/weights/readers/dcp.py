"""Reader for torch.distributed.checkpoint directories (.metadata + __R_N.distcp), torchtitan naming.

``.metadata`` (a pickle written by DCP) is read with a restricted unpickler that admits only DCP's
own metadata classes, torch.Size, dtypes and paths. It gives every chunk of every tensor (its box
in the global tensor) and the storage item holding it: (file, byte offset, length). Each item is
one ``torch.save`` archive; its zip directory and data.pkl (a few hundred bytes, interpreted by
pipeline/weights/readers/torch_save.py without running torch code) give where its raw bytes start, so the
chunk is then addressed exactly like a tensor of a safetensors shard and executed by the same
block reader (pread / preadv scatter / copy_file_range): no torch DCP load path, no chunk loaded
whole. Model-only exports and torchtitan's own checkpoints have torchtitan names at the top level
(beside ``optimizer.*``, ``lr_scheduler``, ``dataloader``, ``train_state``, which are skipped);
some have them under ``model.``. torchtitan's llama3 (like Meta) keeps q/k rows in interleaved RoPE
order: those reads carry ``rope_head_dim`` so the rows land in rotate-half order. torchtitan's qwen3
(``attention.q_norm`` / ``k_norm`` present) computes RoPE in rotate-half order as Hugging Face does,
so its rows are read as they are.

DCP holds no model config: head counts, eps and RoPE settings come from a ``params.json`` (Meta /
torchtitan) or ``config.json`` (Hugging Face) beside or above the checkpoint, or ``--model-config``;
dims, layer count, vocabulary, FFN size, head_dim, q/k norms and q/k/v biases are read off the
tensor shapes.
"""

from __future__ import annotations

import bisect
import math
import os
import pickle
from pathlib import Path
from typing import TYPE_CHECKING

from titan_pipe.records.checkpoint_format import Box
from titan_pipe.weights.readers import torch_save
from titan_pipe.weights.readers.dcp_metadata import (
    STAND_INS,
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorProperties,
    TensorStorageMetadata,
    torch_global,
)
from titan_pipe.io.safetensors_io import pread_into
from titan_pipe.weights.readers.store import SafetensorsStore
from titan_pipe.io.safetensors_io import StoredTensor, read_header
from titan_pipe.weights.readers.torch_save import SavedTensor
from titan_pipe.weights.source_plan import Read, SourcePlan, TensorPlan, check_accounted
from titan_pipe.rules.dtypes import DTYPE_SIZES
from titan_pipe.errors import UserError
from titan_pipe.rules import limits
from titan_pipe.model import features
from titan_pipe.model.args import ModelArgs, RopeScaling, check_fits, validate_args
from titan_pipe.model.hf_config import from_hf_config
from titan_pipe.model.names import TORCHTITAN_MODEL_PREFIX
from titan_pipe.model.params import native_names, param_of
from titan_pipe.io.paths import resolve_inside
from titan_pipe.rules.values import BOOL, DICT, FLOAT, INT, read, read_json

if TYPE_CHECKING:
    import torch

FORMAT = "dcp"
METADATA = ".metadata"


# Exactly the classes DCP's Metadata is built from (torch 2.x FileSystemWriter, megatron-core's
# planner): constructing any of them runs no code with effects. A prefix rule would also admit
# callables such as format_utils.dcp_to_torch_save, which writes files.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "torch.distributed.checkpoint.planner": {  # all_local_plans, kept by newer savers
        "SavePlan",
        "WriteItem",
        "WriteItemType",
        "TensorWriteData",
    },
    "torch.serialization": {"_get_layout"},  # layout name -> torch.strided etc. (a dict lookup)
    "torch._utils": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admit only what DCP metadata is made of; anything else is refused by name. DCP's own classes
    are built as their stand-ins (pipeline/weights/readers/dcp_metadata.py): torch.distributed.checkpoint is
    never imported to read one file."""

    def find_class(self, module: str, name: str):
        found = torch_global(name) if module == "torch" else None
        if found is not None:
            return found
        if name not in _METADATA_GLOBALS.get(module, ()):
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        stand_in = STAND_INS.get((module, name))
        return stand_in if stand_in is not None else super().find_class(module, name)


def read_metadata(path: Path):
    f = path / METADATA
    try:
        with open(f, "rb") as fh:
            md = _MetadataUnpickler(fh).load()
    except FileNotFoundError:
        raise UserError(f"{f}: missing; a DCP checkpoint needs its .metadata file") from None
    except (
        pickle.UnpicklingError,
        EOFError,
        AttributeError,
        ImportError,
        ValueError,
        TypeError,
        KeyError,
        IndexError,
        RecursionError,
        MemoryError,
    ) as e:
        raise UserError(
            f"{f}: not a readable DCP metadata file ({type(e).__name__}: {str(e)[:200]}); it is "
            "corrupted or not written by torch.distributed.checkpoint"
        ) from None
    problem = metadata_problem(md)
    if problem:
        raise UserError(f"{f}: {problem}; the metadata is corrupted or not written by torch.distributed.checkpoint")
    return md


def _ints(v, n: int | None = None) -> bool:
    return (
        isinstance(v, (tuple, list))
        and (n is None or len(v) == n)
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)
    )


def metadata_problem(md) -> str | None:
    """What in an unpickled .metadata is not the shape torch writes (one phrase), or None: every
    tensor entry's size, chunks (offsets and sizes of its rank, inside it) and dtype, and every
    storage entry's path, offset and length, checked before any of them is used."""
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        return f"its top object is a {type(md).__name__}, not a DCP Metadata with a state_dict_metadata dict"
    for fqn, meta in md.state_dict_metadata.items():
        if not isinstance(fqn, str):
            return f"a state_dict key {fqn!r} is not a string"
        if isinstance(meta, BytesStorageMetadata):
            continue
        if not isinstance(meta, TensorStorageMetadata):
            return f"{fqn}: a {type(meta).__name__}, not a tensor or bytes entry"
        if not _ints(meta.size) or not isinstance(meta.chunks, list) or not meta.chunks:
            return f"{fqn}: size {meta.size!r} or chunks {type(meta.chunks).__name__} malformed"
        if not isinstance(meta.properties, TensorProperties) or not isinstance(meta.properties.dtype, str):
            return f"{fqn}: no tensor properties with a dtype"
        for c in meta.chunks:
            offsets, sizes = getattr(c, "offsets", None), getattr(c, "sizes", None)
            if not (_ints(offsets, len(meta.size)) and _ints(sizes, len(meta.size))) or any(
                o + n > d for o, n, d in zip(offsets, sizes, meta.size)
            ):
                return f"{fqn}: a chunk at {offsets!r} of {sizes!r} is not inside its size {tuple(meta.size)}"
    storage = md.storage_data
    if not isinstance(storage, dict):
        return f"storage_data is a {type(storage).__name__}, not a dict"
    for key, info in storage.items():
        if not isinstance(key, MetadataIndex) or not isinstance(info, StorageInfo):
            return f"a storage entry of {type(key).__name__} -> {type(info).__name__}, not index -> storage info"
        if not isinstance(info.relative_path, str) or not _ints([info.offset, info.length]):
            return (
                f"the storage entry of {key.fqn!r} has path {info.relative_path!r}, offset {info.offset!r}, "
                f"length {info.length!r}"
            )
    return None


def looks_like(path: Path) -> bool:
    # .metadata alone decides: with its data files missing the reader names the missing file.
    return (path / METADATA).is_file()


def _find_config(path: Path, model_config: Path | None) -> Path:
    if model_config is not None:
        if not model_config.is_file():
            raise UserError(f"{model_config}: --model-config file not found")
        return model_config
    for d in (path, path.parent, path.parent.parent):
        for name in ("params.json", "config.json"):
            if (d / name).is_file():
                return d / name
    raise UserError(
        f"{path}: a DCP checkpoint holds no model config; put a params.json (Meta/"
        "torchtitan: n_heads, n_kv_heads, norm_eps, rope_theta) or a Hugging Face "
        "config.json beside it, or pass --model-config FILE"
    )


def model_args(cfg_path: Path, shapes: dict[str, tuple[int, ...]]) -> ModelArgs:
    """Head counts etc. from the config file; dims from the tensor shapes (they cannot disagree)."""
    cfg = read_json(cfg_path, what="a model config (params.json / config.json)")
    if "hidden_size" in cfg:
        return from_hf_config(cfg, source=str(cfg_path))
    if any(".moe." in n for n in shapes):
        raise UserError(
            f"{cfg_path}: a mixture-of-experts checkpoint (torchtitan's moe.experts / moe.router), "
            "whose routing a params.json does not describe; pass the model's Hugging Face config.json "
            "with --model-config FILE"
        )
    try:
        n_layers = 1 + max(int(n.split(".")[1]) for n in shapes if n.startswith("layers."))
        vocab, dim = shapes["tok_embeddings.weight"]
        hidden = shapes["layers.0.feed_forward.w1.weight"][0]
        q_norm = shapes.get("layers.0.attention.q_norm.weight")  # torchtitan's qwen3: head_dim apart
        head_dim = q_norm[0] if q_norm is not None else None
    except (KeyError, ValueError, IndexError) as e:
        raise UserError(
            f"{cfg_path}: the checkpoint's tensors do not give the model's dims ({e!r} missing "
            "or malformed); is it a LLaMA model checkpoint?"
        ) from None
    return validate_args(
        ModelArgs(
            dim=dim,
            n_layers=n_layers,
            n_heads=(n_heads := _param(cfg, "n_heads", INT, cfg_path, bound=limits.HEADS)),
            n_kv_heads=_param(cfg, "n_kv_heads", INT, cfg_path, default=n_heads, bound=limits.HEADS),
            vocab_size=vocab,
            ffn_hidden_dim=hidden,
            head_dim=head_dim,
            **{f.name: shown for f in features.FEATURES if (shown := f.shown_in(shapes)) is not None},
            norm_eps=_param(cfg, "norm_eps", FLOAT, cfg_path, default=1e-5, bound=limits.NORM_EPS),
            rope_theta=_param(cfg, "rope_theta", FLOAT, cfg_path, default=10000.0, bound=limits.ROPE_THETA),
            rope_scaling=_meta_scaling(cfg, cfg_path),
            max_seq_len=_param(cfg, "max_seq_len", INT, cfg_path, default=4096, bound=limits.POSITIONS),
        ),
        source=cfg_path,
    )


def _param(cfg: dict, key: str, kind: str, cfg_path: Path, **kw):
    """One value of a params.json (Meta / torchtitan), typed strictly (titan_pipe.rules.values)."""
    return read(cfg, key, kind, source=cfg_path, fix="write the value the model was trained with", **kw)


def _meta_scaling(cfg: dict, cfg_path: Path) -> RopeScaling | None:
    """Llama-3.1 RoPE scaling of a params.json: use_scaled_rope (Meta) or a rope_scaling object."""
    if not (_param(cfg, "use_scaled_rope", BOOL, cfg_path, default=False) or cfg.get("rope_scaling")):
        return None
    s = _param(cfg, "rope_scaling", DICT, cfg_path, default={})
    p = {
        k: read(s, k, kind, source=cfg_path, default=d, bound=b, prefix="rope_scaling.")
        for k, kind, d, b in (
            ("factor", FLOAT, 8.0, limits.ROPE_FACTOR),
            ("low_freq_factor", FLOAT, 1.0, limits.ROPE_FACTOR),
            ("high_freq_factor", FLOAT, 4.0, limits.ROPE_FACTOR),
            ("original_max_position_embeddings", INT, 8192, limits.POSITIONS),
        )
    }
    return RopeScaling(**p)


def convertible_dtype(meta, fqn: str, where: Path) -> str:
    """The safetensors code of a .metadata tensor entry's dtype; UserError naming it if no reader converts it."""
    if meta.properties.dtype not in DTYPE_SIZES:
        raise UserError(f"{where}: {fqn} has dtype {meta.properties.dtype}, not convertible")
    return meta.properties.dtype


def stored_bytes(md) -> int:
    """Bytes of every tensor .metadata lists (each chunk is later checked against its file)."""
    # a dtype no reader converts ("torch.complex64"...) counts at 8 bytes an element: an estimate for
    # check_fits only (a model tensor of such a dtype is refused by name when it is planned)
    return sum(
        math.prod(m.size) * DTYPE_SIZES.get(m.properties.dtype, 8)
        for m in md.state_dict_metadata.values()
        if hasattr(m, "chunks")
    )


def data_path(root: Path, relative: str) -> Path:
    """The file a storage entry of ``.metadata`` names, refused unless it lies inside ``root``.

    The one place paths read from DCP metadata (also Megatron torch_dist's) become file paths.
    """
    return resolve_inside(
        root,
        relative,
        source=root / METADATA,
        what="storage file path",
        fix="the metadata is corrupted or hostile; re-save the checkpoint",
    )


class StorageFiles:
    """The storage files ``.metadata`` names, each checked by data_path once (a few files hold many
    chunks): relative path as written -> (the checked path, its path relative to the root)."""

    def __init__(self, root: Path):
        self.root = root
        self._seen: dict[str, tuple[Path, str]] = {}

    def __call__(self, relative: str) -> tuple[Path, str]:
        got = self._seen.get(relative)
        if got is None:
            f = data_path(self.root, relative)
            got = self._seen[relative] = (f, str(f.relative_to(self.root)))
        return got


class DcpStore(SafetensorsStore):
    """Chunks of a DCP checkpoint, addressed like safetensors tensors: (file, byte offset) of each.

    Row-major chunks (all that DCP's writer produces from ordinary parameters) go through the
    same pread / preadv / copy_file_range paths as our own shards. A chunk saved with other
    strides is read whole (one chunk in memory) and viewed with them.
    """

    def __init__(
        self, root: Path, headers: dict[str, dict[str, StoredTensor]], strided: dict[tuple[str, str], SavedTensor]
    ):
        super().__init__(root, headers)
        self.strided = strided

    def header(self, file: str) -> dict[str, StoredTensor]:
        return self.headers.get(file, {})

    def byte_span(self, file: str, key: str, box: Box) -> tuple[int, int, int] | None:
        return None if (file, key) in self.strided else super().byte_span(file, key, box)

    def read_box(self, file: str, key: str, box: Box) -> "torch.Tensor":
        s = self.strided.get((file, key))
        if s is None:
            return super().read_box(file, key, box)
        import torch  # here: only a strided chunk needs it

        from titan_pipe.rules.dtypes import TORCH_DTYPES

        buf = torch.empty(s.storage_nbytes, dtype=torch.uint8)
        pread_into(self.fd(file), memoryview(buf.numpy()), s.storage_start, self.root / file)
        x = buf.view(TORCH_DTYPES[s.dtype]).as_strided(s.shape, s.stride, (s.start - s.storage_start) // s.itemsize)
        for d, (o, n) in enumerate(zip(box.offsets, box.lengths)):
            x = x.narrow(d, o, n)
        return x


def _locate_chunk(
    path: Path, fd: int, size: int, fqn: str, info, dtype: str, lengths: tuple[int, ...], st_headers: dict
) -> SavedTensor:
    """Where the bytes of one storage item lie; every way it can disagree with .metadata refused."""
    where = f"{path}: chunk of {fqn} at bytes {info.offset}..{info.offset + info.length}"
    if info.offset < 0 or info.length < 0 or info.offset + info.length > size:
        raise UserError(
            f"{where} runs past the end of the file ({size} bytes); the file is truncated. Copy the complete checkpoint"
        )
    try:
        s = torch_save.locate(fd, info.offset, info.length)
    except torch_save.PayloadError as e:
        # FileSystemWriter(serialization_format=SAFETENSORS) writes a safetensors file instead:
        # its chunks are raw tensors under their fqn.
        if path not in st_headers:
            try:
                st_headers[path] = read_header(path)[0] if size >= 8 and os.pread(fd, 1, 8) == b"{" else {}
            except UserError:
                st_headers[path] = {}
        t = st_headers[path].get(fqn)
        if t is None:
            raise UserError(
                f"{where}: {e}; expected a torch.save payload (titan-pipe reads DCP FileSystemWriter checkpoints)"
            ) from None
        s = SavedTensor(
            t.dtype,
            t.shape,
            tuple(math.prod(t.shape[d + 1 :]) for d in range(len(t.shape))),
            t.start,
            t.start,
            t.nbytes,
        )
    if s.dtype != dtype or s.shape != tuple(lengths):
        raise UserError(
            f"{where} holds {s.dtype} {list(s.shape)}, but {METADATA} says {dtype} "
            f"{list(lengths)}; the file does not belong to this checkpoint"
        )
    return s


def open_source(
    path: Path, *, vocab_size: int | None = None, model_config: Path | None = None, read_headers: bool = True
) -> tuple[SourcePlan, DcpStore]:
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
            name = fqn[len(TORCHTITAN_MODEL_PREFIX) :]
        else:
            name = fqn
        if name.startswith(("layers.", "tok_embeddings.", "norm.", "output.")) and "freqs_cis" not in name:
            tensor_meta[name] = (fqn, meta)
    if not tensor_meta:
        if any(k.startswith(("decoder.layers.", "embedding.word_embeddings.")) for k in sdm):
            raise UserError(
                f"{path / METADATA}: holds Megatron tensor names (decoder.layers...): a "
                "Megatron torch_dist checkpoint, which needs its metadata.json and "
                "common.pt beside .metadata; pass --source-format megatron"
            )
        raise UserError(
            f"{path / METADATA}: holds no torchtitan model tensors (tok_embeddings, "
            "layers.N...); is it a model checkpoint?"
        )
    shapes = {n: tuple(m.size) for n, (_, m) in tensor_meta.items()}
    cfg_path = _find_config(path, model_config)
    args = model_args(cfg_path, shapes)
    check_fits(args, stored_bytes(md), source=cfg_path, where=f"the tensors {path / METADATA} lists")
    check_accounted(shapes, args, source=cfg_path, describe=lambda n: f"{tensor_meta[n][0]!r} of {path / METADATA}")
    if vocab_size is not None and vocab_size != args.vocab_size:
        raise UserError(f"--vocab-size {vocab_size} disagrees with the embedding of {path} ({args.vocab_size} rows)")
    interleaved = not any(f.rotate_half_in_torchtitan for f in features.active(args))  # qwen3's is rotate-half
    tensors = plan_tensors(
        path,
        md,
        tensor_meta,
        native_names(args),
        rope_head_dim=lambda n: args.head_dim if interleaved and param_of(n).rope else None,
    )
    plan_files, headers, strided = locate_chunks(path, md, tensors)
    return (
        SourcePlan(
            FORMAT,
            path,
            args,
            tensors,
            files=plan_files,
            layout={"chunks": sum(len(t.reads) for t in tensors.values()), "model_prefix": prefixed},
        ),
        DcpStore(path, headers, strided),
    )


def plan_tensors(
    path: Path, md, wanted: dict[str, tuple[str, object]], order, *, rope_head_dim=lambda name: None
) -> dict[str, TensorPlan]:
    """One TensorPlan per native name in ``order``: a read per chunk of its DCP tensor.

    ``wanted``: native name -> (fqn in the checkpoint, TensorStorageMetadata). The store key of a
    chunk is ``fqn@offsets``; its file is the storage entry's (validated) relative path.
    """
    storage = md.storage_data
    tensors = {}
    files = StorageFiles(path)
    for name in order:
        if name not in wanted:
            raise UserError(
                f"{path / METADATA}: no tensor {name!r}; the checkpoint is incomplete or its config disagrees"
            )
        fqn, meta = wanted[name]
        dtype = convertible_dtype(meta, fqn, path)
        hd = rope_head_dim(name)
        reads = []
        for chunk in meta.chunks:
            info = storage.get(MetadataIndex(fqn, chunk.offsets))  # its index is only a hint
            if info is None:
                raise UserError(
                    f"{path / METADATA}: the chunk of {fqn} at {list(chunk.offsets)} has no "
                    "storage entry (no file holds it); the metadata is incomplete or corrupted"
                )
            if getattr(info, "transform_descriptors", None):
                raise UserError(
                    f"{data_path(path, info.relative_path)}: {fqn} is stored transformed "
                    f"({', '.join(info.transform_descriptors)}); titan-pipe reads plain "
                    "(uncompressed) DCP only"
                )
            dst = Box(tuple(chunk.offsets), tuple(chunk.sizes))
            if hd and dst.offsets[0] % hd:
                raise UserError(f"{path}: {fqn} chunk at row {dst.offsets[0]} splits an attention head")
            file = files(info.relative_path)[1]
            reads.append(Read(file, f"{fqn}@{','.join(map(str, dst.offsets))}", Box.full(dst.lengths), dst, hd))
        reads.sort(key=lambda r: r.dst_box.offsets)
        split = "whole" if len(reads) == 1 else f"{len(reads)} chunks"
        tensors[name] = TensorPlan(
            name, tuple(meta.size), dtype, tuple(reads), split + (", interleaved RoPE" if hd else "")
        )
    return tensors


class ChunkLocator:
    """Finds where each storage item's tensor lies; opens every .distcp file once.

    ``locate`` gives (file relative to the root, SavedTensor) and refuses, naming the file, a
    missing file, an item past its end, a payload that is not a plain saved tensor, or one whose
    dtype/shape disagrees with .metadata.
    """

    def __init__(self, root: Path):
        self.root = root
        self._fds: dict[str, tuple[int, int]] = {}
        self._st_headers: dict[Path, dict] = {}
        self._files = StorageFiles(root)
        self._claimed: dict[str, tuple[list[int], list[tuple]]] = {}  # file -> sorted starts, owners

    def locate(self, fqn: str, info, dtype: str, lengths: tuple[int, ...]) -> tuple[str, SavedTensor]:
        f, rel = self._files(info.relative_path)
        if rel not in self._fds:
            try:
                fd = os.open(f, os.O_RDONLY)
            except FileNotFoundError:
                raise UserError(
                    f"{f}: missing; {METADATA} lists it (chunks of {fqn}). Copy the complete checkpoint"
                ) from None
            except IsADirectoryError:
                raise UserError(f"{f}: is a directory, expected a .distcp file") from None
            self._fds[rel] = (fd, os.fstat(fd).st_size)
        fd, size = self._fds[rel]
        saved = _locate_chunk(f, fd, size, fqn, info, dtype, lengths, self._st_headers)
        self._claim(f, rel, (fqn, info.offset), saved)
        return rel, saved

    def _claim(self, f: Path, rel: str, item: tuple, saved: SavedTensor) -> None:
        """Each storage item owns its bytes: two items located on the same bytes would put one
        piece in two places (an expert written twice, another lost) with every shape agreeing.
        Checked on the located bytes, so a torch.save archive and a safetensors-backed save alike."""
        starts, owners = self._claimed.setdefault(rel, ([], []))
        lo, hi = saved.storage_start, saved.storage_start + saved.storage_nbytes
        i = bisect.bisect_left(starts, lo)
        for j in (i - 1, i):
            if 0 <= j < len(starts):
                o_lo, o_hi, o_item = owners[j]
                if o_item != item and o_lo < hi and lo < o_hi:
                    raise UserError(
                        f"{f}: {o_item[0]} and {item[0]} are located on overlapping bytes "
                        f"({max(lo, o_lo)}..{min(hi, o_hi)}); each storage item owns its bytes, so "
                        f"{METADATA} is corrupted: copy the checkpoint again"
                    )
                if o_item == item:
                    return
        starts.insert(i, lo)
        owners.insert(i, (lo, hi, item))

    @property
    def files(self) -> list[str]:
        return sorted(self._fds)

    def close(self) -> None:
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def locate_chunks(path: Path, md, tensors: dict[str, TensorPlan]):
    """(files read, safetensors-like headers per file, strided chunks) for every read of the plan.

    Reads each storage item's zip directory and data.pkl (a few hundred bytes), never its data.
    """
    by_key = {}
    for idx, info in md.storage_data.items():
        if idx.offset is not None:
            by_key[f"{idx.fqn}@{','.join(map(str, idx.offset))}"] = (idx.fqn, info)
    headers: dict[str, dict[str, StoredTensor]] = {}
    strided: dict[tuple[str, str], SavedTensor] = {}
    with ChunkLocator(path) as loc:
        for t in tensors.values():
            for r in t.reads:
                fqn, info = by_key[r.key]
                file, s = loc.locate(fqn, info, t.dtype, r.dst_box.lengths)
                headers.setdefault(file, {})[r.key] = StoredTensor(t.dtype, s.shape, s.start, s.nbytes)
                if not s.row_major:
                    strided[(file, r.key)] = s
        return loc.files, headers, strided
