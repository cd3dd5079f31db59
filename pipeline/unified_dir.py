"""A unified model directory: config.json (a Hugging Face LlamaConfig) beside model.safetensors or
shards listed by model.safetensors.index.json. Finds the weight files and the ModelArgs; reads no
tensor data (titan_pipe.model.load loads a model from it, titan_pipe.model.weights reads weights).

Tensor names may be Hugging Face (``model.layers.0.self_attn.q_proj.weight``) or native
(``layers.0.attention.wq.weight``); ``native_name`` maps either to ours.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from titan_pipe.errors import UserError
from titan_pipe.model.args import ModelArgs
from titan_pipe.model.hf_config import from_hf_config
from titan_pipe.model.names import hf_to_native
from titan_pipe.paths import resolve_inside
from titan_pipe.values import read_json

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

# Non-parameter tensors some Hugging Face versions saved; they carry nothing we need.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class WeightFiles:
    """Where each stored tensor lives: stored name -> file, in a fixed order of files."""

    files: tuple[Path, ...]
    key_to_file: dict[str, Path]


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
    args = from_hf_config(read_json(cfg_path, what="a LlamaConfig"), source=str(cfg_path))
    return tie_as_stored(model_dir, args)


def tie_as_stored(model_dir: Path, args: ModelArgs) -> ModelArgs:
    """The tie of a dir's head, as transformers reads the dir: a config that says
    ``tie_word_embeddings: true`` over weights holding an output matrix that differs from the
    embedding is an untied model (transformers keeps both), so the args say untied and every reader
    (convert, export, init_from, evaluate: they all come through here) keeps that head. A stored head
    equal to the embedding, bit for bit, is the tie; so is none stored. Reads the two tensors only in
    that one case."""
    if not args.tie_embeddings:
        return args
    from dataclasses import replace

    weights = locate_weights(model_dir)
    where = {}
    for key, f in weights.key_to_file.items():
        name = native_name(key, f)
        if name in ("output.weight", "tok_embeddings.weight"):
            where[name] = (f, key)
    if "output.weight" not in where or "tok_embeddings.weight" not in where:
        return args
    from safetensors import safe_open

    tensors = []
    for name in ("tok_embeddings.weight", "output.weight"):
        f, key = where[name]
        with safe_open(str(f), framework="pt") as h:
            tensors.append(h.get_tensor(key))
    emb, head = tensors
    if emb.shape == head.shape and emb.dtype == head.dtype and bool((emb == head).all()):
        return args
    return replace(args, tie_embeddings=False)


def locate_weights(model_dir: Path) -> WeightFiles:
    """The safetensors files of ``model_dir`` and which stored tensor name each one holds.

    Every reader then accounts for each stored tensor against config.json (``place_tensor``,
    ``check_all_placed``) from the headers, before any tensor data is read."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index, single = model_dir / INDEX, model_dir / SINGLE
    if index.is_file():
        weight_map = read_json(index, what="a safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise UserError(f"{index}: 'weight_map' must be a non-empty object {{tensor name: file}}; "
                            "re-create the index with save_pretrained or `titan-pipe convert`")
        key_to_file = {k: resolve_inside(model_dir, v, source=index, what=f"weight_map file of {k!r}")
                       for k, v in weight_map.items()}
        for f in sorted(set(key_to_file.values())):
            if not f.is_file():
                raise UserError(f"{index}: lists shard {f.name}, which is missing from {model_dir}")
            _check_readable(f)
        return WeightFiles(tuple(sorted(set(key_to_file.values()))), key_to_file)
    if single.is_file():
        single = resolve_inside(model_dir, SINGLE, source=model_dir, what="weights file")
        _check_readable(single)
        try:
            with safe_open(str(single), framework="numpy") as fh:  # keys only; "pt" would import torch
                keys = list(fh.keys())
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise UserError(f"{single}: not a readable safetensors file ({e})") from None
        return WeightFiles((single,), {k: single for k in keys})
    found = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth"))
    hint = (f"found {', '.join(found)}" if found else "found no weight files")
    raise UserError(f"{model_dir}: no {SINGLE} or {INDEX} ({hint}); titan-pipe reads safetensors only — "
                    "convert the checkpoint with `titan-pipe convert` or save_pretrained(safe_serialization=True)")


def _check_readable(f: Path) -> None:
    """A weights file this user may not read is one line saying so (it once read as "No such file")."""
    import os

    if not os.access(f, os.R_OK):
        raise UserError(f"{f}: cannot be read by this user (permission denied); give read access "
                        "(chmod a+r) or run as a user who can read it")


def native_name(stored: str, source: Path) -> str | None:
    """Our parameter name for a stored tensor name (HF or native); None for ignorable buffers."""
    if stored.endswith(_IGNORED_SUFFIXES):
        return None
    if stored.startswith(("model.", "lm_head.")):
        try:
            return hf_to_native(stored)
        except KeyError:
            raise UserError(f"{source}: tensor {stored!r} is not a LLaMA parameter titan-pipe knows "
                            "(see titan_pipe.model.names); remove it or convert the checkpoint first") from None
    return stored


def place_tensor(model_dir: Path, args: ModelArgs, expected: dict[str, tuple[int, ...]], *, path: Path,
                 stored: str, present: "set[str] | dict", shape: tuple[int, ...] | None,
                 placed: "set[str] | dict") -> str | None:
    """The native parameter name stored tensor ``stored`` of weight file ``path`` fills, after the
    checks every reader of a unified dir makes: the file holds it, the model has a place for it,
    nothing filled that place already, its ``shape`` is the one config.json implies. None for a
    stored buffer the model does not use. UserError naming the file and tensor otherwise."""
    if stored not in present:
        raise UserError(f"{path}: the index says it holds {stored!r}, but it does not; re-run the conversion")
    name = native_name(stored, path)
    if name is None:
        return None
    if name not in expected:
        raise UserError(f"{path}: tensor {stored!r} has no place in a model with config "
                        f"{model_dir / CONFIG} ({args.n_layers} layers); the weights and "
                        "config.json do not belong together")
    if name in placed:
        raise UserError(f"{path}: tensor {stored!r} is stored twice (as {name!r} already)")
    if shape is not None and tuple(shape) != tuple(expected[name]):
        raise UserError(f"{path}: tensor {stored!r} has shape {list(shape)}, but "
                        f"{model_dir / CONFIG} implies {list(expected[name])}; the weights and "
                        "config.json do not belong together")
    return name


def check_all_placed(model_dir: Path, args: ModelArgs, expected: "dict[str, tuple[int, ...]]",
                     placed: "set[str] | dict") -> None:
    """UserError unless every expected parameter was placed (a tied model may omit output.weight)."""
    missing = sorted(set(expected) - set(placed) - ({"output.weight"} if args.tie_embeddings else set()))
    if missing:
        raise UserError(f"{model_dir}: {len(missing)} parameter(s) missing from the weights, e.g. "
                        f"{missing[0]!r} (config.json: {args.n_layers} layers, dim {args.dim}); "
                        "the weights and config.json do not belong together")
