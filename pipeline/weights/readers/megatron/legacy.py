"""Reader for Megatron-LM legacy checkpoints of megatron-core GPT/LLaMA models (one pickle per rank).

Tree: ``latest_checkpointed_iteration.txt`` + ``iter_XXXXXXX/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt``
(TT: tp rank, PPP: pp rank when pp > 1, EEE: expert-parallel rank when ep > 1). Each file is opened with
``torch.load(weights_only=True, mmap=True)`` and the allow-list of common.py -- never a plain
unpickle -- one rank file at a time as the plan reaches it.

Per rank file (the de-fusion itself: common.py):
- ``linear_qkv`` weight and bias hold the rank's query groups (``num_query_groups / tp``);
- ``linear_fc1`` holds the rank's gate slice, then its up slice;
- vocab-parallel embeddings hold the rank's rows of the padded table;
- ``linear_proj`` / ``linear_fc2`` (row-parallel) hold the rank's columns;
- layer norms (fused into the linear layers as ``layer_norm_weight``, or standalone) and q/k
  layernorms are replicated over tp: read from tp rank 0;
- layer indices are local to each pipeline stage: global id = stage's first layer + local id;
- a mixture of experts: each ep rank's file holds its E/ep SequentialMLP experts as
  ``mlp.experts.local_experts.{j}.linear_fc1/fc2`` (global expert = ep rank x E/ep + j; fc1 its
  gate slice then its up slice, fc2 its columns, as the dense MLP's), or, with
  ``--moe-grouped-gemm`` (megatron-core's GroupedMLP), all of them in ``mlp.experts.weight1``
  (dim, E/ep x 2 ffn/tp), whose memory is (E/ep, dim, [gate; up]) -- fc1 transposed -- and
  ``weight2`` (E/ep x ffn/tp, dim), memory (E/ep, ffn/tp, dim) -- fc2 transposed -- as GroupedMLP
  views them; and a copy of everything else (read from ep rank 0; the router, replicated, from tp
  rank 0 too).
"""

from __future__ import annotations

import argparse
import re
from functools import cached_property
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from titan_pipe.records.checkpoint_format import Box
from titan_pipe.rules import limits
from titan_pipe.weights.readers.megatron.common import (
    FORMAT,
    RANK_DIR,
    TRACKER,
    Reads,
    arg,
    defuse_fc1,
    defuse_qkv,
    fused_group,
    iter_dir,
    iteration,
    load_pickle,
    model_args,
    qkv_group_rows,
    rope_rows,
    tensor_plans,
    true_vocab,
    vocab_read,
)
from titan_pipe.weights.readers.store import Store
from titan_pipe.weights.source_plan import Read, SourcePlan
from titan_pipe.errors import UserError
from titan_pipe.rules.values import INT
from titan_pipe.model import features
from titan_pipe.model.args import ModelArgs, check_fits
from titan_pipe.model.names import megatron_local_expert, megatron_to_native
from titan_pipe.model.params import fused_parts, layer_name, param_of
from titan_pipe.io.paths import resolve_inside

if TYPE_CHECKING:
    import torch

FILE = "model_optim_rng.pt"
_GROUPED = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.weight([12])$")
GROUPED_VIEW = "#experts"  # a grouped weight read as (E/ep, rows, cols) per expert (MegatronStore.read_box)


def load_rank_file(path: Path) -> dict:
    """One model_optim_rng.pt, tensors memory-mapped, through the allow-list only."""
    return load_pickle(path, missing="copy the complete checkpoint", mmap=True)


def rank_files(it_dir: Path) -> dict[tuple[int, ...], str]:
    """The numbers of each rank dir's name (tp rank[, pp rank][, ep rank]) -> file relative to the
    iteration dir (rank_coords reads them as (tp, pp, ep) once the args are known)."""
    out = {}
    for p in it_dir.iterdir():
        m = RANK_DIR.match(p.name)
        if m and p.is_dir():
            resolve_inside(it_dir, f"{p.name}/{FILE}", source=it_dir, what="rank file")
            out[tuple(int(g) for g in m.groups() if g is not None)] = f"{p.name}/{FILE}"
    return out


def rank_coords(numbers: tuple[int, ...], pp: int, ep: int) -> tuple[int, int, int] | None:
    """(tp, pp, ep) ranks of a rank dir's numbers as Megatron names them for this pp and ep (None:
    not a name it writes for them)."""
    want = 1 + (pp > 1) + (ep > 1)
    if len(numbers) != want:
        return None
    t, rest = numbers[0], list(numbers[1:])
    p = rest.pop(0) if pp > 1 else 0
    e = rest.pop(0) if ep > 1 else 0
    return t, p, e


def rank_dir_name(t: int, p: int, e: int, pp: int, ep: int) -> str:
    return f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")


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


def grouped_experts(w: torch.Tensor, memory: tuple[int, int, int]) -> torch.Tensor:
    """GroupedMLP's weight1 (dim, E x rows) or weight2 (E x rows, dim) as (E, cols, rows): its memory
    read as ``memory`` (E, rows_in_memory, cols_in_memory), transposed per expert -- fc1 (E, 2 ffn, dim)
    or fc2 (E, dim, ffn) -- as megatron-core's GroupedMLP views it for its dist checkpoints."""
    return w.reshape(memory).transpose(-1, -2)


class MegatronStore(Store):
    """Rank files loaded (memory-mapped) on demand; at most ``keep`` stay open (one pp stage).
    ``grouped``: (file, GroupedMLP view key) -> the (E, rows, cols) its memory is read as."""

    def __init__(self, root: Path, keep: int, grouped: dict | None = None):
        super().__init__(root)
        self.keep = keep
        self.grouped = grouped or {}
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
        if key.endswith(GROUPED_VIEW):  # GroupedMLP's weight1/weight2 as per-expert fc1 / fc2
            x = grouped_experts(self.model(file)[key[: -len(GROUPED_VIEW)]], self.grouped[(file, key)])
        else:
            x = self.model(file)[key]
        if len(box.offsets) == x.dim() + 1:  # one expert's tensor read as its (1, ...) slice of the stack
            x = x.unsqueeze(0)
        for d, (o, n) in enumerate(zip(box.offsets, box.lengths)):
            x = x.narrow(d, o, n)
        return x

    def close(self) -> None:
        self._open.clear()


@dataclass(frozen=True)
class _Layout:
    """The model and its tp/pp split, as a rank file's Megatron args describe them."""

    it_dir: Path
    files: dict  # (tp rank, pp rank, ep rank) -> file relative to it_dir
    a: argparse.Namespace
    args: ModelArgs
    tp: int
    pp: int
    ep: int
    padded: int  # padded_vocab_size (0: none)
    counts: list[int]  # layers per pp stage
    offsets: list[int]  # first global layer id of each pp stage

    @property
    def ng_local(self) -> int:  # query groups per tp rank
        return self.args.kv_heads // self.tp

    @cached_property
    def expert_split(self) -> tuple[int, int, int]:
        """(experts an ep rank holds, an expert's rows a tp rank holds, dim) of a mixture of experts."""
        routing = features.routing(self.args)
        return routing.experts // self.ep, routing.width // self.tp, self.args.dim


def _rank_files(path: Path) -> tuple[Path, dict, dict]:
    """(iteration dir, {(tp, pp): rank file}, the first rank file loaded): the files and their args."""
    it_dir = iter_dir(path)
    if it_dir is None:
        raise UserError(
            f"{path}: no {TRACKER}, iter_* directory or mp_rank_* directories; not a Megatron-LM checkpoint"
        )
    files = rank_files(it_dir)
    if not files:
        raise UserError(f"{it_dir}: no mp_rank_* directories")
    first = load_rank_file(it_dir / files[min(files)])
    if first.get("args") is None:
        raise UserError(
            f"{it_dir / files[min(files)]}: has no 'args'; titan-pipe needs the model's "
            "Megatron arguments saved in the checkpoint"
        )
    return it_dir, files, first


def _layout(path: Path, it_dir: Path, found: dict, a, vocab_size: int | None) -> _Layout:
    """Check that every (tp, pp, ep) rank file is there and the groups split over tp; the model args."""
    tp = arg(a, "tensor_model_parallel_size", INT, path, bound=limits.PARALLEL)
    pp = arg(a, "pipeline_model_parallel_size", INT, path, bound=limits.PARALLEL)
    ep = arg(a, "expert_model_parallel_size", INT, path, default=1, bound=limits.PARALLEL)
    files = {c: f for n, f in found.items() if (c := rank_coords(n, pp, ep)) is not None}
    want = {(t, p, e) for t in range(tp) for p in range(pp) for e in range(ep)}
    if set(files) != want or len(files) != len(found):
        missing = sorted(want - set(files))
        names = [rank_dir_name(*c, pp, ep) for c in missing] or sorted(f.split("/")[0] for f in found.values())
        raise UserError(
            f"{it_dir}: args say tp={tp} pp={pp}"
            + (f" ep={ep}" if ep > 1 else "")
            + f" but rank dirs {names} are missing or extra; copy the complete checkpoint"
        )
    for (t, p, e), f in files.items():
        if not (it_dir / f).is_file():
            raise UserError(f"{it_dir / f}: missing rank file; copy the complete checkpoint")
    args = model_args(a, true_vocab(a, path, vocab_size), path)
    check_fits(
        args,
        sum((it_dir / f).stat().st_size for f in files.values()),
        source=f"{path}: Megatron args",
        where="its rank files",
    )
    if args.kv_heads % tp:
        raise UserError(f"{it_dir}: {args.kv_heads} query groups do not split over tp={tp}")
    routing = features.routing(args)
    if routing is not None and routing.experts % ep:
        raise UserError(f"{it_dir}: {routing.experts} experts do not split over ep={ep}")
    counts = _stage_layers(a, pp, path)
    padded = arg(a, "padded_vocab_size", INT, path, default=0, bound=limits.VOCAB)
    return _Layout(it_dir, files, a, args, tp, pp, ep, padded, counts, [sum(counts[:s]) for s in range(pp)])


def _grouped_reads(
    lay: _Layout,
    acc: Reads,
    grouped: dict,
    f: str,
    key: str,
    gid: int,
    which: str,
    t: int,
    e: int,
    shape: tuple,
    dtype: str,
) -> None:
    """GroupedMLP's weight1 (which "1") or weight2 ("2") of ep rank ``e``, tp rank ``t``: every local
    expert's fc1 / fc2 through the per-expert view (grouped_experts), as SequentialMLP's would be."""
    per, fl, dim = lay.expert_split
    want = (dim, per * 2 * fl) if which == "1" else (per * fl, dim)
    if shape != want:
        raise UserError(
            f"{lay.it_dir / f}: {key} is {list(shape)}, expected {list(want)} ({per} experts of "
            f"{'2 x ' if which == '1' else ''}{fl} rows on this tp rank, dim {dim})"
        )
    view = key + GROUPED_VIEW
    grouped[(f, view)] = (per, dim, 2 * fl) if which == "1" else (per, fl, dim)
    fc1 = fused_parts("expert_fc1")
    for j in range(per):
        x = e * per + j
        if which == "1":
            for part, row in (("gate", 0), ("up", fl)):
                acc.add(
                    layer_name(gid, fc1[part]),
                    Read(f, view, Box((j, row, 0), (1, fl, dim)), Box((x, t * fl, 0), (1, fl, dim))),
                    dtype,
                )
        else:
            acc.add(
                f"layers.{gid}.moe.experts.w2",
                Read(f, view, Box((j, 0, 0), (1, dim, fl)), Box((x, 0, t * fl), (1, dim, fl))),
                dtype,
            )


def _expert_reads(
    lay: _Layout, acc: Reads, f: str, key: str, name: str, j: int, t: int, e: int, shape: tuple, dtype: str
) -> None:
    """One SequentialMLP expert of ep rank ``e`` (local index ``j``): fc1's gate and up slices (its tp
    rank's rows of each) into w1/w3, fc2's tp columns into w2, each as a (1, ...) slice of the stack."""
    per, fl, dim = lay.expert_split
    if j >= per:
        raise UserError(f"{lay.it_dir / f}: {key}: local expert {j}, but ep={lay.ep} leaves {per} experts a rank")
    x = e * per + j
    fused = fused_group(name)
    if fused:
        if shape != (2 * fl, dim):
            raise UserError(f"{lay.it_dir / f}: {key} is {list(shape)}, expected {[2 * fl, dim]}")
        parts = fused_parts("expert_fc1")
        reads = [
            (
                layer_name(fused[1], parts[part]),
                Read(f, key, Box((0, row, 0), (1, fl, dim)), Box((x, t * fl, 0), (1, fl, dim))),
            )
            for part, row in (("gate", 0), ("up", fl))
        ]
    else:
        if shape != (dim, fl):
            raise UserError(f"{lay.it_dir / f}: {key} is {list(shape)}, expected {[dim, fl]}")
        reads = [(name, Read(f, key, Box((0, 0, 0), (1, dim, fl)), Box((x, 0, t * fl), (1, dim, fl))))]
    for n, read in reads:
        acc.add(n, read, dtype)


def _fused_reads(
    lay: _Layout, acc: Reads, f: str, key: str, group: str, gid: int, t: int, shape: tuple, dtype: str
) -> None:
    """One rank's linear_qkv (weight or bias: its query groups) or linear_fc1 (gate slice, up slice)."""
    args, tail = lay.args, tuple(shape[1:])
    if group == "fc1":
        fl = args.hidden_dim // lay.tp
        if shape != (2 * fl, args.dim):
            raise UserError(f"{lay.it_dir / f}: {key} is {list(shape)}, expected {[2 * fl, args.dim]}")
        reads = defuse_fc1(args, gid, f, key, [(0, t * fl, fl), (fl, args.hidden_dim + t * fl, fl)])
    else:
        exp = (lay.ng_local * qkv_group_rows(args),) + ((args.dim,) if group == "qkv" else ())
        if shape != exp:
            raise UserError(
                f"{lay.it_dir / f}: {key} is {list(shape)}, expected {list(exp)} ({lay.ng_local} "
                f"query groups x ({args.n_heads // args.kv_heads} q + k + v) x {args.head_dim} rows)"
            )
        reads = defuse_qkv(
            args,
            group,
            gid,
            f,
            key,
            first=t * lay.ng_local,
            n_groups=lay.ng_local,
            tail=tail,
            rope=rope_rows(lay.a, args, lay.it_dir),
        )
    for name, read in reads:
        acc.add(name, read, dtype)


def _plain_reads(lay: _Layout, acc: Reads, f: str, key: str, name: str, t: int, shape: tuple, dtype: str) -> None:
    """Vocab-parallel embeddings (padding dropped), row-parallel wo/w2 (split columns), replicated norms."""
    tp, spec = lay.tp, param_of(name)
    if spec.vocab_rows:
        if lay.padded and shape[0] * tp != lay.padded:
            raise UserError(f"{lay.it_dir / f}: {key} has {shape[0]} rows x tp {tp} != padded vocab {lay.padded}")
        acc.add(name, vocab_read(lay.args, f, key, t * shape[0], shape[0]), dtype)
    elif spec.tp == "rowwise":
        acc.add(name, Read(f, key, Box.full(shape), Box((0, t * shape[1]), shape)), dtype)
    elif t == 0:  # norms, q/k layernorms: replicated over tp
        acc.add(name, Read(f, key, Box.full(shape), Box.full(shape)), dtype)


def _plan_rank(lay: _Layout, acc: Reads, t: int, p: int, e: int, f: str, sd: dict, grouped: dict) -> None:
    """The reads one (tp, pp, ep) rank file contributes; its layer count must match its pp stage."""
    import torch  # a rank file was loaded (common.load_pickle): torch is in already

    from titan_pipe.rules.dtypes import DTYPE_NAMES

    model = sd.get("model")
    if model is None:
        raise UserError(
            f"{lay.it_dir / f}: no 'model' entry (keys {sorted(sd)[:6]}); virtual "
            "pipeline checkpoints (model0, model1 ...) are not supported"
        )
    n_local = 0
    for key, x in model.items():
        if ".layers." in key and isinstance(x, torch.Tensor):
            n_local = max(n_local, int(key.split(".")[2]) + 1)
        g = _GROUPED.match(key)
        if g is not None and isinstance(x, torch.Tensor):
            _grouped_reads(
                lay,
                acc,
                grouped,
                f,
                key,
                int(g.group(1)) + lay.offsets[p],
                g.group(2),
                t,
                e,
                tuple(x.shape),
                DTYPE_NAMES[x.dtype],
            )
            continue
        expert = megatron_local_expert(key, lay.offsets[p])
        if expert is not None:
            if isinstance(x, torch.Tensor):
                _expert_reads(lay, acc, f, key, expert[0], expert[1], t, e, tuple(x.shape), DTYPE_NAMES[x.dtype])
            continue
        if e:  # every ep rank keeps a copy of the rest: read ep rank 0's
            continue
        try:
            name = megatron_to_native(key, lay.offsets[p])
        except KeyError as e:
            raise UserError(
                f"{lay.it_dir / f}: {e.args[0]}; only megatron-core LLaMA-family layers are converted"
            ) from None
        if name is None or not isinstance(x, torch.Tensor):
            continue
        dtype, shape, fused = DTYPE_NAMES[x.dtype], tuple(x.shape), fused_group(name)
        if fused:
            _fused_reads(lay, acc, f, key, fused[0], fused[1], t, shape, dtype)
        else:
            _plain_reads(lay, acc, f, key, name, t, shape, dtype)
    if n_local != lay.counts[p]:
        raise UserError(
            f"{lay.it_dir / f}: holds {n_local} layers but pp stage {p} should hold "
            f"{lay.counts[p]} (num_layers {lay.a.num_layers} over pp={lay.pp})"
        )


def open_source(
    path: Path, *, vocab_size: int | None = None, model_config: Path | None = None, read_headers: bool = True
) -> tuple[SourcePlan, MegatronStore]:
    """Plan a legacy checkpoint: find the rank files, read the layout from their args, plan each
    rank file's reads (one rank file in memory at a time), then every global tensor."""
    it_dir, found, first = _rank_files(path)
    lay = _layout(path, it_dir, found, first["args"], vocab_size)
    files, first_file = lay.files, found[min(found)]
    acc, grouped = Reads(), {}
    for (t, p, e), f in sorted(files.items(), key=lambda x: (x[0][1], x[0][2], x[0][0])):
        sd = first if f == first_file else load_rank_file(it_dir / f)
        _plan_rank(lay, acc, t, p, e, f, sd, grouped)
        del sd

    def split(spec, reads) -> str:
        if spec.vocab_rows and lay.padded:
            return f"vocab-parallel, padded {lay.padded} -> {lay.args.vocab_size}"
        return "replicated" if len(reads) == 1 else f"over tp={lay.tp}"

    # Reads name files relative to the iteration dir; the store and the hasher work from there.
    plan = SourcePlan(
        FORMAT,
        it_dir,
        lay.args,
        tensor_plans(it_dir, lay.args, acc, split),
        files=[files[k] for k in sorted(files, key=lambda x: (x[1], x[2], x[0]))],
        step=iteration(first, it_dir / first_file),
        layout={
            "tp": lay.tp,
            "pp": lay.pp,
            **({"ep": lay.ep} if lay.ep > 1 else {}),
            "layers_per_stage": lay.counts,
            "checkpoint_version": first.get("checkpoint_version"),
            "padded_vocab_size": lay.padded or None,
        },
    )
    del first
    return plan, MegatronStore(it_dir, keep=lay.tp * lay.ep, grouped=grouped)
