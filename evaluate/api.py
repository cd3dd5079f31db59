"""evaluate_model: run every comparison the given artifacts allow, write the report.

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
from titan_pipe.evaluate.graph_files import check_external_data
from titan_pipe.evaluate.operators import model_operators, run_conformance
from titan_pipe.evaluate.report import SCHEMA, SCHEMA_VERSION, check_out_dir, write_report
from titan_pipe.evaluate.runners import (DistributedRunner, OmRunner, OnnxDecodeRunner, OnnxRuntimeRunner, Outputs,
                                         TorchRunner, ascend_runtime, concat_outputs)
from titan_pipe.export_record import ExportRecord
from titan_pipe.model.args import ModelArgs, model_differences
from titan_pipe.thresholds import check_task, resolve_thresholds
from titan_pipe.model.transformer import build_model

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
    if onnx is not None:  # names only files inside the export dir, or is refused before any work
        ExportRecord.find(Path(onnx).parent)
        check_external_data(Path(onnx))


def torch_runner_from_checkpoint(checkpoint: Path, *, device: str = "cpu") -> TorchRunner:
    """The checkpoint's weights, assembled by its manifest, in one process (float32, on ``device``)."""
    from titan_pipe.model.weights import open_weights

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


@dataclass
class _Run:
    """One evaluation: its inputs, the reference and its outputs, and what the comparisons collect."""

    s: EvaluateConfig
    steps: _Steps
    checkpoint: Path | None
    model_dir: Path | None
    onnx: Path | None
    om: Path | None
    ref: TorchRunner
    ref_source: str
    dist: DistributedRunner | None
    ort: OnnxRuntimeRunner | None
    ev: object  # EvalData (batches, prompts, source, tokenizer)
    batch_size: int
    seq_len: int
    ref_out: Outputs | None = None
    task_outputs: dict[str, Outputs] = field(default_factory=dict)
    limits_of: dict[str, tuple[str, dict]] = field(default_factory=dict)
    thresholds_used: dict[str, dict] = field(default_factory=dict)
    hist: dict[str, np.ndarray] = field(default_factory=dict)
    judged_dtypes: list[str] = field(default_factory=list)
    gen_runners: dict = field(default_factory=dict)
    generations: dict[str, torch.Tensor] | None = None
    dec: OnnxDecodeRunner | None = None
    dec_skip: str | None = None  # why the KV-cache loop cannot run on these graphs
    prompts: torch.Tensor | None = None  # (N, P) the generations' prompts (cut to a static graph's T)
    n_new: int = 0  # tokens generated per prompt (capped by a static graph's cache)
    op_rows: list = field(default_factory=list)
    op_dtypes: tuple[str, ...] = ()
    dumps: dict | None = None  # evaluate.dump: (comparison, tensor) -> (reference, candidate)

    @property
    def args(self) -> ModelArgs:
        return self.ref.args

    def tdtype(self, cand_dtype: str) -> str:
        """The threshold set: the candidate's dtype, unless evaluate.dtype names one."""
        return cand_dtype if self.s.dtype == "auto" else self.s.dtype

    def limits(self, dt: str) -> dict:
        self.thresholds_used[dt] = resolve_thresholds(dt, self.s.thresholds)
        if dt not in self.judged_dtypes:
            self.judged_dtypes.append(dt)
        return self.thresholds_used[dt]

    def judged(self, label: str, out: Outputs, dt: str) -> None:
        """Record a candidate's outputs for the task-level comparison, with its threshold set."""
        self.task_outputs[label] = out
        self.limits_of[label] = (dt, self.limits(dt))

    def greedy(self) -> dict[str, torch.Tensor]:
        """Greedy generations of every generating runner (computed once, when first needed)."""
        if self.generations is None:
            self.generations = {}
            if self.s.prompts and (len(self.gen_runners) > 1 or self.dec is not None):
                for label, runner in self.gen_runners.items():
                    self.generations[label] = cmp.greedy_generate(runner.run, self.prompts, self.n_new)
        return self.generations


def _prepare(out_dir, checkpoint, model_dir, onnx, om, data, s: EvaluateConfig, steps: _Steps,
             split: ValidationSplit | None) -> _Run:
    """Load the reference and the runners, check they are one model, load the held-out batches."""
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
    run = _Run(s=s, steps=steps, checkpoint=checkpoint, model_dir=model_dir, onnx=onnx, om=om, ref=ref,
               ref_source=ref_source, dist=dist, ort=ort, ev=ev, batch_size=batch_size, seq_len=seq_len)
    run.gen_runners = {ref.label: ref}
    if ort is not None and not ort.info.fixed_shape:
        run.gen_runners[ort.label] = ort
    run.dec = OnnxDecodeRunner.beside(ort) if ort is not None else None
    if run.dec is not None:
        run.dec.find_layers(args.n_layers)
    run.dumps = {} if s.dump else None
    _fit_generation(run)

    steps.step("reference forward")
    run.ref_out = _run_batches(ref, ev.batches)
    run.task_outputs[ref.label] = run.ref_out
    return run


def _fit_generation(run: _Run) -> None:
    """Prompts and new-token count every generation uses: a static prefill graph takes at most its T
    tokens, and its fixed cache holds at most C - T + 1 generated ones."""
    dec, run.prompts, run.n_new = run.dec, run.ev.prompts, run.s.new_tokens
    if dec is None:
        return
    if dec.prompt_len is not None:
        run.prompts = run.prompts[:, -dec.prompt_len:]
    room = dec.max_new_tokens(run.prompts.shape[1])
    if room is not None:
        run.n_new = min(run.n_new, room)
        if run.n_new < 1:
            run.dec, run.n_new = None, run.s.new_tokens
            run.dec_skip = f"the static cache of {dec.path} has no slot left after a {dec.prompt_len}-token prompt"


def _compare_sharded(run: _Run) -> cmp.Comparison:
    """The sharded checkpoint (training layout, torchrun) vs the unified model in one process."""
    run.steps.step("sharded checkpoint under torchrun")
    if run.dist is None:
        return cmp.skipped("sharded_vs_unified", "training checkpoint under its TP/PP layout vs "
                           "the unified model", "no --checkpoint given")
    dist, ref = run.dist, run.ref
    dist_out = concat_outputs(dist.run_all(run.ev.batches))
    dt = run.tdtype(dist.dtype)
    c = cmp.compare_outputs(
        "sharded_vs_unified", "training checkpoint under its TP/PP layout vs the unified model",
        dist_out, run.ref_out, ref_label=dist.label, cand_label=ref.label, dtype=dt, limits=run.limits(dt),
        logits_scope="sharded", keep=run.dumps)
    run.judged(dist.label, dist_out, dt)
    run.hist[f"{ref.label} vs {dist.label}"] = _abs_errors(dist_out, run.ref_out)
    if run.model_dir is None:
        c.title = ("training checkpoint under its TP/PP layout vs its own weights in one "
                   "process (no --model-dir: the converter is not covered)")
    return c


def _compare_onnx(run: _Run) -> cmp.Comparison:
    """Training operators (PyTorch) vs inference operators (ONNX Runtime), per layer and logits."""
    run.steps.step("ONNX Runtime")
    ort, ref = run.ort, run.ref
    if ort is None:
        return cmp.skipped("torch_vs_onnx", "PyTorch vs ONNX Runtime", "no --onnx given")
    ort_out = _run_batches(ort, run.ev.batches)
    dt = run.tdtype(ort.dtype)
    c = cmp.compare_outputs(
        "torch_vs_onnx", "PyTorch (training operators) vs ONNX Runtime, per decoder layer and logits",
        run.ref_out, ort_out, ref_label=ref.label, cand_label=ort.label, dtype=dt, limits=run.limits(dt),
        keep=run.dumps)
    c.details["layers"] = ort.graph.layers_detail()
    run.judged(ort.label, ort_out, dt)
    run.hist[ort.label] = _abs_errors(run.ref_out, ort_out)
    return c


def _compare_kv_decode(run: _Run) -> cmp.Comparison | None:
    """The reference generation loop on the exported pair vs PyTorch per prompt (no row without --onnx)."""
    ort, dec, s = run.ort, run.dec, run.s
    if dec is not None and s.prompts:
        generations = run.greedy()
        row = _kv_decode_row(run.ref, dec, run.prompts, run.n_new, run.tdtype, run.limits, run.dumps)
        gen = dec.generate(run.prompts.tolist(), run.n_new)
        generations[dec.label] = torch.cat([run.prompts, torch.from_numpy(gen.new_tokens).to(run.prompts.dtype)],
                                           dim=1)
        run.limits_of[dec.label] = run.limits_of[ort.label]
        return row
    if ort is None:
        return None
    why = run.dec_skip or ("evaluate.prompts is 0" if not s.prompts else
                           f"no decode.onnx beside {Path(run.onnx).name} exported with the KV cache")
    return cmp.skipped("onnx_kv_decode", "KV-cache decode graph", why)


def _compare_npu_fused(run: _Run) -> cmp.Comparison:
    return _npu_fused_row(run.model_dir, run.ev.batches, run.tdtype, run.limits)


def _compare_operators(run: _Run) -> cmp.Comparison:
    """Per-operator conformance, judged in the dtypes the model comparisons used."""
    run.steps.step("operator conformance")
    if not run.s.operators:
        return cmp.skipped("operators", "operator conformance", "evaluate.operators is false")
    run.op_dtypes = tuple(run.judged_dtypes) or (run.tdtype("float32"),)
    run.op_rows = run_conformance(thresholds=run.s.thresholds, ops=model_operators(run.args))
    return cmp.operator_comparison(run.op_rows, run.op_dtypes)


def _compare_om(run: _Run) -> cmp.Comparison:
    """The ATC .om on an Ascend runtime (ais_bench), when there is one."""
    run.steps.step("OM")
    runtime = ascend_runtime()
    if run.om is None:
        return cmp.skipped("om", "ATC .om model", "no Ascend runtime" if runtime is None else "no --om given")
    if runtime is None:
        return cmp.skipped("om", "ATC .om model", "no Ascend runtime (neither ais_bench nor acl is importable)")
    if runtime != "ais_bench":
        return cmp.skipped("om", "ATC .om model", "pyACL found but titan-pipe drives .om files "
                           "through ais_bench; install ais_bench")
    # per-layer rows from the .om's operator dump, mapped through the ONNX graph it was built from
    omr = OmRunner(Path(run.om), graph=run.ort.graph if run.ort is not None else None, dim=run.args.dim)
    om_out = _run_batches(omr, run.ev.batches)
    dt = run.tdtype(omr.dtype)
    c = cmp.compare_outputs("om", "PyTorch vs the .om on the Ascend runtime", run.ref_out, om_out,
                            ref_label=run.ref.label, cand_label=omr.label, dtype=dt, limits=run.limits(dt),
                            keep=run.dumps)
    c.details["layers"] = (omr.layers_note or "per-layer rows need --onnx (the graph the .om was compiled "
                           "from) to map the operator dump to layers")
    run.judged(omr.label, om_out, dt)
    run.hist[omr.label] = _abs_errors(run.ref_out, om_out)
    # no greedy generation on the .om: gear-compiled models take only their compiled lengths
    return c


def _compare_task(run: _Run) -> cmp.Comparison:
    """Task level: perplexity of every candidate and greedy generations token for token."""
    run.steps.step("perplexity and greedy generation")
    generations = run.greedy()
    task = cmp.task_comparison(run.ev.batches, run.task_outputs, run.ref.label, generations,
                               run.prompts.shape[1], run.limits_of)
    if run.ort is not None and run.ort.info.fixed_shape:
        task.details["generation_note"] = ("prefill re-run skipped for the static ONNX graph (its generation is the "
                                           "KV-cache loop's)")
    return task


# The comparisons in report order; each returns its row (None: no row for these inputs). The KV
# decode row needs the reference's greedy generation (computed once, shared with the task row).
COMPARISONS = (
    _compare_sharded,
    _compare_onnx,
    _compare_kv_decode,
    _compare_npu_fused,
    _compare_operators,
    _compare_om,
    _compare_task,
)


def _evaluate(out_dir, checkpoint, model_dir, onnx, om, data, s: EvaluateConfig, steps: _Steps,
              split: ValidationSplit | None = None) -> EvalResult:
    run = _prepare(out_dir, checkpoint, model_dir, onnx, om, data, s, steps, split)
    comparisons = [c for c in (compare(run) for compare in COMPARISONS) if c is not None]
    verdict = cmp.decide(comparisons, run.op_rows, run.op_dtypes)
    steps.step("writing the report")
    files = write_report(out_dir, _report(run, comparisons, verdict), run.hist, dumps=run.dumps)
    return EvalResult(out_dir, verdict.passed, files["report.json"], _summary(verdict, comparisons))


def _report(run: _Run, comparisons: list[cmp.Comparison], verdict: cmp.Verdict) -> dict:
    args, ev, s = run.args, run.ev, run.s
    return {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "passed": verdict.passed, "verdict": verdict.to_dict(),
        "inputs": {"checkpoint": _s(run.checkpoint), "model_dir": _s(run.model_dir), "onnx": _s(run.onnx),
                   "om": _s(run.om), "data": ev.source},
        "data": {"source": ev.source, "tokenizer": ev.tokenizer, "batches": len(ev.batches),
                 "batch_size": run.batch_size, "seq_len": run.seq_len, "prompts": int(ev.prompts.shape[0]),
                 "prompt_len": int(ev.prompts.shape[1]), "new_tokens": s.new_tokens},
        "model": args.to_dict() | {"rope_scaling": None if args.rope_scaling is None else vars(args.rope_scaling)},
        "settings": s.model_dump(), "thresholds": run.thresholds_used,
        "environment": _environment(),
        "comparisons": [c.to_dict() for c in comparisons],
        "operators": [r.to_dict() for r in run.op_rows],
    }


def ragged_prompts(prompts: torch.Tensor) -> list[list[int]]:
    """(N, P) -> N prompts of lengths P down to P - P//2 (the last N-1 cut from the left), so the
    KV-cache loop runs a left-padded batch of mixed lengths."""
    n, p = prompts.shape
    lengths = [p - (j * (p // 2)) // max(1, n - 1) for j in range(n)]
    return [row[p - k:].tolist() for row, k in zip(prompts, lengths)]


def _kv_decode_row(ref: TorchRunner, dec: OnnxDecodeRunner, prompts: torch.Tensor, n_new: int, tdtype,
                   limits, dumps: dict | None = None) -> cmp.Comparison:
    """The reference generation loop (left-padded batch of mixed-length prompts, prefill, decode.onnx
    one token a step against the fixed cache) vs the PyTorch model run on each prompt alone,
    unpadded: greedy token agreement, and the logits predicting each new token with the loop
    teacher-forced onto the reference's own tokens. Per layer: decode.onnx's own values at each
    teacher-forced decode step vs the reference's at the same position of that prompt."""
    ragged = ragged_prompts(prompts)
    ref_new, ref_logits, ref_layers = [], [], []
    for p in ragged:
        seq = cmp.greedy_generate(ref.run, torch.tensor([p]), n_new)[0]
        ref_new.append(seq[len(p):])
        full = ref.run(seq[None, :-1])
        ref_logits.append(full.logits[0, len(p) - 1:])
        # decode steps feed new tokens 1..n_new-1, at positions len(p) .. len(p)+n_new-2
        ref_layers.append(Outputs(torch.empty(0), *([None if t is None else t[:, len(p):] for t in getattr(full, k)]
                                                    for k in ("hidden", "attn", "mlp"))))
    ref_new = torch.stack(ref_new)
    steps: list[Outputs] = []
    forced = dec.generate(ragged, n_new, forced=ref_new.numpy(), steps_out=steps)
    free = dec.generate(ragged, n_new)
    dt = tdtype(dec.prefill.dtype)
    lim = limits(dt)
    ref_o, cand_o = Outputs(torch.stack(ref_logits)), Outputs(torch.from_numpy(forced.logits))
    if steps:
        r = concat_outputs(ref_layers)
        ref_o = Outputs(ref_o.logits, r.hidden, r.attn, r.mlp)
        cand_o = Outputs(cand_o.logits, steps[0].hidden, steps[0].attn, steps[0].mlp)
    c = cmp.compare_outputs("onnx_kv_decode", "KV-cache decode loop (left-padded batch, prefill + decode.onnx against "
                            "the fixed cache) vs PyTorch on each prompt alone", ref_o, cand_o,
                            ref_label=ref.label, cand_label=dec.label, dtype=dt, limits=lim, keep=dumps)
    agree = cmp.generation_agreement(ref_new, torch.from_numpy(free.new_tokens), 0)
    for f in check_task(ppl_ref=1.0, ppl_cand=1.0, agreement=agree["agreement"], limits=lim):
        c.failures.append(f"{dec.label} ({dt}): {f.text}")
        c.status = "fail"
    c.details = {"positions": f"{n_new} generated positions of {len(ragged)} prompt(s), left-padded, lengths "
                              f"{[len(p) for p in ragged]}",
                 "graphs": "static" if dec.cache_len is not None else "dynamic",
                 "cache_len": dec.cache_len or max(len(p) for p in ragged) + n_new - 1,
                 "generation": agree, "logits": "teacher-forced onto the reference's greedy tokens",
                 "layers": (f"{dec.path.name}: {dec.graph.layers_detail()}; per-layer rows are its {n_new - 1} "
                            "teacher-forced decode steps of each prompt") if steps else
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
    from titan_pipe.model.kernels import npu_fused_kernels, reference_kernels

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
