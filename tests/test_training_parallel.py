"""3D-parallel training against a single-process reference: loss/grad parity per layout and
schedule, exact resume, resume under another layout, activation checkpointing, fp16 loss scaling,
and checkpoint manifests that reassemble into the reference state dict.

Two torchrun launches (2 and 8 gloo ranks) each run many flows (tests/train_driver.py).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from titan_pipe.records.checkpoint_format import Manifest
from titan_pipe.records.checkpoint_format import newest_complete
from titan_pipe.config import parse_flow
from titan_pipe.model.args import FLAVOURS
from titan_pipe.model.transformer import build_model
from titan_pipe.training.parallelize import fill_parameters
from titan_pipe.model.weights import CheckpointWeights, open_weights

from training_reference import reference_run, training_loader
from fault_shim import fault_env

pytestmark = pytest.mark.distributed

HERE = Path(__file__).parent
REL = 1e-4

BASE = {
    "device": "cpu",
    "model": {"flavour": "debug"},
    "train": {
        "steps": 8,
        "batch_size": 8,
        "seq_len": 32,
        "warmup_steps": 2,
        "grad_clip": 1.0,
        "seed": 0,
        "optimizer": {"name": "adamw", "lr": 0.002, "weight_decay": 0.1},
    },
    "checkpoint": {"every": 4, "keep_last": 3},
}
SGD = {"name": "sgd", "lr": 0.05, "weight_decay": 0.0}


def flow(parallel: dict, **sections) -> dict:
    f = copy.deepcopy(BASE)
    f["parallel"] = parallel
    for key, value in sections.items():
        if key == "optimizer":
            f["train"]["optimizer"] = value
        else:
            f[key] = value
    return f


WORLD2 = [
    {"name": "tp2", "flow": flow({"tp": 2})},
    {"name": "tp2_sp", "flow": flow({"tp": 2, "sequence_parallel": True})},
    {"name": "pp2_gpipe", "flow": flow({"pp": 2, "pp_schedule": "gpipe", "microbatches": 2})},
    {"name": "pp2_1f1b", "flow": flow({"pp": 2, "pp_schedule": "1f1b", "microbatches": 4})},
    {"name": "pp2_interleaved", "flow": flow({"pp": 2, "pp_schedule": "interleaved_1f1b", "microbatches": 2})},
    {"name": "dp2_fsdp", "flow": flow({"dp": 2, "dp_mode": "fsdp"})},
    {"name": "dp2_ddp", "flow": flow({"dp": 2, "dp_mode": "ddp"})},
    {"name": "dp2_zero2", "flow": flow({"dp": 2}, zero_stage=2)},
    {"name": "dp2_offload", "flow": flow({"dp": 2}, memory={"optimizer_offload": "cpu"})},
    {"name": "dp2_fsdp_no_overlap", "flow": flow({"dp": 2}, comm={"comm_overlap": False})},
    {"name": "dp2_ddp_no_overlap", "flow": flow({"dp": 2, "dp_mode": "ddp"}, comm={"comm_overlap": False})},
    {"name": "dp2_zero1", "flow": flow({"dp": 2, "dp_mode": "ddp"}, zero_stage=1)},
    # ZeRO-1 optimizer shards saved in the common flattened form, resumed without ZeRO.
    {
        "name": "zero1_to_fsdp",
        "flow": flow({"dp": 2, "dp_mode": "fsdp"}),
        "resume": True,
        "copy_from": {"run": "dp2_zero1", "step": 4},
    },
    # Interrupted at step 4 (its checkpoint copied into a fresh run dir), resumed on the same layout.
    {
        "name": "dp2_fsdp_resumed",
        "flow": flow({"dp": 2, "dp_mode": "fsdp"}),
        "resume": True,
        "copy_from": {"run": "dp2_fsdp", "step": 4},
    },
    # The tp2 run's step-4 checkpoint resumed as a pipeline.
    {
        "name": "tp2_to_pp2",
        "flow": flow({"pp": 2, "pp_schedule": "1f1b", "microbatches": 2}),
        "resume": True,
        "copy_from": {"run": "tp2", "step": 4},
    },
    {
        "name": "dp2_fsdp_ac",
        "flow": flow(
            {"dp": 2, "dp_mode": "fsdp"},
            memory={"activation_checkpointing": True, "activation_checkpointing_layers": 1},
        ),
    },
    {"name": "tp2_sgd", "flow": flow({"tp": 2}, optimizer=SGD)},
    {
        "name": "dp2_fp16",
        "flow": flow(
            {"dp": 2, "dp_mode": "ddp"},
            precision={
                "amp": True,
                "amp_dtype": "float16",
                "loss_scale": 2.0**19,
                "loss_scale_window": 2,
                "min_loss_scale": 2.0**10,
            },
        ),
    },
]

WORLD8 = [
    {"name": "dp2_tp2_pp2", "flow": flow({"dp": 2, "tp": 2, "pp": 2, "pp_schedule": "1f1b", "microbatches": 2})},
    # dp_mode ddp with tp > 1: DDP semantics through FSDP2 replicate (classic DDP rejects DTensors).
    {"name": "dp2_tp2_pp2_ddp", "flow": flow({"dp": 2, "tp": 2, "pp": 2, "microbatches": 2, "dp_mode": "ddp"})},
    {
        "name": "to_dp2_pp4",
        "flow": flow({"dp": 2, "pp": 4, "pp_schedule": "gpipe", "microbatches": 4}),
        "resume": True,
        "copy_from": {"run": "dp2_tp2_pp2", "step": 4},
    },
    # The evaluator's path: forward only, a (dp2, tp2, pp2) checkpoint under interleaved + SP.
    {
        "name": "forward_interleaved_sp",
        "forward": {"run": "dp2_tp2_pp2", "step": 8},
        "flow": flow(
            {"dp": 2, "tp": 2, "pp": 2, "pp_schedule": "interleaved_1f1b", "microbatches": 2, "sequence_parallel": True}
        ),
    },
    {
        "name": "init_interleaved_sp",
        "save_init": True,
        "flow": flow(
            {"dp": 2, "tp": 2, "pp": 2, "pp_schedule": "interleaved_1f1b", "microbatches": 2, "sequence_parallel": True}
        ),
    },
]


# The other families in the 3-D layout, 4 steps each: Qwen2's q/k/v biases split with their rows
# and its tied embeddings (the last stage's output a synced copy of the embedding, training/tied.py),
# Qwen3's q/k norms replicated over the split heads (gradients summed over tp), Mistral's window
# shorter than seq_len.
FAMILIES = {
    "qwen2": {"qkv_bias": True, "tie_embeddings": True},
    "qwen3": {"qk_norm": True, "head_dim": 32},
    "mistral": {"sliding_window": 8},
    # Gemma 3's switches: offset norms around both sub-layers (their outputs' norms replicated,
    # sequence-split under SP), GeGLU, scaled and tied embeddings, a global layer in 3 with its own
    # linearly scaled RoPE, the others sliding over 8 positions, query_pre_attn_scalar apart from head_dim
    "gemma3": {
        "norm_offset": True,
        "sandwich_norms": True,
        "embed_scale": True,
        "activation": "gelu_tanh",
        "qk_norm": True,
        "head_dim": 32,
        "sliding_window": 8,
        "global_every": 3,
        "rope_theta": 1e6,
        "rope_local_theta": 1e4,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "attn_scalar": 24.0,
        "tie_embeddings": True,
    },
}
# Tied embeddings resumed under other layouts: copy -> copy (pp2 -> tp2), copy -> one tensor (tp2 -> dp2).
TIED = dict(
    flow({"pp": 2, "microbatches": 2}),
    model={"flavour": "debug", "qkv_bias": True, "tie_embeddings": True},
    train=dict(BASE["train"], steps=4),
    checkpoint={"every": 2, "keep_last": 3},
)
TIED_RUNS = [
    {"name": "tied_pp2", "flow": TIED},
    {"name": "tied_tp2", "flow": dict(TIED, parallel={"tp": 2})},
    # tp 1: the module's own tie, which to_empty would split into two parameters (training/parallelize.py)
    {"name": "tied_dp2", "flow": dict(TIED, parallel={"dp": 2})},
    {
        "name": "tied_pp2_to_tp2",
        "flow": dict(TIED, parallel={"tp": 2}),
        "resume": True,
        "copy_from": {"run": "tied_pp2", "step": 2},
    },
    {
        "name": "tied_tp2_to_dp2",
        "flow": dict(TIED, parallel={"dp": 2}),
        "resume": True,
        "copy_from": {"run": "tied_tp2", "step": 2},
    },
]
# A mixture of experts (Mixtral-shaped, 4 experts top-2, load-balancing loss 0.01) data-parallel:
# FSDP through the fused loss, DDP through the full logits, and the FSDP run resumed under DDP.
MOE = dict(
    flow({"dp": 2}),
    model={"flavour": "debug_moe"},
    train=dict(BASE["train"], steps=6),
    checkpoint={"every": 3, "keep_last": 2},
)
MOE_RUNS = [
    {"name": "moe_dp2_fsdp", "flow": MOE},
    {
        "name": "moe_dp2_ddp_full",
        "flow": dict(MOE, parallel={"dp": 2, "dp_mode": "ddp"}, train=dict(MOE["train"], loss="full")),
    },
    {
        "name": "moe_fsdp_to_ddp",
        "flow": dict(MOE, parallel={"dp": 2, "dp_mode": "ddp"}),
        "resume": True,
        "copy_from": {"run": "moe_dp2_fsdp", "step": 3},
    },
    # expert parallelism: the 4 experts split over ep2 (2 a rank), tokens sent by all-to-all;
    # the dp2 run's checkpoint resumed with the experts split, and the ep2 one's without
    {"name": "moe_dp2_ep2", "flow": dict(MOE, parallel={"dp": 2, "ep": 2})},
    {
        "name": "moe_ep1_to_ep2",
        "flow": dict(MOE, parallel={"dp": 2, "ep": 2}),
        "resume": True,
        "copy_from": {"run": "moe_dp2_fsdp", "step": 3},
    },
    {
        "name": "moe_ep2_to_ddp",
        "flow": dict(MOE, parallel={"dp": 2, "dp_mode": "ddp"}),
        "resume": True,
        "copy_from": {"run": "moe_dp2_ep2", "step": 3},
    },
    # tensor parallelism on the attention, the experts and router whole on each tp rank
    {"name": "moe_tp2", "flow": dict(MOE, parallel={"tp": 2})},
]
# 8 ranks: dp8 with the experts over ep4 (one each, every dp_mod_ep pair sharing them) and over ep2.
MOE_RUNS8 = [
    {"name": "moe_dp8_ep4", "flow": dict(MOE, parallel={"dp": 8, "ep": 4})},
    {"name": "moe_dp8_ep2", "flow": dict(MOE, parallel={"dp": 8, "ep": 2})},
]
# A mixture of experts in a pipeline: each stage passes its routers' statistics on, the last stage
# adds the load-balancing loss of all of them (per microbatch, over every dp rank's rows of it). A
# large coefficient (0.5) so that a router the loss missed would show.
MOE_PP = dict(MOE, model={"flavour": "debug_moe", "router_aux_loss_coef": 0.5})
MOE_PP_LAYOUTS = {
    "moe_dp4_ep2_pp2": {"dp": 4, "ep": 2, "pp": 2, "microbatches": 2},
    "moe_dp4_ep4_pp2_gpipe": {"dp": 4, "ep": 4, "pp": 2, "microbatches": 2, "pp_schedule": "gpipe"},
    "moe_dp4_pp2_interleaved": {"dp": 4, "pp": 2, "microbatches": 2, "pp_schedule": "interleaved_1f1b"},
}
# dp2 x tp2 x pp2: the attention split over tp, the stages carrying the routing statistics
MOE_3D = {"dp": 2, "tp": 2, "pp": 2, "microbatches": 2}
MOE_PP_RUNS = [{"name": n, "flow": dict(MOE_PP, parallel=par)} for n, par in MOE_PP_LAYOUTS.items()] + [
    {"name": "moe_dp2_tp2_pp2", "flow": dict(MOE_PP, parallel=MOE_3D)},
    # the ep2 pipeline's step-3 checkpoint resumed with the experts over ep4 and another schedule
    {
        "name": "moe_pp_ep2_to_ep4",
        "flow": dict(MOE_PP, parallel=MOE_PP_LAYOUTS["moe_dp4_ep4_pp2_gpipe"]),
        "resume": True,
        "copy_from": {"run": "moe_dp4_ep2_pp2", "step": 3},
    },
]
FAMILY_RUNS = [
    {
        "name": f"{fam}_3d",
        "flow": dict(
            flow({"dp": 2, "tp": 2, "pp": 2, "pp_schedule": "1f1b", "microbatches": 2}),
            model={"flavour": "debug", **over},
            train=dict(BASE["train"], steps=4),
        ),
    }
    for fam, over in FAMILIES.items()
]
# Gemma 3 again under sequence parallel and the interleaved schedule (one layer a virtual stage)
FAMILY_RUNS.append(
    {
        "name": "gemma3_3d_sp_interleaved",
        "flow": dict(
            FAMILY_RUNS[-1]["flow"],
            parallel={
                "dp": 2,
                "tp": 2,
                "pp": 2,
                "microbatches": 2,
                "sequence_parallel": True,
                "pp_schedule": "interleaved_1f1b",
            },
        ),
    }
)


def launch(nproc: int, runs: list[dict], workdir: Path) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / "spec.json"
    spec.write_text(json.dumps({"workdir": str(workdir), "runs": runs}))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(HERE / "train_driver.py"),
        str(spec),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads((workdir / "results.json").read_text())


CRASH_FLOW = dict(flow({"tp": 2}), name="crashed", checkpoint={"every": 2, "keep_last": 3}, train=dict(BASE["train"]))
CRASH_FAULT = "4:1:checkpoint"  # TITAN_PIPE_FAULT: rank 1 dies while writing the step-4 checkpoint


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """A tp2 run whose rank 1 dies while writing the step-4 checkpoint (after its shard file)."""
    work = tmp_path_factory.mktemp("world2")
    CRASH_FLOW["runs_dir"] = str(work / "runs")
    (work / "crashed.yaml").write_text(yaml.safe_dump(CRASH_FLOW))
    env = dict(fault_env(CRASH_FAULT), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "titan_pipe.training.rank",
        "--flow",
        str(work / "crashed.yaml"),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=work)
    ckpts = work / "runs" / "crashed" / "checkpoints"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        latest = newest_complete(ckpts, warn=True)
    snapshot = {
        "rc": proc.returncode,
        "latest": latest,
        "warnings": [str(w.message) for w in caught],
        "step4": sorted(str(p.relative_to(ckpts)) for p in (ckpts / "step-000004").rglob("*")),
    }
    return work, snapshot


@pytest.fixture(scope="module")
def world2(crashed):
    work, _ = crashed
    # The crashed run is resumed (same name, same flow without the fault) inside this launch.
    resume = {"name": "crashed", "flow": flow({"tp": 2}, checkpoint={"every": 2, "keep_last": 3}), "resume": True}
    # Continued pretraining from our own tp2 checkpoint, under another layout.
    init = {
        "name": "init_from_tp2",
        "flow": dict(
            flow({"pp": 2, "microbatches": 2}),
            init_from=str(work / "runs" / "tp2" / "checkpoints" / "step-000008"),
            train=dict(BASE["train"], steps=2),
        ),
    }
    return work, launch(2, WORLD2 + [resume, init] + TIED_RUNS + MOE_RUNS, work)


def sft_flow(work: Path, parallel: dict) -> dict:
    """Fine-tuning a Qwen3-shaped model saved by transformers (with its tokenizer and chat template)
    on chat records: whole conversations packed into windows of 192, the loss on the answers."""
    return {
        "device": "cpu",
        "model": FAMILY_RUNS[1]["flow"]["model"],
        "init_from": str(work / "hf_qwen3_chat"),
        "data": {
            "path": str(work / "chat" / "chat.jsonl"),
            "tokenizer": str(work / "hf_qwen3_chat"),
            "format": "chat",
            "val_fraction": 0.1,
        },
        "train": {
            "mode": "sft",
            "steps": 4,
            "batch_size": 8,
            "seq_len": 192,
            "seed": 0,
            "grad_clip": 1.0,
            "optimizer": {"lr": 0.001},
        },
        "parallel": parallel,
        "checkpoint": {"every": 4, "keep_last": 1},
    }


SFT_LAYOUTS = {
    "sft_dp2_tp2_pp2": {"dp": 2, "tp": 2, "pp": 2, "microbatches": 2},
    "sft_dp2_tp2_sp_pp2_interleaved": {
        "dp": 2,
        "tp": 2,
        "pp": 2,
        "microbatches": 2,
        "sequence_parallel": True,
        "pp_schedule": "interleaved_1f1b",
    },
    "sft_dp8": {"dp": 8},
}  # the fused loss (no tp, no pp) with its denominator


LORA_LAYOUTS = {
    "lora_dp2_tp2_pp2": {"dp": 2, "tp": 2, "pp": 2, "microbatches": 2},
    "lora_dp2_tp2_sp_pp2_interleaved": {
        "dp": 2,
        "tp": 2,
        "pp": 2,
        "microbatches": 2,
        "sequence_parallel": True,
        "pp_schedule": "interleaved_1f1b",
    },
}


def lora_flow(work: Path, parallel: dict) -> dict:
    """LoRA rank 4 on every attention and MLP linear of the Qwen3-shaped dir, 4 steps."""
    return {
        "device": "cpu",
        "init_from": str(work / "hf_qwen3"),
        "parallel": parallel,
        "train": dict(
            BASE["train"],
            steps=4,
            lora={"rank": 4, "alpha": 8, "targets": ["q", "k", "v", "o", "gate", "up", "down"]},
            optimizer={"name": "adamw", "lr": 0.01, "weight_decay": 0.1},
        ),
        "checkpoint": {"every": 4, "keep_last": 1},
    }


@pytest.fixture(scope="module")
def world8(tmp_path_factory):
    """One 8-rank launch: the Llama layouts, the other families' parity runs, a Hugging Face Qwen3
    dir (written by transformers) as init_from placed into dp2 x tp2 x pp2, and that dir with a chat
    tokenizer fine-tuned on chat records in three layouts."""
    import shutil

    from chat_fixtures import chat_records, train_tokenizer, write_jsonl
    from convert_writers import native_state, write_hf

    work = tmp_path_factory.mktemp("world8")
    qwen3 = parse_flow(FAMILY_RUNS[1]["flow"], base=work).model.args()
    write_hf(native_state(qwen3, seed=5), qwen3, work / "hf_qwen3")
    shutil.copytree(work / "hf_qwen3", work / "hf_qwen3_chat")
    train_tokenizer(work / "hf_qwen3_chat")
    write_jsonl(work / "chat" / "chat.jsonl", chat_records(80))
    init = {
        "name": "init_from_hf_qwen3",
        "flow": dict(FAMILY_RUNS[1]["flow"], init_from=str(work / "hf_qwen3"), train=dict(BASE["train"], steps=1)),
    }
    sft = [{"name": name, "flow": sft_flow(work, par)} for name, par in SFT_LAYOUTS.items()]
    # LoRA on the transformers-saved Qwen3 (q/k norms, decoupled head_dim): adapters beside split heads
    lora = [{"name": name, "flow": lora_flow(work, par), "check_base": True} for name, par in LORA_LAYOUTS.items()]
    return work, launch(8, WORLD8 + FAMILY_RUNS + [init] + MOE_RUNS8 + MOE_PP_RUNS + sft + lora, work)


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    base = tmp_path_factory.mktemp("ref")
    return {"adamw": reference_run(flow({}), base=base), "sgd": reference_run(flow({}, optimizer=SGD), base=base)}


def losses(results, name):
    return [r["loss"] for r in results[name]["metrics"]]


def assert_close(got, want, rel=REL, what="loss"):
    assert len(got) == len(want), (got, want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= rel * abs(w), (
            f"{what} at step {i + 1}: {g} vs reference {w} (rel {abs(g - w) / abs(w):.2e})"
        )


@pytest.mark.parametrize(
    "name",
    [
        "tp2",
        "tp2_sp",
        "pp2_gpipe",
        "pp2_1f1b",
        "pp2_interleaved",
        "dp2_fsdp",
        "dp2_ddp",
        "dp2_zero2",
        "dp2_zero1",
        "dp2_offload",
        "dp2_fsdp_no_overlap",
        "dp2_ddp_no_overlap",
    ],
)
def test_world2_layouts_match_single_process(world2, ref, name):
    _, res = world2
    assert_close(losses(res, name), ref["adamw"]["losses"])
    assert_close([r["grad_norm"] for r in res[name]["metrics"]], ref["adamw"]["grad_norms"], what="grad norm")


@pytest.mark.parametrize("name", ["dp2_tp2_pp2", "dp2_tp2_pp2_ddp"])
def test_3d_layouts_match_single_process(world8, ref, name):
    _, res = world8
    assert_close(losses(res, name), ref["adamw"]["losses"])
    assert_close([r["grad_norm"] for r in res[name]["metrics"]], ref["adamw"]["grad_norms"], what="grad norm")


@pytest.mark.parametrize("run", FAMILY_RUNS, ids=lambda r: r["name"])
def test_3d_families_match_single_process(world8, run, tmp_path):
    _, res = world8
    ref = reference_run(run["flow"], base=tmp_path)
    assert_close(losses(res, run["name"]), ref["losses"])
    assert_close([r["grad_norm"] for r in res[run["name"]]["metrics"]], ref["grad_norms"], what="grad norm")


def test_tied_embeddings_under_tp_and_pp_resume_across_layouts(world2, world8, tmp_path):
    """Tied embeddings trained as one matrix whatever the layout: the checkpoint holds the embedding
    alone, and resuming pp2 -> tp2 (output copy to copy) or tp2 -> dp2 (copy to the module's own
    tie) continues the single-process curve; dp2 from scratch keeps the module's tie through to_empty."""
    work, res = world2
    ref = reference_run(TIED, base=tmp_path)
    for name in ("tied_pp2", "tied_tp2", "tied_dp2"):
        assert_close(losses(res, name), ref["losses"])
        assert_close([r["grad_norm"] for r in res[name]["metrics"]], ref["grad_norms"], what="grad norm")
    for name in ("tied_pp2_to_tp2", "tied_tp2_to_dp2"):
        assert [r["step"] for r in res[name]["metrics"]] == [3, 4]
        assert_close(losses(res, name), ref["losses"][2:])
    for run in ("tied_pp2", "tied_tp2"):
        assert "output.weight" not in Manifest.load(work / "runs" / run / "checkpoints" / "step-000004").params
    m = Manifest.load(world8[0] / "runs" / "qwen2_3d" / "checkpoints" / "step-000004")
    assert "output.weight" not in m.params and m.params["layers.0.attention.wq.bias"].tp_dim == 0


def test_init_from_a_hugging_face_qwen3_dir_under_dp_tp_pp(world8):
    """transformers' save_pretrained of a Qwen3 model, read as init_from and placed into
    dp2 x tp2 x pp2: the first loss is that of those weights in one process."""
    from convert_writers import native_state

    work, res = world8
    args = parse_flow(FAMILY_RUNS[1]["flow"], base=work).model.args()
    model = build_model(args, seed=None)
    model.load_state_dict(native_state(args, seed=5))
    cfg = parse_flow(FAMILY_RUNS[1]["flow"], base=work)
    x, y = training_loader(cfg, base=work, prepared=work / "ref-data-qwen3").next_batch()
    with torch.no_grad():
        want = float(torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()))
    got = res["init_from_hf_qwen3"]["metrics"][0]["loss"]
    assert abs(got - want) <= 1e-5 * want


@pytest.mark.parametrize("name", list(LORA_LAYOUTS))
def test_lora_in_3d_matches_the_hand_written_reference(world8, name):
    """LoRA under dp2 x tp2 x pp2 (1f1b; interleaved with sequence parallel): every step's loss and
    gradient norm equal one process looping over W + (alpha/r) B A; the base is bit-identical after."""
    from training_reference import lora_reference_run

    work, res = world8
    ref = lora_reference_run(lora_flow(work, {}), base=work)
    got = res[name]["metrics"]
    assert len(got) == 4
    for r, loss, norm in zip(got, ref["losses"], ref["grad_norms"]):
        assert abs(r["loss"] - loss) <= REL * loss and abs(r["grad_norm"] - norm) <= 1e-3 * norm, (r, loss, norm)
    ranks = json.loads((work / f"{name}.base.json").read_text())
    assert all(r["differing"] == [] and r["state_entries"] == r["adapters"] for r in ranks)


def test_fine_tuning_matches_each_conversation_run_alone(world8, tmp_path):
    """train.mode sft in dp2 x tp2 x pp2 (1f1b; interleaved with sequence parallel) and dp8: the loss
    at every step is the single-process loss of every conversation run on its own, no packing (so no
    document can see another), summed over the answer tokens and divided by their count in the global
    batch. Training on every token instead gives other losses: the mask matters."""
    from convert_writers import native_state
    from training_reference import sft_reference_run

    work, res = world8
    flow = sft_flow(work, {})
    args = parse_flow(flow, base=work).model.args()
    want = sft_reference_run(flow, base=tmp_path, state=native_state(args, seed=5))["losses"]
    unmasked = sft_reference_run(flow, base=tmp_path, state=native_state(args, seed=5), masked=False)["losses"]
    for name in SFT_LAYOUTS:
        got = [r["loss"] for r in res[name]["metrics"]]
        assert_close(got, want, what=name)
        for g, u in zip(got, unmasked):
            assert abs(g - u) > 10 * REL * abs(u), f"{name}: {g} is the unmasked loss {u}"


@pytest.fixture(scope="module")
def moe_ref(tmp_path_factory):
    return reference_run(MOE, base=tmp_path_factory.mktemp("moe_ref"))


@pytest.mark.parametrize("name", ["moe_dp2_fsdp", "moe_dp2_ddp_full", "moe_dp2_ep2", "moe_tp2"])
def test_moe_data_and_expert_parallel_match_single_process(world2, moe_ref, name):
    """The load-balancing loss of the whole batch (the ranks' routing statistics summed), so dp2
    follows the single-process curve with the same loss (cross entropy + 0.01 x balance); with the
    experts split over ep2 too (tokens to their experts' ranks and back, the experts' gradient over
    the ep group's tokens); and under tp2 (the attention split, every expert run on each tp rank)."""
    _, res = world2
    assert_close(losses(res, name), moe_ref["losses"])
    assert_close([r["grad_norm"] for r in res[name]["metrics"]], moe_ref["grad_norms"], what="grad norm")


@pytest.mark.parametrize("name", ["moe_dp8_ep4", "moe_dp8_ep2"])
def test_moe_expert_parallel_on_8_ranks_matches_single_process(world8, moe_ref, name):
    _, res = world8
    assert_close(losses(res, name), moe_ref["losses"])
    assert_close([r["grad_norm"] for r in res[name]["metrics"]], moe_ref["grad_norms"], what="grad norm")


def test_moe_pipeline_matches_single_process(world8, tmp_path):
    """dp4 x pp2 with the experts over ep2 (1f1b) and ep4 (gpipe), and interleaved 1F1B without ep:
    every step's loss and grad norm equal one process whose load-balancing loss is per microbatch
    over the dp ranks' rows of it, as the pipeline computes it; the ep2 run's checkpoint resumes with
    the experts over ep4 on the same curve. (That every stage's routers get the loss's gradient is
    test_moe's stage-by-stage test.)"""
    from training_reference import reference_run

    _, res = world8
    ref = reference_run(dict(MOE_PP, parallel={"dp": 4}), base=tmp_path, microbatches=2)
    for name in MOE_PP_LAYOUTS:
        assert_close(losses(res, name), ref["losses"], what=name)
        assert_close([r["grad_norm"] for r in res[name]["metrics"]], ref["grad_norms"], what=f"{name} grad norm")
    assert [r["step"] for r in res["moe_pp_ep2_to_ep4"]["metrics"]] == [4, 5, 6]
    assert_close(losses(res, "moe_pp_ep2_to_ep4"), ref["losses"][3:])
    ref3d = reference_run(dict(MOE_PP, parallel=MOE_3D), base=tmp_path / "3d", microbatches=2)
    assert_close(losses(res, "moe_dp2_tp2_pp2"), ref3d["losses"], what="moe_dp2_tp2_pp2")
    assert_close(
        [r["grad_norm"] for r in res["moe_dp2_tp2_pp2"]["metrics"]],
        ref3d["grad_norms"],
        what="moe_dp2_tp2_pp2 grad norm",
    )


@pytest.mark.parametrize("name", ["moe_fsdp_to_ddp", "moe_ep1_to_ep2", "moe_ep2_to_ddp"])
def test_moe_checkpoint_resumes_under_another_layout(world2, moe_ref, name):
    """Checkpoints hold the experts as boxes of their stacks whatever the layout: a dp2 run resumes
    with them split over ep2, an ep2 run's (two files of experts) under DDP, on the same curve."""
    _, res = world2
    assert [r["step"] for r in res[name]["metrics"]] == [4, 5, 6]
    assert_close(losses(res, name), moe_ref["losses"][3:])


def test_moe_expert_parallel_checkpoint_records_the_experts_placement(world2):
    work, _ = world2
    m = Manifest.load(work / "runs" / "moe_dp2_ep2" / "checkpoints" / "step-000006")
    assert m.parallel.ep == 2
    chunks = m.params["layers.0.moe.experts.w1"].chunks
    assert sorted((c.file, c.box.offsets[0], c.box.lengths[0]) for c in chunks) == [
        ("model/pp0-tp0-ep0.safetensors", 0, 2),
        ("model/pp0-tp0-ep1.safetensors", 2, 2),
    ]


def test_resume_continues_bit_for_bit(world2):
    _, res = world2
    full, resumed = losses(res, "dp2_fsdp"), losses(res, "dp2_fsdp_resumed")
    assert [r["step"] for r in res["dp2_fsdp_resumed"]["metrics"]] == [5, 6, 7, 8]
    assert resumed == full[4:]


def test_resume_under_another_layout(world2, world8, ref):
    _, r2 = world2
    _, r8 = world8
    assert [r["step"] for r in r2["tp2_to_pp2"]["metrics"]] == [5, 6, 7, 8]
    assert_close(losses(r2, "tp2_to_pp2"), ref["adamw"]["losses"][4:])
    assert_close(losses(r8, "to_dp2_pp4"), ref["adamw"]["losses"][4:])


def test_zero1_checkpoint_resumes_under_fsdp(world2):
    _, res = world2
    assert_close(losses(res, "zero1_to_fsdp"), losses(res, "dp2_zero1")[4:], rel=1e-6)


def test_activation_checkpointing_changes_nothing(world2):
    _, res = world2
    assert_close(losses(res, "dp2_fsdp_ac"), losses(res, "dp2_fsdp"), rel=1e-6)


def test_sgd_parameters_match_single_process(world2, ref):
    work, res = world2
    assert_close(losses(res, "tp2_sgd"), ref["sgd"]["losses"])
    weights = CheckpointWeights(work / "runs" / "tp2_sgd" / "checkpoints" / "step-000008")
    for name, want in ref["sgd"]["state"].items():
        got = weights.full(name)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_fp16_dynamic_loss_scaling_end_to_end(world2):
    _, res = world2
    recs = res["dp2_fp16"]["metrics"]
    scale, good = 2.0**19, 0
    for r in recs:
        # What the scaler must have done, replayed from the skipped flags.
        if r["skipped"]:
            scale, good = max(scale / 2, 2.0**10), 0
            assert r["grad_norm"] is None
        else:
            good += 1
            if good == 2:
                scale, good = scale * 2, 0
        assert r["loss_scale"] == scale, recs
    assert recs[0]["skipped"], "a 2^19 fp16 loss scale must overflow on the first step"
    assert not all(r["skipped"] for r in recs)
    assert all(r["loss_scale"] >= 2.0**10 for r in recs)
    assert recs[-1]["loss"] < recs[0]["loss"]


def test_manifest_covers_every_parameter_once(world8):
    work, _ = world8
    step = work / "runs" / "dp2_tp2_pp2" / "checkpoints" / "step-000008"
    m = Manifest.load(step)
    m.validate()
    model = build_model(FLAVOURS["debug"], seed=None, device="meta")
    assert set(m.params) == {n for n, _ in model.named_parameters()}
    assert sorted(m.files) == sorted(f"model/pp{s}-tp{t}.safetensors" for s in range(2) for t in range(2))
    import hashlib

    for rel, info in m.files.items():
        data = (step / rel).read_bytes()
        assert len(data) == info.size and hashlib.sha256(data).hexdigest() == info.sha256
    wq = m.params["layers.0.attention.wq.weight"]
    assert wq.tp_dim == 0 and wq.stage == 0 and [c.box.offsets for c in wq.chunks] == [(0, 0), (32, 0)]
    wo = m.params["layers.3.attention.wo.weight"]
    assert wo.tp_dim == 1 and wo.stage == 1 and sorted(c.box.offsets for c in wo.chunks) == [(0, 0), (0, 32)]
    assert m.params["norm.weight"].tp_dim is None and len(m.params["norm.weight"].chunks) == 2
    assert m.parallel.dp == 2 and m.parallel.stages == ((0, 1), (2, 3))
    # Pruned to keep_last=3: steps 4 and 8 remain (only two were written).
    assert sorted(p.name for p in step.parent.iterdir()) == ["step-000004", "step-000008"]


def test_sharded_init_reassembles_exactly(world8):
    """(dp2, tp2, pp2) interleaved + sequence parallel, layout-independent init: the shards put
    back together by the manifest are bit-identical to the single-process model."""
    work, _ = world8
    step = work / "runs" / "init_interleaved_sp" / "checkpoints" / "step-000000"
    m = Manifest.load(step)
    assert len(m.files) == 8  # 4 virtual stages x 2 tp ranks
    weights = CheckpointWeights(step)
    want = build_model(FLAVOURS["debug"], seed=0).state_dict()
    assert set(weights.names()) == set(want)
    for name, tensor in want.items():
        assert torch.equal(weights.full(name), tensor), name


def test_killed_rank_fails_the_run_and_leaves_no_manifest(crashed):
    _, snap = crashed
    assert snap["rc"] != 0
    # Rank 1 had written its shard of step 4 when it died; the step never got a manifest.
    assert "step-000004/model/pp0-tp1.safetensors" in snap["step4"]
    assert "step-000004/manifest.json" not in snap["step4"]
    assert snap["latest"].name == "step-000002"
    assert any("step-000004" in w and "ignoring" in w for w in snap["warnings"])


def test_crashed_run_resumes_to_the_uninterrupted_curve(world2):
    work, res = world2
    recs = res["crashed"]["metrics"]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 3, 4, 5, 6, 7, 8]
    assert [r["loss"] for r in recs[4:]] == losses(res, "tp2")[2:]
    # The partial step-4 dir was replaced by a complete one on the way.
    assert (work / "runs" / "crashed" / "checkpoints" / "step-000004" / "manifest.json").is_file()


def test_init_from_our_checkpoint_under_another_layout(world2):
    work, res = world2
    weights = open_weights(work / "runs" / "tp2")  # a run dir means its newest complete step
    assert isinstance(weights, CheckpointWeights) and weights.dir.name == "step-000008"
    model = build_model(weights.args, seed=None, device="meta")
    fill_parameters(model, weights.args, device=torch.device("cpu"), seed=0, weights=weights)
    cfg = parse_flow(flow({}), base=work)
    x, y = training_loader(cfg, base=work, prepared=work / "ref-data").next_batch()
    with torch.no_grad():
        want = float(torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()))
    got = res["init_from_tp2"]["metrics"][0]["loss"]
    assert abs(got - want) <= 1e-5 * want
    assert got < losses(res, "tp2")[0] - 1.0  # it really started from trained weights


def test_forward_logits_of_a_sharded_checkpoint(world8):
    work, _ = world8
    from safetensors.torch import load_file

    got = load_file(str(work / "forward_interleaved_sp.safetensors"))
    weights = CheckpointWeights(work / "runs" / "dp2_tp2_pp2" / "checkpoints" / "step-000008")
    model = build_model(weights.args, seed=None, device="meta")
    fill_parameters(model, weights.args, device=torch.device("cpu"), seed=0, weights=weights)
    with torch.no_grad():
        want = model(got["tokens"])
    torch.testing.assert_close(got["logits"], want, rtol=0, atol=1e-5)
