"""Build a Run (evaluate/run.py): reference and candidates checked to be one model, data, memory
mode, and the reference's values over every sequence the comparisons need (computed once)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from titan_pipe.records.checkpoint_format import MANIFEST_NAME, is_complete
from titan_pipe.config import EvaluateConfig
from titan_pipe.rules.dtypes import DTYPE_BYTES_BY_NAME
from titan_pipe.errors import UserError
from titan_pipe.evaluate.batches import ValidationSplit, load_eval_data
from titan_pipe.evaluate.graph_pieces import past_bytes, tensor_bytes
from titan_pipe.evaluate.inputs import reference_device, same_model
from titan_pipe.evaluate.memory import MemoryPlan, Need, decode_step_bytes, ort_bytes, plan_memory
from titan_pipe.evaluate.report import TensorDump
from titan_pipe.evaluate.run import REF, REF_GEN, Ledger, Prompts, Request, Run, Sides, ragged_prompts
from titan_pipe.evaluate.runners.ort import OnnxDecodeRunner, OnnxRuntimeRunner
from titan_pipe.evaluate.runners.ort_layers import LayerChain, Sessions
from titan_pipe.evaluate.runners.pytorch import LayeredModel, layer_bytes, top_bytes
from titan_pipe.evaluate.runners.sharded import DistributedRunner
from titan_pipe.evaluate.store import StoreSink, ValueStore
from titan_pipe.graphs.generation import plan_batches
from titan_pipe.model.args import ModelArgs


def prepare(
    *,
    out_dir: Path,
    checkpoint: Path | None,
    model_dir: Path | None,
    onnx: Path | None,
    om: Path | None,
    data: Path | None,
    settings: EvaluateConfig,
    steps,
    split: ValidationSplit | None,
) -> Run:
    """Everything the comparisons read; UserError (before any report is written) on bad input."""
    steps.step("loading the reference")
    device = reference_device(settings.device)
    reference, ref_source = _reference(checkpoint, model_dir, device)
    args = reference.args
    sharded = None
    if checkpoint is not None and is_complete(Path(checkpoint)):  # a DCP / Megatron one has no layout of ours to run
        sharded = DistributedRunner(Path(checkpoint), device=device)
        same_model(sharded.args, args, f"--checkpoint {checkpoint} vs --model-dir {model_dir}")
    prefill = decode = None
    if onnx is not None:
        prefill = OnnxRuntimeRunner(Path(onnx))
        prefill.check_matches(args, source=ref_source)
        prefill.find_layers(args.n_layers)  # the graph's own per-layer values (export.json / structure)
        decode = OnnxDecodeRunner.beside(prefill)
        if decode is not None:
            decode.find_layers(args.n_layers)
    batch_size, seq_len = settings.batch_size, settings.seq_len
    if prefill is not None and prefill.info.fixed_shape:
        batch_size, seq_len = prefill.info.fixed_shape  # a static graph takes only its own shape
    if seq_len > args.max_seq_len:
        raise UserError(f"evaluate.seq_len {seq_len} exceeds the model's max_seq_len {args.max_seq_len}")
    ev = load_eval_data(
        data=Path(data) if data else None,
        model_dir=Path(model_dir) if model_dir else None,
        vocab_size=args.vocab_size,
        n_batches=settings.batches,
        batch_size=batch_size,
        seq_len=seq_len,
        n_prompts=settings.prompts,
        prompt_len=settings.prompt_len,
        split=split,
        checkpoint=Path(checkpoint) if checkpoint else None,
    )
    request = Request(settings, checkpoint, model_dir, onnx, om, ev, batch_size, seq_len)
    prompts, n_new, decode, decode_skip = _fit_generation(ev.prompts, settings.new_tokens, decode)
    chains = [_chain(prefill), _chain(decode, _loop_shape(prefill, decode, prompts, n_new, settings.prompts))]
    memory = _plan(settings, args, request, (prefill, decode), chains, sharded, reference.stored_itemsize)
    whole = memory.mode == "whole"
    reference.keep = whole
    if sharded is not None:  # its ranks go one decoder layer at a time too
        sharded.streamed = not whole
    sessions = Sessions(None if whole else memory.budget - _activations(args, request))
    for chain in chains:
        if chain is not None:
            chain.sessions = sessions
    sides = Sides(reference, ref_source, sharded, prefill, chains[0], decode, chains[1], decode_skip)
    run = Run(
        request,
        sides,
        Prompts(prompts, n_new, None),
        memory,
        ValueStore(spill=not whole),
        Ledger(),
        steps,
        TensorDump(out_dir) if settings.dump else None,
    )
    try:
        return _reference_values(run)
    except BaseException:
        run.close()
        raise


def _reference(checkpoint: Path | None, model_dir: Path | None, device: str) -> tuple[LayeredModel, str]:
    """The float32 reference (its weights not read yet) and the file its model config came from."""
    from titan_pipe.model.stated import checkpoint_args
    from titan_pipe.model.weights import open_weights
    from titan_pipe.weights.detect import other_format

    where = "" if device == "cpu" else f", {device}"
    if checkpoint is not None and other_format(Path(checkpoint)):  # torchtitan DCP / Megatron: the reference itself
        source = open_weights(Path(checkpoint))
        if model_dir is not None:
            same_model(
                source.args, checkpoint_args(Path(model_dir)), f"--checkpoint {checkpoint} vs --model-dir {model_dir}"
            )
        ref = LayeredModel(
            source,
            device=device,
            label=f"torch float32 ({Path(checkpoint).name}, {source.plan.format}, one process{where})",
        )
        return ref, str(source.plan.root)
    if model_dir is not None:
        ref = LayeredModel(
            open_weights(Path(model_dir)), device=device, label=f"torch float32 ({Path(model_dir).name}{where})"
        )
        return ref, f"{Path(model_dir) / 'config.json'}"
    source = open_weights(Path(checkpoint), adapters_apart=True)  # LoRA: base + adapters, as trained
    lora = f", LoRA rank {source.lora.rank} unmerged" if getattr(source, "lora", None) is not None else ""
    ref = LayeredModel(
        source, device=device, label=f"torch float32 ({Path(checkpoint).name}, one process{lora}{where})"
    )
    return ref, f"{Path(checkpoint) / MANIFEST_NAME}"


def _fit_generation(prompts, n_new: int, dec: OnnxDecodeRunner | None):
    """(ragged prompts, new tokens, decode runner, why no KV loop): a static prefill graph takes at
    most its T tokens, and its fixed cache holds at most C - T + 1 generated ones."""
    skip = None
    if dec is not None:
        if dec.prompt_len is not None:
            prompts = prompts[:, -dec.prompt_len :]
        room = dec.max_new_tokens(prompts.shape[1])
        if room is not None:
            if min(n_new, room) < 1:
                dec, skip = (
                    None,
                    f"the static cache of {dec.path} has no slot left after a {dec.prompt_len}-token prompt",
                )
            else:
                n_new = min(n_new, room)
    return ragged_prompts(prompts) if prompts.shape[0] else [], n_new, dec, skip


def _loop_shape(prefill, decode, prompts, n_new: int, wanted: int) -> tuple[int, int] | None:
    """(rows, cache slots) of the generation loop's largest batch, or None when no loop runs."""
    if decode is None or not wanted or not len(prompts) or n_new < 1:
        return None
    plan = plan_batches(prefill=prefill.graph.io, decode=decode.graph.io, prompts=prompts, max_new_tokens=n_new)
    return max(pb.ids.shape[0] for pb in plan), max(pb.cache_len for pb in plan)


def _chain(runner, loop: tuple[int, int] | None = None) -> LayerChain | None:
    """The graph's layer chain, or None when its per-layer values (or the stream into layer 0) are unknown.
    ``loop``: (rows, cache slots) of the decode steps a decode graph's layers run (their caches count)."""
    if runner is None or runner.graph.taps is None or runner.graph.taps.embed is None:
        return None
    item = _itemsize(runner)
    rows, slots = loop or (0, 0)

    def need(p) -> int:
        step = decode_step_bytes(past_bytes(p, rows=rows, slots=slots)) if loop and p.layer is not None else 0
        return ort_bytes(p.weight_bytes, item) + step

    return LayerChain(runner.graph, need=need)


def _itemsize(runner) -> int:
    """Bytes per weight of a graph (the decode graph's are the prefill graph's)."""
    return DTYPE_BYTES_BY_NAME[runner.prefill.dtype if isinstance(runner, OnnxDecodeRunner) else runner.dtype]


def _plan(
    settings: EvaluateConfig,
    args: ModelArgs,
    request: Request,
    graphs,
    chains,
    sharded: DistributedRunner | None,
    ref_item: int,
) -> MemoryPlan:
    """``ref_item``: bytes per weight of the reference's linear layers as stored (it holds them so)."""
    ref_layers = [
        Need(f"decoder layer {i} (PyTorch reference)", layer_bytes(args, i, ref_item)) for i in range(args.n_layers)
    ]
    top = top_bytes(args, ref_item)
    whole = [Need("PyTorch reference", sum(n.bytes for n in ref_layers) + top)]
    graphs_whole = []
    pieces = ref_layers + [Need("embedding and output (PyTorch reference)", top)]
    can_stream = None
    for runner, chain in zip(graphs, chains):
        if runner is None:
            continue
        item = _itemsize(runner)
        if chain is None:
            total = sum(tensor_bytes(t) for t in runner.graph.structure.graph.initializer)
            graphs_whole.append(Need(runner.path.name, ort_bytes(total, item)))
            can_stream = f"{runner.path.name}: {runner.graph.layers_note or 'no per-layer values'}"
            continue
        graphs_whole.append(Need(runner.path.name, sum(ort_bytes(p.weight_bytes, item) for p in chain.pieces)))
        pieces += [Need(f"{runner.path.name} {p.name} (ONNX Runtime)", chain.need(p)) for p in chain.pieces]
    if sharded is not None:  # its ranks run while evaluate waits: a step of its own, every rank counted
        resident, streamed = sharded.memory_needs(
            batches=len(request.data.batches), batch_size=request.batch_size, seq_len=request.seq_len
        )
        whole.append(Need(f"sharded forward ({sharded.world_size} ranks, every layer)", resident))
        pieces.append(Need(f"sharded forward ({sharded.world_size} ranks, one layer each)", streamed))
    activations = _activations(args, request)
    if graphs_whole:  # held together once the reference is done: the graphs' pieces, resident
        whole.append(Need(" + ".join(n.name for n in graphs_whole), sum(n.bytes for n in graphs_whole)))
    return plan_memory(settings.max_memory, whole=whole, pieces=pieces, activations=activations, can_stream=can_stream)


def _activations(args: ModelArgs, request: Request) -> int:
    """Bytes of one batch's values that grow with the model (the per-layer streams, the logits)."""
    b, t = request.batch_size, request.seq_len
    return 4 * b * t * (len(request.data.batches) * 6 * args.dim + 2 * args.vocab_size)


def _reference_values(run: Run) -> Run:
    """The reference's greedy tokens (when a candidate generates) with, for the KV-cache loop, what
    its steps computed on the way (the loop's reference side: the logits choosing each new token,
    each layer's values at the positions the decode steps feed); then one layer-major forward over
    the held-out batches."""
    s, p = run.sides, run.prompts
    generates = s.decode is not None or (s.prefill is not None and not s.prefill.info.fixed_shape)
    tokens = None
    if p.prompts and generates:
        run.steps.step("reference generation")
        values = {} if s.decode is not None else None
        start = time.perf_counter()
        tokens = s.reference.greedy(p.prompts, p.n_new, values=values)
        run.ledger.seconds["reference generation"] = time.perf_counter() - start
        for (kind, layer), v in (values or {}).items():
            run.store.put((REF_GEN, kind, layer, 0), v)
    run.steps.step("reference forward")
    start = time.perf_counter()
    seqs = list(run.request.data.batches)
    s.reference.forward(seqs, StoreSink(run.store, [(REF, b) for b in range(len(seqs))]))
    s.reference.drop()  # every comparison reads the reference's values from the store from here on
    run.ledger.seconds["reference forward"] = time.perf_counter() - start
    return run if tokens is None else replace(run, prompts=Prompts(p.prompts, p.n_new, tokens))
