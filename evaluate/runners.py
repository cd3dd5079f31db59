"""Runners: one model artifact in, (logits, per-layer hidden states) out, for the same token batches.

  TorchRunner        the unified safetensors model in one process (forward hooks on each layer)
  OnnxRuntimeRunner  the exported graph in ONNX Runtime (``hidden.{i}`` outputs of a debug export)
  DistributedRunner  the training checkpoint under its own TP/PP layout: training's sharded forward process
  OmRunner           the ATC .om through ais_bench when an Ascend runtime is importable

Every ``run(tokens (B, T) int64)`` returns ``Outputs`` on the CPU in the runner's own dtype:
logits (B, T, vocab) and hidden[i] (B, T, dim) = the hidden state after decoder layer i.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from titan_pipe import procs, sharded_outputs
from titan_pipe.checkpoint_format import is_complete
from titan_pipe.dtypes import ORT_NAMES
from titan_pipe.errors import StageFailed, UserError
from titan_pipe.evaluate.graph_files import check_external_data
from titan_pipe.export_record import RECORD_FILE
from titan_pipe.graph_io import (ATTENTION_MASK, DECODE_FILE, HIDDEN, INPUT_IDS, LOGITS, PAST, POSITION_IDS,
                                 PREFILL_INPUTS, PRESENT, hidden_name)
from titan_pipe.model.args import ModelArgs


@dataclass
class Outputs:
    """logits (B, T, vocab); hidden[i] (B, T, dim) the residual stream after decoder layer i ([] if
    not available); attn[i] / mlp[i] (B, T, dim) layer i's attention / MLP block output before its
    residual Add (None entries, or [], where a candidate has no such value)."""

    logits: torch.Tensor
    hidden: list[torch.Tensor] = field(default_factory=list)
    attn: list[torch.Tensor | None] = field(default_factory=list)
    mlp: list[torch.Tensor | None] = field(default_factory=list)


def _cat(parts: list[list], dim: int = 0) -> list:
    """Per-layer lists of several batches joined along ``dim`` ([] unless every part has them)."""
    if not parts or not all(parts):
        return []
    return [None if any(p[i] is None for p in parts) else torch.cat([p[i] for p in parts], dim=dim)
            for i in range(len(parts[0]))]


def concat_outputs(parts: list[Outputs], dim: int = 0) -> Outputs:
    """Batches stacked along the batch dim (B_total, T, ...) (``dim=1``: steps along T)."""
    logits = torch.cat([p.logits for p in parts], dim=dim) if all(p.logits.numel() for p in parts) else torch.empty(0)
    return Outputs(logits, _cat([p.hidden for p in parts], dim),
                   _cat([p.attn for p in parts], dim), _cat([p.mlp for p in parts], dim))


class TorchRunner:
    """Our Transformer (any Kernels) in this process; hooks capture each decoder layer's output."""

    def __init__(self, model, args: ModelArgs, *, label: str = "torch", device: str = "cpu"):
        self.model, self.args, self.label, self.device = model.eval(), args, label, device
        self.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")

    @classmethod
    def from_dir(cls, model_dir: Path, *, dtype: str | None = "float32", device: str = "cpu",
                 kernels=None, label: str | None = None) -> "TorchRunner":
        from titan_pipe.model.load import load_unified_model

        model, args = load_unified_model(Path(model_dir), dtype=dtype, device=device, kernels=kernels)
        return cls(model, args, label=label or f"torch {dtype or 'stored'} ({Path(model_dir).name})",
                   device=device)

    @torch.no_grad()
    def run(self, tokens: torch.Tensor) -> Outputs:
        captured: dict[tuple[str, int], torch.Tensor] = {}

        def hook(kind: str, i: int):
            return lambda _m, _i, out: captured.__setitem__((kind, i), out.detach().to("cpu"))

        hooks = []
        for key, layer in self.model.layers.items():
            hooks.append(layer.register_forward_hook(hook("layer", int(key))))
            hooks.append(layer.attention.register_forward_hook(hook("attn", int(key))))
            hooks.append(layer.feed_forward.register_forward_hook(hook("mlp", int(key))))
        try:
            logits = self.model(tokens.to(self.device)).to("cpu")
        finally:
            for h in hooks:
                h.remove()
        n = sorted(i for kind, i in captured if kind == "layer")
        return Outputs(logits, [captured["layer", i] for i in n], [captured["attn", i] for i in n],
                       [captured["mlp", i] for i in n])


def _session_options(threads: int = 0):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if threads:
        opts.intra_op_num_threads = threads
    return opts


def _as_tensor(a) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


class OnnxGraph:
    """One deployed ONNX file in ONNX Runtime, plus (after ``find_layers``) a copy of its structure
    that also returns its per-layer values (evaluate/graph_taps.py): the per-layer tensors of the
    candidate itself, computed by its own nodes on its own weights."""

    def __init__(self, path: Path, *, threads: int = 0, hint: str = ""):
        import onnxruntime as ort

        self.path, self.threads = Path(path), threads
        # the structure, checked before ONNX Runtime opens anything the graph names
        self.structure = check_external_data(self.path)
        try:
            self.session = ort.InferenceSession(str(self.path), _session_options(threads),
                                                providers=["CPUExecutionProvider"])
        except Exception as e:  # ORT's own exception types (InvalidGraph, NoSuchFile, ...), protobuf errors
            raise UserError(f"{self.path}: ONNX Runtime cannot load it: {str(e).splitlines()[0][:300]}"
                            + (f"; {hint}" if hint else "")) from None
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.taps = None
        self.layers_note = ""
        self.tap_session = None
        self.copy_check: str | None = None  # how the copy's outputs compare with the graph's own
        self._copy_equal: bool | None = None

    def find_layers(self, n_layers: int) -> None:
        """Locate the per-layer values (export.json, else the residual Add chain) and build the copy."""
        from titan_pipe.evaluate.graph_taps import find_layer_taps, tapped_session

        self.taps, self.layers_note = find_layer_taps(self.path, self.structure, n_layers)
        if self.taps is not None and any(n not in self.outputs for n in self.taps.names()):
            try:
                self.tap_session = tapped_session(self.path, self.structure, self.taps.names(),
                                                  _session_options(self.threads))
            except Exception as e:  # a copy ORT refuses must not hide the graph's own results
                self.taps, self.layers_note = None, (f"{self.layers_note}, but ONNX Runtime refused the copy "
                                                     f"exposing them: {str(e).splitlines()[0][:200]}")
        # only the nodes are needed from here on; inline weights (graphs < 2 GB) need not stay twice
        self.structure.graph.ClearField("initializer")

    def run(self, names: list[str], feeds: dict) -> tuple[list[np.ndarray], Outputs | None]:
        """(the graph's own ``names`` outputs, per-layer values as Outputs (logits unset) or None)."""
        if self.taps is None:
            return self.session.run(names, feeds), None
        tap_names = self.taps.names()
        if self.tap_session is None:  # every value is already a graph output
            res = self.session.run(names + tap_names, feeds)
            own, extra = res[:len(names)], res[len(names):]
        else:
            res = self.tap_session.run(names + tap_names, feeds)
            own, extra = res[:len(names)], res[len(names):]
            if self._copy_equal is None:  # once: does exposing values change what the graph computes?
                real = self.session.run(names, feeds)
                gap = max(float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max()) if a.size else 0.0
                          for a, b in zip(real, own))
                self._copy_equal = gap == 0.0
                if self._copy_equal:  # one session from here on: the copy (weights held once, not twice)
                    self.session = self.tap_session
                self.copy_check = ("the copy exposing them returns the graph's own outputs bit for bit"
                                   if self._copy_equal else
                                   f"the copy exposing them differs from the graph on its outputs (max abs "
                                   f"{gap:.3g}, ORT fuses differently): outputs are taken from the graph itself")
                own = real
            elif not self._copy_equal:
                own = self.session.run(names, feeds)
        got = dict(zip(tap_names, extra))
        t = self.taps
        pick = lambda ns: [_as_tensor(got[n]) if n else None for n in ns]  # noqa: E731
        return own, Outputs(torch.empty(0), pick(t.layer), pick(t.attn), pick(t.mlp))

    def layers_detail(self) -> str:
        return self.layers_note + (f"; {self.copy_check}" if self.copy_check else "")


@dataclass(frozen=True)
class GraphInfo:
    """What an ONNX graph declares: dtype, static (B, T) if any, vocab, dim, exposed layers."""

    dtype: str
    fixed_shape: tuple[int, int] | None
    vocab: int | None
    dim: int | None
    n_hidden: int
    extra_inputs: tuple[str, ...]


class OnnxRuntimeRunner:
    """The exported prefill graph: input ``input_ids`` (B, T), output ``logits``; per-layer values
    from the graph itself once ``find_layers(n_layers)`` has located them."""

    def __init__(self, onnx_path: Path, *, label: str | None = None, threads: int = 0):
        onnx_path = Path(onnx_path)
        if not onnx_path.is_file():
            raise UserError(f"{onnx_path}: ONNX file not found; pass the model.onnx written by `titan-pipe export`")
        self.graph = OnnxGraph(onnx_path, threads=threads, hint="re-export it with `titan-pipe export`")
        self.path, self.label = onnx_path, label or f"onnxruntime ({onnx_path.name})"
        self.info = self._describe()
        self.dtype = self.info.dtype

    @property
    def session(self):
        return self.graph.session

    def find_layers(self, n_layers: int) -> None:
        self.graph.find_layers(n_layers)

    def _describe(self) -> GraphInfo:
        ins = {i.name: i for i in self.session.get_inputs()}
        outs = {o.name: o for o in self.session.get_outputs()}
        if INPUT_IDS not in ins or LOGITS not in outs:
            raise UserError(f"{self.path}: expected input {INPUT_IDS!r} and output {LOGITS!r} (the prefill graph "
                            f"of `titan-pipe export`), found inputs {list(ins)} and outputs {list(outs)[:4]}")
        if any(n.startswith(PAST) for n in ins):
            raise UserError(f"{self.path}: takes {PAST}* inputs: that is the KV-cache decode graph; "
                            "pass the prefill graph model.onnx instead")
        extra = tuple(n for n in ins if n not in PREFILL_INPUTS)
        if extra:
            raise UserError(f"{self.path}: takes {extra[0]!r} besides {', '.join(PREFILL_INPUTS)}; pass the "
                            "prefill graph model.onnx written by `titan-pipe export`")
        shape = ins[INPUT_IDS].shape
        fixed = tuple(shape) if all(isinstance(d, int) for d in shape) else None
        lg = outs[LOGITS].shape
        n_hidden = sum(1 for n in outs if n.startswith(HIDDEN))
        dim = None
        if n_hidden:
            hs = outs[hidden_name(0)].shape
            dim = hs[-1] if isinstance(hs[-1], int) else None
        dtype = ORT_NAMES.get(outs[LOGITS].type)
        if dtype is None:
            raise UserError(f"{self.path}: logits have type {outs[LOGITS].type}; expected float, float16 or bfloat16")
        return GraphInfo(dtype, fixed, lg[-1] if isinstance(lg[-1], int) else None, dim, n_hidden, extra)

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
        from titan_pipe.evaluate.graph_taps import recorded_layer_count

        recorded = recorded_layer_count(self.path)
        if not info.n_hidden and recorded is not None and recorded != args.n_layers:
            problems.append(f"{RECORD_FILE} records {recorded} layer outputs vs n_layers {args.n_layers}")
        if problems:
            raise UserError(f"{self.path} does not match {source}: {'; '.join(problems)}; export the graph "
                            "from this model directory (or pass the model directory it came from)")

    def run(self, tokens: torch.Tensor) -> Outputs:
        if self.info.fixed_shape and tuple(tokens.shape) != self.info.fixed_shape:
            raise UserError(f"{self.path}: static input shape {list(self.info.fixed_shape)} but the batch is "
                            f"{list(tokens.shape)}; set evaluate.batch_size/seq_len to match or export with dynamic: true")
        ids = tokens.cpu().numpy().astype(np.int64)
        feeds = {INPUT_IDS: ids}
        takes = {i.name for i in self.session.get_inputs()}
        if ATTENTION_MASK in takes:  # unpadded batches: every token real, positions 0..T-1
            feeds[ATTENTION_MASK] = np.ones_like(ids)
        if POSITION_IDS in takes:
            feeds[POSITION_IDS] = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int64), ids.shape).copy()
        (logits,), layers = self.graph.run([LOGITS], feeds)
        if layers is None:
            return Outputs(_as_tensor(logits))
        return Outputs(_as_tensor(logits), layers.hidden, layers.attn, layers.mlp)


class _RecordingSession:
    """A stand-in for an ORT session (``run``, ``get_inputs``, ``get_outputs``) that runs an
    OnnxGraph and keeps each call's per-layer values, so the reference generation loop
    (titan_pipe.generation) runs unchanged while decode.onnx's own layers are captured."""

    def __init__(self, graph: OnnxGraph):
        self.graph, self.calls = graph, []

    def get_inputs(self):
        return self.graph.session.get_inputs()

    def get_outputs(self):
        return self.graph.session.get_outputs()

    def run(self, names, feeds):
        own, layers = self.graph.run(list(names), feeds)
        if layers is not None:
            self.calls.append(layers)
        return own


class OnnxDecodeRunner:
    """KV-cache generation with the exported pair through the reference loop
    (titan_pipe.generation): left-padded prompts, prefill ``model.onnx``, then
    ``decode.onnx`` one token a step against the fixed-capacity cache — the path a deployment
    generates with, on static graphs as on dynamic ones. Per-layer values of each decode step
    come from decode.onnx itself (``find_layers``)."""

    def __init__(self, prefill: OnnxRuntimeRunner, decode_path: Path):
        self.prefill, self.path = prefill, Path(decode_path)
        self.graph = OnnxGraph(self.path, hint="re-export it with `titan-pipe export`")
        present = [o.name for o in prefill.session.get_outputs() if o.name.startswith(PRESENT)]
        past = [i.name for i in self.session.get_inputs() if i.name.startswith(PAST)]
        if len(past) != len(present) or not past:
            raise UserError(f"{self.path}: takes {len(past)} {PAST}* inputs but {prefill.path.name} "
                            f"gives {len(present)} {PRESENT}* outputs; export both with kv_cache from one model")
        dims = {i.name: i.shape for i in self.session.get_inputs()}
        slots = dims.get(ATTENTION_MASK, [None, None])[1]
        self.cache_len = slots if isinstance(slots, int) else None  # fixed by a static graph
        t = prefill.session.get_inputs()[0].shape[1]
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
        has_present = any(o.name.startswith(PRESENT) for o in prefill.session.get_outputs())
        return cls(prefill, decode) if decode.is_file() and has_present else None

    def max_new_tokens(self, prompt_len: int) -> int | None:
        """How many tokens a prompt of this length can generate against a static cache (None: any)."""
        if self.cache_len is None:
            return None
        return self.cache_len - max(prompt_len, self.prompt_len or 0) + 1

    def generate(self, prompts: list[list[int]], n_new: int, forced=None, steps_out: list | None = None):
        """Ragged prompts -> Generation (new_tokens (N, n_new), logits (N, n_new, vocab)); ``forced``
        (N, n_new) feeds those tokens instead of the argmax (teacher forcing). ``steps_out``: a list
        that receives decode.onnx's per-layer values, (N, n_new - 1, dim) per layer as one Outputs
        (logits unset): the steps feeding new tokens 1 .. n_new-1, when the decode graph's layers were
        found."""
        from titan_pipe.generation import generate

        decode = _RecordingSession(self.graph) if steps_out is not None else self.session
        gen = generate(prefill=self.prefill.session, decode=decode, prompts=prompts, max_new_tokens=n_new,
                       forced=None if forced is None else np.asarray(forced))
        if steps_out is not None and decode.calls and len(decode.calls) % max(n_new - 1, 1) == 0:
            # calls run batch after batch (static graphs: B prompts at a time, the last batch filled
            # with copies after the real rows), n_new - 1 decode steps each
            per = n_new - 1
            batches = [concat_outputs(decode.calls[i:i + per], dim=1) for i in range(0, len(decode.calls), per)]
            out = concat_outputs(batches, dim=0)
            n = len(prompts)
            trim = lambda xs: [None if x is None else x[:n] for x in xs]  # noqa: E731
            steps_out.append(Outputs(torch.empty(0), trim(out.hidden), trim(out.attn), trim(out.mlp)))
        return gen


def ascend_runtime() -> str | None:
    """'ais_bench' or 'acl' when that Python package is importable here, else None."""
    for name in ("ais_bench", "acl"):
        if importlib.util.find_spec(name) is not None:
            return name
    return None


class OmRunner:
    """The .om model through ais_bench's InferSession (outputs named as in the ONNX graph).

    ``dtype`` is known after the first run (the dtype of the logits the chip returns: ATC's
    precision_mode decides it). Static .om files run in ais_bench's "static" mode; gear-compiled
    ones (``--dynamic_dims``) in "dymdims", which accepts only the compiled (batch, seq) gears.

    With ``graph`` (the ONNX graph the .om was compiled from, its per-layer values found), every
    run also dumps the operators' outputs through an ACL dump config and maps them to layers
    (evaluate/om_dump.py). Not executed on a machine without an Ascend runtime.
    """

    def __init__(self, om_path: Path, *, device_id: int = 0, graph: "OnnxGraph | None" = None,
                 dim: int | None = None):
        om_path = Path(om_path)
        if not om_path.is_file():
            raise UserError(f"{om_path}: .om file not found; run `titan-pipe export` on a host with ATC")
        if ascend_runtime() != "ais_bench":
            raise RuntimeError("OmRunner needs the ais_bench package (pyACL alone is not driven here)")
        from ais_bench.infer.interface import InferSession  # Ascend hosts only

        from titan_pipe.evaluate.om_dump import acl_dump_config

        self.graph = graph if graph is not None and graph.taps is not None and dim else None
        self.dim = dim
        acl_json = None
        if self.graph is not None:
            self.dump_root = Path(tempfile.mkdtemp(prefix="titan-eval-om-dump-"))
            acl_json = self.dump_root / "acl.json"
            acl_json.write_text(json.dumps(acl_dump_config(self.dump_root / "raw", om_path.stem)))
        self.session = InferSession(device_id, str(om_path), acl_json_path=str(acl_json) if acl_json else None)
        self.path, self.label, self.dtype = om_path, f"om ({om_path.name})", "float16"
        self.out_names = [o.name for o in self.session.get_outputs()]
        in_shape = list(self.session.get_inputs()[0].shape)
        self.mode = "static" if all(int(d) > 0 for d in in_shape) else "dymdims"
        self.layers_note = ""

    def run(self, tokens: torch.Tensor) -> Outputs:
        res = self.session.infer([tokens.cpu().numpy().astype(np.int64)], mode=self.mode)
        by_name = dict(zip(self.out_names, res))
        logits = np.asarray(by_name.get(LOGITS, res[0]))
        self.dtype = {np.dtype(np.float16): "float16", np.dtype(np.float32): "float32"}.get(logits.dtype, "float16")
        out = Outputs(torch.from_numpy(logits))
        if self.graph is not None:
            out = self._dumped_layers(out, tuple(tokens.shape))
        return out

    def _dumped_layers(self, out: Outputs, bt: tuple[int, int]) -> Outputs:
        """This run's dump, converted to .npy by msaccucmp, mapped onto the graph's per-layer values."""
        import shutil

        from titan_pipe.evaluate.om_dump import load_layer, map_values_to_dump, msaccucmp_convert, scan_dump

        raw = self.dump_root / "raw"
        npy = self.dump_root / "npy"
        shutil.rmtree(npy, ignore_errors=True)
        msaccucmp_convert(raw, npy)
        shutil.rmtree(raw, ignore_errors=True)  # the next run's dump starts empty
        dump = scan_dump(npy)
        t = self.graph.taps
        shape = (*bt, self.dim)
        lists = []
        for names in (t.layer, t.attn, t.mlp):
            mapped = map_values_to_dump(self.graph.structure, list(names), dump)
            self.layers_note = "; ".join(mapped.notes[:3])
            lists.append([_opt_tensor(load_layer(f, shape)) for f in mapped.files])
        hidden = lists[0] if all(h is not None for h in lists[0]) else []
        return Outputs(out.logits, hidden, lists[1], lists[2])


def _opt_tensor(a):
    return None if a is None else _as_tensor(a)


class DistributedRunner:
    """The training checkpoint under its own dp/tp/pp layout: torchrun + the training operators.

    Starts training's sharded forward process (titan_pipe.sharded_outputs: ``python -m
    torch.distributed.run --nproc_per_node=dp*tp*pp -m titan_pipe.training.sharded_forward``) once
    for all batches (start-up dominates on CPU) and reads back logits and per-layer hidden states
    from the safetensors files it writes.
    """

    def __init__(self, checkpoint: Path, *, device: str = "cpu", timeout_s: float = 900):
        from titan_pipe.checkpoint_format import Manifest

        checkpoint = Path(checkpoint)
        if not is_complete(checkpoint):
            raise UserError(f"{checkpoint}: no manifest.json, so not a complete titan-pipe checkpoint; pass "
                            "runs/<name>/checkpoints/step-XXXXXX (the manifest is written last)")
        try:
            self.manifest = Manifest.load(checkpoint)
        except Exception as e:
            raise UserError(f"{checkpoint / 'manifest.json'}: unreadable ({e})") from None
        self.args = ModelArgs.from_dict(self.manifest.model, source=checkpoint / "manifest.json")
        self.layout = self.manifest.parallel
        self.checkpoint, self.device, self.timeout_s = checkpoint, device, timeout_s
        where = "" if device == "cpu" else f", {device}"
        self.label = f"torchrun tp{self.layout.tp} pp{self.layout.pp} ({checkpoint.name}{where})"
        self.dtype = "float32"

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def run_all(self, batches: list[torch.Tensor]) -> list[Outputs]:
        """All batches in one torchrun launch; StageFailed with the ranks' last log lines on error."""
        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory(prefix="titan-eval-dist-") as tmp:
            tmp = Path(tmp)
            save_file({sharded_outputs.batch_key(i): b.contiguous() for i, b in enumerate(batches)},
                      str(tmp / sharded_outputs.TOKENS_FILE))
            cmd = sharded_outputs.command(world_size=self.world_size, checkpoint=self.checkpoint, out_dir=tmp,
                                          device=self.device)
            env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
            try:
                # guarded: the ranks die with this process, on a timeout or an interrupt too
                proc = procs.run(cmd, capture_output=True, text=True, timeout=self.timeout_s, env=env)
            except subprocess.TimeoutExpired:
                raise StageFailed(f"sharded forward of {self.checkpoint} timed out after {self.timeout_s:.0f}s") from None
            if proc.returncode != 0:
                tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
                raise StageFailed(f"sharded forward of {self.checkpoint} failed (exit {proc.returncode}):\n{tail}")
            got = sharded_outputs.read_outputs(tmp, n_batches=len(batches), n_layers=self.args.n_layers)
        return [Outputs(logits, hidden) for logits, hidden in got]

    def run(self, tokens: torch.Tensor) -> Outputs:
        return self.run_all([tokens])[0]
