"""A unified model directory: the one reader every stage uses (export, init_from, evaluate, convert).

A unified dir holds ``config.json`` (a Hugging Face config of a supported family) beside
``model.safetensors`` or shards listed by ``model.safetensors.index.json``. Tensor names may be
Hugging Face (``model.layers.0.self_attn.q_proj.weight``) or native (``layers.0.attention.wq.weight``,
what ``titan-pipe convert --naming native`` writes); ``native_name`` maps either to ours.

``open_unified`` finds the files, reads and checks their headers (titan_pipe.io.safetensors_io) and
accounts for every stored tensor against config.json before any tensor data is read: the file holds
it, the model has a place for it, nothing else fills that place, its shape is the one config.json
implies, nothing the model needs is missing. Then ``UnifiedDir.read`` / ``read_box`` read tensors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from titan_pipe.errors import UserError
from titan_pipe.model import features
from titan_pipe.model.args import ModelArgs
from titan_pipe.model.hf_config import from_hf_config
from titan_pipe.model.names import hf_to_native, parse_hf_expert
from titan_pipe.model.params import native_shapes
from titan_pipe.io.paths import resolve_inside
from titan_pipe.io.safetensors_io import StoredTensor, open_tensors, read_header
from titan_pipe.rules.values import read_json

if TYPE_CHECKING:
    import torch

    from titan_pipe.records.checkpoint_format import Box

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def weight_file_name(k: int, n: int) -> str:
    """The name of weight file ``k`` (0-based) of ``n``: model.safetensors alone, else the shards
    save_pretrained names (model-00001-of-00003.safetensors), listed by the index (INDEX)."""
    return SINGLE if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"


# Non-parameter tensors some Hugging Face versions saved; they carry nothing we need.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class StoredParam:
    """Where one parameter is stored: its file, its key there and its header entry."""

    name: str  # native parameter name
    file: Path
    key: str
    stored: StoredTensor
    expert: int | None = None  # one expert's slice (dim 0) of a stacked expert parameter


@dataclass(frozen=True)
class UnifiedDir:
    """An opened unified dir: its ModelArgs (the head's tie as the weights store it) and every
    parameter's place. A tied model's ``output.weight`` is absent unless the dir stores it."""

    root: Path
    args: ModelArgs
    files: tuple[Path, ...]
    params: dict[str, StoredParam]
    headers: dict[Path, dict[str, StoredTensor]]  # every weight file's checked header
    # stacked expert parameters stored one tensor per expert (Hugging Face): native name -> its experts in order
    experts: dict[str, tuple[StoredParam, ...]] = field(default_factory=dict)

    def parts(self, name: str) -> tuple[StoredParam, ...]:
        """Where parameter ``name`` is stored: one tensor, or one per expert (dim 0) in expert order."""
        return self.experts[name] if name in self.experts else (self.get(name),)

    def get(self, name: str) -> StoredParam:
        if name in self.params:
            return self.params[name]
        source = features.shared(self.args).get(name)  # a tied head stored as the embedding alone
        if source is not None and source in self.params:
            return self.params[source]
        raise UserError(
            f"{self.root}: no tensor for parameter {name!r}; the directory is incomplete or of another model"
        )

    def read(self, name: str) -> "torch.Tensor":
        """The whole tensor of parameter ``name`` in its stored dtype."""
        return self._read(self.parts(name))

    @staticmethod
    def _read(parts: tuple[StoredParam, ...], index: tuple[slice, ...] | None = None) -> "torch.Tensor":
        """The tensor of ``parts`` (``index`` of it): one stored tensor, or the stack of one per
        expert (``index[0]`` picks the experts), each file opened once."""
        from contextlib import ExitStack

        with ExitStack() as files:
            opened: dict[Path, object] = {}

            def handle(p: StoredParam):
                if p.file not in opened:
                    opened[p.file] = files.enter_context(open_tensors(p.file))
                return opened[p.file]

            if parts[0].expert is None:
                h = handle(parts[0])
                return h.get_tensor(parts[0].key) if index is None else h.get_slice(parts[0].key)[index]
            import torch

            chosen = parts if index is None else parts[index[0]]
            rest = None if index is None else index[1:]
            return torch.stack(
                [handle(p).get_tensor(p.key) if rest is None else handle(p).get_slice(p.key)[rest] for p in chosen]
            )

    def read_box(self, name: str, box: "Box") -> "torch.Tensor":
        """(box.lengths) piece of parameter ``name``: only that part of the stored tensor(s) is read."""
        return self._read(self.parts(name), tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths)))


def read_model_args(model_dir: Path) -> ModelArgs:
    """ModelArgs of a unified dir, the head's tie as its weights store it (``open_unified``)."""
    return open_unified(model_dir).args


def read_config(model_dir: Path) -> ModelArgs:
    """ModelArgs from ``model_dir/config.json`` alone; UserError naming the file and field if unusable."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise UserError(
            f"{model_dir}: not a directory; pass the output directory of `titan-pipe convert` "
            "or a Hugging Face model directory"
        )
    cfg_path = model_dir / CONFIG
    if not cfg_path.is_file():
        raise UserError(
            f"{cfg_path}: missing; a unified model directory needs a Hugging Face config.json "
            "beside its weights (`titan-pipe convert` writes one)"
        )
    return from_hf_config(read_json(cfg_path, what="a model config"), source=str(cfg_path))


def open_unified(model_dir: Path) -> UnifiedDir:
    """Open a unified dir: config, weight files, headers, every stored tensor placed (module doc)."""
    model_dir = Path(model_dir)
    args = read_config(model_dir)
    key_to_file = _locate(model_dir)
    files = tuple(sorted(set(key_to_file.values())))
    expected = dict(native_shapes(args))
    shared, routing = features.shared(args), features.routing(args)
    for name, source in shared.items():  # a tied model may store its head too (the embedding, or an untied one)
        expected[name] = expected[source]
    placed: dict[str, StoredParam] = {}
    headers = {path: read_header(path)[0] for path in files}
    for path, header in headers.items():
        for key in sorted(k for k, f in key_to_file.items() if f == path):
            if key not in header:
                raise UserError(f"{path}: the index says it holds {key!r}, but it does not; re-run the conversion")
    experts: dict[str, dict[int, StoredParam]] = {}
    for path, header in headers.items():  # every stored tensor, listed by the index or not: none goes unseen
        for key in sorted(header):
            one = parse_hf_expert(key)
            if one is not None:
                _place_expert(model_dir, args, routing, expected, path, key, header[key], one, experts, placed)
                continue
            name = _place(model_dir, args, expected, path, key, header[key].shape, placed)
            if name is not None:
                if name in experts:
                    raise UserError(
                        f"{path}: tensor {key!r} stacks the experts that are also stored one by one; "
                        "which copy is meant is ambiguous. Keep one"
                    )
                placed[name] = StoredParam(name, path, key, header[key])
    stacked = {}
    n = routing.experts if routing is not None else 0
    for name, by_expert in experts.items():
        gap = next((e for e in range(n) if e not in by_expert), None)
        if gap is not None:
            raise UserError(
                f"{model_dir}: expert {gap} of {name!r} is missing ({len(by_expert)} of "
                f"{n} stored; config.json: {n} experts); the weights and "
                "config.json do not belong together"
            )
        stacked[name] = tuple(by_expert[e] for e in range(n))
    missing = sorted(set(expected) - set(placed) - set(stacked) - set(shared))
    if missing:
        raise UserError(
            f"{model_dir}: {len(missing)} parameter(s) missing from the weights, e.g. "
            f"{missing[0]!r} (config.json: {args.n_layers} layers, dim {args.dim}); "
            "the weights and config.json do not belong together"
        )
    unified = UnifiedDir(model_dir, args, files, placed, headers, stacked)
    return _tie_as_stored(unified)


def _tie_as_stored(u: UnifiedDir) -> UnifiedDir:
    """The head's tie as transformers reads the dir: a config saying ``tie_word_embeddings: true``
    over weights holding a head that differs from the embedding is an untied model (transformers
    keeps both), so the args say untied and every reader keeps that head. A stored head equal to the
    embedding, bit for bit, is the tie; so is none stored. Reads the two tensors only in that case."""
    for name, source in features.shared(u.args).items():
        if name not in u.params:
            continue
        emb, head = u.read(source), u.read(name)
        if not (emb.shape == head.shape and emb.dtype == head.dtype and bool((emb == head).all())):
            return replace(u, args=features.unshared(u.args))
    return u


def _locate(model_dir: Path) -> dict[str, Path]:
    """Stored tensor name -> weight file: the index's weight_map, else model.safetensors's keys."""
    index, single = model_dir / INDEX, model_dir / SINGLE
    if index.is_file():
        weight_map = read_json(index, what="a safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise UserError(
                f"{index}: 'weight_map' must be a non-empty object {{tensor name: file}}; "
                "re-create the index with save_pretrained or `titan-pipe convert`"
            )
        key_to_file = {
            k: resolve_inside(model_dir, v, source=index, what=f"weight_map file of {k!r}")
            for k, v in weight_map.items()
        }
        for f in sorted(set(key_to_file.values())):
            if not f.is_file():
                raise UserError(f"{index}: lists shard {f.name}, which is missing from {model_dir}")
            _check_readable(f)
        return key_to_file
    if single.is_file():
        single = resolve_inside(model_dir, SINGLE, source=model_dir, what="weights file")
        _check_readable(single)
        return {k: single for k in read_header(single)[0]}
    found = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth"))
    hint = f"found {', '.join(found)}" if found else "found no weight files"
    raise UserError(
        f"{model_dir}: no {SINGLE} or {INDEX} ({hint}); titan-pipe reads safetensors only — "
        "convert the checkpoint with `titan-pipe convert` or save_pretrained(safe_serialization=True)"
    )


def _check_readable(f: Path) -> None:
    """A weights file this user may not read is one line saying so (it once read as "No such file")."""
    if not os.access(f, os.R_OK):
        raise UserError(
            f"{f}: cannot be read by this user (permission denied); give read access "
            "(chmod a+r) or run as a user who can read it"
        )


def native_name(stored: str, source: Path, family: str | None = None) -> str | None:
    """Our parameter name for a stored tensor name (HF in ``family``'s spelling, or native); None for
    ignorable buffers."""
    if stored.endswith(_IGNORED_SUFFIXES):
        return None
    if stored.startswith(("model.", "lm_head.")):
        try:
            return hf_to_native(stored, family)
        except KeyError:
            raise UserError(
                f"{source}: tensor {stored!r} is not a parameter of a model family titan-pipe "
                "knows (see titan_pipe.model.names); remove it or convert the checkpoint "
                "first"
            ) from None
    return stored


def _place_expert(
    model_dir: Path,
    args: ModelArgs,
    routing: "features.Routing | None",
    expected: dict[str, tuple[int, ...]],
    path: Path,
    key: str,
    stored: StoredTensor,
    found: tuple[str, int],
    experts: dict,
    placed: dict,
) -> None:
    """Place one expert's tensor (Hugging Face: one per expert) into its stacked parameter's slot;
    ``routing``: the model's (None: a dense model, where no expert's tensor has a place)."""
    name, e = found
    n, layers = (0, []) if routing is None else (routing.experts, list(routing.layers))
    if name not in expected or e >= n:
        raise UserError(
            f"{path}: tensor {key!r} has no place in the model of {model_dir / CONFIG} "
            f"({args.n_layers} layers, {n} experts in layers {layers}); "
            "the weights and config.json do not belong together"
        )
    if name in placed or e in experts.get(name, {}):
        raise UserError(
            f"{path}: tensor {key!r} is also stored elsewhere (expert {e} of {name!r}); which copy "
            "is meant is ambiguous. Keep one"
        )
    if tuple(stored.shape) != tuple(expected[name][1:]):
        raise UserError(
            f"{path}: tensor {key!r} has shape {list(stored.shape)}, but {model_dir / CONFIG} implies "
            f"{list(expected[name][1:])} per expert; the weights and config.json do not belong together"
        )
    experts.setdefault(name, {})[e] = StoredParam(name, path, key, stored, e)


def _place(
    model_dir: Path,
    args: ModelArgs,
    expected: dict[str, tuple[int, ...]],
    path: Path,
    stored: str,
    shape: tuple[int, ...],
    placed: dict,
) -> str | None:
    """The native parameter name stored tensor ``stored`` fills; None for a buffer the model does not use."""
    name = native_name(stored, path, args.family)
    if name is None:
        return None
    if name not in expected:
        raise UserError(
            f"{path}: tensor {stored!r} has no place in the model of {model_dir / CONFIG} "
            f"({args.n_layers} layers, dim {args.dim}); the weights and config.json do not belong "
            "together: fix the config (layer count, dims) to describe the weights, or remove the tensor"
        )
    if name in placed:
        raise UserError(
            f"{path}: tensor {stored!r} is also stored in {placed[name].file.name} (as "
            f"{placed[name].key!r}); which copy is meant is ambiguous. Keep it in one file (and in the index)"
        )
    if tuple(shape) != tuple(expected[name]):
        raise UserError(
            f"{path}: tensor {stored!r} has shape {list(shape)}, but "
            f"{model_dir / CONFIG} implies {list(expected[name])}; the weights and "
            "config.json do not belong together"
        )
    return name
