"""The conversion plan as pure data: for each output tensor, which boxes of which stored tensors fill it.

Every reader turns its source format into a ``SourcePlan``: global tensors (native names, global
shapes) each with ``Read``s, a read copying one box of a *stored* tensor (a shard, a fused
Megatron tensor, a DCP chunk) to one box of the global tensor. A read is a translation of a box,
optionally with the rows of each attention head reordered (Meta/torchtitan interleaved RoPE pairs
-> Hugging Face rotate-half). Fused QKV, fused gate/up, padded vocabularies and pipeline layer
offsets are all just reads with the right boxes.

``plan_unified`` and ``plan_sharded`` then say which output file and key receives which *region*
of each global tensor. Nothing here touches a file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from titan_pipe.records.checkpoint_format import Box, LayoutError, shard_file, split_box
from titan_pipe.rules.choices import NAMINGS
from titan_pipe.rules.dtypes import DTYPE_SIZES, OUT_DTYPES
from titan_pipe.model import features
from titan_pipe.model.args import ModelArgs
from titan_pipe.errors import UserError
from titan_pipe.model.families import family_of
from titan_pipe.model.names import hf_expert_key, native_to_hf
from titan_pipe.model.params import native_names, param_of
from titan_pipe.model.sharding import split_stages, stage_of, tp_problems, tp_split_dim
from titan_pipe.model.unified_dir import weight_file_name


@dataclass(frozen=True)
class Read:
    """Copy ``src_box`` of stored tensor ``file``/``key`` onto ``dst_box`` of the global tensor.

    ``rope_head_dim``: the rows of the source box are whole attention heads of this size in
    interleaved (Meta) RoPE order; they land in rotate-half order (row 2i -> i, 2i+1 -> hd/2 + i).
    """

    file: str
    key: str
    src_box: Box
    dst_box: Box
    rope_head_dim: int | None = None

    def clip(self, region: Box) -> "Read | None":
        """This read restricted to the part of ``dst_box`` inside ``region`` (global coordinates)."""
        hit = self.dst_box.intersect(region)
        if hit is None:
            return None
        if hit == self.dst_box:
            return self
        if self.rope_head_dim and (hit.offsets[0] - self.dst_box.offsets[0]) % self.rope_head_dim:
            raise LayoutError(
                f"{self.key}: a region boundary at row {hit.offsets[0]} cuts an "
                f"attention head of {self.rope_head_dim} rows"
            )
        shift = [s - d for s, d in zip(self.src_box.offsets, self.dst_box.offsets)]
        src = Box(tuple(o + s for o, s in zip(hit.offsets, shift)), hit.lengths)
        return Read(self.file, self.key, src, hit, self.rope_head_dim)


@dataclass(frozen=True)
class TensorPlan:
    """One global tensor (native name) and the reads that fill it exactly once; ``delta``: a
    low-rank term added as it is written (a LoRA merge)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name of the stored data
    reads: tuple[Read, ...]
    split: str = "replicated"  # how the source holds it, for inspect: "dim 0 over tp=2", "fused qkv" ...
    delta: "LowRank | None" = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]

    def check_coverage(self) -> None:
        """Every element written exactly once; replicas (equal dst boxes) must be dropped before."""
        total = math.prod(self.shape)
        for i, r in enumerate(self.reads):
            if not r.dst_box.within(self.shape):
                raise LayoutError(f"{self.name}: {r.file}:{r.key} box {r.dst_box} lies outside shape {self.shape}")
            for other in self.reads[:i]:
                if r.dst_box.intersect(other.dst_box) is not None:
                    raise LayoutError(
                        f"{self.name}: {other.file} and {r.file} claim overlapping "
                        f"boxes {other.dst_box} and {r.dst_box}"
                    )
        covered = sum(r.dst_box.numel for r in self.reads)
        if covered != total:
            raise LayoutError(
                f"{self.name}: the shards cover {covered} of {total} elements; a shard or chunk is missing"
            )


@dataclass(frozen=True)
class LowRank:
    """``scale * B A`` added to a (out, in) tensor as it is written: LoRA's merge, W + (alpha / rank)
    B A. ``a`` (rank, in) and ``b`` (out, rank) are tensors of the same source, read by their plans
    (small: rank rows or columns); the sum is taken in float32 and rounded once to the output dtype."""

    a: TensorPlan
    b: TensorPlan
    scale: float


@dataclass
class SourcePlan:
    """A whole source checkpoint as global tensors; the common language of all readers."""

    format: str  # titan | dcp | megatron | hf
    root: Path
    args: ModelArgs
    tensors: dict[str, TensorPlan]  # native name -> plan, in model order
    files: list[str]  # every data file the plan reads, relative to root
    step: int | None = None
    layout: dict = field(
        default_factory=dict
    )  # a description of the source's layout for inspect and provenance only; no code reads it
    pp_schedule: str | None = None  # the pipeline schedule a titan source was trained with (a sharded output keeps it)
    expected_sha256: dict[str, str] = field(default_factory=dict)  # file -> sha256 (titan manifest)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def check(self) -> None:
        for t in self.tensors.values():
            t.check_coverage()


@dataclass(frozen=True)
class OutTensor:
    """Output key ``key`` of file receives ``region`` of global tensor ``source`` as ``dtype``."""

    key: str
    source: TensorPlan
    region: Box
    dtype: str
    # The shape the file records, when it drops the region's leading 1: one expert's (h, d) slice
    # of a stacked (E, h, d) tensor is stored as a tensor of its own (the same bytes).
    stored_shape: tuple[int, ...] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.region.lengths

    @property
    def nbytes(self) -> int:
        return self.region.numel * DTYPE_SIZES[self.dtype]

    def reads(self) -> list[Read]:
        """The source reads clipped to the region, with dst boxes made relative to the region."""
        out = []
        for r in self.source.reads:
            c = r.clip(self.region)
            if c is None:
                continue
            rel = Box(tuple(o - ro for o, ro in zip(c.dst_box.offsets, self.region.offsets)), c.dst_box.lengths)
            out.append(Read(c.file, c.key, c.src_box, rel, c.rope_head_dim))
        return out


@dataclass(frozen=True)
class OutFile:
    name: str  # relative to the output directory
    tensors: tuple[OutTensor, ...]
    stage: int | None = None  # the pipeline stage a sharded output's file holds (None: unified)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class OutputPlan:
    kind: str  # "unified" | "sharded"
    files: tuple[OutFile, ...]
    tp: int = 1
    pp: int = 1
    stages: tuple[tuple[int, ...], ...] = ()


def check_accounted(found, args: ModelArgs, *, source: object, describe=repr) -> None:
    """Every tensor a source holds (``found``: native names) has a place in the model ``args``
    describes; one that has none (a layer past n_layers, a parameter the model lacks) is refused,
    naming it as stored (``describe(name)``), never skipped. A tied model may store output.weight."""
    names = set(native_names(args)) | set(features.shared(args))
    extra = sorted(n for n in found if n not in names)
    if extra:
        raise UserError(
            f"{source}: tensor {describe(extra[0])} ({len(extra)} in all) has no place in the model its "
            f"config describes ({args.n_layers} layers, dim {args.dim}); fix the config (layer "
            "count, dims) to describe the weights, or remove the tensor"
        )


def output_dtype(src_dtype: str, dtype: str) -> str:
    if dtype == "keep":
        return src_dtype
    if dtype not in OUT_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of keep, {', '.join(OUT_DTYPES)}")
    return OUT_DTYPES[dtype]


def _unified_tensors(src: SourcePlan) -> list[TensorPlan]:
    """The tensors a unified model holds: a shared one (a tied output matrix is the embedding) is left out."""
    shared = features.shared(src.args)
    return [t for n, t in src.tensors.items() if n not in shared]


def plan_unified(
    src: SourcePlan, *, naming: str = "hf", dtype: str = "keep", max_shard_size: int = 5 * 10**9
) -> OutputPlan:
    """One model.safetensors, or model-0000k-of-0000n.safetensors when past ``max_shard_size``.

    Shards are filled greedily in model order (as transformers' save_pretrained does); a tensor
    larger than the limit gets a file of its own.
    """
    if naming not in NAMINGS:
        raise ValueError(f"naming {naming!r} is not one of {', '.join(NAMINGS)}")
    family = family_of(src.args).model_type if naming == "hf" else None
    outs = []
    for t in _unified_tensors(src):
        if naming == "hf" and param_of(t.name).expert:  # one tensor per expert, as transformers stores them
            outs += [
                OutTensor(
                    hf_expert_key(t.name, e, family),
                    t,
                    split_box(t.shape, 0, t.shape[0], e),
                    output_dtype(t.dtype, dtype),
                    stored_shape=tuple(t.shape[1:]),
                )
                for e in range(t.shape[0])
            ]
        else:
            outs.append(
                OutTensor(
                    native_to_hf(t.name, family) if naming == "hf" else t.name,
                    t,
                    Box.full(t.shape),
                    output_dtype(t.dtype, dtype),
                )
            )
    groups: list[list[OutTensor]] = [[]]
    size = 0
    for o in outs:
        if groups[-1] and size + o.nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(o)
        size += o.nbytes
    if len(groups) == 1:
        return OutputPlan("unified", (OutFile(weight_file_name(0, 1), tuple(groups[0])),))
    n = len(groups)
    return OutputPlan("unified", tuple(OutFile(weight_file_name(k, n), tuple(g)) for k, g in enumerate(groups)))


def plan_sharded(src: SourcePlan, *, tp: int, pp: int, dtype: str = "keep") -> OutputPlan:
    """Our own checkpoint layout: titan_pipe.records.checkpoint_format.shard_file names, native keys, local tensors.

    Split dims come from the sharding table (titan_pipe.model.sharding), stages from split_stages, as
    the trainer does; replicated tensors (norms) sit in every tp rank's file of their stage, so
    each rank can load its own file alone.
    """
    args = src.args
    if tp < 1 or pp < 1:
        raise ValueError(f"--tp {tp} --pp {pp}: both must be >= 1")
    problems = tp_problems(args, tp)
    if problems:
        raise ValueError(f"--tp {tp} {problems[0]}")
    stages = split_stages(args.n_layers, pp)  # raises ValueError naming the numbers
    files = []
    for s in range(pp):
        for r in range(tp):
            outs = []
            for t in _unified_tensors(src):
                if stage_of(t.name, stages) != s:
                    continue
                region = split_box(t.shape, tp_split_dim(t.name), tp, r)
                outs.append(OutTensor(t.name, t, region, output_dtype(t.dtype, dtype)))
            files.append(OutFile(shard_file(s, r), tuple(outs), stage=s))
    return OutputPlan("sharded", tuple(files), tp=tp, pp=pp, stages=tuple(tuple(x) for x in stages))
