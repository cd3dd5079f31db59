"""Read a unified model directory (ours, or any Hugging Face LLaMA dir) into our Transformer.

A unified directory holds ``config.json`` (a Hugging Face LlamaConfig) and the weights as one
``model.safetensors`` or as shards listed by ``model.safetensors.index.json``. Tensor names may
be Hugging Face (``model.layers.0.self_attn.q_proj.weight``) or native (``layers.0.attention.wq.weight``).
The model is built on the meta device and each tensor is assigned as it is read, so loading holds
one copy of the weights (plus one tensor in flight for a dtype cast).
"""
from __future__ import annotations

from pathlib import Path

import torch

from titan_pipe.dtypes import parse_dtype
from titan_pipe.errors import UserError
from titan_pipe.model.args import ModelArgs
from titan_pipe.model.kernels import Kernels
from titan_pipe.model.transformer import Transformer, build_model, rope_cos_sin
from titan_pipe.unified_dir import check_all_placed, locate_weights, place_tensor, read_model_args


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
                shape = tuple(fh.get_slice(stored).get_shape()) if stored in present else None
                name = place_tensor(model_dir, args, expected, path=path, stored=stored, present=present,
                                    shape=shape, placed=loaded)
                if name is None:
                    continue
                t = fh.get_tensor(stored)
                if target is not None and t.dtype != target:
                    t = t.to(target)
                _assign_param(model, name, t.to(device))
                loaded.add(name)
    check_all_placed(model_dir, args, expected, loaded)
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
