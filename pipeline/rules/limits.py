"""The bounds on every size titan-pipe reads from a file or a command line, declared once.

A number from a file someone else wrote (config.json, params.json, manifest.json, Megatron args,
export.json, flow.yaml) or from a flag sizes allocations, loops and search spaces. Each bound
here is far above any real model or cluster (the figures in the comments) and far below what
would exhaust a machine, so a value past it is refused in one line before anything is allocated.
titan_pipe.rules.values reads values against these; the CLI checks flags with ``check_flag``.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_pipe.errors import UserError


@dataclass(frozen=True)
class Bound:
    """An inclusive range of integers (or reals) a value must lie in, and why."""

    lo: float
    hi: float
    why: str = ""

    def problem(self, value: float) -> str | None:
        """Why ``value`` is outside the range, or None."""
        if value < self.lo:
            return f"must be >= {fmt(self.lo)}"
        if value > self.hi:
            return f"exceeds titan-pipe's limit of {fmt(self.hi)}" + (f" ({self.why})" if self.why else "")
        return None

    @property
    def range(self) -> str:
        return f"{fmt(self.lo)}..{fmt(self.hi)}"


def fmt(x: float) -> str:
    """A bound or a value as a user writes it: whole numbers in full (1048576, not 1.04858e+06)."""
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e18 else f"{x:g}"


# --- model dimensions (ModelArgs, from any source) ------------------------------------------------
# Llama 3.1 405B: 126 layers, dim 16384, 128 heads, ffn 53248, vocab 128256, 131072 positions.
LAYERS = Bound(1, 1024, "the largest published dense models have under 200 layers")
DIM = Bound(1, 1 << 17, "Llama 3.1 405B has 16384")
HEADS = Bound(1, 4096, "Llama 3.1 405B has 128")
FFN = Bound(1, 1 << 20, "Llama 3.1 405B has 53248")
VOCAB = Bound(1, 1 << 23, "the largest tokenizers have about 256k ids")
# RoPE tables are (positions, head_dim) and both training and export allocate them whole.
POSITIONS = Bound(1, 1 << 20, "RoPE tables hold one row per position; 1M-context LLaMA models have 1048576")
HEAD_DIM = Bound(2, 1024, "LLaMA models use 64-256")
EXPERTS = Bound(1, 4096, "Qwen3-MoE and DeepSeek-V3 route over 128-256 experts")
LORA_RANK = Bound(1, 4096, "LoRA ranks in use are 4-256")
ROPE_TABLE = Bound(1, 1 << 27, "cos and sin tables of positions x head_dim float32 values, 512 MiB each at the limit")
ROPE_THETA = Bound(1e-3, 1e12, "LLaMA models use 1e4-5e6")
NORM_EPS = Bound(0.0, 1.0, "RMSNorm epsilons are 1e-6-1e-5")
ROPE_FACTOR = Bound(1e-6, 1e6, "Llama 3.1 uses 8")
PARAMS = Bound(1, 4e12, "the largest dense models have about 4e11 parameters")

# --- parallel layouts and clusters ----------------------------------------------------------------
DEVICES = Bound(1, 65536, "the planner's search space grows with the divisors of the device count")
PARALLEL = Bound(1, 65536, "dp x tp x pp is a device count")
LAYOUTS = Bound(1, 50_000, "the planner estimates every candidate layout, ~1-10 ms each")

# --- sequences, batches, steps -------------------------------------------------------------------
MAX_BAD_FRACTION = 0.01  # chat / instruction records prepare may leave out (counted, named) before it fails
SEQ_LEN = Bound(1, POSITIONS.hi, "a sequence is at most as long as a model's positions")
BATCH = Bound(1, 1 << 20, "sequences per step")
STEPS = Bound(1, 1 << 40)
CACHE_LEN = Bound(2, POSITIONS.hi, "decode KV-cache slots are positions")
EVAL_BATCHES = Bound(1, 1 << 16)
WORKERS = Bound(1, 1024, "processes started on this machine")
TOP_ROWS = Bound(1, 10_000)

DATA_FILES = Bound(1, 64, "an export's weight files: each is written by a thread of its own")

# --- files ------------------------------------------------------------------------------------------
# One record of a data file (a .txt document or a .jsonl line): held in memory whole while parsed.
# Tokenizing one record costs ~210 bytes of memory a character (a byte-level BPE tokenizer's
# encoding with offsets): 16 MiB took 3.4 GB and 20 s here (11 M tokens), 64 MiB would take ~14 GB.
RECORD_BYTES = Bound(
    0, 16 * 2**20, "one document or JSON line is held whole while it is tokenized: about 3.4 GB of memory at 16 MiB"
)
# A JSON record (config.json, params.json, an index, a manifest, export.json) is read whole.
TOKENIZER_BYTES = Bound(0, 512 * 2**20, "tokenizer.json files are 2-35 MB (Gemma 3's is 33 MB)")
TEMPLATE_BYTES = Bound(0, 2**20, "chat templates are 1-30 KB; Qwen3's is 4 KB")
JSON_BYTES = Bound(0, 256 * 2**20, "a model's JSON records are kilobytes to a few megabytes")
# Nodes of a flow.yaml once its aliases are expanded: a flow file has a few hundred.
YAML_NODES = Bound(0, 100_000, "a flow.yaml has a few hundred keys; anchors and aliases are expanded")
# Characters of an input value shown in a message: a message names a value, it does not print data.
SHOWN_CHARS = 80


def shown(value: object) -> str:
    """``repr(value)`` cut to SHOWN_CHARS, so a message never prints a large input."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def check_flag(flag: str, value: float | None, bound: Bound) -> None:
    """UserError naming a command-line flag whose value is outside ``bound``; None passes."""
    if value is None:
        return
    why = bound.problem(value)
    if why:
        raise UserError(f"{flag} {value}: {why}; pass a value in {bound.range}")
