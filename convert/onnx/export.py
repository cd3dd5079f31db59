"""The export stage: a unified model dir -> model.onnx + decode.onnx (+ model.onnx.data), ATC command/.om, export.json.

The graphs are built directly (convert/onnx/graphs.py: a decoder layer's nodes emitted once per
layer) and the weights streamed tensor by tensor from the safetensors files into one external-data
file both graphs share (convert/onnx/data_file.py), so the cost is the weights' I/O: the model is
never loaded, traced or held in memory. Opset 14 is the default (15 accepted): inside ATC's 11..15
and the window of every operator the graphs use (convert/onnx/data/atc_onnx_ops.json). Everything is
written to a hidden sibling directory and renamed into place when complete, so a failure leaves
nothing.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import onnx

from titan_pipe.io.atomic import swap_dir, temp_dir
from titan_pipe.convert.onnx import atc as atc_mod
from titan_pipe.convert.onnx.atc_ops import find_problems, load_atc_ops, operator_report
from titan_pipe.convert.onnx.files import check_and_infer, file_table
from titan_pipe.convert.onnx.data_file import DataWriter
from titan_pipe.convert.onnx.graphs import GraphSpec, LayerValues, build_graph, io_dims
from titan_pipe.model.params import initializer_names
from titan_pipe.convert.onnx.weights import plan_weights
from titan_pipe.rules.choices import default_cache_len, export_problems
from titan_pipe.config import ExportConfig
from titan_pipe.records.stage_summaries import ExportSummary
from titan_pipe.rules.dtypes import BY_NAME
from titan_pipe.errors import StageFailed, UserError
from titan_pipe.records.export_record import (
    RECORD_FILE,
    DecodeContract,
    ExportRecord,
    FileEntry,
    GraphRecord,
    OperatorUse,
)
from titan_pipe.io.faults import as_fault, check_free_space
from titan_pipe.graphs.graph_io import DATA_FILE, DECODE_FILE, PREFILL_FILE, data_file_names
from titan_pipe.model import features, rope
from titan_pipe.model.args import ModelArgs, count_params
from titan_pipe.graphs.onnx_nodes import NP_DTYPES
from titan_pipe.model.params import native_shapes
from titan_pipe.model.unified_dir import open_unified

WHAT = "the ONNX export"


@dataclass(frozen=True)
class GraphPlan:
    """One graph to build: file name, I/O names and the dims ATC sees (-1 = dynamic)."""

    file: str
    decode: bool
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    input_dims: dict[str, tuple[int, ...]]
    spec: GraphSpec


@dataclass(frozen=True)
class ExportPlan:
    opset: int
    dtype: str
    batch: int
    seq_len: int
    cache_len: int
    dynamic: bool
    kv_cache: bool
    expose_hidden: bool
    soc_version: str
    precision_mode: str
    atc: bool  # run atc when it is on PATH (ExportConfig.atc)
    weight_bytes: int
    graphs: tuple[GraphPlan, ...]
    hash_weights: bool  # the digests of the weights' data files in export.json (False: null)
    digest: str  # export.json's file digests (titan_pipe.io.hashing.DIGESTS)
    data_files: tuple[str, ...] = (DATA_FILE,)  # the weights' external-data files (titan_pipe.graphs.graph_io)


@dataclass(frozen=True)
class ExportResult:
    out_dir: Path
    onnx: Path
    decode_onnx: Path | None
    export_json: Path
    atc_status: str  # ok | not_found | skipped
    summary: ExportSummary
    om: Path | None = None  # the prefill graph's .om, when ATC ran and built it


def plan_export(args: ModelArgs, settings: ExportConfig) -> ExportPlan:
    """Validate the options against the model (titan_pipe.rules.choices: the rules flow.yaml validation
    uses too) and lay out the graphs (pure data, no I/O)."""
    e = settings
    problems = export_problems(
        max_positions=args.max_seq_len,
        opset=e.opset,
        dtype=e.dtype,
        batch=e.batch,
        seq_len=e.seq_len,
        cache_len=e.cache_len,
        kv_cache=e.kv_cache,
        precision_mode=e.precision_mode,
        digest=e.digest,
        data_files=e.data_files,
    )
    if problems:
        raise UserError(problems[0])
    opset, dtype, batch, seq_len, dynamic, kv_cache = e.opset, e.dtype, e.batch, e.seq_len, e.dynamic, e.kv_cache
    cache_len = default_cache_len(args.max_seq_len) if e.cache_len is None else e.cache_len
    graphs = []
    for decode in (False, True) if kv_cache else (False,):
        spec = GraphSpec(
            decode=decode,
            kv_cache=kv_cache,
            expose_hidden=e.expose_hidden,
            batch=None if dynamic else batch,
            seq=None if dynamic else seq_len,
            cache=None if dynamic else cache_len,
            dtype=dtype,
            opset=opset,
        )
        ins, outs = spec.io_names(args.n_layers)
        dims = io_dims(args, spec)
        graphs.append(
            GraphPlan(
                spec.file,
                decode,
                tuple(ins),
                tuple(outs),
                {n: tuple(d if isinstance(d, int) else -1 for d in dims[n]) for n in ins},
                spec,
            )
        )
    itemsize = BY_NAME[dtype].itemsize
    # never more files than tensors: each tensor goes whole into one file, so the rest would be empty
    data_files = min(e.data_files, len(native_shapes(args)))
    return ExportPlan(
        opset,
        dtype,
        batch,
        seq_len,
        cache_len,
        dynamic,
        kv_cache,
        e.expose_hidden,
        e.soc_version,
        e.precision_mode,
        e.atc,
        count_params(args) * itemsize,
        tuple(graphs),
        e.hash_weights,
        e.digest,
        data_file_names(data_files),
    )


def _check_paths(model_dir: Path, out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not overwrite:
        raise UserError(f"{out_dir} already exists; pass --overwrite to replace it (or choose another -o)")
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"{out_dir} exists and is not a directory; remove it or choose another -o")
    src, dst = model_dir.resolve(), out_dir.resolve()
    if dst == src or dst in src.parents:
        raise UserError(
            f"output {out_dir} would contain or replace the source model {model_dir}; "
            "choose an output directory outside it"
        )


def _rope_rows(plan: ExportPlan, args: ModelArgs) -> int:
    """Rows of the RoPE tables: every position a graph can be asked for (positions < cache slots)."""
    if plan.dynamic:
        return args.max_seq_len
    return plan.cache_len if plan.kv_cache else plan.seq_len


def output_bytes(plan: ExportPlan, args: ModelArgs) -> int:
    """What the export will take on disk: the weights in the graph dtype, the two RoPE tables, and
    for each graph 64 kB plus 16 kB a layer (node protos without weights), ATC script, export.json."""
    tables = 2 * len(features.rope_tables(args))  # cos and sin of each
    rope = tables * _rope_rows(plan, args) * args.head_dim * BY_NAME[plan.dtype].itemsize
    return plan.weight_bytes + rope + len(plan.graphs) * (65536 + 16384 * args.n_layers) + 65536


def _write_weights(args: ModelArgs, plan: ExportPlan, work: Path, sources, hash_weights: bool) -> DataWriter:
    """Every weight (and the RoPE tables) planned into the data files, then streamed there."""
    with DataWriter(work, plan.data_files, plan.dtype, digest=plan.digest if hash_weights else None) as data:
        for init_name, native in initializer_names(args).items():
            parts = sources[native]
            if parts[0].expert is None:
                data.add_source(init_name, parts[0])
            else:  # stored one tensor per expert (Hugging Face): one stacked initializer
                data.add_stacked(init_name, parts)
        np_dtype = NP_DTYPES[plan.dtype]
        for table in features.rope_tables(args):  # the main one, and Gemma 3's sliding layers' own
            cos, sin = rope.cos_sin(args, _rope_rows(plan, args), table)
            data.add_array(f"rope_cos{table.suffix}", cos.astype(np_dtype))
            data.add_array(f"rope_sin{table.suffix}", sin.astype(np_dtype))
        data.write()
    return data


def _graph_report(path: Path, plan: ExportPlan, values: LayerValues) -> GraphRecord:
    """Check + shape-infer one graph, then its record (I/O dims, operators, per-layer value names);
    UserError if ATC would reject it."""
    try:
        model = check_and_infer(path)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise StageFailed(
            f"{path.name}: onnx.checker / shape inference rejected the exported graph: "
            f"{str(e).strip().splitlines()[0][:400]}"
        ) from e
    report = operator_report(model)
    problems = find_problems(model, report)
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise UserError(f"{path.name}: not ATC-compatible: {problems[0]}{more}")

    def dims(vi):
        return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]

    return GraphRecord(
        opset=plan.opset,
        inputs={vi.name: dims(vi) for vi in model.graph.input},
        outputs={vi.name: dims(vi) for vi in model.graph.output},
        n_nodes=len(model.graph.node),
        operators=tuple(OperatorUse(u.domain, u.op_type, u.count, u.since_version) for u in report),
        layer_outputs=tuple(values.layer_outputs),
        attn_outputs=tuple(values.attn_outputs),
        mlp_outputs=tuple(values.mlp_outputs),
        embed_output=values.embed_output,
    )


def _record(
    *,
    model_dir: Path,
    args: ModelArgs,
    plan: ExportPlan,
    atc_status: str,
    invocations: list,
    graphs: dict[str, GraphRecord],
    files: dict[str, dict],
    export_s: float,
    timings: dict[str, float],
) -> ExportRecord:
    """The export record (titan_pipe.records.export_record) of a finished export."""
    return ExportRecord(
        source={"model_dir": str(model_dir.resolve()), "config": args.to_dict()},
        options={k: v for k, v in asdict(plan).items() if k not in ("graphs",)},
        exporter={"onnx": onnx.__version__, "path": "titan_pipe.convert.onnx.graphs (built directly)"},
        decode=DecodeContract(plan.cache_len) if plan.kv_cache else None,
        atc={
            "status": atc_status,
            "soc_version": plan.soc_version,
            "precision_mode": plan.precision_mode,
            "commands": [list(i.argv) for i in invocations],
            "operator_list": {
                "file": "titan_pipe.convert.onnx data/atc_onnx_ops.json",
                "cann_version": load_atc_ops()["cann_version"],
            },
        },
        graphs=graphs,
        files={f: FileEntry(e["bytes"], e["digest"], e["algorithm"]) for f, e in files.items()},
        export_seconds=round(export_s, 3),
        timings_seconds=timings,
    )


def export_model(
    model_dir: Path, out_dir: Path, settings: ExportConfig = ExportConfig(), *, overwrite: bool = False
) -> ExportResult:
    """Export a unified model dir to ONNX for ATC (see docs/export.md for the graphs' I/O).

    Writes out_dir/{model.onnx, decode.onnx (kv_cache), model.onnx.data (the weights, shared),
    atc/command.sh, om/ (if atc ran), export.json}; nothing is left behind on failure.
    ``cache_len`` (decode slots C) defaults to min(max_position_embeddings, 4096). ``digest``: the
    algorithm of export.json's file digests (titan_pipe.io.hashing.DIGESTS: xxh3_128, or sha256 for a
    cryptographic one); ``hash_weights``: the digest of model.onnx.data (computed while streaming; False
    records null and saves the pass over the weights' bytes — a flow's stage cache hashes them anyway).
    """
    from rich.console import Console

    console = Console(stderr=True)
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    _check_paths(model_dir, out_dir, overwrite)
    unified = open_unified(model_dir)  # headers read and every tensor placed: bad weights fail before any write
    args = unified.args
    plan = plan_export(args, settings)
    sources = plan_weights(unified)
    needs = output_bytes(plan, args)
    check_free_space(out_dir, needs=needs, what=WHAT)  # refuse before a byte is written
    work = temp_dir(out_dir)
    t0 = time.perf_counter()
    timings: dict[str, float] = {}

    def lap(name: str, since: float) -> float:
        now = time.perf_counter()
        timings[name] = round(now - since, 3)
        return now

    try:
        with console.status(
            f"streaming {plan.weight_bytes / 1e9:.2f} GB of weights as {plan.dtype} into {', '.join(plan.data_files)}"
        ):
            data = _write_weights(args, plan, work, sources, plan.hash_weights)
        t = lap("weights", t0)
        graphs, layer_values = {}, {}
        for g in plan.graphs:
            proto, layer_values[g.file] = build_graph(args, g.spec, data.entries)
            onnx.save(proto, str(work / g.file))
        t = lap("build", t)
        for g in plan.graphs:
            with console.status(f"checking {g.file} (onnx.checker full check, shape inference, ATC operators)"):
                graphs[g.file] = _graph_report(work / g.file, plan, layer_values[g.file])
            t = lap(f"check {g.file}", t)
        invocations = [
            atc_mod.atc_invocation(
                graph=g.file,
                inputs=[atc_mod.GraphInput(n, g.input_dims[n]) for n in g.inputs],
                soc_version=plan.soc_version,
                precision_mode=plan.precision_mode,
                dynamic=plan.dynamic,
                batch=plan.batch,
                seq_len=plan.seq_len,
                cache_len=plan.cache_len,
                max_len=args.max_seq_len,
                weight_bytes=plan.weight_bytes,
                decode=g.decode,
            )
            for g in plan.graphs
        ]
        (work / "atc").mkdir()
        script = work / "atc" / "command.sh"
        script.write_text(atc_mod.command_script(invocations, plan.precision_mode))
        script.chmod(0o755)
        atc_status = "skipped"
        if plan.atc:
            atc_status = atc_mod.run_atc(
                invocations, work, lambda line: console.print(line, highlight=False, markup=False)
            )
            if atc_status == "not_found":
                console.print(
                    f"atc is not on PATH: no .om built; the command is in {out_dir / 'atc' / 'command.sh'}",
                    highlight=False,
                    soft_wrap=True,
                )
        t = lap("atc", t)
        files = file_table(work, algorithm=plan.digest, known=data.digests)
        lap("hash", t)
        export_s = time.perf_counter() - t0
        record = _record(
            model_dir=model_dir,
            args=args,
            plan=plan,
            atc_status=atc_status,
            invocations=invocations,
            graphs=graphs,
            files=files,
            export_s=export_s,
            timings=timings,
        )
        (work / RECORD_FILE).write_text(record.to_json())
        swap_dir(work, out_dir)
    except BaseException as e:
        shutil.rmtree(work, ignore_errors=True)
        fault = as_fault(e, path=out_dir, what=WHAT, needs=needs) if isinstance(e, Exception) else None
        if fault is not None:  # after the cleanup, so "N free now" counts the space it gave back
            raise fault from None
        raise
    summary = ExportSummary(
        opset=plan.opset,
        dtype=plan.dtype,
        dynamic=plan.dynamic,
        kv_cache=plan.kv_cache,
        cache_len=plan.cache_len,
        params=count_params(args),
        weight_bytes=plan.weight_bytes,
        graphs={f: {"nodes": r.n_nodes, "bytes": record.files[f].bytes} for f, r in graphs.items()},
        # the weights, in external-data files the graphs share (a graph file holds only its nodes)
        data_files=tuple(sorted(f for f in record.files if f.startswith(PREFILL_FILE + ".data"))),
        data_bytes=sum(e.bytes for f, e in record.files.items() if f.startswith(PREFILL_FILE + ".data")),
        atc_status=atc_status,
        export_seconds=round(export_s, 3),
        timings_seconds=timings,
    )
    om = out_dir / f"{invocations[0].om}.om"  # invocations[0]: the prefill graph, model.onnx
    return ExportResult(
        out_dir=out_dir,
        onnx=out_dir / PREFILL_FILE,
        decode_onnx=out_dir / DECODE_FILE if plan.kv_cache else None,
        export_json=out_dir / RECORD_FILE,
        atc_status=atc_status,
        summary=summary,
        om=om if om.is_file() else None,
    )
