"""Sliding-window attention (Mistral; Qwen2/3 with use_sliding_window; Gemma 3's local layers): a
query sees the ``sliding_window`` newest positions, itself included. Which layers slide is
ModelArgs.layer_window (every layer, or the local ones beside global layers).
Field ``model.sliding_window`` (None: full causal attention).

It owns the window's explicit mask the planner charges, the exported graphs' window term, and how a
Megatron-LM checkpoint states it (``window_size``). How a config.json states it is its family's
(titan_pipe.model.families: Mistral, Qwen, Gemma 3 each spell it otherwise)."""

from __future__ import annotations

from pathlib import Path

from titan_pipe.errors import UserError
from titan_pipe.model.features.feature import Feature
from titan_pipe.rules import limits
from titan_pipe.rules.limits import Bound


def applies(args) -> bool:
    """Whether a window cuts anything: one shorter than the positions the model takes."""
    return args.sliding_window is not None and args.sliding_window < args.max_seq_len


def _mask_bytes(args, seq_len: int, elem_bytes: float) -> float:
    """The explicit (T, T) mask a masked attention keeps for backward (an additive bias in the
    compute dtype), per layer and microbatch averaged over the layers (a global layer has none)."""
    w = args.sliding_window
    if w >= seq_len:
        return 0.0
    sliding = sum(args.layer_window(i) is not None for i in range(args.n_layers)) / args.n_layers
    return elem_bytes * seq_len * seq_len * sliding


def _onnx_mask(nodes, g, args, allowed: str, *, decode: bool, attention_mask: str, position_ids: str) -> str:
    """``allowed`` narrowed to each query's window by position distance (int64 gaps), named under
    "mask." with the other shared mask nodes every layer reads."""
    if not applies(args):
        return allowed
    if decode:  # real tokens after each slot = query position - key position; (B, 1, 1, C)
        after = g.op("CumSum", [attention_mask, g.const(1)], "mask.window.after", exclusive=1, reverse=1)
        gap = g.op("Unsqueeze", [after, g.const([1, 2])], "mask.window.gap")
    else:  # (B, 1, T, 1) - (B, 1, 1, T)
        gap = g.op(
            "Sub",
            [
                g.op("Unsqueeze", [position_ids, g.const([1, 3])], "mask.window.query_pos"),
                g.op("Unsqueeze", [position_ids, g.const([1, 2])], "mask.window.key_pos"),
            ],
            "mask.window.gap",
        )
    return nodes.within_window(g, allowed, gap, args.sliding_window, "mask.window")


def _read_megatron(a, root: Path, arg) -> dict:
    """Megatron's ``window_size`` (left, right), as flash-attention takes it -> the window."""
    w = getattr(a, "window_size", None)
    if not w:
        return {"sliding_window": None}
    if not (
        isinstance(w, (tuple, list)) and len(w) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in w)
    ):
        raise UserError(
            f"{root}: Megatron args window_size = {limits.shown(w)} is not a pair of integers "
            "(left, right); re-save the checkpoint from Megatron-LM"
        )
    left, right = w
    if right != 0 or not 0 <= left < limits.POSITIONS.hi:
        raise UserError(f"{root}: Megatron args window_size {tuple(w)}: only a causal window (left, 0) is supported")
    return {"sliding_window": left + 1}  # the query itself plus `left` earlier positions


FEATURE = Feature(
    name="sliding_window",
    label="sliding window",
    switch=False,
    bounds=(("sliding_window", Bound(1, limits.POSITIONS.hi, "a window is at most a model's positions")),),
    describe=lambda m: f"sliding window {m['sliding_window']}",
    mask_bytes=_mask_bytes,
    onnx_mask=_onnx_mask,
    read_megatron=_read_megatron,
)
