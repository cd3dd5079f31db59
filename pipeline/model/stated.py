"""The checkpoint is the source of truth: a model read from ``init_from``, compared with what flow.yaml states.

``checkpoint_args(path)`` reads the architecture a titan-pipe checkpoint (its manifest), a unified
or Hugging Face dir (config.json, the head's tie as its weights store it) holds, no tensor data
read. ``stated_conflicts`` compares it with flow.yaml's ``model`` section: every key the user
wrote (an explicit ``null`` included: ``rope_scaling: null`` is a value, "no scaling") and, where a
``flavour`` is written, every architecture value the flavour brings. A difference is one line naming
both values; nothing the file states is silently replaced by the checkpoint's value, and nothing the
checkpoint holds by a flavour's or a default's.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from titan_pipe.weights.detect import open_source, other_format
from titan_pipe.records.checkpoint_format import MANIFEST_NAME, Manifest, complete_step
from titan_pipe.model import features
from titan_pipe.model.args import ModelArgs
from titan_pipe.model.unified_dir import read_model_args
from titan_pipe.tokens.model_files import GENERATION_CONFIG, dir_token_ids, generation_config

# ModelArgs value -> the resolved property two architectures are compared on (a field that only
# helps derive another, like multiple_of for the FFN width, is compared through what it derives).
COMPARED: dict[str, str] = {
    "dim": "dim",
    "n_layers": "n_layers",
    "n_heads": "n_heads",
    "n_kv_heads": "kv_heads",
    "head_dim": "head_dim",
    "vocab_size": "vocab_size",
    "multiple_of": "hidden_dim",
    "ffn_dim_multiplier": "hidden_dim",
    "ffn_hidden_dim": "hidden_dim",
    "norm_eps": "norm_eps",
    "rope_theta": "rope_theta",
    "rope_scaling": "rope_scaling",
    "max_seq_len": "max_seq_len",
    **features.compared(),  # the features' switches and values
    "activation": "activation",
}
# Training choices, not architecture: a value given in flow.yaml is used over the checkpoint's.
TRAINING_FIELDS = ("router_aux_loss_coef",)


def checkpoint_args(path: Path) -> ModelArgs:
    """The model a checkpoint step dir (a run dir or its checkpoints/: the newest complete step) or a
    unified / Hugging Face model dir holds, from its manifest or config.json (UserError if unusable)."""
    step = complete_step(path)
    if step is not None:
        return ModelArgs.from_dict(Manifest.load(step).model, source=step / MANIFEST_NAME)
    if other_format(path):
        plan, store = open_source(path)  # a DCP / torchtitan or Megatron-LM checkpoint: its reader's model
        store.close()
        return plan.args
    return read_model_args(path)


def checkpoint_side(path: Path) -> tuple[dict, dict[str, Path]]:
    """(token ids, {name: file}) a checkpoint carries beside its weights for the next one: a step
    dir's manifest extra.token_ids and attached generation_config.json, a model dir's config.json ids
    and generation_config.json (titan_pipe.tokens.model_files)."""
    step = complete_step(path)
    if step is None:
        g = generation_config(path)
        return dir_token_ids(path), ({GENERATION_CONFIG: g} if g is not None else {})
    extra = Manifest.load(step).extra
    files = {GENERATION_CONFIG: step / GENERATION_CONFIG} if GENERATION_CONFIG in extra.attached else {}
    return dict(extra.token_ids or {}), files


def _shown(value: object) -> str:
    if value is None:
        return "null"
    if hasattr(value, "factor") and getattr(value, "rope_type", "llama3") == "linear":  # RopeScaling
        return f"{{rope_type: linear, factor: {value.factor:g}}}"
    if hasattr(value, "factor"):
        return (
            f"{{factor: {value.factor:g}, low_freq_factor: {value.low_freq_factor:g}, high_freq_factor: "
            f"{value.high_freq_factor:g}, original_max_position_embeddings: "
            f"{value.original_max_position_embeddings}}}"
        )
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return str(list(value))
    return str(value).lower() if isinstance(value, bool) else str(value)


def stated_conflicts(
    stated: ModelArgs, given: set[str], held: ModelArgs, *, flavour: str | None, where: str
) -> list[str]:
    """One line per architecture key flow.yaml writes that differs from the checkpoint's, and one line
    for all the values a written ``flavour`` brings that differ.

    ``stated``: flow.yaml's model resolved (flavour + keys); ``given``: the model keys the file
    writes (``flavour`` among them where it names one: then every architecture value is stated);
    ``held``: the checkpoint's model, read at ``where``.
    """
    out, seen, brought = [], set(), []
    for key in COMPARED:
        prop = COMPARED[key]
        by_flavour = key not in given
        if prop in seen or (by_flavour and not ("flavour" in given and flavour is not None)):
            continue
        a, b = getattr(stated, prop), getattr(held, prop)
        if a == b:
            continue
        seen.add(prop)
        shown = (_shown(getattr(stated, key) if key == prop else a), _shown(getattr(held, key) if key == prop else b))
        if by_flavour:
            brought.append(f"{prop} {shown[0]} vs {shown[1]}")
            continue
        out.append(
            f"model.{key}: {shown[0]} but init_from {where} holds {shown[1]}; remove model.{key} (the "
            "checkpoint states the architecture) or point init_from at the model you mean"
        )
    if brought:
        out.append(
            f"model.flavour: {flavour} brings {', '.join(brought)} (flavour vs init_from {where}); remove "
            "model.flavour (the checkpoint states the architecture) or point init_from at the model you mean"
        )
    return out


def with_training_fields(held: ModelArgs, stated: ModelArgs, given: set[str]) -> ModelArgs:
    """The checkpoint's model with the training-only values flow.yaml gives laid over it."""
    return replace(held, **{k: getattr(stated, k) for k in TRAINING_FIELDS if k in given})
