"""ZeRO stage 1: optimizer states sharded over dp with torch's ZeroRedundancyOptimizer (DDP keeps
whole parameters and gradients), and its state in the same flattened, FQN-keyed form as
``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``, so a ZeRO-1 checkpoint
resumes without ZeRO (or under another dp) and the other way round."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.optim import ZeroRedundancyOptimizer

_CLASSES = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


def build_zero1(params: list[nn.Parameter], group: ProcessGroup, *, name: str, **hparams) -> ZeroRedundancyOptimizer:
    """Each dp rank keeps optimizer state for its 1/dp of the parameters and broadcasts them
    after its step. ``hparams``: lr, betas, eps, weight_decay (as for build_optimizer)."""
    if name not in _CLASSES:
        raise ValueError(f"train.optimizer.name {name!r} is not one of {', '.join(_CLASSES)}")
    if name == "sgd":
        hparams = {k: v for k, v in hparams.items() if k in ("lr", "weight_decay")}
    return ZeroRedundancyOptimizer(params, optimizer_class=_CLASSES[name], process_group=group, **hparams)


def _owned(opt: ZeroRedundancyOptimizer) -> list[nn.Parameter]:
    return [p for g in opt.optim.param_groups for p in g["params"]]


@torch.no_grad()
def _ensure_state(opt: ZeroRedundancyOptimizer) -> None:
    """Materialize lazily created state (e.g. Adam moments) with a zero-LR step on zero grads,
    so there are tensors for DCP to load into."""
    owned = _owned(opt)
    if not owned or all(p in opt.optim.state for p in owned):
        return
    lrs = [g["lr"] for g in opt.optim.param_groups]
    grads = [p.grad for p in owned]
    for g in opt.optim.param_groups:
        g["lr"] = 0.0
    for p in owned:
        p.grad = torch.zeros_like(p)
    opt.optim.step()
    for g, lr in zip(opt.optim.param_groups, lrs):
        g["lr"] = lr
    for p, g in zip(owned, grads):
        p.grad = g


def zero1_state(opt: ZeroRedundancyOptimizer, fqns: dict[nn.Parameter, str]) -> dict:
    """Flattened state of the parameters this rank owns: ``state.<fqn>.<key>`` and
    ``param_groups.<fqn>.<key>`` (keys of different dp ranks are disjoint)."""
    _ensure_state(opt)
    flat: dict = {}
    # Hyperparameters come from the wrapper's groups (index-aligned with the inner ones): an LR
    # scheduler edits those, and the inner copy only catches up at the next step().
    for inner, outer in zip(opt.optim.param_groups, opt.param_groups):
        for p in inner["params"]:
            fqn = fqns[p]
            for k, v in opt.optim.state.get(p, {}).items():
                flat[f"state.{fqn}.{k}"] = v
            for k, v in outer.items():
                if k != "params":
                    flat[f"param_groups.{fqn}.{k}"] = v
    return flat


def load_zero1_state(opt: ZeroRedundancyOptimizer, fqns: dict[nn.Parameter, str], flat: dict) -> None:
    """Put a (DCP-loaded) flattened state back into the owned parameters' optimizer state."""
    for group in opt.optim.param_groups:
        for p in group["params"]:
            fqn = fqns[p]
            prefix = f"state.{fqn}."
            opt.optim.state[p] = {k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix)}
            lr = flat.get(f"param_groups.{fqn}.lr")
            if lr is not None:
                group["lr"] = lr
    # The wrapper's own param_groups (which LR schedulers edit) follow the inner optimizer's.
    for outer in opt.param_groups:
        owned = [p for p in outer["params"] if p in opt.optim.state]
        if owned:
            lr = flat.get(f"param_groups.{fqns[owned[0]]}.lr")
            if lr is not None:
                outer["lr"] = lr
