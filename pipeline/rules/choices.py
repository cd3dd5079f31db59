"""Every closed set of choices and every export default, declared once, with the export option rules.

flow.yaml validation (titan_pipe.config), the CLI options and the stages that act on a choice all
read it from here, so ``titan-pipe validate`` refuses exactly what a stage would refuse after
training (tests/test_choices.py walks every set and checks config and stage agree). Pure data:
no torch, no stage imports. The model's own choice sets live with the model, each once: flavours
(titan_pipe.model.args.FLAVOURS) and the Hugging Face architectures read and written
(titan_pipe.model.families.FAMILIES).
"""

from __future__ import annotations

from typing import Callable

from titan_pipe.rules import limits
from titan_pipe.rules.dtypes import EXPORT_NAMES
from titan_pipe.io.hashing import DIGESTS

DEVICES = ("auto", "cpu", "cuda", "npu")
# model.kernels: auto = npu_fused on NPU, torch_fused on CUDA, reference on CPU (titan_pipe.model.kernels)
KERNELS = ("auto", "reference", "torch_fused", "npu_fused")
# train.loss: the cross entropy from full float32 logits, or fused with the output projection in chunks
# (titan_pipe.model.loss); auto = chunked where it applies (tp = pp = 1), else full
LOSSES = ("auto", "full", "chunked")
TRAIN_MODES = ("pretrain", "sft")  # train.mode
RECORD_FORMATS = ("text", "chat", "instruction")  # data.format / data prepare --format
# train.optimizer.implementation: auto = fused on CUDA, foreach elsewhere (titan_pipe.training.optim)
OPTIMIZER_IMPLS = ("auto", "foreach", "fused")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
INTERLEAVED = "interleaved_1f1b"  # the schedule that runs several virtual stages per pp rank
DP_MODES = ("fsdp", "ddp")
OPTIMIZERS = ("adamw", "sgd")
# train.compile_backend: auto = inductor on cuda/cpu, TorchAir's backend on npu (titan_pipe.training.compile)
COMPILE_BACKENDS = ("auto", "inductor", "aot_eager", "eager")
OFFLOADS = ("none", "cpu")
SOURCE_FORMATS = ("auto", "titan", "megatron", "dcp", "hf")  # what convert reads (--source-format); auto: detected
NAMINGS = ("hf", "native")  # convert's output tensor names: Hugging Face (transformers loads it) or ours
PRECISION_MODES = ("origin", "mixed_float16", "fp16")  # ATC's; origin keeps the graph's dtype

ATC_OPSET_WINDOW = (11, 15)  # the ONNX opsets ATC takes (convert/onnx/data/atc_onnx_ops.json agrees)
EXPORT_OPSETS = (14, 15)  # inside ATC's window; 14 is the lowest every operator of the graphs exists at


# Decode KV-cache slots when none are asked for: the model's positions, at most this many (the export
# options' defaults are titan_pipe.config.ExportConfig's).
MAX_DEFAULT_CACHE_LEN = 4096


def default_cache_len(max_positions: int) -> int:
    """Decode KV-cache slots when none are asked for."""
    return min(max_positions, MAX_DEFAULT_CACHE_LEN)


def export_problems(
    *,
    max_positions: int,
    opset: object,
    dtype: str,
    batch: int,
    seq_len: int,
    cache_len: int | None,
    kv_cache: bool,
    precision_mode: str,
    digest: str,
    data_files: int,
    spell: Callable[[str], str] = lambda k: "--" + k.replace("_", "-"),
) -> list[str]:
    """One line per export option the export stage refuses for a model of ``max_positions``.

    ``spell(option)`` is how the caller's user names an option: ``--cache-len`` on the command
    line (the default), ``export.cache_len:`` in a flow.yaml.
    """
    out = []
    lo, hi = ATC_OPSET_WINDOW
    if not isinstance(opset, int) or isinstance(opset, bool) or not lo <= opset <= hi:
        out.append(f"opset {opset!r}: ATC takes ONNX opsets {lo}..{hi} only; use {spell('opset')} 14 (default) or 15")
    elif opset not in EXPORT_OPSETS:
        out.append(
            f"opset {opset}: the graphs need opset >= 14 (Trilu-free attention, Unsqueeze/Slice with tensor "
            f"axes); use {spell('opset')} 14 (default) or 15"
        )
    if dtype not in EXPORT_NAMES:
        out.append(f"dtype {dtype!r} is not one of {', '.join(EXPORT_NAMES)} (ATC graphs carry no bfloat16)")
    if precision_mode not in PRECISION_MODES:
        out.append(f"precision mode {precision_mode!r} is not one of {', '.join(PRECISION_MODES)}")
    if digest not in DIGESTS:
        out.append(
            f"digest {digest!r} is not one of {', '.join(DIGESTS)}; use {spell('digest')} xxh3_128 (default) or sha256"
        )
    for key, value, bound in (
        ("batch", batch, limits.BATCH),
        ("seq_len", seq_len, limits.SEQ_LEN),
        ("cache_len", cache_len, limits.CACHE_LEN),
        ("data_files", data_files, limits.DATA_FILES),
    ):
        why = None if value is None else bound.problem(value)
        if why:
            out.append(f"{key} {value} {why}; pass {spell(key)} {bound.range}")
    if out:
        return out
    if seq_len + (1 if kv_cache else 0) > max_positions:  # the cache rules below follow from this one
        return [
            f"seq_len {seq_len} (+1 decode step) exceeds the model's max_position_embeddings {max_positions} "
            f"(config.json); pass a smaller {spell('seq_len')}"
        ]
    cache = default_cache_len(max_positions) if cache_len is None else cache_len
    if kv_cache and cache < seq_len + 1:
        out.append(
            f"cache_len {cache} is smaller than seq_len {seq_len} + 1 (the prompt plus one new token); "
            f"pass {spell('cache_len')} {seq_len + 1} or more (or a smaller {spell('seq_len')})"
        )
    if kv_cache and cache > max_positions:
        out.append(
            f"cache_len {cache} exceeds the model's max_position_embeddings {max_positions} (config.json); "
            f"pass {spell('cache_len')} {max_positions} or less"
        )
    return out
