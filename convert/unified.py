"""Read a unified model directory (ours, or any Hugging Face LLaMA dir) into our Transformer.

A unified directory holds ``config.json`` (a Hugging Face LlamaConfig) and the weights as one
``model.safetensors`` or as shards listed by ``model.safetensors.index.json``. Tensor names may
be Hugging Face (``model.layers.0.self_attn.q_proj.weight``) or native (``layers.0.attention.wq.weight``).
The model is built on the meta device and each tensor is assigned as it is read, so loading holds
one copy of the weights (plus one tensor in flight for a dtype cast).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from titan_pipe.convert.names import from_hf_config, hf_to_native
from titan_pipe.errors import UserError
from titan_pipe.paths import resolve_inside
from titan_pipe.training.kernels import Kernels
from titan_pipe.training.model import ModelArgs, Transformer, build_model, rope_cos_sin

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

# Non-parameter tensors some Hugging Face versions saved; they carry nothing we need.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class WeightFiles:
    """Where each stored tensor lives: stored name -> file, in a fixed order of files."""

    files: tuple[Path, ...]
    key_to_file: dict[str, Path]


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """'float32'/'float16'/'bfloat16' (or a torch.dtype, or None = keep) -> torch.dtype | None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype in ("keep", "auto"):
        return None
    if dtype not in _DTYPES:
        raise UserError(f"dtype {dtype!r} is not one of float32, float16, bfloat16 (or keep)")
    return _DTYPES[dtype]


def read_model_args(model_dir: Path) -> ModelArgs:
    """ModelArgs from ``model_dir/config.json``; UserError naming the file and field if unusable."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise UserError(f"{model_dir}: not a directory; pass the output directory of `titan-pipe convert` "
                        "or a Hugging Face LLaMA directory")
    cfg_path = model_dir / CONFIG
    if not cfg_path.is_file():
        raise UserError(f"{cfg_path}: missing; a unified model directory needs a Hugging Face config.json "
                        "beside its weights (`titan-pipe convert` writes one)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{cfg_path}: not valid JSON ({e}); rewrite it or re-run `titan-pipe convert`") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{cfg_path}: expected a JSON object (a LlamaConfig), got {type(cfg).__name__}")
    try:
        return from_hf_config(cfg, source=str(cfg_path))
    except ValueError as e:
        raise UserError(str(e)) from None


def locate_weights(model_dir: Path) -> WeightFiles:
    """The safetensors files of ``model_dir`` and which stored tensor name each one holds."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index, single = model_dir / INDEX, model_dir / SINGLE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise UserError(f"{index}: not a safetensors index (needs a 'weight_map' object): {e}") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise UserError(f"{index}: 'weight_map' must be a non-empty object {{tensor name: file}}; "
                            "re-create the index with save_pretrained or `titan-pipe convert`")
        key_to_file = {k: resolve_inside(model_dir, v, source=index, what=f"weight_map file of {k!r}")
                       for k, v in weight_map.items()}
        for f in sorted(set(key_to_file.values())):
            if not f.is_file():
                raise UserError(f"{index}: lists shard {f.name}, which is missing from {model_dir}")
        return WeightFiles(tuple(sorted(set(key_to_file.values()))), key_to_file)
    if single.is_file():
        single = resolve_inside(model_dir, SINGLE, source=model_dir, what="weights file")
        try:
            with safe_open(str(single), framework="pt") as fh:
                keys = list(fh.keys())
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise UserError(f"{single}: not a readable safetensors file ({e})") from None
        return WeightFiles((single,), {k: single for k in keys})
    found = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth"))
    hint = (f"found {', '.join(found)}" if found else "found no weight files")
    raise UserError(f"{model_dir}: no {SINGLE} or {INDEX} ({hint}); titan-pipe reads safetensors only — "
                    "convert the checkpoint with `titan-pipe convert` or save_pretrained(safe_serialization=True)")


def native_name(stored: str, source: Path) -> str | None:
    """Our parameter name for a stored tensor name (HF or native); None for ignorable buffers."""
    if stored.endswith(_IGNORED_SUFFIXES):
        return None
    if stored.startswith(("model.", "lm_head.")):
        try:
            return hf_to_native(stored)
        except KeyError:
            raise UserError(f"{source}: tensor {stored!r} is not a LLaMA parameter titan-pipe knows "
                            "(see convert/names.py); remove it or convert the checkpoint first") from None
    return stored


def load_unified_model(model_dir: Path, *, dtype: str | torch.dtype | None = None, device: str = "cpu",
                       kernels: Kernels | None = None) -> tuple[Transformer, ModelArgs]:
    """(Transformer in eval mode on ``device``, ModelArgs) from a unified directory.

    ``dtype=None`` keeps the stored dtype of each tensor; otherwise every tensor is cast as it is
    read. Each stored tensor's shape must match config.json; missing, extra or mis-shaped
    tensors raise UserError naming the tensor and the file.
    """
    from safetensors import safe_open

    model_dir = Path(model_dir)
    args = read_model_args(model_dir)
    target = parse_dtype(dtype)
    weights = locate_weights(model_dir)
    model = build_model(args, kernels=kernels, seed=None, device="meta")
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    loaded: set[str] = set()
    for path in weights.files:
        wanted = sorted(k for k, f in weights.key_to_file.items() if f == path)
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            present = set(fh.keys())
            for stored in wanted:
                if stored not in present:
                    raise UserError(f"{path}: the index says it holds {stored!r}, but it does not; "
                                    "re-run the conversion")
                name = native_name(stored, path)
                if name is None:
                    continue
                if name not in expected:
                    raise UserError(f"{path}: tensor {stored!r} has no place in a model with config "
                                    f"{model_dir / CONFIG} ({args.n_layers} layers); the weights and "
                                    "config.json do not belong together")
                if name in loaded:
                    raise UserError(f"{path}: tensor {stored!r} is stored twice (as {name!r} already)")
                shape = tuple(fh.get_slice(stored).get_shape())
                if shape != expected[name]:
                    raise UserError(f"{path}: tensor {stored!r} has shape {list(shape)}, but "
                                    f"{model_dir / CONFIG} implies {list(expected[name])}; the weights and "
                                    "config.json do not belong together")
                t = fh.get_tensor(stored)
                if target is not None and t.dtype != target:
                    t = t.to(target)
                _assign_param(model, name, t.to(device))
                loaded.add(name)
    missing = sorted(set(expected) - loaded)
    if args.tie_embeddings and "output.weight" in missing:
        missing.remove("output.weight")
    if missing:
        raise UserError(f"{model_dir}: {len(missing)} parameter(s) missing from the weights, e.g. "
                        f"{missing[0]!r} (config.json: {args.n_layers} layers, dim {args.dim}); "
                        "the weights and config.json do not belong together")
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    dtypes = {p.dtype for p in model.parameters()}
    cos, sin = rope_cos_sin(args)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    if len(dtypes) > 1:
        raise UserError(f"{model_dir}: tensors are stored in mixed dtypes {sorted(map(str, dtypes))}; "
                        "pass dtype='float32' (or another) to cast them to one")
    return model.eval(), args


def _assign_param(model: Transformer, name: str, value: torch.Tensor) -> None:
    """Replace the meta parameter ``name`` by ``value`` (no copy)."""
    *path, leaf = name.split(".")
    owner = model
    for part in path:
        owner = getattr(owner, part) if not isinstance(owner, torch.nn.ModuleDict) else owner[part]
    setattr(owner, leaf, torch.nn.Parameter(value, requires_grad=False))
