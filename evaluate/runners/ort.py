"""ONNX Runtime, whole graphs: the exported prefill graph and the KV-cache decode graph, each in one
session (sessions come from titan_pipe.graphs.generation.ort_session, the one way titan-pipe opens one).

A whole graph runs here when its per-layer values are unknown (a graph titan-pipe did not describe
and whose structure does not give them) and to check, on the first batch, that its pieces chained
(runners/ort_layers.py, where per-layer values come from) return its own logits. What a graph
declares (I/O names, dims, dtype) is read from its structure, so streamed mode never opens the
whole graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from titan_pipe.rules.dtypes import FLOAT_NAMES, onnx_type
from titan_pipe.errors import UserError
from titan_pipe.evaluate.graph_files import check_external_data
from titan_pipe.evaluate.graph_taps import LayerTaps, find_layer_taps, recorded_layer_count
from titan_pipe.evaluate.runners.outputs import Outputs
from titan_pipe.records.export_record import RECORD_FILE
from titan_pipe.graphs.generation import generate, ort_session
from titan_pipe.graphs.graph_io import (
    ATTENTION_MASK,
    DECODE_FILE,
    HIDDEN,
    INPUT_IDS,
    LOGITS,
    PAST,
    POSITION_IDS,
    PREFILL_INPUTS,
    PRESENT,
    hidden_name,
)
from titan_pipe.model.args import ModelArgs

_HINT = "re-export it with `titan-pipe export`"
_DTYPE_OF = {onnx_type(n): n for n in FLOAT_NAMES}


@dataclass(frozen=True)
class Port:
    """A graph input or output as ONNX Runtime's NodeArg shows it: name, dims (int, or a name /
    None where dynamic), ONNX element type."""

    name: str
    shape: list
    elem: int


class GraphIO:
    """A graph's inputs and outputs read from its structure (``get_inputs`` / ``get_outputs`` as
    an ORT session has them, so the generation loop's planning takes it in place of a session)."""

    def __init__(self, structure):
        def port(vi) -> Port:
            dims = [
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in vi.type.tensor_type.shape.dim
            ]
            return Port(vi.name, dims, vi.type.tensor_type.elem_type)

        inits = {t.name for t in structure.graph.initializer}
        self.inputs = [port(v) for v in structure.graph.input if v.name not in inits]
        self.outputs = [port(v) for v in structure.graph.output]

    def get_inputs(self) -> list[Port]:
        return self.inputs

    def get_outputs(self) -> list[Port]:
        return self.outputs


def as_tensor(a) -> torch.Tensor:
    """A session's output as a tensor of its own: a view would keep the session's memory arena alive."""
    return torch.from_numpy(np.array(a, copy=True))


class OnnxGraph:
    """One deployed ONNX file: its checked structure, its per-layer values once ``find_layers`` ran
    (the names evaluate cuts it into pieces at: runners/ort_layers.py), and, opened on first use,
    its session running the whole graph."""

    def __init__(self, path: Path, *, threads: int = 0):
        self.path, self.threads = Path(path), threads
        self.structure = check_external_data(self.path)  # before ONNX Runtime opens anything it names
        self.io = GraphIO(self.structure)
        self.taps: LayerTaps | None = None
        self.layers_note = ""
        self._session = None

    def find_layers(self, n_layers: int) -> None:
        """Locate the per-layer values: export.json, else the residual Add chain."""
        self.taps, self.layers_note = find_layer_taps(self.path, self.structure, n_layers)

    @property
    def session(self):
        if self._session is None:
            self._session = ort_session(self.path, threads=self.threads, hint=_HINT, prepack=False)
        return self._session

    def run(self, names: list[str], feeds: dict) -> list[np.ndarray]:
        return self.session.run(names, feeds)

    def close(self) -> None:
        self._session = None


@dataclass(frozen=True)
class GraphInfo:
    """What an ONNX graph declares: dtype, static (B, T) if any, vocab, dim, exposed layers."""

    dtype: str
    fixed_shape: tuple[int, int] | None
    vocab: int | None
    dim: int | None
    n_hidden: int


def describe_prefill(path: Path, io: GraphIO) -> GraphInfo:
    """The prefill graph's declaration; UserError for a graph that is not one."""
    ins = {i.name: i for i in io.get_inputs()}
    outs = {o.name: o for o in io.get_outputs()}
    if INPUT_IDS not in ins or LOGITS not in outs:
        raise UserError(
            f"{path}: expected input {INPUT_IDS!r} and output {LOGITS!r} (the prefill graph "
            f"of `titan-pipe export`), found inputs {list(ins)} and outputs {list(outs)[:4]}"
        )
    if any(n.startswith(PAST) for n in ins):
        raise UserError(
            f"{path}: takes {PAST}* inputs: that is the KV-cache decode graph; "
            "pass the prefill graph model.onnx instead"
        )
    extra = tuple(n for n in ins if n not in PREFILL_INPUTS)
    if extra:
        raise UserError(
            f"{path}: takes {extra[0]!r} besides {', '.join(PREFILL_INPUTS)}; pass the "
            "prefill graph model.onnx written by `titan-pipe export`"
        )
    shape = ins[INPUT_IDS].shape
    fixed = tuple(shape) if all(isinstance(d, int) and d > 0 for d in shape) else None
    lg = outs[LOGITS].shape
    n_hidden = sum(1 for n in outs if n.startswith(HIDDEN))
    dim = None
    if n_hidden:
        hs = outs[hidden_name(0)].shape
        dim = hs[-1] if isinstance(hs[-1], int) else None
    dtype = _DTYPE_OF.get(outs[LOGITS].elem)
    if dtype is None:
        raise UserError(
            f"{path}: logits have ONNX element type {outs[LOGITS].elem}; expected float, float16 or bfloat16"
        )
    return GraphInfo(dtype, fixed, lg[-1] if isinstance(lg[-1], int) else None, dim, n_hidden)


class OnnxRuntimeRunner:
    """The exported prefill graph: input ``input_ids`` (B, T), output ``logits``; per-layer values
    from the graph itself once ``find_layers(n_layers)`` has located them and ``open`` ran."""

    def __init__(self, onnx_path: Path, *, label: str | None = None, threads: int = 0):
        onnx_path = Path(onnx_path)
        if not onnx_path.is_file():
            raise UserError(f"{onnx_path}: ONNX file not found; pass the model.onnx written by `titan-pipe export`")
        self.graph = OnnxGraph(onnx_path, threads=threads)
        self.path, self.label = onnx_path, label or f"onnxruntime ({onnx_path.name})"
        self.info = describe_prefill(onnx_path, self.graph.io)
        self.dtype = self.info.dtype

    @property
    def session(self):
        return self.graph.session

    def find_layers(self, n_layers: int) -> None:
        self.graph.find_layers(n_layers)

    def check_matches(self, args: ModelArgs, *, source: str) -> None:
        """UserError when the graph's vocab / dim / layer count disagree with the model config."""
        info = self.info
        problems = []
        if info.vocab is not None and info.vocab != args.vocab_size:
            problems.append(f"vocab {info.vocab} vs vocab_size {args.vocab_size}")
        if info.dim is not None and info.dim != args.dim:
            problems.append(f"hidden size {info.dim} vs dim {args.dim}")
        if info.n_hidden and info.n_hidden != args.n_layers:
            problems.append(f"{info.n_hidden} {HIDDEN}* outputs vs n_layers {args.n_layers}")
        recorded = recorded_layer_count(self.path)
        if not info.n_hidden and recorded is not None and recorded != args.n_layers:
            problems.append(f"{RECORD_FILE} records {recorded} layer outputs vs n_layers {args.n_layers}")
        problems += self._weight_shape_problems(args)
        if problems:
            raise UserError(
                f"{self.path} does not match {source}: {'; '.join(problems)}; export the graph "
                "from this model directory (or pass the model directory it came from)"
            )

    def _weight_shape_problems(self, args: ModelArgs) -> list[str]:
        """The graph's own weights against the model's: an initializer of another shape (another FFN
        width, head count, ...) means another model, named as such rather than as a layer-0 divergence."""
        from titan_pipe.model.params import initializer_names, native_shapes

        want = native_shapes(args)
        names = initializer_names(args)
        for init in self.graph.structure.graph.initializer:
            native = names.get(init.name)
            if native is None or native not in want:
                continue
            if tuple(init.dims) != tuple(want[native]):
                return [
                    f"weight {init.name!r} is {list(init.dims)} in the graph vs {list(want[native])} for "
                    f"{native} (dim {args.dim}, ffn {args.hidden_dim}, heads {args.n_heads}/{args.kv_heads})"
                ]
        return []

    def feeds(self, tokens: torch.Tensor) -> dict[str, np.ndarray]:
        """The graph's inputs for unpadded batches: every token real, positions 0..T-1."""
        if self.info.fixed_shape and tuple(tokens.shape) != self.info.fixed_shape:
            raise UserError(
                f"{self.path}: static input shape {list(self.info.fixed_shape)} but the batch is "
                f"{list(tokens.shape)}; set evaluate.batch_size/seq_len to match or export with dynamic: true"
            )
        ids = tokens.cpu().numpy().astype(np.int64)
        feeds = {INPUT_IDS: ids}
        takes = {i.name for i in self.graph.io.get_inputs()}
        if ATTENTION_MASK in takes:
            feeds[ATTENTION_MASK] = np.ones_like(ids)
        if POSITION_IDS in takes:
            feeds[POSITION_IDS] = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int64), ids.shape).copy()
        return feeds

    def run(self, tokens: torch.Tensor) -> Outputs:
        """The whole graph on one batch: its logits (per-layer values come from its pieces)."""
        return Outputs(as_tensor(self.graph.run([LOGITS], self.feeds(tokens))[0]))

    def close(self) -> None:
        self.graph.close()


class OnnxDecodeRunner:
    """KV-cache generation with the exported pair through the reference loop
    (titan_pipe.graphs.generation): left-padded prompts, prefill ``model.onnx``, then ``decode.onnx``
    one token a step against the fixed-capacity cache — the path a deployment generates with, on
    static graphs as on dynamic ones. Per-layer values of each decode step come from decode.onnx
    itself (``find_layers``)."""

    def __init__(self, prefill: OnnxRuntimeRunner, decode_path: Path):
        self.prefill, self.path = prefill, Path(decode_path)
        self.graph = OnnxGraph(self.path)
        present = [o.name for o in prefill.graph.io.get_outputs() if o.name.startswith(PRESENT)]
        past = [i.name for i in self.graph.io.get_inputs() if i.name.startswith(PAST)]
        if len(past) != len(present) or not past:
            raise UserError(
                f"{self.path}: takes {len(past)} {PAST}* inputs but {prefill.path.name} "
                f"gives {len(present)} {PRESENT}* outputs; export both with kv_cache from one model"
            )
        dims = {i.name: i.shape for i in self.graph.io.get_inputs()}
        slots = dims.get(ATTENTION_MASK, [None, None])[1]
        self.cache_len = slots if isinstance(slots, int) else None  # fixed by a static graph
        t = prefill.graph.io.get_inputs()[0].shape[1]
        self.prompt_len = t if isinstance(t, int) else None
        self.label = f"onnxruntime KV-cache ({prefill.path.name} + {self.path.name})"

    @property
    def session(self):
        return self.graph.session

    def find_layers(self, n_layers: int) -> None:
        self.graph.find_layers(n_layers)

    @classmethod
    def beside(cls, prefill: OnnxRuntimeRunner) -> "OnnxDecodeRunner | None":
        """The decode graph next to ``prefill`` when both were exported with the KV cache, else None."""
        decode = prefill.path.parent / DECODE_FILE
        has_present = any(o.name.startswith(PRESENT) for o in prefill.graph.io.get_outputs())
        return cls(prefill, decode) if decode.is_file() and has_present else None

    def max_new_tokens(self, prompt_len: int) -> int | None:
        """How many tokens a prompt of this length can generate against a static cache (None: any)."""
        if self.cache_len is None:
            return None
        return self.cache_len - max(prompt_len, self.prompt_len or 0) + 1

    def generate(self, prompts: list[list[int]], n_new: int, forced=None):
        """Ragged prompts -> Generation (new_tokens (N, n_new), logits (N, n_new, vocab)) through the
        deployed loop on the whole graphs; ``forced`` (N, n_new) feeds those tokens instead of the
        argmax (teacher forcing)."""
        return generate(
            prefill=self.prefill.graph.session,
            decode=self.graph.session,
            prompts=prompts,
            max_new_tokens=n_new,
            forced=None if forced is None else np.asarray(forced),
        )

    def close(self) -> None:
        self.graph.close()
