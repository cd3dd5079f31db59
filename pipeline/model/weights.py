"""Weight sources for init_from / resume: whole (global) parameter tensors, one at a time, read
from one of our checkpoints (assembled by its manifest), a unified safetensors directory or a
Hugging Face LLaMA directory. Every source has ``.args`` (ModelArgs), ``.full(name) -> Tensor`` and
``.box(name, box) -> Tensor`` (one rank's piece, reading only the stored chunks that overlap it).
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Protocol

import torch

from titan_pipe.records.checkpoint_format import (
    MANIFEST_NAME,
    Box,
    FileInfo,
    LayoutError,
    complete_step,
    is_complete,
    open_checkpoint,
)
from titan_pipe.rules.dtypes import TORCH_DTYPES
from titan_pipe.errors import UserError
from titan_pipe.io.hashing import sha256_file
from titan_pipe.model.args import SHAPE_KEYS, ModelArgs, check_fits, model_differences
from titan_pipe.model.lora import BaseRef, LoRASpec, adapter_of, adapter_shapes, is_adapter, lora_record
from titan_pipe.model.lora_modules import init_adapter, merge
from titan_pipe.model.unified_dir import CONFIG, INDEX, open_unified
from titan_pipe.weights.detect import open_source, other_format
from titan_pipe.weights.read import read_global
from titan_pipe.io.paths import resolve_inside
from titan_pipe.io.safetensors_io import open_tensors

_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+; Python names it from 3.13 on


class WeightSource(Protocol):
    """What build_parallel_model reads weights from: global tensors by native parameter name."""

    args: ModelArgs

    def full(self, name: str) -> torch.Tensor: ...

    def stored_dtype(self, name: str) -> torch.dtype: ...

    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor: ...

    def box(self, name: str, box: Box) -> torch.Tensor: ...

    def names(self) -> list[str]: ...


class CheckpointWeights:
    """Parameters of a titan-pipe checkpoint step dir, each assembled from its TP chunks."""

    def __init__(self, step_dir: Path):
        self.dir = Path(step_dir)
        self.manifest = open_checkpoint(self.dir)
        self.args = ModelArgs.from_dict(self.manifest.model, source=self.dir / MANIFEST_NAME)
        # a LoRA checkpoint holds its adapters only (their shapes: LoRAWeights checks them)
        self.lora_record = lora_record(self.manifest.extra.other, source=self.dir / MANIFEST_NAME)
        if self.lora_record is None:
            check_fits(
                self.args,
                sum(f.size for f in self.manifest.files.values()),
                source=self.dir / MANIFEST_NAME,
                where="its shard files",
            )
        # every chunk names a file listed here (validate), so checking these covers them all
        self._paths = {
            rel: resolve_inside(self.dir, rel, source=self.dir / MANIFEST_NAME, what="shard")
            for rel in self.manifest.files
        }
        self._open: dict[str, object] = {}

    def names(self) -> list[str]:
        return list(self.manifest.params)

    def files(self) -> list[Path]:
        """Every file the weights are read from, manifest.json first."""
        return [self.dir / MANIFEST_NAME, *self._paths.values()]

    def _file(self, rel: str):
        if rel not in self._open:
            verify_file(self._paths[rel], self.manifest.files[rel], manifest=self.dir / MANIFEST_NAME)
            self._open[rel] = open_tensors(self._paths[rel])
        return self._open[rel]

    def close(self) -> None:
        """Drop the open shard files (their memory maps): a reader going layer by layer calls it
        between layers, so mapped pages of layers already read do not stay in its memory."""
        self._open.clear()

    def stored_dtype(self, name: str) -> torch.dtype:
        """The dtype of ``name`` as stored."""
        return TORCH_DTYPES[self._spec(name).dtype]

    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """``name`` as stored, copied into ``out`` (of its shape and stored dtype)."""
        return out.copy_(self.full(name))

    def full(self, name: str) -> torch.Tensor:
        """(global shape) tensor of ``name``, chunks placed by their manifest boxes."""
        return self.box(name, Box.full(self._spec(name).shape))

    def box(self, name: str, box: Box) -> torch.Tensor:
        """(box.lengths) piece of ``name`` at ``box`` of the global tensor: only the chunks that overlap
        it are read, and of each only the overlap (a rank reading its own TP shard reads one chunk)."""
        spec = self._spec(name)
        out = None
        for c in spec.chunks:
            part = c.box.intersect(box)
            if part is None:
                continue
            piece = self._file(c.file).get_slice(c.key)[_slices(part, c.box)]
            if part == box:  # one chunk holds the whole box (replicas hold the same values)
                return piece
            if out is None:
                out = torch.empty(box.lengths, dtype=piece.dtype)
            out[_slices(part, box)] = piece
        if out is None:
            raise UserError(
                f"{self.dir / MANIFEST_NAME}: no chunk of {name!r} overlaps {box}; the manifest "
                "does not cover the parameter (copy the checkpoint again)"
            )
        return out

    def _spec(self, name: str):
        spec = self.manifest.params.get(name)
        if spec is None:
            raise UserError(
                f"{self.dir / MANIFEST_NAME}: no parameter {name!r}; the checkpoint is of "
                "another model (check model.* in flow.yaml)"
            )
        return spec


_VERIFIED: set[tuple[str, int, int, str]] = set()  # (path, size, mtime_ns, sha256) checked in this process


def verify_file(path: Path, info, *, manifest: Path) -> None:
    """A shard as its manifest lists it, before a tensor of it is read: present, of its size, of its
    sha256 (as convert checks them); each file once a process. A one-line UserError otherwise."""
    try:
        st = path.stat()
    except OSError:
        raise UserError(f"{path}: listed in {manifest} but missing; copy the checkpoint again (whole)") from None
    key = (str(path), st.st_size, st.st_mtime_ns, info.sha256)
    if key in _VERIFIED:
        return
    if st.st_size != info.size:
        raise UserError(
            f"{path}: {st.st_size:,} bytes, but {manifest} lists {info.size:,}; the file is truncated or "
            "replaced: copy the checkpoint again"
        )
    digest = sha256_file(path)
    if digest != info.sha256:
        raise UserError(
            f"{path}: sha256 {digest[:12]}... but {manifest} lists {info.sha256[:12]}...; the file was "
            "changed after it was saved: copy the checkpoint again"
        )
    _VERIFIED.add(key)


def _slices(part: Box, within: Box) -> tuple[slice, ...]:
    """Index of ``part`` inside a tensor holding ``within`` (both boxes of the same global tensor)."""
    return tuple(slice(o - w, o - w + n) for o, w, n in zip(part.offsets, within.offsets, part.lengths))


class SafetensorsWeights:
    """A unified model dir (ours or Hugging Face): config.json + model*.safetensors (+ index), opened
    and checked by titan_pipe.model.unified_dir, the reader export and convert use too, so a directory
    that ``titan-pipe export`` accepts is one ``init_from`` accepts, with the same errors."""

    def __init__(self, model_dir: Path):
        self.dir = Path(model_dir)
        self._unified = open_unified(self.dir)
        self.args = self._unified.args
        self._maps: dict[Path, mmap.mmap] | None = {}  # None: mapping given up (see mapped)

    def names(self) -> list[str]:
        return list(self._unified.params)

    def files(self) -> list[Path]:
        """Every file the weights are read from: config.json, the index where there is one, the weight files."""
        weights = {part.file for n in self._unified.params for part in self._unified.parts(n)}
        return [self.dir / CONFIG, *([self.dir / INDEX] if (self.dir / INDEX).is_file() else []), *sorted(weights)]

    def full(self, name: str) -> torch.Tensor:
        return self._unified.read(name)

    def stored_dtype(self, name: str) -> torch.dtype:
        """The dtype of ``name`` as stored."""
        return TORCH_DTYPES[self._unified.parts(name)[0].stored.dtype]

    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """``name`` as stored, read into ``out`` (contiguous, of its shape and stored dtype) by plain
        file reads: no memory map, so a reader that refills one buffer layer after layer touches
        no fresh pages (mapping a file again per read faults on each of its pages)."""
        view = memoryview(out.view(-1).view(torch.uint8).numpy())
        pos = 0
        for part in self._unified.parts(name):  # one stored tensor, or one per expert in order
            with open(part.file, "rb", buffering=0) as f:
                f.seek(part.stored.start)
                end = pos + part.stored.nbytes
                while pos < end:
                    got = f.readinto(view[pos:end])
                    if not got:
                        raise UserError(
                            f"{part.file}: ends before tensor {part.key!r} does; the file is truncated (copy it again)"
                        )
                    pos += got
        return out

    def mapped(self, name: str) -> torch.Tensor | None:
        """``name`` as stored, a view of its file's own pages (each file mapped once, private and
        never written; the tensor's pages faulted in by one madvise(MADV_POPULATE_READ) call, not
        one fault per page), or None where it cannot be (a tensor stored in parts, a kernel before
        5.14): then ``read_into``. ``evict`` takes the pages out of this process again; the view
        stays valid (a later read faults them back in from the file)."""
        parts = self._unified.parts(name)
        if len(parts) != 1 or self._maps is None:
            return None
        part = parts[0]
        pages = self._map(part.file)
        try:
            pages.madvise(_POPULATE_READ, *self._span(part))
        except (OSError, ValueError, AttributeError):  # no MADV_POPULATE_READ (or no madvise): plain reads
            self._maps = None
            return None
        dtype = self.stored_dtype(name)
        flat = torch.frombuffer(
            pages, dtype=dtype, count=part.stored.nbytes // dtype.itemsize, offset=part.stored.start
        )
        return flat.view(part.stored.shape)

    def evict(self) -> None:
        """Take every mapped page out of this process (they stay in the page cache): the whole of each
        mapping, since faulting a tensor in also maps the pages around it (the kernel's fault-around)."""
        for m in (self._maps or {}).values():
            m.madvise(mmap.MADV_DONTNEED)

    def _map(self, file: Path) -> mmap.mmap:
        if file not in self._maps:
            with open(file, "rb") as f:
                self._maps[file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return self._maps[file]

    @staticmethod
    def _span(part) -> tuple[int, int]:
        """(start, length) of the whole pages holding the stored tensor (madvise takes pages)."""
        lo = part.stored.start // mmap.PAGESIZE * mmap.PAGESIZE
        hi = -(-(part.stored.start + part.stored.nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE
        return lo, hi - lo

    def box(self, name: str, box: Box) -> torch.Tensor:
        """(box.lengths) piece of ``name``: only that part of the stored tensor is read."""
        return self._unified.read_box(name, box)


class PlannedWeights:
    """Any other format convert reads — a torch DCP / torchtitan step, a Megatron-LM checkpoint —
    through its reader's plan (titan_pipe.weights): each tensor assembled from the stored pieces that
    overlap what is asked (a rank's box reads only those), RoPE rows reordered where the source
    interleaves them. So init_from and evaluate open every checkpoint convert opens."""

    def __init__(self, path: Path):
        self.dir = Path(path)
        self.plan, self.store = open_source(self.dir)
        try:
            self.plan.check()
        except LayoutError as e:
            raise UserError(f"{self.plan.root}: {e}") from None
        self.args = self.plan.args

    def names(self) -> list[str]:
        return list(self.plan.tensors)

    def files(self) -> list[Path]:
        return [self.plan.root / f for f in self.plan.files]

    def _plan(self, name: str):
        t = self.plan.tensors.get(name)
        if t is None:
            raise UserError(f"{self.plan.root}: no tensor {name!r} in this {self.plan.format} checkpoint")
        return t

    def full(self, name: str) -> torch.Tensor:
        return read_global(self._plan(name), self.store)

    def box(self, name: str, box: Box) -> torch.Tensor:
        return read_global(self._plan(name), self.store, box)

    def stored_dtype(self, name: str) -> torch.dtype:
        return TORCH_DTYPES[self._plan(name).dtype]

    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(self.full(name))

    def close(self) -> None:
        self.store.close()


class AdaptedWeights:
    """A LoRA model's parameters, adapters apart (what a model built with the adapters loads: a
    resumed training, evaluate's reference): the frozen base's by their names, the adapters' from a
    LoRA checkpoint (``adapters``) or, starting fresh, their seeded initial values."""

    def __init__(self, base, spec: LoRASpec, *, adapters: CheckpointWeights | None = None, seed: int = 0):
        self.base, self.lora, self.adapters, self.seed = base, spec, adapters, seed
        self.args = base.args
        self.shapes = adapter_shapes(self.args, spec)
        if adapters is not None:
            held = {n: tuple(adapters.manifest.params[n].shape) for n in adapters.names()}
            if held != self.shapes:
                wrong = sorted(set(held.items()) ^ set(self.shapes.items()))[0][0]
                raise UserError(
                    f"{adapters.dir / MANIFEST_NAME}: adapter {wrong!r} does not match its LoRA record "
                    f"(rank {spec.rank}, targets {', '.join(spec.targets)}); copy the checkpoint again"
                )

    def names(self) -> list[str]:
        return self.base.names() + list(self.shapes)

    def adapter(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A, B) of base weight ``name``, None where it has no adapter."""
        if adapter_of(name) not in self.shapes:
            return None
        return self.full(adapter_of(name, "a")), self.full(adapter_of(name, "b"))

    def full(self, name: str) -> torch.Tensor:
        if not is_adapter(name):
            return self.base.full(name)
        if self.adapters is not None:
            return self.adapters.full(name)
        return init_adapter(name, self.shapes[name], self.seed, self.lora.init)

    def stored_dtype(self, name: str) -> torch.dtype:
        return self.full(name).dtype if is_adapter(name) else self.base.stored_dtype(name)

    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(self.full(name))

    def box(self, name: str, box: Box) -> torch.Tensor:
        if not is_adapter(name):
            return self.base.box(name, box)
        return self.full(name)[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths))]


class MergedWeights:
    """A LoRA checkpoint read as the model it deploys: every targeted weight W + (alpha / rank) B A
    (float32 sums rounded once to W's stored dtype), the rest the base's. What ``open_weights`` gives
    for a LoRA checkpoint, so init_from, a sharded forward or any reader that builds no adapters sees
    the fine-tuned model, never the bare base."""

    def __init__(self, adapted: AdaptedWeights):
        self.adapted, self.args, self.lora = adapted, adapted.args, adapted.lora

    def names(self) -> list[str]:
        return self.adapted.base.names()

    def full(self, name: str) -> torch.Tensor:
        w = self.adapted.base.full(name)
        ab = self.adapted.adapter(name)
        return w if ab is None else merge(w, *ab, self.lora.scale)

    def stored_dtype(self, name: str) -> torch.dtype:
        return self.adapted.base.stored_dtype(name)

    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(self.full(name))

    def box(self, name: str, box: Box) -> torch.Tensor:
        w = self.adapted.base.box(name, box)
        ab = self.adapted.adapter(name)
        if ab is None:
            return w
        (r0, c0), (nr, nc) = box.offsets, box.lengths
        return merge(w, ab[0][:, c0 : c0 + nc], ab[1][r0 : r0 + nr], self.lora.scale)


def base_ref(root: Path, paths: list[Path]) -> BaseRef:
    """The record of the base a LoRA training starts from: its directory and every file its weights
    come from (a weight source's ``files()``), with size and sha256."""
    root = Path(root).resolve()
    files = {}
    for f in paths:
        rel = str(f.resolve().relative_to(root))
        files[rel] = (f.stat().st_size, sha256_file(f))
    return BaseRef(str(root), files)


def open_base(ref: BaseRef, *, source: Path):
    """The frozen base a LoRA checkpoint (``source``, its manifest) names, each of its files checked
    against the record (present, of its size and sha256) before a tensor is read."""
    root = Path(ref.path)
    if not root.is_dir():
        raise UserError(
            f"{source}: its adapters were trained on the base model {root}, which is not there; the "
            "checkpoint holds the adapters only: put that model back at that path"
        )
    for rel, (size, digest) in ref.files.items():
        verify_file(root / rel, FileInfo(size, digest), manifest=source)
    return _open_plain(root)


def _open_plain(path: Path):
    if is_complete(path):
        src = CheckpointWeights(path)
        if src.lora_record is not None:
            spec, ref = src.lora_record
            return MergedWeights(AdaptedWeights(open_base(ref, source=path / MANIFEST_NAME), spec, adapters=src))
        return src
    return PlannedWeights(path) if other_format(path) else SafetensorsWeights(path)


def open_adapted(step_dir: Path) -> AdaptedWeights:
    """A LoRA checkpoint with its adapters apart (its base checked and opened); UserError when
    ``step_dir`` holds no adapters."""
    src = CheckpointWeights(step_dir)
    if src.lora_record is None:
        raise UserError(f"{Path(step_dir) / MANIFEST_NAME}: not a LoRA checkpoint (no extra.lora record)")
    spec, ref = src.lora_record
    return AdaptedWeights(open_base(ref, source=Path(step_dir) / MANIFEST_NAME), spec, adapters=src)


def open_weights(path: Path, *, adapters_apart: bool = False) -> WeightSource:
    """Our checkpoint (a step dir with manifest.json; a run dir or its checkpoints/ dir means its
    newest complete step), a dir of safetensors + config.json (unified or Hugging Face), or a torch DCP /
    torchtitan or Megatron-LM checkpoint (read through its plan, PlannedWeights). A LoRA checkpoint reads
    as its merged model (MergedWeights), or with ``adapters_apart`` as its base and adapters
    (AdaptedWeights: a reader that applies the adapters itself, as training did)."""
    path = complete_step(path) or Path(path)
    if not (is_complete(path) or other_format(path) or (path / "config.json").is_file()):
        raise UserError(
            f"init_from: {path} is neither a titan-pipe checkpoint (no {MANIFEST_NAME}), a model dir (no "
            "config.json), a torch DCP / torchtitan step (no .metadata) nor a Megatron-LM checkpoint; point it "
            "at checkpoints/step-XXXXXX, a unified or Hugging Face dir, or one of those"
        )
    src = _open_plain(path)
    return src.adapted if adapters_apart and isinstance(src, MergedWeights) else src


def check_compatible(source_args: ModelArgs, args: ModelArgs, source: Path) -> None:
    """The model in flow.yaml must have the shapes of the weights it starts from."""
    diffs = model_differences(source_args, args, keys=SHAPE_KEYS, labels=("there", "in flow.yaml"))
    if diffs:
        raise UserError(
            f"init_from: {source} holds another model shape ({'; '.join(diffs)}); set model.* in flow.yaml to match it"
        )
