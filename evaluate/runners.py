"""Runners: one model artifact in, (logits, per-layer hidden states) out, for the same token batches.

  TorchRunner        the unified safetensors model in one process (forward hooks on each layer)
  OnnxRuntimeRunner  the exported graph in ONNX Runtime (``hidden.{i}`` outputs of a debug export)
  DistributedRunner  the training checkpoint under its own TP/PP layout, under torchrun
  OmRunner           the ATC .om through ais_bench when an Ascend runtime is importable

Every ``run(tokens (B, T) int64)`` returns ``Outputs`` on the CPU in the runner's own dtype:
logits (B, T, vocab) and hidden[i] (B, T, dim) = the hidden state after decoder layer i.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from titan_pipe.checkpoint_format import is_complete
from titan_pipe.dtypes import ORT_NAMES
from titan_pipe.errors import StageFailed, UserError
from titan_pipe.evaluate.graph_files import check_external_data
from titan_pipe.model_args import ModelArgs



@dataclass
class Outputs:
    logits: torch.Tensor  # (B, T, vocab)
    hidden: list[torch.Tensor] = field(default_factory=list)  # n_layers x (B, T, dim); [] if not exposed


def concat_outputs(parts: list[Outputs]) -> Outputs:
    """Batches stacked along the batch dim (B_total, T, ...)."""
    hidden = [torch.cat([p.hidden[i] for p in parts]) for i in range(len(parts[0].hidden))] \
        if all(p.hidden for p in parts) else []
    return Outputs(torch.cat([p.logits for p in parts]), hidden)


class TorchRunner:
    """Our Transformer (any Kernels) in this process; hooks capture each decoder layer's output."""

    def __init__(self, model, args: ModelArgs, *, label: str = "torch", device: str = "cpu"):
        self.model, self.args, self.label, self.device = model.eval(), args, label, device
        self.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")

    @classmethod
    def from_dir(cls, model_dir: Path, *, dtype: str | None = "float32", device: str = "cpu",
                 kernels=None, label: str | None = None) -> "TorchRunner":
        from titan_pipe.convert.unified import load_unified_model

        model, args = load_unified_model(Path(model_dir), dtype=dtype, device=device, kernels=kernels)
        return cls(model, args, label=label or f"torch {dtype or 'stored'} ({Path(model_dir).name})",
                   device=device)

    @torch.no_grad()
    def run(self, tokens: torch.Tensor) -> Outputs:
        captured: dict[int, torch.Tensor] = {}
        hooks = [layer.register_forward_hook(
            lambda _m, _i, out, i=int(key): captured.__setitem__(i, out.detach().to("cpu")))
            for key, layer in self.model.layers.items()]
        try:
            logits = self.model(tokens.to(self.device)).to("cpu")
        finally:
            for h in hooks:
                h.remove()
        return Outputs(logits, [captured[i] for i in sorted(captured)])


# The prefill graph's inputs (convert/onnx/graphs.py); the runner feeds unpadded batches.
_PREFILL_INPUTS = ("input_ids", "attention_mask", "position_ids")


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
    """The exported prefill graph: input ``input_ids`` (B, T), outputs ``logits`` [+ ``hidden.{i}``]."""

    def __init__(self, onnx_path: Path, *, label: str | None = None, threads: int = 0):
        import onnxruntime as ort

        onnx_path = Path(onnx_path)
        if not onnx_path.is_file():
            raise UserError(f"{onnx_path}: ONNX file not found; pass the model.onnx written by "
                            "`titan-pipe export` (with --expose-hidden for per-layer results)")
        check_external_data(onnx_path)  # before ONNX Runtime opens anything the graph names
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        if threads:
            opts.intra_op_num_threads = threads
        try:
            self.session = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
        except Exception as e:  # ORT's own exception types (InvalidGraph, NoSuchFile, ...)
            raise UserError(f"{onnx_path}: ONNX Runtime cannot load it: {str(e).splitlines()[0][:300]}; "
                            "re-export it with `titan-pipe export`") from None
        self.path, self.label = onnx_path, label or f"onnxruntime ({onnx_path.name})"
        self.info = self._describe()
        self.dtype = self.info.dtype

    def _describe(self) -> GraphInfo:
        ins = {i.name: i for i in self.session.get_inputs()}
        outs = {o.name: o for o in self.session.get_outputs()}
        if "input_ids" not in ins or "logits" not in outs:
            raise UserError(f"{self.path}: expected input 'input_ids' and output 'logits' (the prefill graph "
                            f"of `titan-pipe export`), found inputs {list(ins)} and outputs {list(outs)[:4]}")
        if any(n.startswith("past_key_values.") for n in ins):
            raise UserError(f"{self.path}: takes past_key_values.* inputs: that is the KV-cache decode graph; "
                            "pass the prefill graph model.onnx instead")
        extra = tuple(n for n in ins if n not in _PREFILL_INPUTS)
        if extra:
            raise UserError(f"{self.path}: takes {extra[0]!r} besides {', '.join(_PREFILL_INPUTS)}; pass the "
                            "prefill graph model.onnx written by `titan-pipe export`")
        shape = ins["input_ids"].shape
        fixed = tuple(shape) if all(isinstance(d, int) for d in shape) else None
        lg = outs["logits"].shape
        n_hidden = sum(1 for n in outs if n.startswith("hidden."))
        dim = None
        if n_hidden:
            hs = outs["hidden.0"].shape
            dim = hs[-1] if isinstance(hs[-1], int) else None
        dtype = ORT_NAMES.get(outs["logits"].type)
        if dtype is None:
            raise UserError(f"{self.path}: logits have type {outs['logits'].type}; expected float, float16 or bfloat16")
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
            problems.append(f"{info.n_hidden} hidden.* outputs vs n_layers {args.n_layers}")
        if problems:
            raise UserError(f"{self.path} does not match {source}: {'; '.join(problems)}; export the graph "
                            "from this model directory (or pass the model directory it came from)")

    def run(self, tokens: torch.Tensor) -> Outputs:
        if self.info.fixed_shape and tuple(tokens.shape) != self.info.fixed_shape:
            raise UserError(f"{self.path}: static input shape {list(self.info.fixed_shape)} but the batch is "
                            f"{list(tokens.shape)}; set evaluate.batch_size/seq_len to match or export with dynamic: true")
        names = ["logits"] + [f"hidden.{i}" for i in range(self.info.n_hidden)]
        ids = tokens.cpu().numpy().astype(np.int64)
        feeds = {"input_ids": ids}
        takes = {i.name for i in self.session.get_inputs()}
        if "attention_mask" in takes:  # unpadded batches: every token real, positions 0..T-1
            feeds["attention_mask"] = np.ones_like(ids)
        if "position_ids" in takes:
            feeds["position_ids"] = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int64), ids.shape).copy()
        res = self.session.run(names, feeds)
        to_t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
        return Outputs(to_t(res[0]), [to_t(a) for a in res[1:]])


class OnnxDecodeRunner:
    """KV-cache generation with the exported pair through the reference loop
    (titan_pipe.convert.onnx.generate): left-padded prompts, prefill ``model.onnx``, then
    ``decode.onnx`` one token a step against the fixed-capacity cache — the path a deployment
    generates with, on static graphs as on dynamic ones."""

    def __init__(self, prefill: OnnxRuntimeRunner, decode_path: Path):
        from titan_pipe.convert.onnx.generate import ort_session

        self.prefill, self.path = prefill, Path(decode_path)
        check_external_data(self.path)  # before ONNX Runtime opens anything the graph names
        self.session = ort_session(self.path)
        present = [o.name for o in prefill.session.get_outputs() if o.name.startswith("present.")]
        past = [i.name for i in self.session.get_inputs() if i.name.startswith("past_key_values.")]
        if len(past) != len(present) or not past:
            raise UserError(f"{self.path}: takes {len(past)} past_key_values inputs but {prefill.path.name} "
                            f"gives {len(present)} present outputs; export both with kv_cache from one model")
        dims = {i.name: i.shape for i in self.session.get_inputs()}
        slots = dims.get("attention_mask", [None, None])[1]
        self.cache_len = slots if isinstance(slots, int) else None  # fixed by a static graph
        t = prefill.session.get_inputs()[0].shape[1]
        self.prompt_len = t if isinstance(t, int) else None
        self.label = f"onnxruntime KV-cache ({prefill.path.name} + {self.path.name})"

    @classmethod
    def beside(cls, prefill: OnnxRuntimeRunner) -> "OnnxDecodeRunner | None":
        """The decode graph next to ``prefill`` when both were exported with the KV cache, else None."""
        decode = prefill.path.parent / "decode.onnx"
        has_present = any(o.name.startswith("present.") for o in prefill.session.get_outputs())
        return cls(prefill, decode) if decode.is_file() and has_present else None

    def max_new_tokens(self, prompt_len: int) -> int | None:
        """How many tokens a prompt of this length can generate against a static cache (None: any)."""
        if self.cache_len is None:
            return None
        return self.cache_len - max(prompt_len, self.prompt_len or 0) + 1

    def generate(self, prompts: list[list[int]], n_new: int, forced=None):
        """Ragged prompts -> Generation (new_tokens (N, n_new), logits (N, n_new, vocab)); ``forced``
        (N, n_new) feeds those tokens instead of the argmax (teacher forcing)."""
        from titan_pipe.convert.onnx.generate import generate

        return generate(prefill=self.prefill.session, decode=self.session, prompts=prompts, max_new_tokens=n_new,
                        forced=None if forced is None else np.asarray(forced))


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
    """

    def __init__(self, om_path: Path, *, device_id: int = 0):
        om_path = Path(om_path)
        if not om_path.is_file():
            raise UserError(f"{om_path}: .om file not found; run `titan-pipe export` on a host with ATC")
        if ascend_runtime() != "ais_bench":
            raise RuntimeError("OmRunner needs the ais_bench package (pyACL alone is not driven here)")
        from ais_bench.infer.interface import InferSession  # Ascend hosts only

        self.session = InferSession(device_id, str(om_path))
        self.path, self.label, self.dtype = om_path, f"om ({om_path.name})", "float16"
        self.out_names = [o.name for o in self.session.get_outputs()]
        in_shape = list(self.session.get_inputs()[0].shape)
        self.mode = "static" if all(int(d) > 0 for d in in_shape) else "dymdims"

    def run(self, tokens: torch.Tensor) -> Outputs:
        res = self.session.infer([tokens.cpu().numpy().astype(np.int64)], mode=self.mode)
        by_name = dict(zip(self.out_names, res))
        logits = np.asarray(by_name.get("logits", res[0]))
        self.dtype = {np.dtype(np.float16): "float16", np.dtype(np.float32): "float32"}.get(logits.dtype, "float16")
        hidden = [torch.from_numpy(np.asarray(by_name[f"hidden.{i}"])) for i in range(len(by_name))
                  if f"hidden.{i}" in by_name]
        return Outputs(torch.from_numpy(logits), hidden)


class DistributedRunner:
    """The training checkpoint under its own dp/tp/pp layout: torchrun + the training operators.

    Runs ``python -m torch.distributed.run --nproc_per_node=dp*tp*pp -m
    titan_pipe.evaluate.sharded_forward`` once for all batches (start-up dominates on CPU) and
    reads back logits and per-layer hidden states from safetensors files.
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
        self.args = ModelArgs.from_dict(self.manifest.model)
        p = self.manifest.parallel
        self.layout = {k: int(p.get(k, 1)) for k in ("dp", "tp", "pp")}
        self.checkpoint, self.device, self.timeout_s = checkpoint, device, timeout_s
        self.label = f"torchrun tp{self.layout['tp']} pp{self.layout['pp']} ({checkpoint.name})"
        self.dtype = "float32"

    @property
    def world_size(self) -> int:
        return self.layout["tp"] * self.layout["pp"] * self.layout["dp"]

    def run_all(self, batches: list[torch.Tensor]) -> list[Outputs]:
        """All batches in one torchrun launch; StageFailed with the ranks' last log lines on error."""
        from safetensors.torch import load_file, save_file

        with tempfile.TemporaryDirectory(prefix="titan-eval-dist-") as tmp:
            tmp = Path(tmp)
            save_file({f"batch.{i}": b.contiguous() for i, b in enumerate(batches)}, str(tmp / "tokens.safetensors"))
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={self.world_size}", "-m", "titan_pipe.evaluate.sharded_forward",
                   "--checkpoint", str(self.checkpoint), "--tokens", str(tmp / "tokens.safetensors"),
                   "--out", str(tmp), "--device", self.device]
            env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout_s, env=env)
            except subprocess.TimeoutExpired:
                raise StageFailed(f"sharded forward of {self.checkpoint} timed out after {self.timeout_s:.0f}s") from None
            if proc.returncode != 0:
                tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
                raise StageFailed(f"sharded forward of {self.checkpoint} failed (exit {proc.returncode}):\n{tail}")
            meta = json.loads((tmp / "done.json").read_text())
            logits = load_file(str(tmp / "logits.safetensors"))
            hidden: dict[str, torch.Tensor] = {}
            for f in meta["hidden_files"]:
                hidden.update(load_file(str(tmp / f)))
        out = []
        for i in range(len(batches)):
            hs = [hidden[f"batch.{i}.hidden.{j}"] for j in range(self.args.n_layers)
                  if f"batch.{i}.hidden.{j}" in hidden]
            out.append(Outputs(logits[f"batch.{i}"], hs if len(hs) == self.args.n_layers else []))
        return out

    def run(self, tokens: torch.Tensor) -> Outputs:
        return self.run_all([tokens])[0]
