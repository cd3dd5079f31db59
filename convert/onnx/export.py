"""The export stage: a unified model dir -> model.onnx (+ decode.onnx), ATC command/.om, export.json.

Graphs come from the TorchScript exporter (``torch.onnx.export(dynamo=False)``) because it takes
``opset_version`` directly; the dynamo exporter emits opset >= 18, above ATC's 11..15. Opset 14
is the default: the lowest opset at which ``scaled_dot_product_attention`` exports, and inside the
window of every operator the graph uses (convert/onnx/data/atc_onnx_ops.json). Everything is written
to a hidden sibling directory and renamed into place when complete, so a failure leaves nothing.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import onnx
import torch

from titan_pipe.atomic import swap_dir, temp_dir
from titan_pipe.convert.onnx import atc as atc_mod
from titan_pipe.convert.onnx.atc_ops import find_problems, load_atc_ops, operator_report
from titan_pipe.convert.onnx.files import (
    check_and_infer, file_table, gather_external_data, move_files, share_external_data,
)
from titan_pipe.convert.onnx.graphs import DecodeGraph, PrefillGraph, dynamic_axes, io_names, tap_names
from titan_pipe.convert.unified import load_unified_model
from titan_pipe.dtypes import BY_NAME, TORCH_BY_NAME
from titan_pipe.errors import StageFailed, UserError
from titan_pipe.model_args import ModelArgs, count_params
from titan_pipe.unified_dir import locate_weights, read_model_args

EXPORT_OPSETS = (14, 15)  # inside ATC's 11..15 and >= 14 for the SDPA exporter
# ATC graphs carry no bfloat16.
EXPORT_DTYPES = ("float32", "float16")


@dataclass(frozen=True)
class GraphPlan:
    """One graph to export: file name, I/O names, the dims ATC sees (-1 = dynamic) and trace dims.

    ``traced_outputs`` are the outputs the tracer is given: ``outputs`` plus every per-layer tap
    (hidden.{i}, attn_out.{i}, mlp_out.{i}), so those values carry stable names in the graph; the
    taps not in ``outputs`` are then dropped from the graph's outputs and stay inner values whose
    names export.json records (layer_outputs, ...), for evaluate to expose in a copy of the graph.
    """

    file: str
    decode: bool
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    traced_outputs: tuple[str, ...]
    input_dims: dict[str, tuple[int, ...]]
    trace_dims: dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class ExportPlan:
    opset: int
    dtype: str
    batch: int
    seq_len: int
    dynamic: bool
    kv_cache: bool
    expose_hidden: bool
    soc_version: str
    precision_mode: str
    run_atc: bool
    weight_bytes: int
    graphs: tuple[GraphPlan, ...]


@dataclass(frozen=True)
class ExportResult:
    out_dir: Path
    onnx: Path
    decode_onnx: Path | None
    export_json: Path
    atc_status: str  # ok | not_found | skipped
    summary: dict
    om: Path | None = None  # the prefill graph's .om, when ATC ran and built it


def plan_export(args: ModelArgs, *, opset: int = 14, dtype: str = "float32", batch: int = 1, seq_len: int = 32,
                dynamic: bool = True, kv_cache: bool = True, soc_version: str = "Ascend910B3",
                run_atc: bool = True, precision_mode: str = "origin",
                expose_hidden: bool = False) -> ExportPlan:
    """Validate the options against the model and lay out the graphs (pure data, no I/O)."""
    lo, hi = load_atc_ops()["atc_opset_window"]
    if not isinstance(opset, int) or not lo <= opset <= hi:
        raise UserError(f"opset {opset!r}: ATC takes ONNX opsets {lo}..{hi} only; use --opset 14 (default) or 15")
    if opset not in EXPORT_OPSETS:
        raise UserError(f"opset {opset}: the TorchScript exporter needs opset >= 14 for scaled_dot_product_attention; "
                        "use --opset 14 (default) or 15")
    if dtype not in EXPORT_DTYPES:
        raise UserError(f"dtype {dtype!r} is not one of {', '.join(EXPORT_DTYPES)} (ATC graphs carry no bfloat16)")
    if precision_mode not in atc_mod.PRECISION_MODES:
        raise UserError(f"precision mode {precision_mode!r} is not one of {', '.join(atc_mod.PRECISION_MODES)}")
    if batch < 1 or seq_len < 1:
        raise UserError(f"batch {batch} and seq_len {seq_len} must both be >= 1")
    if seq_len + (1 if kv_cache else 0) > args.max_seq_len:
        raise UserError(f"seq_len {seq_len} (+1 decode step) exceeds the model's max_position_embeddings "
                        f"{args.max_seq_len} (config.json); pass a smaller --seq-len")
    hkv, hd, n = args.kv_heads, args.head_dim, args.n_layers
    graphs = []
    for decode in ((False, True) if kv_cache else (False,)):
        ins, traced = io_names(n, decode=decode, kv_cache=kv_cache, taps=True)
        kept = {"hidden"} if expose_hidden else set()
        outs = [o for o in traced if o.split(".")[0] not in ("hidden", "attn_out", "mlp_out")
                or o.split(".")[0] in kept]
        if dynamic:  # trace with sizes > 1 so nothing specialises on a broadcastable 1
            tb, ts, tp = max(batch, 2), (2 if decode else 3), 3
            dims = {"input_ids": (-1, -1)}
        else:
            tb, ts, tp = batch, (1 if decode else seq_len), seq_len
            dims = {"input_ids": (batch, ts)}
        trace = {"input_ids": (tb, ts)}
        for name in ins[1:]:
            trace[name] = (tb, hkv, tp, hd)
            dims[name] = (-1, hkv, -1, hd) if dynamic else (batch, hkv, seq_len, hd)
        graphs.append(GraphPlan("decode.onnx" if decode else "model.onnx", decode, tuple(ins), tuple(outs),
                                tuple(traced), dims, trace))
    itemsize = BY_NAME[dtype].itemsize
    return ExportPlan(opset, dtype, batch, seq_len, dynamic, kv_cache, expose_hidden, soc_version,
                      precision_mode, run_atc, count_params(args) * itemsize, tuple(graphs))


def _check_paths(model_dir: Path, out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not overwrite:
        raise UserError(f"{out_dir} already exists; pass --overwrite to replace it (or choose another -o)")
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir} exists and is not a directory; remove it or choose another -o")
    src, dst = model_dir.resolve(), out_dir.resolve()
    if dst == src or dst in src.parents:
        raise UserError(f"output {out_dir} would contain or replace the source model {model_dir}; "
                        "choose an output directory outside it")


def _sample_inputs(g: GraphPlan, vocab: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, g.trace_dims["input_ids"], generator=gen)
    past = [torch.randn(g.trace_dims[n], generator=gen).to(dtype) for n in g.inputs[1:]]
    return (ids, *past)


def _export_graph(model, args: ModelArgs, plan: ExportPlan, g: GraphPlan, work: Path) -> None:
    """Trace one graph into ``work/g.file`` (external data gathered into ``g.file + '.data'``)."""
    scratch = work / f".{g.file}.scratch"
    scratch.mkdir()
    module = (DecodeGraph(model, taps=True) if g.decode
              else PrefillGraph(model, kv_cache=plan.kv_cache, taps=True)).eval()
    sample = _sample_inputs(g, args.vocab_size, TORCH_BY_NAME[plan.dtype])
    axes = dynamic_axes(list(g.inputs), list(g.traced_outputs), decode=g.decode) if plan.dynamic else None
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exporter's deprecation and tracer notices
            torch.onnx.export(module, sample, str(scratch / g.file), dynamo=False, opset_version=plan.opset,
                              input_names=list(g.inputs), output_names=list(g.traced_outputs), dynamic_axes=axes,
                              do_constant_folding=True, export_params=True)
    except Exception as e:  # the exporter raises many types; the first line says what it could not map
        raise StageFailed(f"{g.file}: torch.onnx.export (TorchScript, opset {plan.opset}) failed: "
                          f"{str(e).strip().splitlines()[0][:400]}; model code that does not export belongs "
                          "in training/model.py or convert/onnx/graphs.py") from e
    del module
    gather_external_data(scratch / g.file)
    _drop_outputs(scratch / g.file, keep=g.outputs)
    move_files(scratch, work)
    scratch.rmdir()


def _drop_outputs(path: Path, *, keep: tuple[str, ...]) -> None:
    """Remove the graph outputs not in ``keep`` (the per-layer taps): their values stay in the graph
    under the same names, computed by the same nodes, just no longer returned."""
    model = onnx.load(str(path), load_external_data=False)
    outs = [o for o in model.graph.output if o.name in keep]
    if len(outs) == len(model.graph.output):
        return
    del model.graph.output[:]
    model.graph.output.extend(outs)
    onnx.save(model, str(path))


def _layer_taps(model: onnx.ModelProto, n_layers: int) -> dict[str, list[str | None]]:
    """export.json's per-layer value names (the contract evaluate reads): layer_outputs[i] holds the
    residual stream after decoder layer i, attn_outputs[i] / mlp_outputs[i] its attention / MLP
    block output before the residual Add; null where the graph has no value of that name."""
    produced = {o for n in model.graph.node for o in n.output}
    names = tap_names(n_layers)
    return {key: [v if v in produced else None for v in names[kind]]
            for key, kind in (("layer_outputs", "hidden"), ("attn_outputs", "attn_out"), ("mlp_outputs", "mlp_out"))}


def _graph_report(path: Path, plan: ExportPlan, n_layers: int) -> dict:
    """Check + shape-infer one graph, then its operator report; UserError if ATC would reject it."""
    try:
        model = check_and_infer(path)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise StageFailed(f"{path.name}: onnx.checker / shape inference rejected the exported graph: "
                          f"{str(e).strip().splitlines()[0][:400]}") from e
    report = operator_report(model)
    problems = find_problems(model, report)
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise UserError(f"{path.name}: not ATC-compatible: {problems[0]}{more}")

    def dims(vi):
        return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]

    return {
        "opset": plan.opset,
        "inputs": {vi.name: dims(vi) for vi in model.graph.input},
        "outputs": {vi.name: dims(vi) for vi in model.graph.output},
        "n_nodes": len(model.graph.node),
        **_layer_taps(model, n_layers),
        "operators": [{"domain": u.domain, "op_type": u.op_type, "count": u.count,
                       "since_version": u.since_version} for u in report],
    }


def export_model(*, model_dir: Path, out_dir: Path, opset: int = 14, dtype: str = "float32", batch: int = 1,
                 seq_len: int = 32, dynamic: bool = True, kv_cache: bool = True,
                 soc_version: str = "Ascend910B3", run_atc: bool = True, precision_mode: str = "origin",
                 overwrite: bool = False, expose_hidden: bool = False) -> ExportResult:
    """Export a unified model dir to ONNX for ATC (see docs/export.md for the graphs' I/O).

    Writes out_dir/{model.onnx, decode.onnx (kv_cache), *.onnx.data (graphs past 2 GB),
    atc/command.sh, om/ (if atc ran), export.json}; nothing is left behind on failure.
    """
    from rich.console import Console

    console = Console(stderr=True)
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    _check_paths(model_dir, out_dir, overwrite)
    args = read_model_args(model_dir)
    locate_weights(model_dir)  # fail on missing weights before any work
    plan = plan_export(args, opset=opset, dtype=dtype, batch=batch, seq_len=seq_len, dynamic=dynamic,
                       kv_cache=kv_cache, soc_version=soc_version, run_atc=run_atc,
                       precision_mode=precision_mode, expose_hidden=expose_hidden)
    work = temp_dir(out_dir)
    t0 = time.perf_counter()
    timings: dict[str, float] = {}

    def lap(name: str, since: float) -> float:
        now = time.perf_counter()
        timings[name] = round(now - since, 3)
        return now

    try:
        with console.status(f"loading {model_dir} ({plan.weight_bytes / 1e9:.2f} GB as {dtype})"):
            model, _ = load_unified_model(model_dir, dtype=TORCH_BY_NAME[dtype])
        t = lap("load", t0)
        for g in plan.graphs:
            with console.status(f"exporting {g.file} (opset {opset}, {'dynamic' if dynamic else 'static'} shapes)"):
                _export_graph(model, args, plan, g, work)
            t = lap(f"export {g.file}", t)
        del model
        if kv_cache and (work / "model.onnx.data").exists():
            share_external_data(work / "model.onnx", work / "decode.onnx")
        graphs = {}
        for g in plan.graphs:
            with console.status(f"checking {g.file} (onnx.checker full check, shape inference, ATC operators)"):
                graphs[g.file] = _graph_report(work / g.file, plan, args.n_layers)
            t = lap(f"check {g.file}", t)
        invocations = [atc_mod.atc_invocation(
            graph=g.file, inputs=[atc_mod.GraphInput(n, g.input_dims[n]) for n in g.inputs],
            soc_version=soc_version, precision_mode=precision_mode, dynamic=dynamic, batch=batch,
            seq_len=seq_len, max_len=args.max_seq_len, weight_bytes=plan.weight_bytes, decode=g.decode)
            for g in plan.graphs]
        (work / "atc").mkdir()
        script = work / "atc" / "command.sh"
        script.write_text(atc_mod.command_script(invocations, precision_mode))
        script.chmod(0o755)
        atc_status = "skipped"
        if run_atc:
            atc_status = atc_mod.run_atc(invocations, work, lambda line: console.print(line, highlight=False,
                                                                                       markup=False))
            if atc_status == "not_found":
                console.print(f"atc is not on PATH: no .om built; the command is in {out_dir / 'atc' / 'command.sh'}",
                              highlight=False, soft_wrap=True)
        t = lap("atc", t)
        files = file_table(work)
        lap("hash", t)
        export_s = time.perf_counter() - t0
        record = {
            "format": "titan-pipe-export/1",
            "source": {"model_dir": str(model_dir.resolve()), "config": args.to_dict()},
            "options": {k: v for k, v in asdict(plan).items() if k not in ("graphs",)},
            "exporter": {"torch": torch.__version__, "onnx": onnx.__version__,
                         "path": "torch.onnx.export(dynamo=False)"},
            "atc": {"status": atc_status, "soc_version": soc_version, "precision_mode": precision_mode,
                    "commands": [list(i.argv) for i in invocations],
                    "operator_list": {"file": "convert/onnx/data/atc_onnx_ops.json",
                                      "cann_version": load_atc_ops()["cann_version"]}},
            "graphs": graphs,
            "files": files,
            "export_seconds": round(export_s, 3),
            "timings_seconds": timings,
        }
        (work / "export.json").write_text(json.dumps(record, indent=1) + "\n")
        swap_dir(work, out_dir)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    summary = {"opset": opset, "dtype": dtype, "dynamic": dynamic, "kv_cache": kv_cache,
               "params": count_params(args), "weight_bytes": plan.weight_bytes,
               "graphs": {f: {"nodes": r["n_nodes"], "bytes": record["files"][f]["bytes"]} for f, r in graphs.items()},
               "atc_status": atc_status, "export_seconds": round(export_s, 3), "timings_seconds": timings}
    om = out_dir / f"{invocations[0].om}.om"  # invocations[0]: the prefill graph, model.onnx
    return ExportResult(out_dir=out_dir, onnx=out_dir / "model.onnx",
                        decode_onnx=out_dir / "decode.onnx" if kv_cache else None,
                        export_json=out_dir / "export.json", atc_status=atc_status, summary=summary,
                        om=om if om.is_file() else None)
