"""Test inputs for the convert stage: the same weights written by hand in each source format.

Independent of titan_pipe.convert: Hugging Face through transformers' save_pretrained, DCP through
torch.distributed.checkpoint's own save (torchtitan names, Meta interleaved RoPE), Megatron-LM as
the dict tree megatron-core writes (fused per-group QKV, fused gate|up, padded vocab, per-stage
local layer ids, args Namespace, RNG state).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from titan_pipe.model.args import ModelArgs, resolve_args
from titan_pipe.model.transformer import build_model

# GQA (8 q heads over 4 kv heads), divisible by tp 4; vocab 320 needs padding under Megatron.
ARGS = dict(n_heads=8, n_kv_heads=4)


def model_args(**overrides) -> ModelArgs:
    return resolve_args("debug", **{**ARGS, **overrides})


def native_state(args: ModelArgs, seed: int = 0) -> dict[str, torch.Tensor]:
    """Our model's weights (norms and biases randomised too, so a swapped one cannot pass)."""
    m = build_model(args, seed=seed)
    g = torch.Generator().manual_seed(seed + 7)
    sd = {}
    for k, v in m.state_dict().items():
        if args.tie_embeddings and k == "output.weight":
            continue
        if k.endswith("norm.weight"):
            v = torch.rand(v.shape, generator=g) + 0.5
        elif k.endswith(".bias"):
            v = torch.randn(v.shape, generator=g) * 0.5
        sd[k] = v.clone()
    return sd


def hf_model(args: ModelArgs):
    """An (untrained) transformers model of ``args``' architecture: Llama, Mistral, Qwen2 or Qwen3."""
    import transformers

    from titan_pipe.model.hf_config import to_hf_config

    cfg = {k: v for k, v in to_hf_config(args).items() if k not in ("architectures", "torch_dtype")}
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))


def write_hf(sd: dict, args: ModelArgs, out: Path, **save_kw) -> Path:
    """save_pretrained of a tiny transformers model of ``args``' architecture holding ``sd``."""
    from titan_pipe.model.families import family_of
    from titan_pipe.model.names import native_to_hf

    model = hf_model(args)
    family = family_of(args).model_type
    missing, unexpected = model.load_state_dict({native_to_hf(k, family): v for k, v in sd.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.save_pretrained(out, safe_serialization=True, **save_kw)
    return out


def to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rotate-half rows -> Meta interleaved pairs (the inverse of the HF conversion's permute); a
    1-D bias is a column."""
    rows, *rest = w.shape
    hd = rows // n_heads
    return w.reshape(n_heads, 2, hd // 2, -1).transpose(1, 2).reshape(rows, *rest)


def write_dcp(sd: dict, args: ModelArgs, out: Path, *, full: bool = True, safetensors_items: bool = False) -> Path:
    """A torchtitan DCP checkpoint (single-process dcp.save), with params.json beside it.

    ``safetensors_items``: FileSystemWriter(serialization_format=SAFETENSORS), whose .distcp file
    is a safetensors file of raw tensors instead of one torch.save payload per item.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat

    tt = {}
    for k, v in sd.items():
        if args.qk_norm:  # torchtitan's qwen3: rotate-half rows, as Hugging Face's
            pass
        elif k.endswith(("attention.wq.weight", "attention.wq.bias")):
            v = to_interleaved(v, args.n_heads)
        elif k.endswith(("attention.wk.weight", "attention.wk.bias")):
            v = to_interleaved(v, args.kv_heads)
        tt[k] = v.clone()
    if full:
        state = {
            "model": tt,
            "optimizer": {
                "state": {
                    k: {"exp_avg": torch.zeros_like(v), "step": torch.tensor(3.0)} for k, v in list(tt.items())[:3]
                },
                "param_groups": [{"lr": 3e-4, "params": list(tt)[:3]}],
            },
            "train_state": {"step": 3},
        }
    else:
        state = tt
    out.mkdir(parents=True)
    if safetensors_items:
        dcp.save(
            state,
            storage_writer=FileSystemWriter(str(out / "step-3"), serialization_format=SerializationFormat.SAFETENSORS),
            no_dist=True,
        )
    else:
        dcp.save(state, checkpoint_id=str(out / "step-3"), no_dist=True)
    params = {
        "dim": args.dim,
        "n_layers": args.n_layers,
        "n_heads": args.n_heads,
        "n_kv_heads": args.kv_heads,
        "vocab_size": args.vocab_size,
        "norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_seq_len": args.max_seq_len,
    }
    (out / "params.json").write_text(json.dumps(params))
    return out / "step-3"


def import_megatron(module: str):
    """A megatron-core module, imported without leaving its torch.load allow-list behind (importing
    megatron.core registers PosixPath, Namespace, ... as safe globals process-wide, which would let
    later tests' refused pickles load); None when megatron-core is not installed."""
    import importlib

    import torch.serialization as ser

    saved = list(ser.get_safe_globals())
    try:
        return importlib.import_module(module)
    except ImportError:
        return None
    finally:
        ser.clear_safe_globals()
        ser.add_safe_globals(saved)


def _megatron_attn_backend():
    """megatron-core's own AttnBackend, so saved args pickle a real Megatron enum global (the
    Megatron readers' allow list names it). No stand-in module is ever put into sys.modules under
    megatron's name: one there hid the real package from every later test in the session."""
    enums = import_megatron("megatron.core.transformer.enums")
    if enums is None:
        import pytest

        pytest.skip("megatron-core is not installed (the [test] extra)")
    return enums.AttnBackend


def fused_qkv(sd: dict, args: ModelArgs, i: int, kind: str) -> torch.Tensor:
    """Layer i's q/k/v weights (kind "weight": (groups, rows, dim)) or biases ("bias": (groups, rows))
    fused as megatron-core's linear_qkv holds them: per query group, its q heads, its k head, its v head."""
    hd, ng = args.head_dim, args.kv_heads
    qpg = args.n_heads // ng
    q = sd[f"layers.{i}.attention.wq.{kind}"].view(ng, qpg * hd, -1)
    k = sd[f"layers.{i}.attention.wk.{kind}"].view(ng, hd, -1)
    v = sd[f"layers.{i}.attention.wv.{kind}"].view(ng, hd, -1)
    out = torch.cat([q, k, v], dim=1)
    return out if kind == "weight" else out.squeeze(-1)


def megatron_rank(
    sd: dict,
    args: ModelArgs,
    t: int,
    p: int,
    tp: int,
    pp: int,
    *,
    fused_norms: bool,
    padded: int,
    e: int = 0,
    ep: int = 1,
    grouped: bool = False,
) -> OrderedDict:
    """The 'model' dict of megatron-core's GPTModel on tp rank t, pp rank p (and, for a mixture of
    experts, ep rank e of ep: its E/ep local experts, each SequentialMLP expert's fc1 [gate; up] and
    fc2 split over tp as the dense MLP's)."""
    ngl = args.kv_heads // tp
    per = args.n_layers // pp
    g = torch.Generator().manual_seed(99)

    def padded_rows(w):
        pad = torch.randn(padded - w.shape[0], w.shape[1], generator=g)  # junk a reader must drop
        return torch.cat([w, pad]).chunk(tp)[t].clone()

    out = OrderedDict()
    if p == 0:
        out["embedding.word_embeddings.weight"] = padded_rows(sd["tok_embeddings.weight"])
    for local in range(per):
        i = p * per + local
        L = f"decoder.layers.{local}."
        if fused_norms:
            out[L + "self_attention.linear_qkv.layer_norm_weight"] = sd[f"layers.{i}.attention_norm.weight"].clone()
        else:
            out[L + "input_layernorm.weight"] = sd[f"layers.{i}.attention_norm.weight"].clone()
        out[L + "self_attention.linear_qkv.weight"] = (
            fused_qkv(sd, args, i, "weight")[t * ngl : (t + 1) * ngl].flatten(0, 1).clone()
        )
        if args.qkv_bias:
            out[L + "self_attention.linear_qkv.bias"] = (
                fused_qkv(sd, args, i, "bias")[t * ngl : (t + 1) * ngl].flatten().clone()
            )
        out[L + "self_attention.linear_qkv._extra_state"] = None
        if args.qk_norm:  # megatron-core's qk_layernorm: one per head, replicated over tp
            out[L + "self_attention.q_layernorm.weight"] = sd[f"layers.{i}.attention.q_norm.weight"].clone()
            out[L + "self_attention.k_layernorm.weight"] = sd[f"layers.{i}.attention.k_norm.weight"].clone()
        out[L + "self_attention.linear_proj.weight"] = sd[f"layers.{i}.attention.wo.weight"].chunk(tp, 1)[t].clone()
        out[L + "self_attention.linear_proj._extra_state"] = None
        if fused_norms:
            out[L + "mlp.linear_fc1.layer_norm_weight"] = sd[f"layers.{i}.ffn_norm.weight"].clone()
        else:
            out[L + "pre_mlp_layernorm.weight"] = sd[f"layers.{i}.ffn_norm.weight"].clone()
        if args.is_moe_layer(i):
            out[L + "mlp.router.weight"] = sd[f"layers.{i}.moe.router.gate.weight"].clone()
            per_rank = args.n_experts // ep
            mine = range(e * per_rank, (e + 1) * per_rank)
            if grouped:  # megatron-core's GroupedMLP: weight1/weight2 hold the rank's experts transposed
                fc1 = torch.stack(
                    [
                        torch.cat(
                            [
                                sd[f"layers.{i}.moe.experts.w1"][x].chunk(tp)[t],
                                sd[f"layers.{i}.moe.experts.w3"][x].chunk(tp)[t],
                            ]
                        ).T
                        for x in mine
                    ]
                )
                fc2 = torch.stack([sd[f"layers.{i}.moe.experts.w2"][x].chunk(tp, 1)[t].T for x in mine])
                out[L + "mlp.experts.weight1"] = fc1.contiguous().reshape(args.dim, -1).clone()
                out[L + "mlp.experts.weight2"] = fc2.contiguous().reshape(-1, args.dim).clone()
                continue
            for j in range(per_rank):
                x = e * per_rank + j
                E = f"{L}mlp.experts.local_experts.{j}."
                out[E + "linear_fc1.weight"] = torch.cat(
                    [sd[f"layers.{i}.moe.experts.w1"][x].chunk(tp)[t], sd[f"layers.{i}.moe.experts.w3"][x].chunk(tp)[t]]
                ).clone()
                out[E + "linear_fc2.weight"] = sd[f"layers.{i}.moe.experts.w2"][x].chunk(tp, 1)[t].clone()
            continue
        out[L + "mlp.linear_fc1.weight"] = torch.cat(
            [
                sd[f"layers.{i}.feed_forward.w1.weight"].chunk(tp)[t],
                sd[f"layers.{i}.feed_forward.w3.weight"].chunk(tp)[t],
            ]
        ).clone()
        out[L + "mlp.linear_fc2.weight"] = sd[f"layers.{i}.feed_forward.w2.weight"].chunk(tp, 1)[t].clone()
    if p == pp - 1:
        out["decoder.final_layernorm.weight"] = sd["norm.weight"].clone()
        out["output_layer.weight"] = padded_rows(sd["output.weight"])
    return out


def write_megatron(
    sd: dict,
    args: ModelArgs,
    out: Path,
    *,
    tp: int = 2,
    pp: int = 2,
    fused_norms: bool = True,
    iteration: int = 50,
    with_vocab: bool = True,
    divisible_by: int = 128,
    ep: int = 1,
    grouped: bool = False,
) -> Path:
    """iter_XXXXXXX/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt + latest_checkpointed_iteration.txt, as
    Megatron-LM's get_checkpoint_name names them (the pp rank when pp > 1, the ep rank when ep > 1)."""
    multiple = divisible_by * tp
    padded = -(-args.vocab_size // multiple) * multiple
    ns = megatron_args(
        args, tp=tp, pp=pp, padded=padded, divisible_by=divisible_by, with_vocab=with_vocab, ckpt_format=None, ep=ep
    )
    ns.moe_grouped_gemm = grouped
    it = out / f"iter_{iteration:07d}"
    for t, p, e in ((t, p, e) for t in range(tp) for p in range(pp) for e in range(ep)):
        d = it / (f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else ""))
        d.mkdir(parents=True)
        model = megatron_rank(
            sd, args, t, p, tp, pp, fused_norms=fused_norms, padded=padded, e=e, ep=ep, grouped=grouped
        )
        ckpt = {
            "args": ns,
            "checkpoint_version": 3.0,
            "iteration": iteration,
            "model": model,
            "optimizer": {"optimizer": {"state": {}, "param_groups": [{"lr": 1e-4}]}},
            "opt_param_scheduler": {"num_steps": iteration},
            "rng_state": [
                {
                    "random_rng_state": random.getstate(),
                    "np_rng_state": np.random.get_state(),
                    "torch_rng_state": torch.get_rng_state(),
                    "rng_tracker_states": {},
                }
            ],
            "num_floating_point_operations_so_far": 0,
        }
        torch.save(ckpt, d / "model_optim_rng.pt")
    (out / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return out


def megatron_args(
    args: ModelArgs,
    *,
    tp: int,
    pp: int,
    padded: int,
    divisible_by: int = 128,
    vpp: int | None = None,
    with_vocab: bool = True,
    ckpt_format: str | None = "torch_dist",
    ep: int = 1,
) -> argparse.Namespace:
    """The model part of Megatron-LM's saved ``args`` (``ckpt_format=None``: the legacy layout's, which
    predates that field and virtual pipeline stages)."""
    ns = argparse.Namespace(
        num_layers=args.n_layers,
        hidden_size=args.dim,
        ffn_hidden_size=args.hidden_dim,
        num_attention_heads=args.n_heads,
        group_query_attention=True,
        num_query_groups=args.kv_heads,
        kv_channels=args.head_dim,
        padded_vocab_size=padded,
        make_vocab_size_divisible_by=divisible_by,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        norm_epsilon=args.norm_eps,
        rotary_base=int(args.rope_theta),
        max_position_embeddings=args.max_seq_len,
        seq_length=args.max_seq_len,
        untie_embeddings_and_output_weights=True,
        swiglu=True,
        add_bias_linear=False,
        normalization="RMSNorm",
        position_embedding_type="rope",
        params_dtype=torch.float32,
        bf16=False,
        attention_backend=_megatron_attn_backend().auto,
        transformer_impl="transformer_engine",
        add_qkv_bias=args.qkv_bias,
        qk_layernorm=args.qk_norm,
        num_layers_per_virtual_pipeline_stage=args.n_layers // pp // vpp if vpp else None,
    )
    if args.moe:  # Megatron-LM's MoE arguments (moe_layer_freq as the list --moe-layer-freq parses into)
        ns.num_experts, ns.moe_router_topk, ns.moe_ffn_hidden_size = (
            args.n_experts,
            args.experts_per_token,
            args.expert_dim,
        )
        ns.moe_layer_freq = [int(args.is_moe_layer(i)) for i in range(args.n_layers)]
        ns.moe_router_pre_softmax, ns.moe_aux_loss_coeff = not args.router_norm_topk, args.router_aux_loss_coef
        ns.moe_grouped_gemm, ns.moe_token_dispatcher_type, ns.moe_router_score_function = False, "allgather", "softmax"
        ns.expert_model_parallel_size = ep
    if ckpt_format is not None:
        ns.ckpt_format, ns.virtual_pipeline_model_parallel_size = ckpt_format, vpp
    if with_vocab:
        ns.vocab_size = args.vocab_size
    return ns


def write_megatron_dist(
    sd: dict,
    args: ModelArgs,
    out: Path,
    *,
    tp: int = 2,
    pp: int = 2,
    vpp: int = 2,
    iteration: int = 50,
    divisible_by: int = 128,
    common: dict | None = None,
) -> Path:
    """A Megatron-LM torch_dist checkpoint written to megatron.core.dist_checkpointing's layout.

    ``iter_XXXXXXX/{metadata.json, common.pt, .metadata, __R_0.distcp}`` + the tracker file. The
    .metadata is torch DCP's own Metadata of the chunks each (tp, pp) rank saves: layer tensors
    stacked on a leading global-layer axis (one chunk per layer; virtual stage v of pp rank p holds
    the layers of the v*pp+p-th of pp*vpp equal blocks), QKV rows per query group, fc1 as
    [gate; up] with each tp rank's slice of both, row-parallel weights split on the last axis,
    the padded vocabulary split over tp. Each chunk is one torch.save payload, as DCP's
    FileSystemWriter writes it; _extra_state entries are byte items.
    """
    import io
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    hd, ng, qpg = args.head_dim, args.kv_heads, args.n_heads // args.kv_heads
    L, dim, ffn = args.n_layers, args.dim, args.hidden_dim
    multiple = divisible_by * tp
    padded = -(-args.vocab_size // multiple) * multiple
    g = torch.Generator().manual_seed(99)

    def pad(w):
        return torch.cat([w, torch.randn(padded - w.shape[0], w.shape[1], generator=g)])

    full = {
        "embedding.word_embeddings.weight": pad(sd["tok_embeddings.weight"]),
        "output_layer.weight": pad(sd["output.weight"]),
        "decoder.final_layernorm.weight": sd["norm.weight"],
    }
    stack = {
        "self_attention.linear_qkv.layer_norm_weight": [],
        "self_attention.linear_qkv.weight": [],
        "self_attention.linear_proj.weight": [],
        "mlp.linear_fc1.layer_norm_weight": [],
        "mlp.linear_fc1.weight": [],
        "mlp.linear_fc2.weight": [],
    }
    if args.qkv_bias:
        stack["self_attention.linear_qkv.bias"] = []
    if args.qk_norm:
        stack["self_attention.q_layernorm.weight"], stack["self_attention.k_layernorm.weight"] = [], []
    for i in range(L):
        stack["self_attention.linear_qkv.layer_norm_weight"].append(sd[f"layers.{i}.attention_norm.weight"])
        stack["self_attention.linear_qkv.weight"].append(fused_qkv(sd, args, i, "weight").reshape(-1, dim))
        if args.qkv_bias:
            stack["self_attention.linear_qkv.bias"].append(fused_qkv(sd, args, i, "bias").reshape(-1))
        if args.qk_norm:
            stack["self_attention.q_layernorm.weight"].append(sd[f"layers.{i}.attention.q_norm.weight"])
            stack["self_attention.k_layernorm.weight"].append(sd[f"layers.{i}.attention.k_norm.weight"])
        stack["self_attention.linear_proj.weight"].append(sd[f"layers.{i}.attention.wo.weight"])
        stack["mlp.linear_fc1.layer_norm_weight"].append(sd[f"layers.{i}.ffn_norm.weight"])
        stack["mlp.linear_fc1.weight"].append(
            torch.cat([sd[f"layers.{i}.feed_forward.w1.weight"], sd[f"layers.{i}.feed_forward.w3.weight"]])
        )
        stack["mlp.linear_fc2.weight"].append(sd[f"layers.{i}.feed_forward.w2.weight"])
    for key, ts in stack.items():
        full["decoder.layers." + key] = torch.stack(ts)

    def chunks_of(t: int, p: int):
        """(fqn, offsets, sizes) of the chunks rank (t, p) writes (replicas: tp rank 0 only)."""
        vblocks = pp * (vpp or 1)
        per = L // vblocks
        layers = [i for v in range(vpp or 1) for i in range((v * pp + p) * per, (v * pp + p + 1) * per)]
        if p == 0:
            yield "embedding.word_embeddings.weight", (t * padded // tp, 0), (padded // tp, dim)
        for i in layers:
            if t == 0:
                yield "decoder.layers.self_attention.linear_qkv.layer_norm_weight", (i, 0), (1, dim)
                yield "decoder.layers.mlp.linear_fc1.layer_norm_weight", (i, 0), (1, dim)
                if args.qk_norm:
                    yield "decoder.layers.self_attention.q_layernorm.weight", (i, 0), (1, hd)
                    yield "decoder.layers.self_attention.k_layernorm.weight", (i, 0), (1, hd)
            rows = ng // tp * (qpg + 2) * hd
            yield "decoder.layers.self_attention.linear_qkv.weight", (i, t * rows, 0), (1, rows, dim)
            if args.qkv_bias:
                yield "decoder.layers.self_attention.linear_qkv.bias", (i, t * rows), (1, rows)
            q = args.q_dim
            yield "decoder.layers.self_attention.linear_proj.weight", (i, 0, t * q // tp), (1, dim, q // tp)
            for half in (0, ffn):
                yield "decoder.layers.mlp.linear_fc1.weight", (i, half + t * ffn // tp, 0), (1, ffn // tp, dim)
            yield "decoder.layers.mlp.linear_fc2.weight", (i, 0, t * ffn // tp), (1, dim, ffn // tp)
        if p == pp - 1:
            if t == 0:
                yield "decoder.final_layernorm.weight", (0,), (dim,)
            yield "output_layer.weight", (t * padded // tp, 0), (padded // tp, dim)

    it = out / f"iter_{iteration:07d}"
    it.mkdir(parents=True)
    sdm, storage = {}, {}
    for p in range(pp):
        for t in range(tp):
            rank = p * tp + t
            name = f"__{rank}_0.distcp"
            with open(it / name, "wb") as f:
                extra = f"decoder.layers.self_attention.linear_qkv._extra_state/shard_{rank}_{tp * pp}"
                blob = pickle.dumps(None)
                storage[MetadataIndex(extra)] = _StorageInfo(name, f.tell(), len(blob))
                f.write(blob)
                sdm[extra] = BytesStorageMetadata()
                for fqn, offs, sizes in chunks_of(t, p):
                    x = full[fqn][tuple(slice(o, o + n) for o, n in zip(offs, sizes))].clone()
                    at = f.tell()
                    buf = io.BytesIO()
                    torch.save(x, buf)
                    f.write(buf.getvalue())
                    storage[MetadataIndex(fqn, torch.Size(offs))] = _StorageInfo(name, at, f.tell() - at)
                    m = sdm.setdefault(fqn, TensorStorageMetadata(TensorProperties(dtype=x.dtype), full[fqn].shape, []))
                    m.chunks.append(ChunkStorageMetadata(torch.Size(offs), torch.Size(sizes)))
    with open(it / ".metadata", "wb") as f:
        pickle.dump(Metadata(state_dict_metadata=sdm, storage_data=storage), f)
    ns = megatron_args(args, tp=tp, pp=pp, padded=padded, divisible_by=divisible_by, vpp=vpp)
    torch.save(
        common
        if common is not None
        else {"args": ns, "checkpoint_version": 3.0, "iteration": iteration, "num_floating_point_operations_so_far": 0},
        it / "common.pt",
    )
    (it / "metadata.json").write_text(
        json.dumps(
            {
                "sharded_backend": "torch_dist",
                "sharded_backend_version": 1,
                "common_backend": "torch",
                "common_backend_version": 1,
            }
        )
    )
    (out / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return out


def hash_tree(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (to prove a source was left untouched)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }
