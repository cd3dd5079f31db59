"""What Megatron-LM's two checkpoint formats share: the allow-listed unpickler, the iteration dir a
tracker names, the model from the saved ``args``, the true vocabulary, the de-fusion of the fused
tensors into reads, and the plan builder. Imported by the legacy and torch_dist readers, never the
other way round.

De-fusion (all boxes; see titan_pipe.weights.source_plan):
- ``linear_qkv`` weight and bias: rows grouped per query group, each group = its q heads, then its
  k head, then its v head (rows of head_dim) -> wq/wk/wv (and their biases) rows of the group's
  global heads;
- ``linear_fc1``: rows are [gate; up] of the FFN (per tp rank: its slice of each) -> w1 / w3 rows;
- the vocabulary is padded (``make_vocab_size_divisible_by`` x tp): rows past the true size are
  not read.
"""

from __future__ import annotations

import argparse
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from titan_pipe.records.checkpoint_format import Box
from titan_pipe.rules import limits
from titan_pipe.model import features
from titan_pipe.weights.source_plan import Read, TensorPlan, check_accounted
from titan_pipe.errors import UserError
from titan_pipe.rules.limits import Bound
from titan_pipe.model.args import ModelArgs, RopeScaling, validate_args
from titan_pipe.model.params import Param, fused_parts, layer_name, native_names, native_shapes, param_of
from titan_pipe.io.paths import resolve_inside
from titan_pipe.rules.values import BOOL, FLOAT, INT, REQUIRED, read

FORMAT = "megatron"
TRACKER = "latest_checkpointed_iteration.txt"
# mp_rank_TT, then _PPP when pp > 1, then _EEE when ep > 1 (which of the two a single suffix is, the
# args say: legacy.rank_coords)
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


class MegatronEnum:
    """Stand-in for a Megatron enum member found in ``args`` (we only keep its name and value)."""

    def __init__(self, *value):
        self.value = value[0] if len(value) == 1 else value

    def __repr__(self) -> str:
        return f"MegatronEnum({self.value!r})"


def _stand_in(qualname: str):
    return (type(qualname.rsplit(".", 1)[1], (MegatronEnum,), {}), qualname)


_NP_RECONSTRUCT = np._core.multiarray._reconstruct if hasattr(np, "_core") else np.core.multiarray._reconstruct
# Everything a Megatron rank file or common.pt may unpickle: its args Namespace, the numpy types of
# the saved RNG state, stand-ins for Megatron's enums. Nothing that runs code.
ALLOWED = [
    argparse.Namespace,
    np.ndarray,
    np.dtype,
    type(np.dtype(np.uint32)),
    type(np.dtype(np.float64)),
    type(np.dtype(np.int64)),
    (_NP_RECONSTRUCT, "numpy.core.multiarray._reconstruct"),
    (_NP_RECONSTRUCT, "numpy._core.multiarray._reconstruct"),
    _stand_in("megatron.core.transformer.enums.AttnBackend"),
    _stand_in("megatron.core.transformer.enums.AttnMaskType"),
    _stand_in("megatron.core.enums.ModelType"),
    _stand_in("megatron.core.transformer.enums.ModelType"),
    _stand_in("megatron.core.transformer.enums.LayerType"),
]

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_UNPICKLER = re.compile(r"WeightsUnpickler error: (.*?)(?: Please use|$)", re.M)


def refusal_reason(e: Exception) -> str:
    """The one informative clause of torch's multi-line weights_only refusal ('Unsupported global:
    GLOBAL pathlib.PosixPath ...'), without its advice to load the file unsafely."""
    text = _ANSI.sub("", str(e))
    m = _UNPICKLER.search(text)
    line = m.group(1) if m else next((ln for ln in text.splitlines() if ln.strip()), type(e).__name__)
    return line.strip().rstrip(".")[:200]


def load_pickle(path: Path, *, missing: str, mmap: bool = False) -> dict:
    """A torch.save file of Megatron's (a rank file, common.pt) through the allow-list only, as a
    dict; UserError naming the file (``missing``: what to do when it is absent)."""
    import torch  # here: detecting and planning other formats needs none

    try:
        with torch.serialization.safe_globals(ALLOWED):
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise UserError(f"{path}: missing; {missing}") from None
    except pickle.UnpicklingError as e:
        raise UserError(
            f"{path}: refused to unpickle ({refusal_reason(e)}): titan-pipe loads Megatron files "
            "with weights_only=True and an allow-list (titan_pipe.weights.readers.megatron.common "
            "ALLOWED); the file holds a type outside it or is corrupted. Re-save it from "
            "Megatron-LM, and load it without the allow-list only if you trust its source"
        ) from None
    except (RuntimeError, EOFError, ValueError, OSError) as e:
        raise UserError(
            f"{path}: not a readable torch checkpoint ({str(e).splitlines()[0][:160]}); it is truncated or corrupted"
        ) from None
    if not isinstance(obj, dict):
        raise UserError(f"{path}: holds a {type(obj).__name__}, expected Megatron's checkpoint dict")
    return obj


def iter_dir(path: Path) -> Path | None:
    """The iteration dir of a Megatron tree: ``path`` itself (it holds mp_rank_* dirs), the one the
    tracker file names, or the newest iter_*; None when ``path`` is none of these."""
    if any(RANK_DIR.match(p.name) for p in path.iterdir() if p.is_dir()):
        return path
    tracker = path / TRACKER
    if tracker.is_file():
        with open(tracker, "rb") as fh:  # a few bytes: the file is a number, whatever it claims
            it = fh.read(32).decode("ascii", errors="replace").strip()
        d = (
            path / ("release" if it == "release" else f"iter_{int(it):07d}")
            if (it == "release" or (it.isascii() and it.isdigit()))
            else None
        )
        if d is None:
            raise UserError(f"{tracker}: holds {it!r}, expected an iteration number or 'release'")
        if not d.is_dir():
            raise UserError(f"{tracker}: points at {d.name}, which is missing; copy the checkpoint again")
    else:
        iters = sorted(p for p in path.glob("iter_*") if p.is_dir())
        if not iters:
            return None
        d, tracker = iters[-1], path
    return resolve_inside(path, d.name, source=tracker, what="iteration directory", kind="dir")


def arg(a, name: str, kind: str, root: Path, *, default=REQUIRED, bound: Bound | None = None):
    """Megatron argument ``name`` of the saved args, typed strictly (titan_pipe.rules.values): a float
    layer count or a string flag in a pickled Namespace is refused, never truncated or truthy."""
    return read(
        vars(a) if hasattr(a, "__dict__") else {},
        name,
        kind,
        source=f"{root}: Megatron args",
        default=default,
        bound=bound,
        fix="re-save the checkpoint from Megatron-LM",
    )


def iteration(state: dict, where: Path) -> int:
    """The training step a rank file or common.pt records (0 when absent), typed strictly."""
    return read(state, "iteration", INT, source=where, default=0)


def true_vocab(a, root: Path, vocab_size: int | None) -> int:
    """The unpadded vocabulary: --vocab-size, the args' vocab_size, or a tokenizer.json beside."""
    if vocab_size is not None:
        return vocab_size
    v = arg(a, "vocab_size", INT, root, default=None, bound=limits.VOCAB)
    if v:
        return v
    for d in (root, root.parent):
        tok = d / "tokenizer.json"
        if tok.is_file():
            from tokenizers import Tokenizer

            return Tokenizer.from_file(str(tok)).get_vocab_size(with_added_tokens=True)
    raise UserError(
        f"{root}: the checkpoint's args hold only the padded vocabulary "
        f"({getattr(a, 'padded_vocab_size', '?')}); pass --vocab-size N (the tokenizer's "
        "size) or put its tokenizer.json beside the checkpoint"
    )


def _refuse_architecture(a, root: Path) -> None:
    """What the decoder cannot compute: another MLP, norm or position embedding, linear biases, MoE."""

    def need(cond: bool, what: str):
        if not cond:
            raise UserError(
                f"{root}: Megatron args {what}; titan-pipe converts LLaMA-family models "
                "(RoPE, RMSNorm, SwiGLU, no linear biases but q/k/v ones) only"
            )

    need(arg(a, "swiglu", BOOL, root, default=True), "have swiglu=False")
    need(
        not arg(a, "add_bias_linear", BOOL, root, default=False),
        "have add_bias_linear=True (biases on every linear layer)",
    )
    need(
        getattr(a, "normalization", "RMSNorm") == "RMSNorm", f"use normalization={getattr(a, 'normalization', None)!r}"
    )
    need(
        getattr(a, "position_embedding_type", "rope") == "rope",
        f"use position_embedding_type={getattr(a, 'position_embedding_type', None)!r}",
    )
    if arg(a, "num_experts", INT, root, default=None, bound=limits.EXPERTS):  # a mixture of experts: Mixtral's
        # or Qwen3-MoE's router and experts (titan_pipe.model.families), nothing else
        need(
            getattr(a, "moe_router_score_function", "softmax") == "softmax",
            f"route with moe_router_score_function={getattr(a, 'moe_router_score_function', None)!r} (only softmax)",
        )
        need(
            getattr(a, "moe_router_topk_scaling_factor", None) in (None, 1.0),
            f"scale the top-k weights (moe_router_topk_scaling_factor={getattr(a, 'moe_router_topk_scaling_factor', None)})",
        )
        need(
            not getattr(a, "moe_shared_expert_intermediate_size", None),
            "have shared experts (moe_shared_expert_intermediate_size)",
        )
        need(not getattr(a, "moe_router_enable_expert_bias", False), "have router expert biases (DeepSeek-V3 style)")
        need(not getattr(a, "moe_router_num_groups", None), "route by groups (moe_router_num_groups)")


def model_args(a, vocab: int, root: Path, *, virtual_ok: bool = False) -> ModelArgs:
    """ModelArgs from Megatron's args, every value typed strictly and bounded; ``virtual_ok``: the
    format places virtual stages itself (torch_dist)."""
    _refuse_architecture(a, root)
    if arg(a, "num_layers_per_virtual_pipeline_stage", INT, root, default=None, bound=limits.LAYERS) and not virtual_ok:
        raise UserError(f"{root}: virtual pipeline stages (model0, model1 ... per file) are not supported")
    n_heads = arg(a, "num_attention_heads", INT, root, bound=limits.HEADS)
    groups = (
        arg(a, "num_query_groups", INT, root, bound=limits.HEADS)
        if arg(a, "group_query_attention", BOOL, root, default=False)
        else n_heads
    )
    scaling = None
    if arg(a, "use_rope_scaling", BOOL, root, default=False):
        scaling = RopeScaling(
            arg(a, "rope_scaling_factor", FLOAT, root, default=8.0, bound=limits.ROPE_FACTOR), 1.0, 4.0, 8192
        )
    positions = arg(a, "max_position_embeddings", INT, root, default=None, bound=limits.POSITIONS) or arg(
        a, "seq_length", INT, root, default=4096, bound=limits.POSITIONS
    )
    args = ModelArgs(
        dim=arg(a, "hidden_size", INT, root, bound=limits.DIM),
        n_layers=arg(a, "num_layers", INT, root, bound=limits.LAYERS),
        n_heads=n_heads,
        n_kv_heads=groups,
        head_dim=arg(a, "kv_channels", INT, root, default=None, bound=limits.HEAD_DIM),
        vocab_size=vocab,
        ffn_hidden_dim=arg(a, "ffn_hidden_size", INT, root, bound=limits.FFN),
        norm_eps=arg(a, "norm_epsilon", FLOAT, root, default=1e-5, bound=limits.NORM_EPS),
        rope_theta=arg(a, "rotary_base", FLOAT, root, default=10000.0, bound=limits.ROPE_THETA),
        rope_scaling=scaling,
        max_seq_len=positions,
        **{
            f.name: arg(a, f.megatron_arg, BOOL, root, default=False) != f.megatron_negated
            for f in features.FEATURES
            if f.megatron_arg
        },
        **{
            k: v
            for f in features.FEATURES
            if f.read_megatron is not None
            for k, v in f.read_megatron(a, root, arg).items()
        },
    )
    return validate_args(args, source=f"{root}: Megatron args")


def rope_rows(a, args: ModelArgs, root: Path) -> int | None:
    """Head size when q/k rows are in interleaved RoPE pairs (``rotary_interleaved``), else None."""
    return args.head_dim if arg(a, "rotary_interleaved", BOOL, root, default=False) else None


# ---------------------------------------------------------------------------------------------
# De-fusion: stored Megatron tensors -> reads of native parameters


def _rows(off: int, n: int, tail: tuple[int, ...]) -> Box:
    """Rows off..off+n of a tensor whose other dims are ``tail`` (whole)."""
    return Box((off,) + (0,) * len(tail), (n,) + tail)


def fused_group(name: str) -> tuple[str, int] | None:
    """(the fused group: 'qkv', the biases' or 'fc1', global layer id) of a name megatron_to_native gave as '<group>:gid'."""
    if not name.startswith("<"):
        return None
    group, _, gid = name[1:].partition(">:")
    return group, int(gid)


def qkv_group_rows(args: ModelArgs) -> int:
    """Rows of one query group in a fused linear_qkv: its q heads, its k head, its v head."""
    return (args.n_heads // args.kv_heads + 2) * args.head_dim


def defuse_qkv(
    args: ModelArgs,
    group: str,
    gid: int,
    file: str,
    key: str,
    *,
    first: int,
    n_groups: int,
    tail: tuple[int, ...],
    rope: int | None,
) -> Iterator[tuple[str, Read]]:
    """Reads of ``n_groups`` query groups stored from row 0 of ``file``/``key`` (a linear_qkv weight,
    ``tail`` (dim,), or bias, ``tail`` ()), the first being global group ``first``."""
    hd, qpg = args.head_dim, args.n_heads // args.kv_heads
    parts = fused_parts(group)
    for g in range(n_groups):
        G, base = first + g, g * qkv_group_rows(args)
        for part, so, do, n in (
            ("q", base, G * qpg * hd, qpg * hd),
            ("k", base + qpg * hd, G * hd, hd),
            ("v", base + (qpg + 1) * hd, G * hd, hd),
        ):
            p = parts[part]
            yield layer_name(gid, p), Read(file, key, _rows(so, n, tail), _rows(do, n, tail), rope if p.rope else None)


def defuse_fc1(
    args: ModelArgs, gid: int, file: str, key: str, pieces: list[tuple[int, int, int]]
) -> Iterator[tuple[str, Read]]:
    """Reads of a stored linear_fc1: ``pieces`` (row in the stored tensor, row in the whole [gate; up]
    of the FFN, rows); the gate rows go to w1, the up rows to w3."""
    ffn, dim, parts = args.hidden_dim, args.dim, fused_parts("fc1")
    for src, dst, n in pieces:
        for part, lo in (("gate", 0), ("up", ffn)):
            a, b = max(dst, lo), min(dst + n, lo + ffn)
            if b > a:
                yield (
                    layer_name(gid, parts[part]),
                    Read(file, key, _rows(src + a - dst, b - a, (dim,)), _rows(a - lo, b - a, (dim,))),
                )


def defuse_expert_fc1(
    args: ModelArgs, gid: int, file: str, key: str, offs: tuple[int, ...], lens: tuple[int, ...]
) -> Iterator[tuple[str, Read]]:
    """Reads of a stored piece (box ``offs``/``lens``) of a routing layer's experts' linear_fc1,
    (experts, [gate; up] rows, dim): the gate rows go to moe.experts.w1, the up rows to w3."""
    ffn, parts = args.expert_dim, fused_parts("expert_fc1")
    e0, r0, c0 = offs
    ne, nr, nc = lens
    for part, lo in (("gate", 0), ("up", ffn)):
        a, b = max(r0, lo), min(r0 + nr, lo + ffn)
        if b > a:
            yield (
                layer_name(gid, parts[part]),
                Read(file, key, Box((0, a - r0, 0), (ne, b - a, nc)), Box((e0, a - lo, c0), (ne, b - a, nc))),
            )


def vocab_read(args: ModelArgs, file: str, key: str, row: int, n: int) -> Read | None:
    """Rows row..row+n of a padded vocabulary table, stored from row 0; padding rows are not read."""
    hit = _rows(row, n, (args.dim,)).intersect(_rows(0, args.vocab_size, (args.dim,)))
    if hit is None:
        return None
    return Read(file, key, _rows(hit.offsets[0] - row, hit.lengths[0], (args.dim,)), hit)


# ---------------------------------------------------------------------------------------------
# The plan of the global tensors


@dataclass
class Reads:
    """What the stored tensors contribute, global tensor by global tensor."""

    reads: dict[str, list[Read]] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)

    def add(self, name: str, read: Read | None, dtype: str) -> None:
        if read is not None:
            self.reads.setdefault(name, []).append(read)
            self.dtypes[name] = dtype


def tensor_plans(
    where: Path, args: ModelArgs, acc: Reads, split: Callable[[Param, list[Read]], str]
) -> dict[str, TensorPlan]:
    """Every parameter of the model with its declared global shape and its reads (sorted by
    destination), ``split(entry, reads)`` describing how the source held it; a missing one, or a
    stored tensor with no place in the model (check_accounted), is an error naming ``where``."""
    check_accounted(acc.reads, args, source=f"{where}: Megatron args")
    tensors, shapes = {}, native_shapes(args)
    for name in native_names(args):
        if name not in acc.reads:
            raise UserError(
                f"{where}: no tensor for {name!r}; the checkpoint is incomplete or its args disagree with its tensors"
            )
        spec, reads = param_of(name), acc.reads[name]
        kind = f"fused {spec.fused[0]}" if spec.fused else split(spec, reads)
        tensors[name] = TensorPlan(
            name, shapes[name], acc.dtypes[name], tuple(sorted(reads, key=lambda r: r.dst_box.offsets)), kind
        )
    return tensors
