"""Name tables: native (torchtitan-style) <-> Hugging Face LLaMA <-> Megatron (ModelArgs <-> LlamaConfig: hf_config).

The tables are derived from the parameter list (titan_pipe.model.params), never spelled here.

Native q/k rows are already in Hugging Face's rotate-half layout, so native <-> HF is renaming
only. (torchtitan/Meta checkpoints use interleaved RoPE pairs: their reader permutes q/k rows.)
"""
from __future__ import annotations

import re

from titan_pipe.model.params import LAYER_PARAMS, LAYER_PREFIX, MODEL_PARAMS

# (native pattern, Hugging Face pattern); {i} is the layer id. Derived from the parameter list.
NATIVE_TO_HF: tuple[tuple[str, str], ...] = (
    *((p.name, p.hf) for p in MODEL_PARAMS if p.scope == "first"),
    *((f"{LAYER_PREFIX}{{i}}.{p.name}", f"model.layers.{{i}}.{p.hf}") for p in LAYER_PARAMS),
    *((p.name, p.hf) for p in MODEL_PARAMS if p.scope == "last"),
)


def _compile(pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(pattern).replace(r"\{i\}", r"(?P<i>\d+)") + "$")


_N2H = [(_compile(n), h) for n, h in NATIVE_TO_HF]
_H2N = [(_compile(h), n) for n, h in NATIVE_TO_HF]


def _translate(name: str, table) -> str:
    for rx, target in table:
        m = rx.match(name)
        if m:
            return target.format(**m.groupdict())
    raise KeyError(name)


def native_to_hf(name: str) -> str:
    try:
        return _translate(name, _N2H)
    except KeyError:
        raise KeyError(f"no Hugging Face name for native parameter {name!r} (titan_pipe.model.names)") from None


def hf_to_native(name: str) -> str:
    try:
        return _translate(name, _H2N)
    except KeyError:
        raise KeyError(f"no native name for Hugging Face parameter {name!r} (titan_pipe.model.names)") from None


# ---------------------------------------------------------------------------------------------
# The tables of the other source formats (the native names and shapes: titan_pipe.model.params)

# torchtitan / Meta (DCP) names are the native names; only the q/k row order differs (interleaved
# RoPE pairs), which the DCP reader undoes. Full training checkpoints nest the model under "model.".
TORCHTITAN_MODEL_PREFIX = "model."

# Megatron-LM (megatron-core GPTModel) names, with {i} the layer index LOCAL to a pipeline stage.
# Values: the native name, or a fused tensor the Megatron reader splits (qkv, fc1).
MEGATRON_TO_NATIVE: tuple[tuple[str, str], ...] = tuple(dict.fromkeys((
    *((m, p.name) for p in MODEL_PARAMS if p.scope == "first" for m in p.megatron),
    *((f"decoder.layers.{{i}}.{m}", f"<{p.fused[0]}>" if p.fused else f"{LAYER_PREFIX}{{i}}.{p.name}")
      for p in LAYER_PARAMS for m in p.megatron),
    *((m, p.name) for p in MODEL_PARAMS if p.scope == "last" for m in p.megatron),
)))
_M2N = [(_compile(m), n) for m, n in MEGATRON_TO_NATIVE]


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
