"""The deployed graphs' interface: file names, input/output names and the decode contract, spelled once.

The exporter builds graphs with these names, the export record lists them, the generation loop
(titan_pipe.graphs.generation) feeds them and evaluate's runners read them (docs/export.md):

  model.onnx   prefill: input_ids, attention_mask, position_ids (B, T) -> logits (B, T, vocab)
               [+ present.{i}.key/value (B, Hkv, T, hd) with the KV cache] [+ hidden.{i} (B, T, dim)]
  decode.onnx  one step: input_ids, position_ids (B, 1), attention_mask (B, C), write_index (B,),
               past_key_values.{i}.key/value (B, Hkv, C, hd) -> logits (B, 1, vocab),
               present.{i}.key/value (B, Hkv, C, hd): the whole cache with slot write_index written
"""

from __future__ import annotations

PREFILL_FILE = "model.onnx"
DECODE_FILE = "decode.onnx"
DATA_FILE = "model.onnx.data"  # the weights both graphs share (external data), when they are one file

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
WRITE_INDEX = "write_index"
LOGITS = "logits"
PAST = "past_key_values."  # + "{i}.key" / "{i}.value"
PRESENT = "present."
HIDDEN = "hidden."  # + "{i}": the residual stream after layer i (debug exports)

PREFILL_INPUTS = (INPUT_IDS, ATTENTION_MASK, POSITION_IDS)
DECODE_INPUTS = (INPUT_IDS, POSITION_IDS, ATTENTION_MASK, WRITE_INDEX)
INT_INPUTS = frozenset(DECODE_INPUTS)  # int64; every other input and output is in the graph dtype
# How decode.onnx updates the cache: it writes the new key/value into slot write_index with Where
# over a one-hot of the slots and returns the whole cache (docs/export.md, "Decode cache").
CACHE_UPDATE = "whole_cache"


def data_file_names(count: int) -> tuple[str, ...]:
    """The external-data files the weights are split over (export.data_files = ``count``): DATA_FILE
    alone, or DATA_FILE-00001-of-0000N .. (numbered as sharded Hugging Face weights are; every name
    starts with DATA_FILE, so copying ``model.onnx*`` still takes the whole graph)."""
    if count == 1:
        return (DATA_FILE,)
    return tuple(f"{DATA_FILE}-{i:05d}-of-{count:05d}" for i in range(1, count + 1))


def kv_names(prefix: str, n_layers: int) -> list[str]:
    """``{prefix}{i}.key``, ``{prefix}{i}.value`` for every layer, in graph order."""
    return [f"{prefix}{i}.{kind}" for i in range(n_layers) for kind in ("key", "value")]


def hidden_name(i: int) -> str:
    return f"{HIDDEN}{i}"


def past_of(present: str) -> str:
    """The decode input a prefill/decode ``present.*`` output is fed back as."""
    return PAST + present.removeprefix(PRESENT)


def present_of(past: str) -> str:
    return PRESENT + past.removeprefix(PAST)


def router_name(i: int) -> str:
    """The experts layer ``i`` of a mixture of experts chose per token ((N, k) int64): a value of the
    exported graphs (titan_pipe.graphs.onnx_nodes.route names it), which evaluate's router row compares."""
    return f"layers.{i}.route.topk"


def io_names(n_layers: int, *, decode: bool, kv_cache: bool, expose_hidden: bool) -> tuple[list[str], list[str]]:
    """(input names, output names) of a graph, in graph order."""
    inputs = list(DECODE_INPUTS) + kv_names(PAST, n_layers) if decode else list(PREFILL_INPUTS)
    outputs = [LOGITS] + (kv_names(PRESENT, n_layers) if kv_cache or decode else [])
    if expose_hidden:
        outputs += [hidden_name(i) for i in range(n_layers)]
    return inputs, outputs
