"""Reader for Megatron-LM legacy checkpoints of megatron-core GPT/LLaMA models.

(``torch_dist`` checkpoints -- a ``metadata.json`` naming that backend in the iteration dir -- are
handed to megatron_dist.py; both are ``--from megatron``.)

Tree: ``latest_checkpointed_iteration.txt`` + ``iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt``
(TT: tp rank, PPP: pp rank when pp > 1). Each file is a pickle; it is opened with
``torch.load(weights_only=True, mmap=True)`` and an explicit allow-list (argparse.Namespace, the
numpy types of the saved RNG state, stand-ins for Megatron's enums) -- never a plain unpickle --
one rank file at a time as the plan reaches it.

Plan rules (all boxes, see convert/source_plan.py):
- ``linear_qkv`` (per rank: its query groups, each = that group's q heads, then its k head, then
  its v head) -> wq/wk/wv rows of the group's global heads;
- ``linear_fc1`` (per rank: its gate slice, then its up slice) -> w1 / w3 rows;
- vocabulary padded to ``make_vocab_size_divisible_by x tp``: rows past the true vocab (from
  ``args``, ``--vocab-size`` or a tokenizer.json) are not read;
- layer indices are local to each pipeline stage: global id = stage's first layer + local id;
- layer norms fused into the linear layers (``layer_norm_weight``) or standalone, replicated
  over tp: read from tp rank 0.
"""
from __future__ import annotations

import argparse
import pickle
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from titan_pipe.checkpoint_format import Box
from titan_pipe.convert.readers import megatron_dist
from titan_pipe.convert.readers.store import Store
from titan_pipe.convert.source_plan import Read, SourcePlan, TensorPlan, check_accounted
from titan_pipe.dtypes import DTYPE_NAMES
from titan_pipe.errors import UserError
from titan_pipe import limits
from titan_pipe.limits import Bound
from titan_pipe.model.args import ModelArgs, RopeScaling, check_fits, validate_args
from titan_pipe.model.names import megatron_to_native
from titan_pipe.model.params import fused_parts, layer_name, native_names, native_shapes, param_of
from titan_pipe.paths import resolve_inside
from titan_pipe.values import BOOL, FLOAT, INT, REQUIRED, read

FORMAT = "megatron"
TRACKER = "latest_checkpointed_iteration.txt"
FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")


class MegatronEnum:
    """Stand-in for a Megatron enum member found in ``args`` (we only keep its name and value)."""

    def __init__(self, *value):
        self.value = value[0] if len(value) == 1 else value

    def __repr__(self) -> str:
        return f"MegatronEnum({self.value!r})"


def _stand_in(qualname: str):
    return (type(qualname.rsplit(".", 1)[1], (MegatronEnum,), {}), qualname)


_NP_RECONSTRUCT = np._core.multiarray._reconstruct if hasattr(np, "_core") else np.core.multiarray._reconstruct
ALLOWED = [
    argparse.Namespace,
    np.ndarray, np.dtype, type(np.dtype(np.uint32)), type(np.dtype(np.float64)),
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


def load_rank_file(path: Path) -> dict:
    """One model_optim_rng.pt, tensors memory-mapped, through the allow-list only."""
    try:
        with torch.serialization.safe_globals(ALLOWED):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise UserError(f"{path}: missing rank file; copy the complete checkpoint") from None
    except pickle.UnpicklingError as e:
        raise UserError(f"{path}: refused to unpickle ({refusal_reason(e)}): titan-pipe loads Megatron "
                        "files with weights_only=True and an allow-list (titan_pipe.convert.readers.megatron "
                        "ALLOWED); the file holds a type outside it or is corrupted. Re-save it from "
                        "Megatron-LM, and load it without the allow-list only if you trust its source") from None
    except (RuntimeError, EOFError, ValueError, OSError) as e:
        raise UserError(f"{path}: not a readable torch checkpoint ({str(e).splitlines()[0][:160]}); "
                        "it is truncated or corrupted") from None


def _iter_dir(path: Path) -> Path | None:
    if any(_RANK_DIR.match(p.name) for p in path.iterdir() if p.is_dir()):
        return path
    tracker = path / TRACKER
    if tracker.is_file():
        with open(tracker, "rb") as fh:  # a few bytes: the file is a number, whatever it claims
            it = fh.read(32).decode("ascii", errors="replace").strip()
        d = path / ("release" if it == "release" else f"iter_{int(it):07d}") if (
            it == "release" or (it.isascii() and it.isdigit())) else None
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


def looks_like(path: Path) -> bool:
    if megatron_dist.looks_like(path):
        return True
    try:
        return _iter_dir(path) is not None
    except UserError:  # a Megatron tree with a bad tracker or iteration dir: open_source says which
        return True


def rank_files(it_dir: Path) -> dict[tuple[int, int], str]:
    """(tp rank, pp rank) -> file relative to the iteration dir."""
    out = {}
    for p in it_dir.iterdir():
        m = _RANK_DIR.match(p.name)
        if m and p.is_dir():
            resolve_inside(it_dir, f"{p.name}/{FILE}", source=it_dir, what="rank file")
            out[(int(m.group(1)), int(m.group(2) or 0))] = f"{p.name}/{FILE}"
    return out


def _true_vocab(a, root: Path, vocab_size: int | None) -> int:
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
    raise UserError(f"{root}: the checkpoint's args hold only the padded vocabulary "
                    f"({getattr(a, 'padded_vocab_size', '?')}); pass --vocab-size N (the tokenizer's "
                    "size) or put its tokenizer.json beside the checkpoint")


def _stage_layers(a, pp: int, root: Path) -> list[int]:
    """Number of layers per pp stage (even, or Megatron's first/last-stage overrides)."""
    n = arg(a, "num_layers", INT, root, bound=limits.LAYERS)
    first = arg(a, "decoder_first_pipeline_num_layers", INT, root, default=None, bound=limits.LAYERS)
    last = arg(a, "decoder_last_pipeline_num_layers", INT, root, default=None, bound=limits.LAYERS)
    if pp == 1:
        return [n]
    counts: list[int | None] = [None] * pp
    if first:
        counts[0] = first
    if last:
        counts[-1] = last
    rest = n - sum(c for c in counts if c)
    free = counts.count(None)
    if free and rest % free:
        raise UserError(f"Megatron args: {n} layers do not split evenly over {free} pipeline stages")
    return [c if c else rest // free for c in counts]


def arg(a, name: str, kind: str, root: Path, *, default=REQUIRED, bound: Bound | None = None):
    """Megatron argument ``name`` of the saved args, typed strictly (titan_pipe.values): a float
    layer count or a string flag in a pickled Namespace is refused, never truncated or truthy."""
    return read(vars(a) if hasattr(a, "__dict__") else {}, name, kind, source=f"{root}: Megatron args",
                default=default, bound=bound, fix="re-save the checkpoint from Megatron-LM")


def model_args(a, vocab: int, root: Path, *, virtual_ok: bool = False) -> ModelArgs:
    """ModelArgs from Megatron's args; ``virtual_ok``: the format places virtual stages itself (torch_dist)."""
    def need(cond: bool, what: str):
        if not cond:
            raise UserError(f"{root}: Megatron args {what}; titan-pipe converts LLaMA-style models "
                            "(RoPE, RMSNorm, SwiGLU, no linear biases) only")

    need(arg(a, "swiglu", BOOL, root, default=True), "have swiglu=False")
    need(not arg(a, "add_bias_linear", BOOL, root, default=False), "have add_bias_linear=True")
    need(getattr(a, "normalization", "RMSNorm") == "RMSNorm", f"use normalization={getattr(a, 'normalization', None)!r}")
    need(getattr(a, "position_embedding_type", "rope") == "rope",
         f"use position_embedding_type={getattr(a, 'position_embedding_type', None)!r}")
    if arg(a, "num_layers_per_virtual_pipeline_stage", INT, root, default=None, bound=limits.LAYERS) and not virtual_ok:
        raise UserError(f"{root}: virtual pipeline stages (model0, model1 ... per file) are not supported")
    n_heads = arg(a, "num_attention_heads", INT, root, bound=limits.HEADS)
    groups = (arg(a, "num_query_groups", INT, root, bound=limits.HEADS)
              if arg(a, "group_query_attention", BOOL, root, default=False) else n_heads)
    dim = arg(a, "hidden_size", INT, root, bound=limits.DIM)
    kv_ch = arg(a, "kv_channels", INT, root, default=None, bound=limits.HEAD_DIM)
    if kv_ch and kv_ch * n_heads != dim:
        raise UserError(f"{root}: kv_channels {kv_ch} x {n_heads} heads != hidden_size {dim}")
    scaling = None
    if arg(a, "use_rope_scaling", BOOL, root, default=False):
        scaling = RopeScaling(arg(a, "rope_scaling_factor", FLOAT, root, default=8.0, bound=limits.ROPE_FACTOR),
                              1.0, 4.0, 8192)
    positions = (arg(a, "max_position_embeddings", INT, root, default=None, bound=limits.POSITIONS)
                 or arg(a, "seq_length", INT, root, default=4096, bound=limits.POSITIONS))
    args = ModelArgs(dim=dim, n_layers=arg(a, "num_layers", INT, root, bound=limits.LAYERS), n_heads=n_heads,
                     n_kv_heads=groups, vocab_size=vocab,
                     ffn_hidden_dim=arg(a, "ffn_hidden_size", INT, root, bound=limits.FFN),
                     norm_eps=arg(a, "norm_epsilon", FLOAT, root, default=1e-5, bound=limits.NORM_EPS),
                     rope_theta=arg(a, "rotary_base", FLOAT, root, default=10000.0, bound=limits.ROPE_THETA),
                     rope_scaling=scaling, max_seq_len=positions,
                     tie_embeddings=not arg(a, "untie_embeddings_and_output_weights", BOOL, root, default=False))
    return validate_args(args, source=f"{root}: Megatron args")


class MegatronStore(Store):
    """Rank files loaded (memory-mapped) on demand; at most ``keep`` stay open (one pp stage)."""

    def __init__(self, root: Path, keep: int):
        super().__init__(root)
        self.keep = keep
        self._open: OrderedDict[str, dict] = OrderedDict()

    def model(self, file: str) -> dict:
        if file in self._open:
            self._open.move_to_end(file)
            return self._open[file]
        sd = load_rank_file(self.root / file)
        if "model" not in sd:
            raise UserError(f"{self.root / file}: has no 'model' entry (keys: {sorted(sd)[:6]})")
        self._open[file] = sd["model"]
        while len(self._open) > self.keep:
            self._open.popitem(last=False)  # dropping the last reference unmaps the file
        return sd["model"]

    def read_box(self, file: str, key: str, box: Box) -> torch.Tensor:
        x = self.model(file)[key]
        for d, (o, n) in enumerate(zip(box.offsets, box.lengths)):
            x = x.narrow(d, o, n)
        return x

    def close(self) -> None:
        self._open.clear()


def _rows(off: int, n: int, dim: int) -> Box:
    """Rows off..off+n of a (rows, dim) matrix."""
    return Box((off, 0), (n, dim))


@dataclass(frozen=True)
class _Layout:
    """The model and its tp/pp split, as a rank file's Megatron args describe them."""

    it_dir: Path
    files: dict  # (tp rank, pp rank) -> file relative to it_dir
    a: argparse.Namespace
    args: ModelArgs
    tp: int
    pp: int
    padded: int  # padded_vocab_size (0: none)
    counts: list[int]  # layers per pp stage
    offsets: list[int]  # first global layer id of each pp stage

    @property
    def qpg(self) -> int:  # query heads per group
        return self.args.n_heads // self.args.kv_heads

    @property
    def ng_local(self) -> int:  # query groups per tp rank
        return self.args.kv_heads // self.tp

    @property
    def ffn_local(self) -> int:
        return self.args.hidden_dim // self.tp


@dataclass
class _Reads:
    """What the rank files contribute, global tensor by global tensor."""

    reads: dict[str, list[Read]] = field(default_factory=dict)
    shapes: dict[str, tuple] = field(default_factory=dict)  # where a rank's shape does not give it
    dtypes: dict[str, str] = field(default_factory=dict)

    def add(self, name: str, read: Read, dtype: str) -> None:
        self.reads.setdefault(name, []).append(read)
        self.dtypes[name] = dtype


def _rank_files(path: Path) -> tuple[Path, dict, dict]:
    """(iteration dir, {(tp, pp): rank file}, the first rank file loaded): the files and their args."""
    it_dir = _iter_dir(path)
    if it_dir is None:
        raise UserError(f"{path}: no {TRACKER}, iter_* directory or mp_rank_* directories; not a "
                        "Megatron-LM checkpoint")
    files = rank_files(it_dir)
    if not files:
        raise UserError(f"{it_dir}: no mp_rank_* directories")
    first = load_rank_file(it_dir / files[min(files)])
    if first.get("args") is None:
        raise UserError(f"{it_dir / files[min(files)]}: has no 'args'; titan-pipe needs the model's "
                        "Megatron arguments saved in the checkpoint")
    return it_dir, files, first


def _layout(path: Path, it_dir: Path, files: dict, a, vocab_size: int | None) -> _Layout:
    """Check that every (tp, pp) rank file is there and the groups split over tp; the model args."""
    tp = arg(a, "tensor_model_parallel_size", INT, path, bound=limits.PARALLEL)
    pp = arg(a, "pipeline_model_parallel_size", INT, path, bound=limits.PARALLEL)
    want = {(t, p) for t in range(tp) for p in range(pp)}
    if set(files) != want:
        missing = sorted(want - set(files))
        raise UserError(f"{it_dir}: args say tp={tp} pp={pp} but rank dirs "
                        f"{['mp_rank_%02d' % t + ('_%03d' % p if pp > 1 else '') for t, p in missing] or sorted(files)} "
                        "are missing or extra; copy the complete checkpoint")
    for (t, p), f in files.items():
        if not (it_dir / f).is_file():
            raise UserError(f"{it_dir / f}: missing rank file; copy the complete checkpoint")
    args = model_args(a, _true_vocab(a, path, vocab_size), path)
    check_fits(args, sum((it_dir / f).stat().st_size for f in files.values()), source=f"{path}: Megatron args",
               where="its rank files")
    if args.kv_heads % tp:
        raise UserError(f"{it_dir}: {args.kv_heads} query groups do not split over tp={tp}")
    counts = _stage_layers(a, pp, path)
    return _Layout(it_dir, files, a, args, tp, pp, arg(a, "padded_vocab_size", INT, path, default=0,
                                                         bound=limits.VOCAB), counts,
                   [sum(counts[:s]) for s in range(pp)])


def _qkv_reads(lay: _Layout, acc: _Reads, f: str, key: str, gid: int, t: int, shape: tuple, dtype: str) -> None:
    """De-fuse one rank's linear_qkv: per query group, qpg q heads then k then v (rows of hd)."""
    hd, qpg, ng_local, dim = lay.args.head_dim, lay.qpg, lay.ng_local, lay.args.dim
    exp = (ng_local * (qpg + 2) * hd, dim)
    if shape != exp:
        raise UserError(f"{lay.it_dir / f}: {key} is {list(shape)}, expected {list(exp)} "
                        f"({ng_local} query groups x ({qpg} q + k + v) x {hd} rows)")
    rope = hd if bool(getattr(lay.a, "rotary_interleaved", False)) else None
    parts = fused_parts("qkv")
    for g in range(ng_local):
        G, base = t * ng_local + g, g * (qpg + 2) * hd
        for part, so, do, n in (("q", base, G * qpg * hd, qpg * hd),
                                ("k", base + qpg * hd, G * hd, hd),
                                ("v", base + (qpg + 1) * hd, G * hd, hd)):
            p = parts[part]
            acc.add(layer_name(gid, p), Read(f, key, _rows(so, n, dim), _rows(do, n, dim), rope if p.rope else None),
                    dtype)


def _fc1_reads(lay: _Layout, acc: _Reads, f: str, key: str, gid: int, t: int, shape: tuple, dtype: str) -> None:
    """De-fuse one rank's linear_fc1: its gate rows, then its up rows."""
    ffn_local, dim = lay.ffn_local, lay.args.dim
    if shape != (2 * ffn_local, dim):
        raise UserError(f"{lay.it_dir / f}: {key} is {list(shape)}, expected {[2 * ffn_local, dim]}")
    parts = fused_parts("fc1")
    for part, so in (("gate", 0), ("up", ffn_local)):
        acc.add(layer_name(gid, parts[part]),
                Read(f, key, _rows(so, ffn_local, dim), _rows(t * ffn_local, ffn_local, dim)), dtype)


def _plain_reads(lay: _Layout, acc: _Reads, f: str, key: str, name: str, t: int, shape: tuple, dtype: str) -> None:
    """Vocab-parallel embeddings (padding dropped), row-parallel wo/w2 (split columns), replicated norms."""
    tp, dim, spec = lay.tp, lay.args.dim, param_of(name)
    acc.dtypes[name] = dtype
    if spec.vocab_rows:
        rows = shape[0]
        if lay.padded and rows * tp != lay.padded:
            raise UserError(f"{lay.it_dir / f}: {key} has {rows} rows x tp {tp} != padded vocab {lay.padded}")
        lo, hi = t * rows, min((t + 1) * rows, lay.args.vocab_size)
        if hi > lo:
            acc.reads.setdefault(name, []).append(Read(f, key, _rows(0, hi - lo, dim), _rows(lo, hi - lo, dim)))
        acc.shapes[name] = (lay.args.vocab_size, dim)
    elif spec.tp == "rowwise":
        cols = shape[1]
        acc.reads.setdefault(name, []).append(Read(f, key, Box.full(shape), Box((0, t * cols), shape)))
        acc.shapes[name] = (shape[0], cols * tp)
    elif t == 0:  # norms: replicated over tp
        acc.reads.setdefault(name, []).append(Read(f, key, Box.full(shape), Box.full(shape)))
        acc.shapes[name] = shape


def _plan_rank(lay: _Layout, acc: _Reads, t: int, p: int, f: str, sd: dict) -> None:
    """The reads one (tp, pp) rank file contributes; its layer count must match its pp stage."""
    model = sd.get("model")
    if model is None:
        raise UserError(f"{lay.it_dir / f}: no 'model' entry (keys {sorted(sd)[:6]}); virtual "
                        "pipeline checkpoints (model0, model1 ...) are not supported")
    n_local = 0
    for key, x in model.items():
        try:
            name = megatron_to_native(key, lay.offsets[p])
        except KeyError as e:
            raise UserError(f"{lay.it_dir / f}: {e.args[0]}; only megatron-core LLaMA-style "
                            "layers are converted") from None
        if name is None or not isinstance(x, torch.Tensor):
            continue
        if ".layers." in key:
            n_local = max(n_local, int(key.split(".")[2]) + 1)
        dtype, shape = DTYPE_NAMES[x.dtype], tuple(x.shape)
        if name.startswith("<qkv>"):
            _qkv_reads(lay, acc, f, key, int(name.split(":")[1]), t, shape, dtype)
        elif name.startswith("<fc1>"):
            _fc1_reads(lay, acc, f, key, int(name.split(":")[1]), t, shape, dtype)
        else:
            _plain_reads(lay, acc, f, key, name, t, shape, dtype)
    if n_local != lay.counts[p]:
        raise UserError(f"{lay.it_dir / f}: holds {n_local} layers but pp stage {p} should hold "
                        f"{lay.counts[p]} (num_layers {lay.a.num_layers} over pp={lay.pp})")


def _tensor_plans(lay: _Layout, acc: _Reads) -> dict[str, TensorPlan]:
    """Every parameter of the model with its global shape and reads; a missing one is an error."""
    args, tp = lay.args, lay.tp
    tensors, shapes = {}, native_shapes(args)
    for name in native_names(args):
        if name not in acc.reads:
            raise UserError(f"{lay.it_dir}: no tensor for {name!r}; the checkpoint is incomplete")
        spec = param_of(name)
        shape = acc.shapes.get(name, shapes[name])  # de-fused q/k/v and gate/up: the declared shape
        kind = (f"fused {spec.fused[0]}" if spec.fused else
                "replicated" if len(acc.reads[name]) == 1 else f"over tp={tp}")
        if spec.vocab_rows and lay.padded:
            kind = f"vocab-parallel, padded {lay.padded} -> {args.vocab_size}"
        tensors[name] = TensorPlan(name, shape, acc.dtypes[name], tuple(acc.reads[name]), kind)
    return tensors


def open_source(path: Path, *, vocab_size: int | None = None, model_config: Path | None = None,
                read_headers: bool = True) -> tuple[SourcePlan, MegatronStore]:
    """Plan a Megatron-LM checkpoint: find the rank files, read the layout from their args, plan
    each rank file's reads (one rank file in memory at a time), then every global tensor.
    torch_dist checkpoints (megatron.core.dist_checkpointing) go to megatron_dist.py."""
    if megatron_dist.looks_like(path):
        return megatron_dist.open_source(path, vocab_size=vocab_size, model_config=model_config)
    it_dir, files, first = _rank_files(path)
    lay = _layout(path, it_dir, files, first["args"], vocab_size)
    acc = _Reads()
    for (t, p), f in sorted(files.items(), key=lambda x: (x[0][1], x[0][0])):
        sd = first if (t, p) == min(files) else load_rank_file(it_dir / f)
        _plan_rank(lay, acc, t, p, f, sd)
        del sd
    check_accounted(acc.reads, lay.args, source=f"{it_dir}: Megatron args")
    tensors = _tensor_plans(lay, acc)
    # Reads name files relative to the iteration dir; the store and the hasher work from there.
    plan = SourcePlan(FORMAT, it_dir, lay.args, tensors,
                      files=[files[k] for k in sorted(files, key=lambda x: (x[1], x[0]))],
                      step=read(first, "iteration", INT, source=it_dir / files[min(files)], default=0),
                      layout={"tp": lay.tp, "pp": lay.pp, "layers_per_stage": lay.counts,
                              "checkpoint_version": first.get("checkpoint_version"),
                              "padded_vocab_size": lay.padded or None})
    del first
    return plan, MegatronStore(it_dir, keep=lay.tp)
