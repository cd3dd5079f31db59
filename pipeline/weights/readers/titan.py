"""Reader for titan-pipe's own checkpoints: manifest.json + the shard files its chunks name.

Everything comes from the manifest (docs/checkpoint-format.md): global shapes, dtypes and the box
each chunk fills. The reader checks the manifest against the files (present, sizes, keys, shapes)
before anything is copied; sha256s are checked while the conversion streams (convert/hashing.py).
"""

from __future__ import annotations

from pathlib import Path

from titan_pipe.records.checkpoint_format import MANIFEST_NAME, Box, Manifest, newest_complete, open_checkpoint
from titan_pipe.weights.readers.store import SafetensorsStore
from titan_pipe.io.safetensors_io import read_header
from titan_pipe.weights.source_plan import Read, SourcePlan, TensorPlan, check_accounted
from titan_pipe.errors import UserError
from titan_pipe.model.args import ModelArgs, check_fits
from titan_pipe.model.params import native_names
from titan_pipe.io.paths import resolve_inside

FORMAT = "titan"


def looks_like(path: Path) -> bool:
    return (path / MANIFEST_NAME).is_file() or newest_complete(path) is not None


def resolve(path: Path) -> Path:
    if (path / MANIFEST_NAME).is_file():
        return path
    found = newest_complete(path)
    if found is None:
        raise UserError(
            f"{path}: no {MANIFEST_NAME} here (nor a complete step-XXXXXX checkpoint "
            "under it); the checkpoint is incomplete or not a titan-pipe checkpoint"
        )
    return found


def describe_split(tp_dim: int | None, n_chunks: int) -> str:
    return "replicated" if tp_dim is None or n_chunks <= 1 else f"dim {tp_dim} in {n_chunks}"


def _accounted(mpath: Path, m: Manifest, args: ModelArgs) -> list[str]:
    """The model's parameter names, once the manifest's files are known to hold that many
    parameters, the manifest lists each of them, and it lists nothing else."""
    check_fits(args, sum(info.size for info in m.files.values()), source=mpath, where="its shard files")
    names = native_names(args)
    missing = [n for n in names if n not in m.params]
    if missing:
        raise UserError(
            f"{mpath}: parameters {missing[:3]} ({len(missing)} in all) are missing; "
            "the manifest does not describe a whole model"
        )
    check_accounted(m.params, args, source=mpath)
    return names


def open_source(
    path: Path, *, vocab_size: int | None = None, model_config: Path | None = None, read_headers: bool = True
) -> tuple[SourcePlan, SafetensorsStore]:
    root = resolve(path)
    mpath = root / MANIFEST_NAME
    m = open_checkpoint(root)
    args = ModelArgs.from_dict(m.model, source=mpath)
    if vocab_size is not None and vocab_size != args.vocab_size:
        raise UserError(
            f"--vocab-size {vocab_size} disagrees with {mpath} (vocab_size "
            f"{args.vocab_size}); drop --vocab-size for titan-pipe checkpoints"
        )
    store = SafetensorsStore(root)
    for name, info in sorted(m.files.items()):
        f = resolve_inside(root, name, source=mpath, what="shard")
        if not f.is_file():
            raise UserError(f"{f}: missing shard (listed in {mpath}); copy the complete checkpoint")
        size = f.stat().st_size
        if size != info.size:
            raise UserError(
                f"{f}: {size} bytes but {mpath} says {info.size}; the shard is truncated or was replaced. Copy it again"
            )
        if read_headers:
            store.headers[name] = read_header(f)[0]
    names = _accounted(mpath, m, args)
    tensors = {}
    for name in names:
        p = m.params[name]
        reads, seen = [], set()
        for c in p.chunks:
            if c.box in seen:
                continue  # a replica (e.g. a norm in every tp rank's file): read it once
            seen.add(c.box)
            if read_headers:
                st = store.stored(c.file, c.key)
                if st.shape != c.box.lengths or st.dtype != p.dtype:
                    raise UserError(
                        f"{root / c.file}: tensor {c.key!r} is {st.dtype} {list(st.shape)} "
                        f"but {mpath} says {p.dtype} {list(c.box.lengths)}; the shard does "
                        "not belong to this manifest"
                    )
            reads.append(Read(c.file, c.key, Box.full(c.box.lengths), c.box))
        tensors[name] = TensorPlan(name, tuple(p.shape), p.dtype, tuple(reads), describe_split(p.tp_dim, len(reads)))
    par = m.parallel
    plan = SourcePlan(
        FORMAT,
        root,
        args,
        tensors,
        files=sorted(m.files),
        step=m.step,
        layout={"dp": par.dp, "tp": par.tp, "pp": par.pp, "pp_schedule": par.pp_schedule},
        pp_schedule=par.pp_schedule,
        expected_sha256={k: v.sha256 for k, v in m.files.items()},
    )
    return plan, store
