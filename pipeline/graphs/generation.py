"""Reference greedy generation with the exported pair: a left-padded batch, one prefill, then
decode.onnx step by step against a fixed-capacity KV cache — the loop a deployment runs.

Part of the deployed-graph contract (titan_pipe.graphs.graph_io names every input and output it feeds):
the exporter builds graphs this loop drives, evaluate drives them with it.

Works with any session object that has ONNX Runtime's ``run(output_names, feeds)`` and
``get_inputs()`` (an ``ais_bench`` wrapper on an Ascend host can offer the same two), on static
graphs (every dim fixed) and dynamic ones alike. The host state is exactly what an Ascend host
keeps (docs/export.md, "Running the static decode loop"):

  cache      present.{i}.key/value (B, Hkv, C, hd): prefill's T slots copied into slots 0..T-1,
             then each decode step's output replaces it (decode.onnx returns the whole cache)
  slot_mask  (B, C) int64: 1 where a slot holds a real token (prompt tokens, then one slot per step)
  positions  (B,) int64: each row's count of real tokens so far = the next token's position
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from titan_pipe.errors import UserError
from titan_pipe.graphs.graph_io import (
    ATTENTION_MASK,
    INPUT_IDS,
    LOGITS,
    PAST,
    POSITION_IDS,
    PRESENT,
    WRITE_INDEX,
    past_of,
    present_of,
)


@dataclass(frozen=True)
class Generation:
    """new_tokens (N, n_new) int64; logits (N, n_new, vocab) float32, row k predicting new token k."""

    new_tokens: np.ndarray
    logits: np.ndarray

    def sequences(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        return [list(p) + row.tolist() for p, row in zip(prompts, self.new_tokens)]


def ort_session(source, *, threads: int = 0, external_dir: Path | None = None, hint: str = "", prepack: bool = True):
    """An ONNX Runtime CPU session: the one way titan-pipe opens a graph (the generation loop,
    evaluate's runners, its per-layer pieces and its operator graphs).

    ``source``: a graph file, or a ModelProto / its bytes (a copy or a piece of a graph), whose
    external data is then read from ``external_dir``. UserError if ONNX Runtime cannot load it;
    ``hint`` says what to do then (default: re-export). ``prepack`` False: ONNX Runtime leaves the
    MatMul weights as they are at session start instead of copying them into its packed layout
    (``session.disable_prepacking``): for a session run a few dozen times, as evaluate's are, the
    packing costs more time and memory than it saves (docs/evaluate.md); results differ by rounding.
    """
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if threads:
        opts.intra_op_num_threads = threads
    if not prepack:
        opts.add_session_config_entry("session.disable_prepacking", "1")
    if isinstance(source, (str, Path)):
        where = Path(source)
        if not where.is_file():
            raise UserError(f"{where}: ONNX file not found; pass the output directory of `titan-pipe export`")
        source = str(where)
    else:
        where = Path(external_dir or ".") / "(graph in memory)"
        source = source if isinstance(source, bytes) else source.SerializeToString()
        if external_dir is not None:
            opts.add_session_config_entry(
                "session.model_external_initializers_file_folder_path", str(Path(external_dir).resolve())
            )
    try:
        return ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # ORT's own exception types (InvalidGraph, NoSuchFile, ...), protobuf errors
        raise UserError(
            f"{where}: ONNX Runtime cannot load it: {str(e).splitlines()[0][:300]}; "
            f"{hint or 're-export it with `titan-pipe export`'}"
        ) from None


def _dims(session) -> dict[str, list]:
    return {i.name: list(i.shape) for i in session.get_inputs()}


def _fixed(d) -> int | None:
    return d if isinstance(d, int) and d > 0 else None


def left_pad(prompts: Sequence[Sequence[int]], length: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, attention_mask), each (N, length) int64, prompts aligned to the right."""
    ids = np.full((len(prompts), length), pad_id, dtype=np.int64)
    mask = np.zeros((len(prompts), length), dtype=np.int64)
    for r, p in enumerate(prompts):
        if len(p):
            ids[r, length - len(p) :] = np.asarray(p, dtype=np.int64)
            mask[r, length - len(p) :] = 1
    return ids, mask


def check_mask(attention_mask: np.ndarray) -> np.ndarray:
    """Row lengths (B,) of a left-padded 0/1 mask; UserError on an all-zero or not left-padded row."""
    m = np.asarray(attention_mask)
    if m.ndim != 2 or not np.isin(m, (0, 1)).all():
        raise UserError(f"attention_mask of shape {list(m.shape)}: expected (B, T) of 0/1; pass 1 for real tokens")
    lengths = m.sum(axis=1)
    empty = np.flatnonzero(lengths == 0)
    if empty.size:
        raise UserError(
            f"attention_mask row {int(empty[0])} is all zeros (an empty prompt): nothing to attend to; "
            "give every prompt at least one token"
        )
    bad = np.flatnonzero((np.diff(m, axis=1) < 0).any(axis=1))
    if bad.size:
        raise UserError(
            f"attention_mask row {int(bad[0])} has padding after a real token; pad on the left (0s first, then 1s)"
        )
    return lengths


@dataclass(frozen=True)
class PaddedBatch:
    """One left-padded batch of the loop: ids, mask (B, T) int64; the first ``n_real`` rows are real
    prompts (the rest fill a static batch); ``forced`` (B, n_new) or None; ``cache_len`` slots C."""

    ids: np.ndarray
    mask: np.ndarray
    cache_len: int
    n_real: int
    forced: np.ndarray | None = None


def plan_batches(
    *,
    prefill,
    decode,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    cache_len: int | None = None,
    pad_id: int = 0,
    forced: np.ndarray | None = None,
) -> list[PaddedBatch]:
    """The batches ``generate`` runs, as data (see ``generate`` for the rules and the errors)."""
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens {max_new_tokens}: generate at least one token")
    pd, dd = _dims(prefill), _dims(decode)
    b_fixed, t_fixed = _fixed(pd[INPUT_IDS][0]), _fixed(pd[INPUT_IDS][1])
    c_fixed = _fixed(dd[ATTENTION_MASK][1])
    for r, p in enumerate(prompts):
        if len(p) == 0:
            raise UserError(
                f"prompt {r} is empty (its attention_mask row would be all zeros); give every prompt at least one token"
            )
        if t_fixed is not None and len(p) > t_fixed:
            raise UserError(
                f"prompt {r} has {len(p)} tokens but the static prefill graph takes {t_fixed}; shorten "
                f"it or re-export with --seq-len {len(p)} or more"
            )
    if forced is not None and np.asarray(forced).shape != (len(prompts), max_new_tokens):
        raise UserError(
            f"forced tokens of shape {list(np.asarray(forced).shape)}: expected "
            f"[{len(prompts)}, {max_new_tokens}] (prompts x new tokens)"
        )
    step = b_fixed or len(prompts)
    plan = []
    for start in range(0, len(prompts), step):
        chunk = list(prompts[start : start + step])
        f = None if forced is None else np.asarray(forced)[start : start + step]
        n_real = len(chunk)
        if b_fixed is not None and n_real < b_fixed:  # fill a static batch
            chunk += [chunk[0]] * (b_fixed - n_real)
            f = None if f is None else np.concatenate([f, np.repeat(f[:1], b_fixed - n_real, axis=0)])
        t = t_fixed or max(len(p) for p in chunk)
        ids, mask = left_pad(chunk, t, pad_id)
        c = c_fixed or cache_len or t + max_new_tokens - 1
        _check_capacity(t, max_new_tokens, c)
        plan.append(PaddedBatch(ids, mask, c, n_real, f))
    return plan


def _check_capacity(t: int, max_new_tokens: int, cache_len: int) -> None:
    if t + max_new_tokens - 1 > cache_len:
        raise UserError(
            f"a prompt of {t} tokens (padded) plus {max_new_tokens} new tokens needs "
            f"{t + max_new_tokens - 1} cache slots but the cache has {cache_len}; generate fewer tokens, "
            f"shorten the prompt, or re-export with --cache-len {t + max_new_tokens - 1} or more"
        )


def prefill_feeds(batch: PaddedBatch) -> dict[str, np.ndarray]:
    """The prefill graph's inputs: ids, mask and each token's position (row count of real tokens - 1)."""
    positions = np.maximum(np.cumsum(batch.mask, axis=1) - 1, 0)
    return {INPUT_IDS: batch.ids, ATTENTION_MASK: batch.mask, POSITION_IDS: positions}


def cache_of(kv: np.ndarray, cache_len: int) -> np.ndarray:
    """A prefill present.* (B, Hkv, T, hd) placed in slots 0..T-1 of a (B, Hkv, C, hd) cache."""
    buf = np.zeros(kv.shape[:2] + (cache_len,) + kv.shape[3:], dtype=kv.dtype)
    buf[:, :, : kv.shape[2]] = kv
    return buf


def decode_feeds(batch: PaddedBatch, k: int, tokens: np.ndarray) -> dict[str, np.ndarray]:
    """Decode step k's inputs besides the cache: new token k ``tokens`` (B,) at slot T+k, position
    (row length + k), the slot mask with slots 0..T+k (a fresh array per step)."""
    b, t = batch.ids.shape
    slot_mask = np.zeros((b, batch.cache_len), dtype=np.int64)
    slot_mask[:, :t] = batch.mask
    slot_mask[:, t : t + k + 1] = 1
    lengths = batch.mask.sum(axis=1)
    return {
        INPUT_IDS: np.asarray(tokens, dtype=np.int64).reshape(b, 1).copy(),
        POSITION_IDS: (lengths + k)[:, None].astype(np.int64),
        ATTENTION_MASK: slot_mask,
        WRITE_INDEX: np.full((b,), t + k, dtype=np.int64),
    }


def kv_names_of(prefill, decode) -> tuple[list[str], list[str]]:
    """(prefill's present.* outputs, decode's past_key_values.* inputs); UserError if they do not pair."""
    present = [o.name for o in prefill.get_outputs() if o.name.startswith(PRESENT)]
    past = [i.name for i in decode.get_inputs() if i.name.startswith(PAST)]
    if not present or len(present) != len(past):
        raise UserError(
            f"the prefill graph gives {len(present)} {PRESENT}* outputs but the decode graph takes "
            f"{len(past)} {PAST}* inputs; export both from one model with the KV cache"
        )
    return present, past


def generate(
    *,
    prefill,
    decode,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    cache_len: int | None = None,
    pad_id: int = 0,
    forced: np.ndarray | None = None,
) -> Generation:
    """Greedy generation for ragged ``prompts`` (lists of token ids), left-padded into batches.

    Static graphs fix the batch B, prompt length T and cache slots C: prompts run B at a time
    (a short last batch is filled with copies of its first prompt, dropped afterwards) and each
    is left-padded to T. Dynamic graphs take all prompts at once, T = the longest prompt, and
    C = ``cache_len`` or T + max_new_tokens - 1. ``forced`` (N, max_new_tokens): feed these tokens
    instead of the argmax (teacher forcing), so the logits can be set against another model's on
    the very same sequences. UserError for an empty prompt, a prompt longer than T, or a cache
    too small for prompt + new tokens.
    """
    parts = []
    for batch in plan_batches(
        prefill=prefill,
        decode=decode,
        prompts=prompts,
        max_new_tokens=max_new_tokens,
        cache_len=cache_len,
        pad_id=pad_id,
        forced=forced,
    ):
        g = generate_padded(
            prefill=prefill,
            decode=decode,
            input_ids=batch.ids,
            attention_mask=batch.mask,
            max_new_tokens=max_new_tokens,
            cache_len=batch.cache_len,
            forced=batch.forced,
        )
        parts.append(Generation(g.new_tokens[: batch.n_real], g.logits[: batch.n_real]))
    return Generation(np.concatenate([p.new_tokens for p in parts]), np.concatenate([p.logits for p in parts]))


def generate_padded(
    *,
    prefill,
    decode,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    max_new_tokens: int,
    cache_len: int,
    forced: np.ndarray | None = None,
) -> Generation:
    """The loop on one left-padded batch: input_ids, attention_mask (B, T) -> Generation.

    Prefill fills cache slots 0..T-1; decode step k feeds new token k at slot T+k and position
    (row length + k). The last new token is never fed, so the cache needs T + max_new_tokens - 1
    slots.
    """
    batch = PaddedBatch(
        np.asarray(input_ids, dtype=np.int64),
        np.asarray(attention_mask, dtype=np.int64),
        cache_len,
        len(input_ids),
        forced,
    )
    check_mask(batch.mask)
    _check_capacity(batch.ids.shape[1], max_new_tokens, cache_len)
    present, past = kv_names_of(prefill, decode)
    res = prefill.run([LOGITS] + present, prefill_feeds(batch))
    logits = res[0][:, -1]
    cache = {past_of(name): cache_of(kv, cache_len) for name, kv in zip(present, res[1:])}
    new_tokens = np.zeros((len(batch.ids), max_new_tokens), dtype=np.int64)
    all_logits = []
    out_names = [LOGITS] + [present_of(p) for p in past]
    for k in range(max_new_tokens):
        all_logits.append(logits.astype(np.float32))
        new_tokens[:, k] = forced[:, k] if forced is not None else logits.argmax(-1)
        if k + 1 == max_new_tokens:
            break
        res = decode.run(out_names, {**decode_feeds(batch, k, new_tokens[:, k]), **cache})
        logits = res[0][:, -1]
        cache = dict(zip(past, res[1:]))
    return Generation(new_tokens, np.stack(all_logits, axis=1))
