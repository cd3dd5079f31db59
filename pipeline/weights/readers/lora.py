"""Reader for a LoRA checkpoint: a titan-pipe step dir holding the adapters only, its manifest's
``extra.lora`` naming the frozen base they were trained on (its directory and the size and sha256 of
each of its files; titan_pipe.model.lora).

Two readings of it:
- ``merge``: the deployed model. The base's tensors (read by the base's own reader, a Hugging Face /
  unified dir or one of our checkpoints) with W + (alpha / rank) B A added to every adapted weight as
  it is written (source_plan.LowRank): streamed like any conversion, one block of one tensor at a time.
- ``adapter``: the adapters alone, as PEFT stores them (``adapter_model.safetensors`` keyed
  ``base_model.model.<Hugging Face name>.lora_A/B.weight``, with ``adapter_config.json``), for
  ``peft.PeftModel.from_pretrained`` on the base model.

Either way the plan is rooted at the LoRA step dir (its tokenizer and token ids are the run's), and
the base's files are read by absolute path and hashed against the record while the output streams,
so a base that changed since training is refused, never merged.
"""

from __future__ import annotations

from pathlib import Path

from titan_pipe.records.checkpoint_format import MANIFEST_NAME, Box, Manifest, open_checkpoint
from titan_pipe.weights.detect import open_source as open_any
from titan_pipe.weights.readers import titan
from titan_pipe.weights.readers.store import SafetensorsStore
from titan_pipe.weights.source_plan import LowRank, Read, SourcePlan, TensorPlan
from titan_pipe.errors import UserError
from titan_pipe.model.args import ModelArgs, model_differences
from titan_pipe.model.families import family_of
from titan_pipe.model.lora import (
    CONVERT_MODES as MODES,
    LoRASpec,
    adapter_of,
    adapter_shapes,
    base_of,
    lora_record,
    peft_key,
)
from titan_pipe.model.names import native_to_hf
from titan_pipe.io.paths import resolve_inside
from titan_pipe.io.safetensors_io import read_header

FORMAT = "titan"
ADAPTER_FORMAT = "peft-adapter"  # SourcePlan.layout["lora"] of an adapter reading


def lora_step(path: Path) -> Path | None:
    """The step dir of a LoRA checkpoint at ``path`` (a step, run or checkpoints dir), else None."""
    if not titan.looks_like(path):
        return None
    try:
        root = titan.resolve(path)
    except UserError:
        return None
    return root if "lora" in Manifest.load(root).extra.other else None


def open_source(path: Path, *, mode: str = "merge") -> tuple[SourcePlan, SafetensorsStore, LoRASpec]:
    """(plan, store, spec) of the LoRA checkpoint at ``path`` read as ``mode``."""
    if mode not in MODES:
        raise UserError(f"--lora {mode!r} is not one of {', '.join(MODES)}")
    root = titan.resolve(path)
    mpath = root / MANIFEST_NAME
    m = open_checkpoint(root)
    spec, ref = lora_record(m.extra.other, source=mpath)
    args = ModelArgs.from_dict(m.model, source=mpath)
    adapters, headers = _adapters(root, m, args, spec)
    base = Path(ref.path)
    if not base.is_dir():
        raise UserError(
            f"{mpath}: its adapters were trained on the base model {base}, which is not there; the "
            "checkpoint holds the adapters only: put that model back at that path"
        )
    for rel, (size, _) in ref.files.items():
        f = resolve_inside(base, rel, source=mpath, what="base file")
        if not f.is_file() or f.stat().st_size != size:
            raise UserError(
                f"{f}: the base file {mpath} records ({size:,} bytes) is missing or of another size; "
                "the base model changed after training: restore it, or train the adapters again"
            )
    expected = {k: v.sha256 for k, v in m.files.items()}
    expected.update({str(base / rel): digest for rel, (_, digest) in ref.files.items()})
    layout = {
        "dp": m.parallel.dp,
        "tp": m.parallel.tp,
        "pp": m.parallel.pp,
        "lora": {**spec.to_dict(), "base": ref.path},
    }
    if mode == "adapter":
        layout["lora"]["reading"] = ADAPTER_FORMAT
        plan = SourcePlan(
            FORMAT, root, args, adapters, files=sorted(m.files), step=m.step, layout=layout, expected_sha256=expected
        )
        return plan, SafetensorsStore(root, headers), spec
    bplan, bstore = open_any(base)  # the base's own reader: a Hugging Face / unified dir or one of our checkpoints
    bstore.close()
    diffs = model_differences(bplan.args, args, labels=("in the base", "in the adapters' manifest"))
    if diffs:
        raise UserError(f"{mpath}: the base {base} is another model ({'; '.join(diffs)}); restore the base it names")
    tensors = {}
    for name, t in bplan.tensors.items():
        reads = tuple(Read(str(base / r.file), r.key, r.src_box, r.dst_box, r.rope_head_dim) for r in t.reads)
        delta = (
            LowRank(adapters[adapter_of(name, "a")], adapters[adapter_of(name, "b")], spec.scale)
            if adapter_of(name) in adapters
            else None
        )
        tensors[name] = TensorPlan(name, t.shape, t.dtype, reads, t.split, delta)
    headers.update({str(base / f): h for f, h in bstore.headers.items()})
    files = sorted(m.files) + [str(base / f) for f in bplan.files]
    plan = SourcePlan(FORMAT, root, args, tensors, files=files, step=m.step, layout=layout, expected_sha256=expected)
    return plan, SafetensorsStore(root, headers), spec


def _adapters(root: Path, m: Manifest, args: ModelArgs, spec: LoRASpec):
    """The adapters' plans (whole-box reads of their chunks, replicas once) and their files' headers,
    checked against the shapes the LoRA record implies."""
    mpath = root / MANIFEST_NAME
    want = adapter_shapes(args, spec)
    if set(m.params) != set(want):
        other = sorted(set(m.params) ^ set(want))
        raise UserError(
            f"{mpath}: holds {len(m.params)} adapter tensors, its LoRA record implies {len(want)} "
            f"({other[0]!r} differs); copy the checkpoint again"
        )
    headers = {}
    for rel, info in m.files.items():
        f = resolve_inside(root, rel, source=mpath, what="shard")
        if not f.is_file() or f.stat().st_size != info.size:
            raise UserError(
                f"{f}: missing or not the size {mpath} records ({info.size:,} bytes); copy the checkpoint again"
            )
        headers[rel] = read_header(f)[0]
    out = {}
    for name, shape in want.items():
        p = m.params[name]
        if tuple(p.shape) != shape:
            raise UserError(
                f"{mpath}: {name} is {list(p.shape)}, its LoRA record implies {list(shape)}; copy the checkpoint again"
            )
        reads, seen = [], set()
        for c in p.chunks:
            if c.box in seen:
                continue
            seen.add(c.box)
            st = headers[c.file].get(c.key)
            if st is None or st.shape != c.box.lengths or st.dtype != p.dtype:
                raise UserError(
                    f"{root / c.file}: tensor {c.key!r} is not the {p.dtype} {list(c.box.lengths)} {mpath} "
                    "lists; the shard does not belong to this manifest"
                )
            reads.append(Read(c.file, c.key, Box.full(c.box.lengths), c.box))
        out[name] = TensorPlan(name, shape, p.dtype, tuple(reads), titan.describe_split(p.tp_dim, len(reads)))
    return out, headers


def peft_keys(plan: SourcePlan) -> dict[str, str]:
    """native adapter name -> the key PEFT stores it under, for the model's family."""
    family = family_of(plan.args).model_type
    return {n: peft_key(n, native_to_hf(base_of(n)[0], family)) for n in plan.tensors}


def adapter_config(plan: SourcePlan, spec: LoRASpec) -> dict:
    """PEFT's adapter_config.json of the adapters: LoRA on the Hugging Face modules they target."""
    family = family_of(plan.args).model_type
    modules = sorted({native_to_hf(base_of(n)[0], family).rsplit(".", 2)[-2] for n in plan.tensors})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": plan.layout["lora"]["base"],
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True if spec.init == "kaiming" else "gaussian",
        "modules_to_save": None,
        "inference_mode": True,
        "revision": None,
    }
