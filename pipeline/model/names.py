"""Name tables: native (torchtitan-style) <-> Hugging Face LLaMA <-> Megatron (ModelArgs <-> LlamaConfig: hf_config).

The tables are derived from the parameter list (titan_pipe.model.params), never spelled here.

Native q/k rows are already in Hugging Face's rotate-half layout, so native <-> HF is renaming
only. (torchtitan/Meta checkpoints use interleaved RoPE pairs: their reader permutes q/k rows.)
"""

from __future__ import annotations

import re
from functools import lru_cache

from titan_pipe.model.families import FAMILIES
from titan_pipe.model.param_spec import Param
from titan_pipe.model.params import LAYER_PARAMS, LAYER_PREFIX, MODEL_PARAMS, param_of, split_layer


# (native pattern, Hugging Face pattern); {i} is the layer id. Derived from the parameter list.
# Stacked expert weights have no one Hugging Face name (one tensor per expert): hf_expert_key.
def hf_table(family: str | None = None) -> tuple[tuple[str, str], ...]:
    """(native pattern, Hugging Face pattern) of every parameter ``family``'s checkpoints may hold,
    in its spelling (its Family's hf_names; None: the list's own names)."""
    return (
        *((p.name, _hf_in(p, family)) for p in MODEL_PARAMS if p.scope == "first" and _held_by(p, family)),
        *(
            (f"{LAYER_PREFIX}{{i}}.{p.name}", f"model.layers.{{i}}.{_hf_in(p, family)}")
            for p in LAYER_PARAMS
            if not p.expert and _held_by(p, family)
        ),
        *((p.name, _hf_in(p, family)) for p in MODEL_PARAMS if p.scope == "last" and _held_by(p, family)),
    )


def _hf_in(p: Param, family: str | None) -> str:
    """``p``'s Hugging Face name in ``family``'s checkpoints (relative to the layer for per-layer ones)."""
    fam = FAMILIES.get(family)
    return p.hf if fam is None else dict(fam.hf_names).get(p.name, p.hf)


def _held_by(p: Param, family: str | None) -> bool:
    """Whether checkpoints of ``family`` (None: a family not named) may hold ``p``: any, unless some
    family holds it alone (Family.own_params)."""
    owners = [f.model_type for f in FAMILIES.values() if p.name in f.own_params]
    return not owners or family in owners


NATIVE_TO_HF = hf_table()
# Mixtral spells the mixture-of-experts names of the list (Qwen3-MoE's) its own way.
MIXTRAL_SPELLING = {
    "mlp.gate.weight": "block_sparse_moe.gate.weight",
    "mlp.experts.{e}.gate_proj.weight": "block_sparse_moe.experts.{e}.w1.weight",
    "mlp.experts.{e}.up_proj.weight": "block_sparse_moe.experts.{e}.w3.weight",
    "mlp.experts.{e}.down_proj.weight": "block_sparse_moe.experts.{e}.w2.weight",
}
MOE_FAMILIES = ("qwen3_moe", "mixtral")


def _compile(pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(pattern).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{e\}", r"(?P<e>\d+)") + "$")


@lru_cache(maxsize=None)
def _tables(family: str | None) -> tuple[list, list]:
    """(native -> HF, HF -> native) compiled patterns of ``family`` (Mixtral's router names too)."""
    table = hf_table(family)
    n2h = [(_compile(n), h) for n, h in table]
    h2n = [(_compile(h), n) for n, h in table]
    h2n += [
        (_compile(f"model.layers.{{i}}.{MIXTRAL_SPELLING[p.hf]}"), f"{LAYER_PREFIX}{{i}}.{p.name}")
        for p in LAYER_PARAMS
        if p.hf in MIXTRAL_SPELLING and not p.expert
    ]
    return n2h, h2n


_EXPERT_HF = [
    (_compile(f"model.layers.{{i}}.{spelling}"), f"{LAYER_PREFIX}{{i}}.{p.name}")
    for p in LAYER_PARAMS
    if p.expert
    for spelling in (p.hf, MIXTRAL_SPELLING[p.hf])
]


def _translate(name: str, table) -> str:
    for rx, target in table:
        m = rx.match(name)
        if m:
            return target.format(**m.groupdict())
    raise KeyError(name)


def native_to_hf(name: str, family: str | None = None) -> str:
    """The Hugging Face name of a native parameter, in ``family``'s spelling (Mixtral's MoE router,
    Gemma 3's norms)."""
    try:
        hf = _translate(name, _tables(family)[0])
    except KeyError:
        raise KeyError(f"no Hugging Face name for native parameter {name!r} (titan_pipe.model.names)") from None
    lid, rest = split_layer(name)
    if family == "mixtral" and lid is not None and param_of(name).hf in MIXTRAL_SPELLING:
        return f"model.layers.{lid}." + spell_hf(param_of(name).hf, family)
    return hf


def hf_to_native(name: str, family: str | None = None) -> str:
    """The native name of a Hugging Face tensor name of a ``family`` checkpoint (its spelling: Gemma 3's
    post_attention_layernorm is the norm after attention, Llama's the norm before the MLP)."""
    try:
        return _translate(name, _tables(family)[1])
    except KeyError:
        raise KeyError(f"no native name for Hugging Face parameter {name!r} (titan_pipe.model.names)") from None


def spell_hf(hf: str, family: str) -> str:
    """A layer-relative Hugging Face name of the list in ``family``'s spelling (Mixtral renames the
    mixture-of-experts tensors; every other name is the list's)."""
    return MIXTRAL_SPELLING.get(hf, hf) if family == "mixtral" else hf


def hf_expert_key(native: str, expert: int, family: str) -> str:
    """The Hugging Face name of expert ``expert``'s slice (dim 0) of a stacked expert parameter
    (``layers.3.moe.experts.w1`` -> ``model.layers.3.mlp.experts.5.gate_proj.weight``)."""
    lid, rest = split_layer(native)
    p = param_of(native)
    if lid is None or not p.expert:
        raise KeyError(f"{native!r} is not a stacked expert parameter (titan_pipe.model.params)")
    return f"model.layers.{lid}." + spell_hf(p.hf, family).format(e=expert)


def parse_hf_expert(name: str) -> tuple[str, int] | None:
    """(native stacked parameter, expert index) of a Hugging Face per-expert tensor name in either
    family's spelling; None for a name that is not one."""
    for rx, target in _EXPERT_HF:
        m = rx.match(name)
        if m:
            return target.format(i=m["i"]), int(m["e"])
    return None


# ---------------------------------------------------------------------------------------------
# The tables of the other source formats (the native names and shapes: titan_pipe.model.params)

# torchtitan / Meta (DCP) names are the native names; only the q/k row order differs (interleaved
# RoPE pairs), which the DCP reader undoes. Full training checkpoints nest the model under "model.".
TORCHTITAN_MODEL_PREFIX = "model."

# Megatron-LM (megatron-core GPTModel) names, with {i} the layer index LOCAL to a pipeline stage.
# Values: the native name, or a fused tensor the Megatron reader splits (qkv, fc1).
MEGATRON_TO_NATIVE: tuple[tuple[str, str], ...] = tuple(
    dict.fromkeys(
        (
            *((m, p.name) for p in MODEL_PARAMS if p.scope == "first" for m in p.megatron),
            *(
                (f"decoder.layers.{{i}}.{m}", f"<{p.fused[0]}>" if p.fused else f"{LAYER_PREFIX}{{i}}.{p.name}")
                for p in LAYER_PARAMS
                for m in p.megatron
            ),
            *((m, p.name) for p in MODEL_PARAMS if p.scope == "last" for m in p.megatron),
        )
    )
)
_M2N = [(_compile(m), n) for m, n in MEGATRON_TO_NATIVE]


# Megatron-LM's legacy rank files keep each SequentialMLP expert of the rank as a module of its own
# (``local_experts.{e}``, e local to the ep rank) where dist checkpoints stack them ("experts.experts.").
_M2N_LOCAL_EXPERT = [
    (
        _compile("decoder.layers.{i}." + m.replace("experts.experts.", "experts.local_experts.{e}.")),
        f"<{p.fused[0]}>" if p.fused else f"{LAYER_PREFIX}{{i}}.{p.name}",
    )
    for p in LAYER_PARAMS
    if p.expert
    for m in p.megatron
]


def megatron_local_expert(name: str, layer_offset: int) -> tuple[str, int] | None:
    """(native stacked name, or '<expert_fc1>:gid', and the expert's index local to its ep rank) of a
    legacy Megatron expert key (``decoder.layers.3.mlp.experts.local_experts.1.linear_fc2.weight``);
    None for any other key."""
    for rx, target in _M2N_LOCAL_EXPERT:
        m = rx.match(name)
        if m:
            gid = int(m["i"]) + layer_offset
            return (f"{target}:{gid}" if target.startswith("<") else target.format(i=gid)), int(m["e"])
    return None


# megatron-core's dist checkpoints saved with ``singleton_local_shards``: each SequentialMLP expert
# under a key of its own (``experts.experts.{e}.``, e global, no expert axis) and a SwiGLU fc1 as two
# tensors, gate ``weight_w`` and up ``weight_v`` (megatron/core/transformer/mlp.py, moe/experts.py).
_SINGLETON_PART = {"gate": "_w", "up": "_v"}
_M2N_SINGLETON = [
    (
        _compile(
            "decoder.layers.{i}."
            + m.replace("experts.experts.", "experts.experts.{e}.")
            + (_SINGLETON_PART[p.fused[1]] if p.fused else "")
        ),
        f"{LAYER_PREFIX}{{i}}.{p.name}",
    )
    for p in LAYER_PARAMS
    for m in p.megatron
    if (p.expert or (p.fused and p.fused[0] == "fc1")) and (not p.fused or p.fused[1] in _SINGLETON_PART)
]


def megatron_singleton(name: str) -> tuple[str, int | None] | None:
    """(native name, global expert index or None) of a key of a ``singleton_local_shards`` save
    (``decoder.layers.3.mlp.experts.experts.5.linear_fc1.weight_v`` -> ('layers.3.moe.experts.w3', 5);
    ``decoder.layers.0.mlp.linear_fc1.weight_w`` -> ('layers.0.feed_forward.w1.weight', None)); None
    for any other key."""
    for rx, target in _M2N_SINGLETON:
        m = rx.match(name)
        if m:
            e = m.groupdict().get("e")
            return target.format(i=int(m["i"])), None if e is None else int(e)
    return None


def megatron_to_native(name: str, layer_offset: int) -> str | None:
    """Native name (or '<qkv>'/'<fc1>' with the global layer id: '<qkv>:5') of a Megatron key.

    None for keys that hold no weights (``_extra_state`` of Transformer Engine modules); KeyError
    for anything else unknown (a bias, an MoE expert...), which the reader reports.
    """
    if name.endswith("._extra_state"):
        return None
    for rx, target in _M2N:
        m = rx.match(name)
        if m:
            i = m.groupdict().get("i")
            gid = None if i is None else int(i) + layer_offset
            if target.startswith("<"):
                return f"{target}:{gid}"
            return target.format(i=gid) if gid is not None else target
    raise KeyError(f"no native name for Megatron parameter {name!r} (titan_pipe.model.names)")
