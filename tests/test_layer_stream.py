"""Layer-streamed forward (training/layer_stream.py) in one process: a 1-rank layout goes through the
same build_parallel_model / forward_logits code as the sharded forward's ranks; the streamed model
holds one decoder layer at a time and its outputs equal the resident model's bit for bit."""

import pytest
import torch
import torch.distributed as dist

from titan_pipe.records.checkpoint_format import Box, ParallelLayout
from titan_pipe.model.args import resolve_args
from titan_pipe.model.weights import CheckpointWeights, open_weights
from titan_pipe.training.checkpoint import save_checkpoint
from titan_pipe.training.layer_stream import local_box
from titan_pipe.training.parallel_dims import ParallelDims
from titan_pipe.training.parallelize import build_parallel_model
from titan_pipe.training.pipeline_parallel import forward_logits

ARGS = resolve_args("debug", n_layers=3)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A 1-rank gloo group and a checkpoint of a randomly initialised model saved by the trainer's writer."""
    root = tmp_path_factory.mktemp("stream")
    dist.init_process_group("gloo", init_method=f"file://{root / 'store'}", rank=0, world_size=1)
    try:
        mesh = ParallelDims(1, 1, 1).build_mesh("cpu")
        src = build_parallel_model(ARGS, mesh, seed=3)
        step = save_checkpoint(
            root / "step-000001",
            model=src,
            optimizers=None,
            train_state={"step": 1},
            parallel=ParallelLayout(dp=1, tp=1, pp=1),
        )
        yield mesh, step
    finally:
        dist.destroy_process_group()


def _layers(pm):
    return [layer for m in pm.modules for layer in m.layers.values()]


def _is_meta(layer) -> bool:
    return all(p.is_meta for p in layer.parameters())


def test_streamed_outputs_equal_resident_and_one_layer_lives_at_a_time(one_rank):
    mesh, step = one_rank
    tokens = torch.randint(0, ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    resident = build_parallel_model(ARGS, mesh, weights=open_weights(step))
    streamed = build_parallel_model(ARGS, mesh, weights=open_weights(step), stream_layers=True)
    assert not any(_is_meta(layer) for layer in _layers(resident))
    layers = _layers(streamed)
    assert all(_is_meta(layer) for layer in layers)  # built without any layer's storage
    assert not streamed.modules[0].tok_embeddings.weight.is_meta  # the ends stay resident

    live = []  # per layer forward: how many layers hold storage while it runs
    outs = {}

    def seen(i, out):
        live.append(sum(not _is_meta(x) for x in layers))
        outs[i] = out

    for i, layer in enumerate(layers):  # prepended: runs before the stream releases the layer
        layer.register_forward_pre_hook(lambda _m, _a, i=i: live.append(-1) if _is_meta(layers[i]) else None)
        layer.register_forward_hook(lambda _m, _i, out, i=i: seen(i, out), prepend=True)
    ref_outs = {}
    for i, layer in enumerate(_layers(resident)):
        layer.register_forward_hook(lambda _m, _i, out, i=i: ref_outs.__setitem__(i, out))
    for _ in range(2):  # a second batch materialises every layer again
        a = forward_logits(resident.modules, resident.stage_plan, tokens, pp_mesh=mesh["pp"], args=ARGS)
        b = forward_logits(streamed.modules, streamed.stage_plan, tokens, pp_mesh=mesh["pp"], args=ARGS)
        assert torch.equal(a, b)
        assert all(torch.equal(ref_outs[i], outs[i]) for i in range(ARGS.n_layers))
    assert live == [1] * (2 * ARGS.n_layers)
    assert all(_is_meta(layer) for layer in layers)  # released after the last forward


def test_box_reads_the_piece_full_would_cut(one_rank):
    _, step = one_rank
    w = CheckpointWeights(step)
    name = "layers.1.feed_forward.w1.weight"
    full = w.full(name)
    box = Box((3, 8), (5, 16))
    assert torch.equal(w.box(name, box), full[3:8, 8:24])
    assert torch.equal(w.box(name, Box.full(tuple(full.shape))), full)
    assert local_box(name, full) == Box.full(tuple(full.shape))  # a plain tensor: all of it


def test_stream_layers_refuses_random_init(one_rank):
    mesh, _ = one_rank
    with pytest.raises(ValueError, match="stored weights"):
        build_parallel_model(ARGS, mesh, seed=0, stream_layers=True)
