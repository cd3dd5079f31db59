"""The checkpoint format: boxes, chunks, parameter specs, the manifest, and the step dirs that hold them.

A *box* is (offsets, lengths) in a tensor's global coordinates, as in torch.distributed.checkpoint's
metadata. A checkpoint is a set of parameters, each with a global shape and dtype and a list of
chunks; a chunk says which file and key hold which box. Nothing here reads tensor data.

A run's checkpoints are ``step-XXXXXX`` directories; one is complete once its manifest.json
(written last) exists, and ``newest_complete`` is the one place that picks the checkpoint to read.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from titan_pipe.rules import limits
from titan_pipe.rules.choices import PP_SCHEDULES
from titan_pipe.errors import UserError
from titan_pipe.tokens.model_files import token_ids
from titan_pipe.rules.limits import Bound, shown
from titan_pipe.rules.mesh_math import world_size
from titan_pipe.rules.values import BOOL, DICT, INT, STR, check, read, refuse

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "titan-pipe-checkpoint"
FORMAT_VERSION = 1
STEP_DIR = re.compile(r"^step-(\d{6,})$")


class LayoutError(UserError, ValueError):
    """A checkpoint whose layout is inconsistent (overlap, gap, shape mismatch...): bad input, so a
    UserError (one line, exit 1); a ValueError too, for the planners that raise it on bad numbers."""


def shard_file(stage: int, tp_rank: int, ep_rank: int | None = None) -> str:
    """The shard file of pipeline stage ``stage`` and tensor-parallel rank ``tp_rank`` (with
    ``ep_rank``: the experts that expert-parallel rank holds), relative to the step dir; the trainer
    and convert's sharded output both name files with it. Readers never parse a name back: the
    manifest's chunks say which file holds what, its params which stage owns it."""
    return f"model/pp{stage}-tp{tp_rank}" + ("" if ep_rank is None else f"-ep{ep_rank}") + ".safetensors"


@dataclass(frozen=True)
class Box:
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "offsets", tuple(int(o) for o in self.offsets))
        object.__setattr__(self, "lengths", tuple(int(n) for n in self.lengths))
        if len(self.offsets) != len(self.lengths):
            raise LayoutError(f"box offsets {self.offsets} and lengths {self.lengths} differ in rank")

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    def intersect(self, other: "Box") -> "Box | None":
        offs, lens = [], []
        for o1, n1, o2, n2 in zip(self.offsets, self.lengths, other.offsets, other.lengths):
            lo, hi = max(o1, o2), min(o1 + n1, o2 + n2)
            if hi <= lo:
                return None
            offs.append(lo)
            lens.append(hi - lo)
        return Box(tuple(offs), tuple(lens))

    def within(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == len(self.offsets) and all(
            o >= 0 and n >= 0 and o + n <= s for o, n, s in zip(self.offsets, self.lengths, shape)
        )

    @staticmethod
    def full(shape: tuple[int, ...]) -> "Box":
        return Box(tuple(0 for _ in shape), tuple(shape))


def split_box(shape: tuple[int, ...], dim: int | None, n: int, i: int) -> Box:
    """The i-th of n equal pieces of a tensor along ``dim`` (dim None: the whole tensor)."""
    if dim is None:
        return Box.full(shape)
    if shape[dim] % n:
        raise LayoutError(f"dim {dim} of shape {tuple(shape)} does not divide into {n} equal parts")
    step = shape[dim] // n
    offs = [0] * len(shape)
    lens = list(shape)
    offs[dim], lens[dim] = i * step, step
    return Box(tuple(offs), tuple(lens))


# A manifest's numbers size what readers plan and allocate: typed strictly, bounded (titan_pipe.rules.values).
DIM_SIZE = Bound(0, 2**40, "one dimension of one tensor")
_MALFORMED = "the manifest holds a malformed value; copy the checkpoint again"
FILE_BYTES = Bound(0, 2**50, "one shard file")
STEP = Bound(0, 2**40, "a training step")


def _list(values: object, source: str, key: str, most: int = 2**16) -> list:
    """``values`` as a list of at most ``most`` items (None: empty); UserError naming it otherwise."""
    values = [] if values is None else values
    if not isinstance(values, list) or len(values) > most:
        raise UserError(
            f"{source}: {key} = {shown(values)} is not a list of at most {most} items; "
            "the manifest is corrupted. Copy the checkpoint again"
        )
    return values


def _dims(values: object, source: str, key: str, most: int = 8) -> tuple[int, ...]:
    """A list of non-negative integers (a shape, a box's offsets or lengths, layer ids), typed strictly."""
    return tuple(check(v, INT, source=source, key=key, bound=DIM_SIZE) for v in _list(values, source, key, most))


def _opt_int(value: object, source: str, key: str) -> int | None:
    return None if value is None else check(value, INT, source=source, key=key, bound=DIM_SIZE)


@dataclass(frozen=True)
class Chunk:
    file: str  # relative to the checkpoint directory
    key: str  # tensor name inside that file
    box: Box


@dataclass
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name: F32, BF16, F16 ...
    tp_dim: int | None = None  # split dim under TP, from titan_pipe.model.sharding (None: replicated)
    stage: int | None = None  # pipeline stage that owns it
    chunks: list[Chunk] = field(default_factory=list)

    def check_coverage(self) -> None:
        """Every element covered exactly once (replicas with identical boxes count once)."""
        total = math.prod(self.shape)
        distinct: list[Box] = []
        for c in self.chunks:
            if not c.box.within(self.shape):
                raise LayoutError(f"{self.name}: chunk {c.file}:{c.key} box {c.box} lies outside shape {self.shape}")
            if c.box in distinct:
                continue
            for other in distinct:
                if c.box.intersect(other) is not None:
                    raise LayoutError(
                        f"{self.name}: two chunks claim overlapping boxes {other} and {c.box} (second in {c.file})"
                    )
            distinct.append(c.box)
        covered = sum(b.numel for b in distinct)
        if covered != total:
            raise LayoutError(f"{self.name}: chunks cover {covered} of {total} elements; a shard is missing")


@dataclass
class FileInfo:
    size: int
    sha256: str


@dataclass(frozen=True)
class ParallelLayout:
    """The rank layout a checkpoint was written under (manifest ``parallel``): dp x tp x pp ranks,
    the pipeline schedule, the layer ids of each (virtual) pipeline stage and the pp rank running
    it. The trainer writes every field, convert's sharded output the layout it produced; older
    manifests may hold only dp/tp/pp (+ pp_schedule): the defaults below are the one reading of
    what is absent."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    stages: tuple[tuple[int, ...], ...] = ()
    stage_ranks: tuple[int, ...] = ()
    sequence_parallel: bool = False
    dp_mode: str | None = None
    dp_kind: str | None = None
    ep: int = 1  # expert parallelism (a mixture of experts' experts over ep of the dp ranks)

    @property
    def world_size(self) -> int:
        return world_size(self.dp, self.tp, self.pp)

    @property
    def n_stages(self) -> int:
        """Pipeline stages in all (interleaved schedules: virtual stages x pp)."""
        return len(self.stages) or self.pp

    @property
    def virtual_stages(self) -> int:
        return max(1, self.n_stages // self.pp)

    def to_dict(self) -> dict:
        d = {
            "dp": self.dp,
            "tp": self.tp,
            "pp": self.pp,
            "pp_schedule": self.pp_schedule,
            "n_stages": self.n_stages,
            "stages": [list(s) for s in self.stages],
            "stage_ranks": list(self.stage_ranks),
            "sequence_parallel": self.sequence_parallel,
        }
        d.update({k: v for k, v in (("dp_mode", self.dp_mode), ("dp_kind", self.dp_kind)) if v is not None})
        if self.ep != 1:
            d["ep"] = self.ep
        return d

    @classmethod
    def from_dict(cls, d: dict, *, source: str = MANIFEST_NAME) -> "ParallelLayout":
        """The layout of a manifest's ``parallel`` object; LayoutError naming the field otherwise."""
        if not isinstance(d, dict):
            raise LayoutError(f"{source}: 'parallel' is a {type(d).__name__}, not an object")
        # Every value typed strictly and bounded (titan_pipe.rules.values): "2" is no tp, 0 no pp.
        kw = dict(source=source, prefix="parallel.", exc=LayoutError, fix=_MALFORMED)
        sizes = {k: read(d, k, INT, default=1, bound=limits.PARALLEL, **kw) for k in ("dp", "tp", "pp")}
        schedule = read(d, "pp_schedule", STR, default="1f1b", **kw)
        if schedule not in PP_SCHEDULES:
            raise refuse(
                source,
                "parallel.pp_schedule",
                schedule,
                f"is not one of {', '.join(PP_SCHEDULES)}",
                _MALFORMED,
                exc=LayoutError,
            )
        layers = int(limits.LAYERS.hi)
        stages = tuple(
            _dims(s, source, "parallel.stages", most=layers)
            for s in _list(d.get("stages"), source, "parallel.stages", most=layers)
        )
        return cls(
            **sizes,
            pp_schedule=schedule,
            stages=stages,
            stage_ranks=_dims(d.get("stage_ranks") or [], source, "parallel.stage_ranks", most=2**16),
            sequence_parallel=read(d, "sequence_parallel", BOOL, default=False, **kw),
            dp_mode=read(d, "dp_mode", STR, default=None, **kw),
            dp_kind=read(d, "dp_kind", STR, default=None, **kw),
            ep=read(d, "ep", INT, default=1, bound=limits.PARALLEL, **kw),
        )


@dataclass
class Manifest:
    """The contents of manifest.json (docs/checkpoint-format.md)."""

    step: int
    model: dict  # ModelArgs.to_dict()
    parallel: ParallelLayout
    params: dict[str, ParamSpec]
    files: dict[str, FileInfo]
    extra: "CheckpointExtra" = field(default_factory=lambda: CheckpointExtra())
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        d = {
            "format": self.format,
            "format_version": self.format_version,
            "step": self.step,
            "model": self.model,
            "parallel": self.parallel.to_dict(),
            "files": {k: asdict(v) for k, v in sorted(self.files.items())},
            "params": {
                name: {
                    "shape": list(p.shape),
                    "dtype": p.dtype,
                    "tp_dim": p.tp_dim,
                    "stage": p.stage,
                    "chunks": [
                        {"file": c.file, "key": c.key, "offsets": list(c.box.offsets), "lengths": list(c.box.lengths)}
                        for c in p.chunks
                    ],
                }
                for name, p in self.params.items()
            },
            "extra": self.extra.to_dict(),
        }
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str, *, source: str = MANIFEST_NAME) -> "Manifest":
        try:
            d = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            raise LayoutError(f"{source}: not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise LayoutError(f"{source}: holds a JSON {type(d).__name__}, not the manifest object")
        if d.get("format") != FORMAT_NAME:
            raise LayoutError(f"{source}: format is {d.get('format')!r}, expected {FORMAT_NAME!r}")
        if check(d.get("format_version", 0), INT, source=source, key="format_version") > FORMAT_VERSION:
            raise LayoutError(
                f"{source}: format_version {d['format_version']} is newer than this "
                f"titan-pipe reads ({FORMAT_VERSION}); upgrade titan-pipe"
            )
        try:
            params = {
                name: ParamSpec(
                    name=name,
                    shape=_dims(p["shape"], source, f"params.{name}.shape"),
                    dtype=check(p["dtype"], STR, source=source, key=f"params.{name}.dtype"),
                    tp_dim=_opt_int(p.get("tp_dim"), source, f"params.{name}.tp_dim"),
                    stage=_opt_int(p.get("stage"), source, f"params.{name}.stage"),
                    chunks=[
                        Chunk(
                            check(c["file"], STR, source=source, key=f"params.{name}.chunks.file"),
                            check(c["key"], STR, source=source, key=f"params.{name}.chunks.key"),
                            Box(
                                _dims(c["offsets"], source, f"params.{name}.chunks.offsets"),
                                _dims(c["lengths"], source, f"params.{name}.chunks.lengths"),
                            ),
                        )
                        for c in p["chunks"]
                    ],
                )
                for name, p in check(d["params"], DICT, source=source, key="params").items()
            }
            files = {
                k: FileInfo(
                    size=check(v["size"], INT, source=source, key=f"files.{k}.size", bound=FILE_BYTES),
                    sha256=check(v["sha256"], STR, source=source, key=f"files.{k}.sha256"),
                )
                for k, v in check(d["files"], DICT, source=source, key="files").items()
            }
            return cls(
                step=check(d["step"], INT, source=source, key="step", bound=STEP),
                model=d["model"],
                parallel=ParallelLayout.from_dict(d["parallel"], source=source),
                params=params,
                files=files,
                extra=CheckpointExtra.from_dict(d.get("extra", {}), source=source),
                format=d["format"],
                format_version=d["format_version"],
            )
        except (KeyError, TypeError) as e:
            raise LayoutError(f"{source}: missing or malformed field {e}") from None

    @classmethod
    def load(cls, ckpt_dir: str | Path) -> "Manifest":
        path = Path(ckpt_dir) / MANIFEST_NAME
        if not path.is_file():
            raise LayoutError(f"{path}: no manifest; the checkpoint is incomplete or not a titan-pipe checkpoint")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise LayoutError(f"{path}: not UTF-8 JSON (byte {e.start}); copy the checkpoint again") from None
        return cls.from_json(text, source=str(path))

    def validate(self) -> None:
        owner: dict[tuple[str, str], tuple[str, object]] = {}  # (file, key) -> the piece it stores
        for p in self.params.values():
            p.check_coverage()
            for c in p.chunks:
                if c.file not in self.files:
                    raise LayoutError(f"{p.name}: chunk file {c.file!r} is not listed in 'files'")
                # one stored tensor is one piece of one parameter: two pieces read from it would put
                # the same values in two places (an expert duplicated, another lost), shapes agreeing
                first = owner.setdefault((c.file, c.key), (p.name, c.box))
                if first != (p.name, c.box):
                    raise LayoutError(
                        f"{p.name}: its chunk at {list(c.box.offsets)} reads {c.key!r} of {c.file}, "
                        f"which already holds {first[0]} at {list(first[1].offsets)}; each stored "
                        "tensor holds one piece of one parameter: the manifest is damaged, copy the "
                        "checkpoint again"
                    )


# fp32 copies of each parameter an optimizer's saved state holds (AdamW: two moments; SGD without
# momentum: none); the weights themselves are one more (fp32 masters under AMP too)
OPTIMIZER_STATE_COPIES = {"adamw": 2, "sgd": 0}


def checkpoint_bytes(n_params: int, *, optimizer: str, save_optimizer: bool) -> int:
    """About what one checkpoint of ``n_params`` parameters takes on disk: the fp32 weights, plus the
    optimizer's fp32 state when it is saved (manifest, train state and tokenizer are kilobytes)."""
    return 4 * n_params * (1 + (OPTIMIZER_STATE_COPIES[optimizer] if save_optimizer else 0))


def is_save_step(step: int, *, steps: int, every: int) -> bool:
    """Whether a run of ``steps`` steps saves a checkpoint after ``step``: every ``every`` steps and the last."""
    return step % every == 0 or step == steps


def checkpoints_written(steps: int, every: int, start: int = 0) -> int:
    """How many of the steps after ``start`` up to ``steps`` are save steps (``is_save_step``), counted
    without walking them."""
    if steps <= start:
        return 0
    return steps // every - start // every + (1 if steps % every else 0)


def step_dir_name(step: int) -> str:
    """The directory name of the checkpoint of ``step``: step-000100."""
    return f"step-{step:06d}"


def is_complete(step_dir: Path) -> bool:
    return (Path(step_dir) / MANIFEST_NAME).is_file()


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of the step-XXXXXX dirs directly under ``root`` (complete or not), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name)))


def complete_step(path: Path) -> Path | None:
    """``path`` itself when it is a complete step dir, else the newest complete step of the run dir
    (or checkpoints dir) it names; None when there is none."""
    path = Path(path)
    return path if is_complete(path) else newest_complete(path)


def newest_complete(run_or_ckpt_dir: Path, *, warn: bool = False) -> Path | None:
    """The newest complete step dir of a run dir (its checkpoints/) or of a dir of step dirs.

    Newer step dirs without a manifest (a run killed while writing them) are skipped; ``warn``
    says so with a warning. None when there is no complete checkpoint.
    """
    path = Path(run_or_ckpt_dir)
    for base in (path / "checkpoints", path):
        for _, step_dir in reversed(step_dirs(base)):
            if is_complete(step_dir):
                return step_dir
            if warn:
                warnings.warn(f"{step_dir}: no {MANIFEST_NAME} (interrupted while saving); ignoring it", stacklevel=2)
    return None


@dataclass(frozen=True)
class CheckpointExtra:
    """The manifest's ``extra``: what a checkpoint holds besides the weights, typed where it is read.

    ``optimizer``/``train_state``: names of the optimizer DCP dir and train state file in the step
    dir (None: not saved); ``kernels``: the model.kernels set it was trained with; ``tokenizer``:
    "byte" or the name of an attached tokenizer file; ``attached``: files copied into the step dir
    (name -> size, sha256); ``converted_from``: {format, path} of a converted source. Keys this
    version does not know are kept in ``other`` and written back as they were."""

    optimizer: str | None = None
    train_state: str | None = None
    kernels: str | None = None
    tokenizer: str | None = None
    attached: dict[str, FileInfo] = field(default_factory=dict)
    converted_from: dict[str, str] | None = None
    token_ids: dict | None = None  # config.json's bos/eos/pad ids of the model (titan_pipe.tokens.model_files)
    other: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = {
            k: v
            for k, v in (
                ("optimizer", self.optimizer),
                ("train_state", self.train_state),
                ("kernels", self.kernels),
                ("tokenizer", self.tokenizer),
                ("converted_from", self.converted_from),
                ("token_ids", self.token_ids),
            )
            if v is not None or k == "optimizer"
        }
        if self.attached:
            d["attached"] = {k: asdict(v) for k, v in sorted(self.attached.items())}
        return {**self.other, **d}

    @classmethod
    def from_dict(cls, value: object, *, source: str = MANIFEST_NAME) -> "CheckpointExtra":
        """The typed record of a manifest's ``extra``; LayoutError naming the key otherwise."""
        extra = dict(check(value, DICT, source=source, key="extra", exc=LayoutError, fix=_MALFORMED))
        kw = dict(source=source, prefix="extra.", exc=LayoutError, fix=_MALFORMED)
        strings = {
            k: read(extra, k, STR, default=None, **kw) for k in ("optimizer", "train_state", "kernels", "tokenizer")
        }
        attached = {}
        for name, entry in check(
            extra.get("attached") or {}, DICT, source=source, key="extra.attached", exc=LayoutError, fix=_MALFORMED
        ).items():
            entry = check(entry, DICT, source=source, key=f"extra.attached.{name}", exc=LayoutError, fix=_MALFORMED)
            attached[name] = FileInfo(
                size=check(
                    entry.get("size"),
                    INT,
                    source=source,
                    key=f"extra.attached.{name}.size",
                    bound=FILE_BYTES,
                    exc=LayoutError,
                    fix=_MALFORMED,
                ),
                sha256=check(
                    entry.get("sha256"),
                    STR,
                    source=source,
                    key=f"extra.attached.{name}.sha256",
                    exc=LayoutError,
                    fix=_MALFORMED,
                ),
            )
        origin = extra.get("converted_from")
        if origin is not None:
            origin = {
                k: check(v, STR, source=source, key=f"extra.converted_from.{k}", exc=LayoutError, fix=_MALFORMED)
                for k, v in check(
                    origin, DICT, source=source, key="extra.converted_from", exc=LayoutError, fix=_MALFORMED
                ).items()
            }
        ids = extra.get("token_ids")
        if ids is not None:
            try:
                ids = token_ids(
                    check(ids, DICT, source=source, key="extra.token_ids", exc=LayoutError, fix=_MALFORMED),
                    source=f"{source}: extra.token_ids",
                )
            except UserError as e:
                raise LayoutError(str(e)) from None
        known = ("optimizer", "train_state", "kernels", "tokenizer", "attached", "converted_from", "token_ids")
        return cls(
            **strings,
            attached=attached,
            converted_from=origin,
            token_ids=ids,
            other={k: v for k, v in extra.items() if k not in known},
        )


def open_checkpoint(step_dir: str | Path) -> Manifest:
    """The manifest of a complete step dir, loaded and validated (every chunk inside its tensor,
    covered once, in a listed file): what every reader of a checkpoint's tensors starts from
    (init_from/resume, convert's titan reader, evaluate's sharded side). LayoutError (a UserError)
    naming the manifest otherwise."""
    m = Manifest.load(step_dir)
    try:
        m.validate()
    except LayoutError as e:
        raise LayoutError(f"{Path(step_dir) / MANIFEST_NAME}: {e}") from None
    return m
