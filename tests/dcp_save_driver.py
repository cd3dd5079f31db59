"""torchrun driver (4 gloo ranks): DCP checkpoints of a model FSDP2- and TP-sharded over (dp 2, tp 2).

Writes into OUT (argv[1]):
  params.json                 the model's head counts (DCP stores no config)
  model_only/                 dcp.save of the model state dict, weights = convert_writers.native_state
                              with q/k rows in Meta/torchtitan interleaved RoPE order
  full/step-1/                after one AdamW step: torchtitan's checkpoint layout -- the model's
                              entries flattened at the top level beside optimizer (flattened),
                              lr_scheduler, dataloader (one entry per dp rank) and train_state
  full_reference.safetensors  rank 0's gathered full tensors after the step (the reference)
  placements.json             each parameter's DTensor placements (to show _StridedShard is there)
  megatron/                   when megatron-core imports: the same weights in a megatron-core
                              GPTModel (tp 2 x pp 2 x virtual pp 2, local layer spec) saved by
                              megatron.core.dist_checkpointing.save as Megatron-LM does (torch_dist:
                              args/iteration in common.pt, 'model0'/'model1' sharded); else
                              megatron_skipped.txt with the import error
  megatron_qwen2/             the same for a Qwen2-style model (add_qkv_bias=True: linear_qkv.bias)
  megatron_moe/               a Qwen3-MoE-shaped megatron-core GPTModel (a dense layer, then MoE layers of
                              SequentialMLP experts) at tp 2 x ep 2, saved the same way
  megatron_moe_grouped/       the same with GroupedMLP experts (weight1/weight2 as legacy files hold them)
  megatron_moe_singleton/     megatron_moe saved with singleton_local_shards (a key per expert, fc1 as _w/_v)
"""

from __future__ import annotations

import json
import pickle
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from convert_writers import model_args, native_state, to_interleaved
from titan_pipe.training.data_parallel import plan_dp
from titan_pipe.training.parallel_dims import ParallelDims
from titan_pipe.training.parallelize import build_parallel_model


class InterleavedWeights:
    """native_state's weights, q/k rows in interleaved order (as torchtitan/Meta hold them)."""

    def __init__(self, args):
        self.args, self.sd = args, native_state(args)

    def full(self, name: str) -> torch.Tensor:
        w = self.sd[name]
        if name.endswith("attention.wq.weight"):
            return to_interleaved(w, self.args.n_heads)
        if name.endswith("attention.wk.weight"):
            return to_interleaved(w, self.args.kv_heads)
        return w


def main(out: Path) -> None:
    # A rank failing inside a collective (say, a megatron-core that cannot save on CPU) makes the
    # others fail after this long instead of hanging the test.
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    rank = dist.get_rank()
    args = model_args()
    dims = ParallelDims(dp=2, tp=2)
    mesh = dims.build_mesh("cpu")
    pm = build_parallel_model(
        args, mesh, dp_plan=plan_dp(dp=2, tp=2, dp_mode="fsdp", zero_stage=None), weights=InterleavedWeights(args)
    )
    module = pm.parts[0]
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "params.json").write_text(
            json.dumps(
                {
                    "n_heads": args.n_heads,
                    "n_kv_heads": args.kv_heads,
                    "norm_eps": args.norm_eps,
                    "rope_theta": args.rope_theta,
                }
            )
        )
        (out / "placements.json").write_text(
            json.dumps({n: [str(p) for p in v.placements] for n, v in module.named_parameters()})
        )
    dist.barrier()
    dcp.save(get_model_state_dict(module), checkpoint_id=str(out / "model_only"))

    opt = torch.optim.AdamW(module.parameters(), lr=1e-2, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 4))
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    logits = module(tokens[:, :-1])
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
    opt.step()
    sched.step()
    dp_rank = dims.coords(rank)[0]
    state = {
        **get_model_state_dict(module),
        "optimizer": get_optimizer_state_dict(module, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)),
        "lr_scheduler": sched.state_dict(),
        "dataloader": {f"dp_rank_{dp_rank}": pickle.dumps({"sample": 17 + dp_rank})},
        "train_state": {"step": torch.tensor(1), "ntokens_seen": torch.tensor(30)},
    }
    dcp.save(state, checkpoint_id=str(out / "full/step-1"))
    full = {n: p.full_tensor().clone() for n, p in module.named_parameters()}
    if rank == 0:
        from safetensors.torch import save_file

        save_file(full, out / "full_reference.safetensors")
    dist.barrier()
    try:
        save_megatron(out, rank)
        save_megatron_moe(out, rank)
        save_megatron_moe(out, rank, grouped=True)
        save_megatron_moe(out, rank, singleton=True)
    except Exception as e:  # a megatron-core that cannot save on CPU: the test skips, saying why
        (out / "megatron_skipped.txt").write_text(f"megatron-core save failed on rank {rank}: {type(e).__name__}: {e}")
    dist.barrier()
    dist.destroy_process_group()


def save_megatron(out: Path, rank: int, tp: int = 2, pp: int = 2, vpp: int = 2) -> None:
    """megatron-core's own torch_dist saves of native_state's weights, a Llama and a Qwen2-style
    model (CPU: two CUDA calls stubbed)."""
    try:
        from megatron.core import parallel_state
        from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: F401 (_save_gpt's, imported here to probe)
        from megatron.core.transformer.transformer_config import TransformerConfig
    except Exception as e:  # ImportError, or a megatron-core that does not import without CUDA
        if rank == 0:
            (out / "megatron_skipped.txt").write_text(f"{type(e).__name__}: {e}")
        return

    # megatron-core's checkpoint saver synchronises CUDA and puts a flag tensor on the current
    # CUDA device; neither exists on a CPU build of torch.
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp
    )
    for name, args in (("megatron", model_args()), ("megatron_qwen2", model_args(qkv_bias=True))):
        cfg = TransformerConfig(
            num_layers=args.n_layers,
            hidden_size=args.dim,
            ffn_hidden_size=args.hidden_dim,
            num_attention_heads=args.n_heads,
            num_query_groups=args.kv_heads,
            kv_channels=args.head_dim,
            use_cpu_initialization=True,
            gated_linear_unit=True,
            activation_func=F.silu,
            normalization="RMSNorm",
            add_bias_linear=False,
            add_qkv_bias=args.qkv_bias,
            layernorm_epsilon=args.norm_eps,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            pipeline_dtype=torch.float32,
        )
        _save_gpt(out / name, rank, cfg, args, tp, pp, vpp)


MOE_ARGS = dict(
    n_experts=4,
    experts_per_token=2,
    moe_hidden_dim=48,
    dense_layers=(0,),
    qk_norm=True,
    head_dim=16,
    router_aux_loss_coef=0.01,
)  # Qwen3-MoE-shaped: q/k norms, narrower experts, a dense first layer


def save_megatron_moe(
    out: Path, rank: int, tp: int = 2, ep: int = 2, grouped: bool = False, singleton: bool = False
) -> None:
    """megatron-core's own MoE GPTModel (its decoder block spec: a dense layer, then MoELayers of
    SequentialMLP experts, or with ``grouped`` its GroupedMLP: weight1/weight2 as the legacy writer lays
    them out, so megatron-core's own view of them decides what is saved) at tp 2 x ep 2, native_state's
    weights loaded, saved by dist_checkpointing. ``singleton``: saved with megatron-core's
    ``singleton_local_shards`` (each expert under a key of its own, SwiGLU fc1 as separate gate (_w)
    and up (_v) tensors), as Megatron-LM does with --dist-ckpt-optim-fully-reshardable off."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from convert_writers import megatron_args, megatron_rank

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    if grouped:  # GroupedMLP's forward needs the grouped_gemm package; building and saving it do not
        from megatron.core.transformer.moe import grouped_gemm_util

        grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None
    args = model_args(**MOE_ARGS)
    cfg = TransformerConfig(
        num_layers=args.n_layers,
        hidden_size=args.dim,
        ffn_hidden_size=args.hidden_dim,
        num_attention_heads=args.n_heads,
        num_query_groups=args.kv_heads,
        kv_channels=args.head_dim,
        use_cpu_initialization=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        layernorm_epsilon=args.norm_eps,
        qk_layernorm=True,
        num_moe_experts=args.n_experts,
        moe_router_topk=args.experts_per_token,
        moe_ffn_hidden_size=args.expert_dim,
        moe_token_dispatcher_type="allgather",
        moe_layer_freq=[int(args.is_moe_layer(i)) for i in range(args.n_layers)],
        moe_grouped_gemm=grouped,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        pipeline_dtype=torch.float32,
    )
    padded = 512
    m = GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_decoder_block_spec(cfg, use_transformer_engine=False),
        vocab_size=padded,
        max_sequence_length=args.max_seq_len,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=int(args.rope_theta),
    )
    t, e = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_expert_model_parallel_rank()
    local = megatron_rank(
        native_state(args), args, t, 0, tp, 1, fused_norms=False, padded=padded, e=e, ep=ep, grouped=grouped
    )
    _load_into(m, local)
    ckpt = out / ("megatron_moe_grouped" if grouped else "megatron_moe_singleton" if singleton else "megatron_moe")
    metadata = {"singleton_local_shards": True} if singleton else None
    state = {
        "args": megatron_args(args, tp=tp, pp=1, padded=padded, ep=ep),
        "iteration": 50,
        "checkpoint_version": 3.0,
        "model": m.sharded_state_dict(metadata=metadata),
    }
    _save_dist(ckpt, rank, state)


def _save_gpt(ckpt: Path, rank: int, cfg, args, tp: int, pp: int, vpp: int) -> None:
    """Build megatron-core's GPTModel for each virtual stage of this rank, load native_state's
    weights into it and dist_checkpointing.save it under ckpt/iter_0000050."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from convert_writers import megatron_args, megatron_rank

    sd = native_state(args)
    padded = 512  # vocab 320 padded to a multiple of 128 x tp
    t, p = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    state = {
        "args": megatron_args(args, tp=tp, pp=pp, padded=padded, vpp=vpp),
        "iteration": 50,
        "checkpoint_version": 3.0,
    }
    for v in range(vpp):
        first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v)
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v)
        m = GPTModel(
            config=cfg,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=padded,
            max_sequence_length=args.max_seq_len,
            pre_process=first,
            post_process=last,
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
            rotary_base=int(args.rope_theta),
            vp_stage=v,
        )
        local = megatron_rank(sd, args, t, v * pp + p, tp, pp * vpp, fused_norms=False, padded=padded)
        _load_into(m, local)
        state[f"model{v}"] = m.sharded_state_dict()
    _save_dist(ckpt, rank, state)


def _load_into(m, local: dict) -> None:
    """A megatron-core module's state from convert_writers.megatron_rank (every weight, none extra)."""
    missing, unexpected = m.load_state_dict({k: x for k, x in local.items() if x is not None}, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)


def _save_dist(ckpt: Path, rank: int, state: dict) -> None:
    """dist_checkpointing.save into ckpt/iter_0000050 with its tracker file, as Megatron-LM saves."""
    from megatron.core import dist_checkpointing

    if rank == 0:
        (ckpt / "iter_0000050").mkdir(parents=True)
    torch.distributed.barrier()
    dist_checkpointing.save(state, str(ckpt / "iter_0000050"))
    if rank == 0:
        (ckpt / "latest_checkpointed_iteration.txt").write_text("50")


if __name__ == "__main__":
    from titan_pipe.processes.procs import exit_rank

    main(Path(sys.argv[1]))
    exit_rank(0)  # no interpreter teardown for gloo's threads to abort (docs/training.md, Faults)
