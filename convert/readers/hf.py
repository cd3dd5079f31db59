"""Reader for Hugging Face LLaMA directories: config.json + model.safetensors (or shards + index).

Hugging Face q/k rows are in rotate-half order, as ours are, so every tensor is one whole-box read
under its native name. Only safetensors weights are read (pytorch_model.bin is a pickle).
"""
from __future__ import annotations

from pathlib import Path

from titan_pipe.checkpoint_format import Box
from titan_pipe.convert.readers.store import SafetensorsStore, read_header
from titan_pipe.convert.source_plan import Read, SourcePlan, TensorPlan, check_accounted
from titan_pipe.errors import UserError
from titan_pipe.model.names import hf_to_native
from titan_pipe.model.params import native_names
from titan_pipe.unified_dir import locate_weights, read_model_args

FORMAT = "hf"
INDEX = "model.safetensors.index.json"


def looks_like(path: Path) -> bool:
    return (path / "config.json").is_file() and (
        (path / INDEX).is_file() or any(path.glob("*.safetensors")))


def weight_files(path: Path) -> list[str]:
    """Weight files relative to ``path``, found as the unified loader finds them (index, else model.safetensors)."""
    return [f.relative_to(path).as_posix() for f in locate_weights(path).files]


def _stored(path: Path, files: list[str], store: SafetensorsStore) -> dict[str, tuple[str, str]]:
    """Native name -> (file, stored key) of every tensor in the headers; a name stored twice is refused."""
    found: dict[str, tuple[str, str]] = {}
    for f in files:
        header = read_header(path / f)[0]
        store.headers[f] = header
        for key in header:
            if "rotary_emb" in key:
                continue  # a buffer some old exports saved, recomputed from the config
            try:
                name = hf_to_native(key)
            except KeyError as e:
                raise UserError(f"{path / f}: {e.args[0]}; titan-pipe converts plain LLaMA "
                                "weights only") from None
            if name in found:
                raise UserError(f"{path / f}: tensor {key!r} is also stored in {path / found[name][0]} "
                                f"(as {found[name][1]!r}); which copy is meant is ambiguous. Keep it in one "
                                "file (and in the index)")
            found[name] = (f, key)
    return found


def open_source(path: Path, *, vocab_size: int | None = None, model_config: Path | None = None,
                read_headers: bool = True) -> tuple[SourcePlan, SafetensorsStore]:
    cfg_path = path / "config.json"
    args = read_model_args(path)
    if vocab_size is not None and vocab_size != args.vocab_size:
        raise UserError(f"--vocab-size {vocab_size} disagrees with {cfg_path} (vocab_size "
                        f"{args.vocab_size}); drop --vocab-size for Hugging Face models")
    files = weight_files(path)
    store = SafetensorsStore(path)
    found = _stored(path, files, store)
    check_accounted(found, args, source=cfg_path, describe=lambda n: f"{found[n][1]!r} in {found[n][0]}")
    tensors = {}
    for name in native_names(args):
        if name not in found:
            raise UserError(f"{path}: no tensor for {name!r} in {', '.join(files)}; "
                            "the model is incomplete")
        f, key = found[name]
        st = store.headers[f][key]
        tensors[name] = TensorPlan(name, st.shape, st.dtype,
                                   (Read(f, key, Box.full(st.shape), Box.full(st.shape)),), "whole")
    return SourcePlan(FORMAT, path, args, tensors, files=files, layout={"tp": 1, "pp": 1}), store
