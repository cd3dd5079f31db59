"""Read a unified model directory (ours, or a Hugging Face dir of a supported family) into our Transformer.

The directory is opened and checked by titan_pipe.model.unified_dir (the one reader of unified
dirs). The model is built on the meta device and each tensor is assigned as it is read, so loading holds one copy of the weights (plus one tensor in flight for a dtype cast).
"""

from __future__ import annotations

from pathlib import Path

import torch

from titan_pipe.rules.dtypes import parse_dtype
from titan_pipe.errors import UserError
from titan_pipe.model.args import ModelArgs
from titan_pipe.model.kernels import Kernels
from titan_pipe.model.transformer import Transformer, build_model
from titan_pipe.model.unified_dir import open_unified


def load_unified_model(
    model_dir: Path, *, dtype: str | torch.dtype | None = None, device: str = "cpu", kernels: Kernels | None = None
) -> tuple[Transformer, ModelArgs]:
    """(Transformer in eval mode on ``device``, ModelArgs) from a unified directory.

    ``dtype=None`` keeps the stored dtype of each tensor; otherwise every tensor is cast as it is
    read. Each stored tensor's shape must match config.json; missing, extra or mis-shaped
    tensors raise UserError naming the tensor and the file.
    """
    unified = open_unified(model_dir)
    args, target = unified.args, parse_dtype(dtype)
    model = build_model(args, kernels=kernels, seed=None, device="meta")
    for name in dict(model.named_parameters()):  # a shared tensor (the tied head) is listed once, as its source
        t = unified.read(name)
        if target is not None and t.dtype != target:
            t = t.to(target)
        _assign_param(model, name, t.to(device))
    model.share_tensors()  # the assignments replaced the source: share it again
    dtypes = {p.dtype for p in model.parameters()}
    model.init_rope(device)
    if len(dtypes) > 1:
        raise UserError(
            f"{model_dir}: tensors are stored in mixed dtypes {sorted(map(str, dtypes))}; "
            "pass dtype='float32' (or another) to cast them to one"
        )
    return model.eval(), args


def _assign_param(model: Transformer, name: str, value: torch.Tensor) -> None:
    """Replace the meta parameter ``name`` by ``value`` (no copy)."""
    *path, leaf = name.split(".")
    owner = model
    for part in path:
        owner = getattr(owner, part) if not isinstance(owner, torch.nn.ModuleDict) else owner[part]
    setattr(owner, leaf, torch.nn.Parameter(value, requires_grad=False))
