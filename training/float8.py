"""float8 training on Hopper and later (``precision.float8: tensorwise | rowwise``), through torchao.

The model's Linear layers (all but the output projection, and only those whose dims float8 GEMMs
take: multiples of 16) run their matmuls in float8 with torchao's scaling recipe of that name, over
the same float32/bfloat16 master weights: checkpoints, convert and export see the same parameters
as without it. CUDA of compute capability 9.0 or later only; anywhere else, and without torchao
(the ``float8`` extra), the launch is refused in one line naming what is missing. torchao is
imported here only, and only when float8 is asked for.
"""

from __future__ import annotations

from torch import nn

FLOAT8_RECIPES = ("tensorwise", "rowwise")
MIN_CAPABILITY = (9, 0)


def float8_problem(recipe: str, device_type: str) -> str | None:
    """Why ``precision.float8: recipe`` cannot run on this host's ``device_type`` (None: it can)."""
    if recipe == "none":
        return None
    import importlib.util

    import torch

    if device_type != "cuda" or not torch.cuda.is_available():
        return (
            f"precision.float8: {recipe} needs a CUDA GPU of compute capability "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or later (H100, H200, B200); this run's device is "
            f"{device_type}; set precision.float8: none"
        )
    cap = torch.cuda.get_device_capability()
    if tuple(cap) < MIN_CAPABILITY:
        return (
            f"precision.float8: {recipe} needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or "
            f"later; {torch.cuda.get_device_name()} is {cap[0]}.{cap[1]}; set precision.float8: none"
        )
    if importlib.util.find_spec("torchao") is None:
        return f"precision.float8: {recipe} needs torchao: pip install torchao (titan-pipe's float8 extra)"
    return None


def _takes_float8(module: nn.Module, fqn: str) -> bool:
    return (
        isinstance(module, nn.Linear)
        and fqn.split(".")[-1] != "output"
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def apply_float8(part: nn.Module, recipe: str) -> nn.Module:
    """Swap ``part``'s eligible Linear layers for torchao's float8 ones (before TP, compile and FSDP,
    as torchao requires); parameter names and values are unchanged."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    return convert_to_float8_training(part, config=config, module_filter_fn=_takes_float8)
