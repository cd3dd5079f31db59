"""evaluate_model: run every comparison of issue 5 that the given artifacts allow, write the report.

The reference is the model as it ran in training: the checkpoint under its own TP/PP layout when
``checkpoint`` is given, proven equal (comparison 1) to the single-process float32 model that
then serves as the reference of every other comparison. Candidates: the exported ONNX graph
(ONNX Runtime) and the .om (Ascend runtime). Absent artifacts make their rows "skipped: ..."
with the reason, never a pass.
"""
from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from titan_pipe.checkpoint_format import MANIFEST_NAME, is_complete
from titan_pipe.config import EvaluateConfig
from titan_pipe.errors import UserError
from titan_pipe.evaluate import compare as cmp
from titan_pipe.evaluate.batches import ValidationSplit, load_eval_data
from titan_pipe.evaluate.operators import run_conformance
from titan_pipe.evaluate.report import SCHEMA, SCHEMA_VERSION, check_out_dir, write_report
from titan_pipe.evaluate.runners import (DistributedRunner, OmRunner, OnnxDecodeRunner, OnnxRuntimeRunner, Outputs,
                                         TorchRunner, ascend_runtime, concat_outputs)
from titan_pipe.model_args import ModelArgs, model_differences
from titan_pipe.thresholds import resolve_thresholds
from titan_pipe.training.model import build_model

_MAX_HIST = 2_000_000  # logits error values kept for the histogram


@dataclass(frozen=True)
class EvalResult:
    out_dir: Path
    passed: bool
    report_json: Path
    summary: dict = field(default_factory=dict)


def _check_inputs(checkpoint, model_dir, onnx, om, data) -> None:
    """Missing files fail before any work, each with the flag, the path and the fix."""
    if checkpoint is None and model_dir is None:
        raise UserError("evaluate needs a reference: pass --checkpoint runs/<name>/checkpoints/step-XXXXXX "
                        "and/or --model-dir runs/<name>/model")
    for flag, p, kind in (("--checkpoint", checkpoint, "dir"), ("--model-dir", model_dir, "dir"),
                          ("--onnx", onnx, "file"), ("--om", om, "file"), ("--data", data, "any")):
        if p is None:
            continue
        p = Path(p)
        if not p.exists():
            raise UserError(f"{flag} {p}: does not exist; check the path")
        if kind == "dir" and not p.is_dir():
            raise UserError(f"{flag} {p}: is a file, expected a directory")
        if flag == "--checkpoint" and not is_complete(p):
            raise UserError(f"--checkpoint {p}: no manifest.json, so not a complete titan-pipe checkpoint; pass "
                            "runs/<name>/checkpoints/step-XXXXXX (the manifest is written last)")
        if kind == "file" and not p.is_file():
            raise UserError(f"{flag} {p}: is a directory, expected a file"
                            + ("; pass OUT_DIR/model.onnx" if flag == "--onnx" else ""))


def torch_runner_from_checkpoint(checkpoint: Path, *, device: str = "cpu") -> TorchRunner:
    """The checkpoint's weights, assembled by its manifest, in one process (float32, on ``device``)."""
    from titan_pipe.training.weights import open_weights

    w = open_weights(Path(checkpoint))
    model = build_model(w.args, seed=None)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(w.full(name).to(torch.float32))
    model.init_rope()
    model.to(device)
    where = "" if device == "cpu" else f", {device}"
    return TorchRunner(model, w.args, label=f"torch float32 ({Path(checkpoint).name}, one process{where})",
                       device=device)


def reference_device(choice: str) -> str:
    """--device auto|cpu|cuda|npu -> the torch device type the PyTorch reference runs on."""
    from titan_pipe.devices import resolve_device

    try:
        return resolve_device(choice).type
    except (RuntimeError, ValueError) as e:
        raise UserError(f"--device {choice}: {e}") from None


def _same_model(a: ModelArgs, b: ModelArgs, where: str) -> None:
    diffs = model_differences(a, b)
    if diffs:
        raise UserError(f"{where}: the models disagree ({'; '.join(diffs)}); pass artifacts of the same run")


def _run_batches(runner, batches: list[torch.Tensor]) -> Outputs:
    return concat_outputs([runner.run(b) for b in batches])


def _abs_errors(ref: Outputs, cand: Outputs) -> np.ndarray:
    e = (cand.logits.double() - ref.logits.double()).abs().numpy().ravel()
    return e[:: max(1, e.size // _MAX_HIST)]


class _Steps:
    """A rich progress bar over the evaluation's steps (quiet when ``enabled`` is False)."""

    def __init__(self, enabled: bool, total: int):
        self.progress = None
        if enabled:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                                     transient=False)
            self.progress.start()
            self.task = self.progress.add_task("evaluate", total=total)

    def step(self, what: str, advance: float = 1) -> None:
        if self.progress:
            self.progress.update(self.task, description=f"evaluate: {what}", advance=advance)

    def close(self) -> None:
        if self.progress:
            self.progress.stop()


def evaluate_model(*, out_dir: Path, checkpoint: Path | None = None, model_dir: Path | None = None,
                   onnx: Path | None = None, om: Path | None = None, data: Path | None = None,
                   settings: EvaluateConfig | None = None, progress: bool = False,
                   split: ValidationSplit | None = None) -> EvalResult:
    """Compare everything given, write REPORT_DIR/{report.json, report.md, report.html, *.csv, *.png}.

    Held-out text: ``data`` (or ``settings.data``), a file used whole; else ``split``, the
    validation split of a training corpus (default: the shipped corpus's). Not both.

    Raises UserError for missing or mismatched inputs (nothing is written then); a failed verdict
    is not an exception: ``EvalResult.passed`` is False (the CLI turns it into exit code 1).
    """
    settings = settings or EvaluateConfig()
    data = data if data is not None else settings.data  # flow.yaml evaluate.data
    _check_inputs(checkpoint, model_dir, onnx, om, data)
    if data is not None and split is not None:
        raise UserError(f"--data {data} and the validation split of {split.corpus or 'the shipped corpus'} "
                        "were both given; pass one of them")
    out_dir = Path(out_dir)
    check_out_dir(out_dir)  # fail before the work, not after
    steps = _Steps(progress, total=8)
    try:
        return _evaluate(out_dir, checkpoint, model_dir, onnx, om, data, settings, steps, split)
    finally:
        steps.close()


def _evaluate(out_dir, checkpoint, model_dir, onnx, om, data, s: EvaluateConfig, steps: _Steps,
              split: ValidationSplit | None = None) -> EvalResult:
    def tdtype(cand_dtype: str) -> str:
        return cand_dtype if s.dtype == "auto" else s.dtype

    steps.step("loading the reference")
    device = reference_device(s.device)
    where = "" if device == "cpu" else f", {device}"
    if model_dir is not None:
        ref = TorchRunner.from_dir(Path(model_dir), dtype="float32", device=device,
                                   label=f"torch float32 ({Path(model_dir).name}{where})")
        ref_source = f"{Path(model_dir) / 'config.json'}"
    else:
        ref = torch_runner_from_checkpoint(Path(checkpoint), device=device)
        ref_source = f"{Path(checkpoint) / MANIFEST_NAME}"
    args = ref.args
    dist = None
    if checkpoint is not None:
        dist = DistributedRunner(Path(checkpoint), device=device)
        _same_model(dist.args, args, f"--checkpoint {checkpoint} vs --model-dir {model_dir}")
    ort = None
    if onnx is not None:
        ort = OnnxRuntimeRunner(Path(onnx))
        ort.check_matches(args, source=ref_source)
        ort.find_layers(args.n_layers)  # the graph's own per-layer values (export.json / structure)
    batch_size, seq_len = s.batch_size, s.seq_len
    if ort is not None and ort.info.fixed_shape:
        batch_size, seq_len = ort.info.fixed_shape  # a static graph takes only its own shape
    if seq_len > args.max_seq_len:
        raise UserError(f"evaluate.seq_len {seq_len} exceeds the model's max_seq_len {args.max_seq_len}")
    ev = load_eval_data(data=Path(data) if data else None, model_dir=Path(model_dir) if model_dir else None,
                        vocab_size=args.vocab_size, n_batches=s.batches, batch_size=batch_size,
                        seq_len=seq_len, n_prompts=s.prompts, prompt_len=s.prompt_len, split=split,
                        checkpoint=Path(checkpoint) if checkpoint else None)

    steps.step("reference forward")
    ref_out = _run_batches(ref, ev.batches)
    comparisons: list[cmp.Comparison] = []
    task_outputs = {ref.label: ref_out}
    limits_of: dict[str, tuple[str, dict]] = {}
    thresholds_used: dict[str, dict] = {}
    hist: dict[str, np.ndarray] = {}
    dumps: dict | None = {} if s.dump else None  # (comparison, tensor) -> (reference, candidate)
    judged_dtypes: list[str] = []

    def limits(dt: str) -> dict:
        thresholds_used[dt] = resolve_thresholds(dt, s.thresholds)
        if dt not in judged_dtypes:
            judged_dtypes.append(dt)
        return thresholds_used[dt]

    # 1. sharded (training layout, torchrun) vs unified (one process)
    steps.step("sharded checkpoint under torchrun")
    if dist is not None:
        dist_out = concat_outputs(dist.run_all(ev.batches))
        dt = tdtype(dist.dtype)
        comparisons.append(cmp.compare_outputs(
            "sharded_vs_unified", "training checkpoint under its TP/PP layout vs the unified model",
            dist_out, ref_out, ref_label=dist.label, cand_label=ref.label, dtype=dt, limits=limits(dt),
            logits_scope="sharded", keep=dumps))
        task_outputs[dist.label] = dist_out
        limits_of[dist.label] = (dt, limits(dt))
        hist[f"{ref.label} vs {dist.label}"] = _abs_errors(dist_out, ref_out)
        if model_dir is None:
            comparisons[-1].title = ("training checkpoint under its TP/PP layout vs its own weights in one "
                                     "process (no --model-dir: the converter is not covered)")
    else:
        comparisons.append(cmp.skipped("sharded_vs_unified", "training checkpoint under its TP/PP layout vs "
                                       "the unified model", "no --checkpoint given"))

    # 2. training operators (PyTorch) vs inference operators (ONNX Runtime)
    steps.step("ONNX Runtime")
    generations: dict[str, torch.Tensor] = {}
    gen_runners = {ref.label: ref}
    if ort is not None:
        ort_out = _run_batches(ort, ev.batches)
        dt = tdtype(ort.dtype)
        comparisons.append(cmp.compare_outputs(
            "torch_vs_onnx", "PyTorch (training operators) vs ONNX Runtime, per decoder layer and logits",
            ref_out, ort_out, ref_label=ref.label, cand_label=ort.label, dtype=dt, limits=limits(dt), keep=dumps))
        comparisons[-1].details["layers"] = ort.graph.layers_detail()
        task_outputs[ort.label] = ort_out
        limits_of[ort.label] = (dt, limits(dt))
        hist[ort.label] = _abs_errors(ref_out, ort_out)
        if not ort.info.fixed_shape:
            gen_runners[ort.label] = ort
    else:
        comparisons.append(cmp.skipped("torch_vs_onnx", "PyTorch vs ONNX Runtime", "no --onnx given"))
    comparisons.append(_npu_fused_row(model_dir, ev.batches, tdtype, limits))

    # 3. operator conformance
    steps.step("operator conformance")
    op_rows = []
    if s.operators:
        op_dtypes = tuple(judged_dtypes) or (tdtype("float32"),)
        op_rows = run_conformance(thresholds=s.thresholds)
        comparisons.append(cmp.operator_comparison(op_rows, op_dtypes))
    else:
        op_dtypes = ()
        comparisons.append(cmp.skipped("operators", "operator conformance", "evaluate.operators is false"))

    # 4. OM on an Ascend runtime
    steps.step("OM")
    runtime = ascend_runtime()
    if om is None:
        comparisons.append(cmp.skipped("om", "ATC .om model", "no Ascend runtime" if runtime is None
                                       else "no --om given"))
    elif runtime is None:
        comparisons.append(cmp.skipped("om", "ATC .om model", "no Ascend runtime (neither ais_bench nor acl "
                                       "is importable)"))
    elif runtime != "ais_bench":
        comparisons.append(cmp.skipped("om", "ATC .om model", "pyACL found but titan-pipe drives .om files "
                                       "through ais_bench; install ais_bench"))
    else:
        # per-layer rows from the .om's operator dump, mapped through the ONNX graph it was built from
        omr = OmRunner(Path(om), graph=ort.graph if ort is not None else None, dim=args.dim)
        om_out = _run_batches(omr, ev.batches)
        dt = tdtype(omr.dtype)
        comparisons.append(cmp.compare_outputs("om", "PyTorch vs the .om on the Ascend runtime", ref_out, om_out,
                                               ref_label=ref.label, cand_label=omr.label, dtype=dt,
                                               limits=limits(dt), keep=dumps))
        comparisons[-1].details["layers"] = (omr.layers_note or "per-layer rows need --onnx (the graph the .om was "
                                             "compiled from) to map the operator dump to layers")
        task_outputs[omr.label] = om_out
        limits_of[omr.label] = (dt, limits(dt))
        hist[omr.label] = _abs_errors(ref_out, om_out)
        # no greedy generation on the .om: gear-compiled models take only their compiled lengths

    # 5. task level (and 2b, the KV-cache decode graph, which needs the reference's generations)
    steps.step("perplexity and greedy generation")
    dec = OnnxDecodeRunner.beside(ort) if ort is not None else None
    if dec is not None:
        dec.find_layers(args.n_layers)
    if s.prompts and (len(gen_runners) > 1 or dec is not None):
        for label, runner in gen_runners.items():
            generations[label] = cmp.greedy_generate(runner.run, ev.prompts, s.new_tokens)
    if dec is not None and s.prompts:
        comparisons.insert(2, _kv_decode_row(ref, dec, generations[ref.label], ev.prompts.shape[1], tdtype, limits,
                                             dumps))
        generations[dec.label], _ = dec.generate(ev.prompts, s.new_tokens)
        limits_of[dec.label] = limits_of[ort.label]
    elif ort is not None:
        why = ("evaluate.prompts is 0" if not s.prompts else
               f"no decode.onnx beside {Path(onnx).name} exported with the KV cache (or a static graph)")
        comparisons.insert(2, cmp.skipped("onnx_kv_decode", "KV-cache decode graph", why))
    task = cmp.task_comparison(ev.batches, task_outputs, ref.label, generations, ev.prompts.shape[1], limits_of)
    if ort is not None and ort.info.fixed_shape:
        task.details["generation_note"] = "skipped for the ONNX graph: static input shape"
    comparisons.append(task)

    verdict = cmp.decide(comparisons, op_rows, op_dtypes)
    steps.step("writing the report")
    report = {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "passed": verdict.passed, "verdict": verdict.to_dict(),
        "inputs": {"checkpoint": _s(checkpoint), "model_dir": _s(model_dir), "onnx": _s(onnx), "om": _s(om),
                   "data": ev.source},
        "data": {"source": ev.source, "tokenizer": ev.tokenizer, "batches": len(ev.batches),
                 "batch_size": batch_size, "seq_len": seq_len, "prompts": int(ev.prompts.shape[0]),
                 "prompt_len": int(ev.prompts.shape[1]), "new_tokens": s.new_tokens},
        "model": args.to_dict() | {"rope_scaling": None if args.rope_scaling is None else vars(args.rope_scaling)},
        "settings": s.model_dump(), "thresholds": thresholds_used,
        "environment": _environment(),
        "comparisons": [c.to_dict() for c in comparisons],
        "operators": [r.to_dict() for r in op_rows],
    }
    files = write_report(out_dir, report, hist, dumps=dumps)
    summary = _summary(verdict, comparisons)
    return EvalResult(out_dir, verdict.passed, files["report.json"], summary)


def _kv_decode_row(ref: TorchRunner, dec: OnnxDecodeRunner, ref_seq: torch.Tensor, n_prompt: int, tdtype,
                   limits, dumps: dict | None = None) -> cmp.Comparison:
    """decode.onnx fed the reference's own greedy tokens step by step (teacher forcing) against the
    reference's full forward on the same sequence: the logits predicting each new token."""
    n_new = ref_seq.shape[1] - n_prompt
    full = ref.run(ref_seq[:, :-1])
    steps: list[Outputs] = []
    _, kv_logits = dec.generate(ref_seq[:, :n_prompt], n_new, forced=ref_seq[:, n_prompt:], steps_out=steps)
    ref_o, cand_o = Outputs(full.logits[:, n_prompt - 1:]), Outputs(kv_logits)
    if steps:  # decode.onnx's own per-layer values at positions P .. P+n_new-2, one step each
        cand_o = Outputs(kv_logits, *(getattr(concat_outputs(steps, dim=1), k) for k in ("hidden", "attn", "mlp")))
        ref_o = Outputs(ref_o.logits, *([None if t is None else t[:, n_prompt:] for t in getattr(full, k)]
                                        for k in ("hidden", "attn", "mlp")))
    dt = tdtype(dec.prefill.dtype)
    c = cmp.compare_outputs("onnx_kv_decode", "KV-cache decode graph (prefill + decode.onnx, one token a step) vs "
                            "PyTorch full forward, teacher-forced", ref_o, cand_o,
                            ref_label=ref.label, cand_label=dec.label, dtype=dt, limits=limits(dt), keep=dumps)
    c.details = {"positions": f"{n_new} generated positions of {ref_seq.shape[0]} prompt(s), "
                              f"prompt length {n_prompt}",
                 "layers": (f"{dec.path.name}: {dec.graph.layers_detail()}; per-layer rows are its {len(steps)} "
                            f"decode steps (positions {n_prompt}..{n_prompt + len(steps) - 1}), the logits row "
                            f"also has the prefill's last position") if steps else
                           f"{dec.path.name}: {dec.graph.layers_detail() or 'no decode steps (new_tokens 1)'}"}
    return c


def _npu_fused_row(model_dir, batches, tdtype, limits) -> cmp.Comparison:
    """The fused NPU training kernels against the reference operators, on NPU hosts only."""
    from titan_pipe.devices import npu_available

    title = "fused NPU training kernels (npu_rms_norm, npu_rotary_mul, npu_fusion_attention) vs reference ops"
    if not npu_available():
        return cmp.skipped("npu_fused", title, "no NPU")
    if model_dir is None:
        return cmp.skipped("npu_fused", title, "needs --model-dir")
    from titan_pipe.training.kernels import npu_fused_kernels, reference_kernels

    # Both on the NPU, so the row measures the kernels and not the device's arithmetic.
    plain = TorchRunner.from_dir(Path(model_dir), dtype="float32", device="npu", kernels=reference_kernels(),
                                 label="torch float32 reference ops (npu)")
    fused = TorchRunner.from_dir(Path(model_dir), dtype="float32", device="npu", kernels=npu_fused_kernels(),
                                 label="torch float32 npu_fused (npu)")
    dt = tdtype("float32")
    return cmp.compare_outputs("npu_fused", title, _run_batches(plain, batches), _run_batches(fused, batches),
                               ref_label=plain.label, cand_label=fused.label, dtype=dt, limits=limits(dt))


def _s(p) -> str | None:
    return None if p is None else str(p)


def _environment() -> dict:
    import onnxruntime

    return {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__,
            "ascend_runtime": ascend_runtime()}


def _summary(verdict: cmp.Verdict, comparisons: list[cmp.Comparison]) -> dict:
    out = {"passed": verdict.passed, "verdict": verdict.text,
           "first_failing_layer": verdict.first_failing_layer,
           "first_failing_operator": verdict.first_failing_operator,
           "comparisons": {c.id: c.status for c in comparisons}}
    for c in comparisons:
        for r in c.rows:
            if r.tensor == "logits":
                out[f"{c.id}.logits"] = {"cosine": r.metrics.cosine, "max_abs": r.metrics.max_abs,
                                         "kl": r.metrics.kl, "top1": r.metrics.top1}
        if c.id == "task":
            out["perplexity"] = c.details.get("perplexity")
    return out
