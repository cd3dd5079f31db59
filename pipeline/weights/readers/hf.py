"""Reader for unified model dirs as convert's source: config.json + model.safetensors (or shards + index),
Hugging Face or native tensor names — opened and checked by titan_pipe.model.unified_dir, the reader
export, init_from and evaluate use, so a dir one stage accepts every stage accepts.

Hugging Face q/k rows are in rotate-half order, as ours are, so every tensor is one whole-box read
under its native name. Only safetensors weights are read (pytorch_model.bin is a pickle).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from titan_pipe.records.checkpoint_format import Box, split_box
from titan_pipe.weights.readers.store import SafetensorsStore
from titan_pipe.weights.source_plan import Read, SourcePlan, TensorPlan
from titan_pipe.errors import UserError
from titan_pipe.model.params import native_names
from titan_pipe.model.unified_dir import INDEX, open_unified

FORMAT = "hf"


def looks_like(path: Path) -> bool:
    return (path / "config.json").is_file() and ((path / INDEX).is_file() or any(path.glob("*.safetensors")))


def open_source(
    path: Path, *, vocab_size: int | None = None, model_config: Path | None = None, read_headers: bool = True
) -> tuple[SourcePlan, SafetensorsStore]:
    unified = open_unified(path)
    args = unified.args
    if vocab_size is not None and vocab_size != args.vocab_size:
        raise UserError(
            f"--vocab-size {vocab_size} disagrees with {path / 'config.json'} (vocab_size "
            f"{args.vocab_size}); drop --vocab-size for Hugging Face models"
        )
    files = [f.relative_to(path).as_posix() for f in unified.files]
    headers = {f.relative_to(path).as_posix(): dict(h) for f, h in unified.headers.items()}
    tensors = {}
    for name in native_names(args):
        parts = unified.parts(name)
        st = parts[0].stored
        if parts[0].expert is None:
            f = parts[0].file.relative_to(path).as_posix()
            tensors[name] = TensorPlan(
                name, st.shape, st.dtype, (Read(f, parts[0].key, Box.full(st.shape), Box.full(st.shape)),), "whole"
            )
            continue
        # one tensor per expert: each read as the (1, ...) slice of the stack it is (the same bytes)
        shape, reads = (len(parts), *st.shape), []
        for p in parts:
            f, one = p.file.relative_to(path).as_posix(), (1, *p.stored.shape)
            headers[f][p.key] = replace(p.stored, shape=one)
            reads.append(Read(f, p.key, Box.full(one), split_box(shape, 0, len(parts), p.expert)))
        tensors[name] = TensorPlan(name, shape, st.dtype, tuple(reads), f"{len(parts)} experts")
    store = SafetensorsStore(path, headers)
    return SourcePlan(FORMAT, path, args, tensors, files=files, layout={"tp": 1, "pp": 1}), store
