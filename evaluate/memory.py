"""The memory budget (``--max-memory`` / evaluate.max_memory) and the mode it leads to.

  whole     every reference layer and every piece of the deployed graphs stays loaded for the run
  streamed  one decoder layer at a time: the reference's float32 layer (read from the safetensors,
            memory-mapped, cast per layer) or one piece of a graph in ONNX Runtime, then freed

``auto`` is a fraction of the RAM available when evaluate starts. The estimates count what grows
with the model (weights as each side holds them, plus one batch's activations), not the Python
process itself: the reference holds its linear layers' weights as stored (2 bytes a parameter
for bfloat16; it computes in float32 a band at a time, runners/pytorch.StoredLinear) and the rest
in float32; ONNX Runtime's CPU provider holds
a graph's weights in float32 (a float16 graph's matmuls run in float32) plus the stored weights
while a session opens (measured: a float16 layer of 88.6 MB peaks at ~260 MB, ~2.9x).
"""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass

from titan_pipe.errors import UserError
from titan_pipe.processes.host_memory import trim_heap
from titan_pipe.rules.sizes import format_size, parse_size

AUTO_FRACTION = 0.5  # of the RAM available at start, for `auto`


@dataclass(frozen=True)
class Need:
    """Bytes a part of the evaluation holds at once: ``name`` says which (for messages)."""

    name: str
    bytes: int


@dataclass(frozen=True)
class MemoryPlan:
    mode: str  # "whole" | "streamed"
    setting: str  # "auto" or the size given
    budget: int
    whole: int  # estimated peak with everything loaded
    streamed: int  # estimated peak one layer at a time
    largest: str  # the piece that sets the streamed peak
    why: str

    def to_dict(self) -> dict:
        return asdict(self)


def budget_bytes(setting: str) -> int:
    if setting == "auto":
        import psutil

        return int(AUTO_FRACTION * psutil.virtual_memory().available)
    try:
        return parse_size(setting)
    except ValueError as e:
        raise UserError(f"--max-memory {setting}: {e} (or auto)") from None


def ort_bytes(weight_bytes: int, itemsize: int) -> int:
    """What an ONNX Runtime CPU session holds for weights stored at ``itemsize`` bytes each."""
    return weight_bytes + weight_bytes * 4 // itemsize


DECODE_STEP_X = 10  # a decode piece's working memory over a step, in multiples of the caches it takes


def decode_step_bytes(past: int) -> int:
    """What ONNX Runtime holds while a decode piece runs a step on caches of ``past`` bytes, beyond its
    weights: the caches in, the updated ones out and the previous step's (kept as the next input),
    the float32 copies a float16 graph's attention is cast to on the CPU, and its arena's rounding.
    Measured: a 7B-width float16 layer with a static 4096-slot cache (64 MB a batch) held 0.45-0.70 GB
    more while stepping than after opening; that is 7-11x."""
    return DECODE_STEP_X * past


def plan_memory(
    setting: str, *, whole: list[Need], pieces: list[Need], activations: int, can_stream: str | None
) -> MemoryPlan:
    """``whole``: what whole mode holds at each stage, one after the other (the reference while it
    runs, then the graphs' pieces; the largest counts); ``pieces``: what one step holds in streamed
    mode (the largest counts); ``can_stream``: None, or why streamed mode is impossible.
    Whole mode when it fits; UserError when not even one piece fits (or streaming is impossible)."""
    budget = budget_bytes(setting)
    need_whole = max(n.bytes for n in whole) + activations
    top = max(pieces, key=lambda n: n.bytes)
    need_one = top.bytes + activations
    label = "auto" if setting == "auto" else setting
    if need_whole <= budget:
        return MemoryPlan(
            "whole",
            label,
            budget,
            need_whole,
            need_one,
            top.name,
            f"everything fits: ~{format_size(need_whole)} of {format_size(budget)}",
        )
    if can_stream is not None:
        raise UserError(
            f"--max-memory {label} ({format_size(budget)}): the whole evaluation needs "
            f"~{format_size(need_whole)} and cannot go one layer at a time ({can_stream}); raise "
            "--max-memory (evaluate.max_memory) or re-export with `titan-pipe export`"
        )
    if need_one > budget:
        raise UserError(
            f"--max-memory {label} ({format_size(budget)}): too small for one layer: {top.name} needs "
            f"~{format_size(need_one)}; give at least {format_size(need_one)} (evaluate.max_memory)"
        )
    return MemoryPlan(
        "streamed",
        label,
        budget,
        need_whole,
        need_one,
        top.name,
        f"~{format_size(need_whole)} needed whole, over the budget of {format_size(budget)}: one "
        f"layer at a time (largest: {top.name}, ~{format_size(need_one)})",
    )


def release() -> None:
    """Hand freed memory back to the system (between layers in streamed mode): Python's garbage,
    then glibc's free lists, which otherwise keep a closed session's arenas in the process.
    (evaluate_model freezes what existed before it starts, so each collection scans only its own
    objects: ~80 ms a call otherwise, 4 s of a 7B-width run.)"""
    gc.collect()
    trim_heap()
