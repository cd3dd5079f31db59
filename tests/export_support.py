"""Helpers for the export tests: write unified model dirs directly (no converter involved)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from titan_pipe.model.args import ModelArgs, resolve_args
from titan_pipe.model.names import native_to_hf
from titan_pipe.model.hf_config import to_hf_config
from titan_pipe.model.transformer import Transformer, build_model


def random_norms(model: Transformer, seed: int = 3) -> None:
    """Norm weights away from 1, so a swapped or dropped norm cannot pass a comparison."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)


def debug_model(seed: int = 0, **overrides) -> tuple[Transformer, ModelArgs]:
    args = resolve_args("debug", **overrides)
    model = build_model(args, seed=seed).eval()
    random_norms(model)
    return model, args


def write_unified(
    model: Transformer,
    args: ModelArgs,
    out: Path,
    *,
    hf_names: bool = True,
    shards: int = 1,
    dtype: torch.dtype | None = None,
) -> Path:
    """A unified dir: config.json + model.safetensors (or ``shards`` files + index)."""
    out.mkdir(parents=True, exist_ok=True)
    sd = {}
    for k, v in model.state_dict().items():
        if k.startswith("rope_") or (args.tie_embeddings and k == "output.weight"):
            continue
        v = v.detach().contiguous()
        sd[native_to_hf(k) if hf_names else k] = v.to(dtype) if dtype is not None else v
    (out / "config.json").write_text(json.dumps(to_hf_config(args)))
    if shards == 1:
        save_file(sd, str(out / "model.safetensors"))
        return out
    keys = sorted(sd)
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: sd[k] for k in keys[s::shards]}
        save_file(part, str(out / name))
        weight_map.update({k: name for k in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def hidden_states(model: Transformer, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Hidden state after each decoder layer, from the model's own layers (the reference)."""
    h = model.tok_embeddings(tokens)
    t = tokens.shape[1]
    cos, sin = model.rope_cos[:t], model.rope_sin[:t]
    out = []
    for layer in model.layers.values():
        h = layer(h, cos, sin)
        out.append(h)
    return out
