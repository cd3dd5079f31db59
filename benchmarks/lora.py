"""Peak memory of a LoRA fine-tune against a full fine-tune of the same model and layout, measured in
the same run, with the planner's prediction for each beside it.

    python benchmarks/lora.py [--steps 6] [--rank 16] [--out DIR]

A 38M-parameter Llama (dim 512, 8 layers, vocab 8192) saved by transformers is the base; the real
trainer (titan_pipe.training.trainer on a one-rank gloo group, dp = tp = pp = 1, float32, AdamW)
fine-tunes it from init_from twice, each in its own subprocess: every weight, then LoRA of --rank on
every attention and MLP linear. A worker's memory is its peak RSS over its RSS just before the model
is built (the interpreter, torch and the data are the same in both; glibc's mmap threshold fixed at
128 KiB so freed buffers leave RSS); the planner's figure is
training/planner/memory.py's total for that layout (parameters, gradients, optimizer states,
activations). Figures print as ratios; a JSON goes to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = {
    "dim": 512,
    "n_layers": 8,
    "n_heads": 8,
    "n_kv_heads": 4,
    "ffn_hidden_dim": 1408,
    "vocab_size": 8192,
    "max_seq_len": 256,
}
BATCH, SEQ = 4, 128


def current_rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def write_base(root: Path) -> Path:
    """The base model, saved by transformers (float32)."""
    import torch
    import transformers

    from titan_pipe.model.args import resolve_args
    from titan_pipe.model.hf_config import to_hf_config

    args = resolve_args("debug", **MODEL)
    cfg = {k: v for k, v in to_hf_config(args).items() if k not in ("architectures", "torch_dtype")}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    model.save_pretrained(root / "base")
    return root / "base"


def flow(base: Path, steps: int, rank: int | None) -> dict:
    f = {
        "device": "cpu",
        "name": f"bench-{'lora' if rank else 'full'}",
        "init_from": str(base),
        "train": {
            "steps": steps,
            "batch_size": BATCH,
            "seq_len": SEQ,
            "warmup_steps": 1,
            "seed": 0,
            "optimizer": {"name": "adamw", "lr": 2e-4, "weight_decay": 0.0},
        },
        "checkpoint": {"every": 10**6, "keep_last": 1, "save_optimizer": False},
    }
    if rank:
        f["train"]["lora"] = {"rank": rank, "alpha": 2 * rank, "targets": ["q", "k", "v", "o", "gate", "up", "down"]}
    return f


def worker(base: str, steps: int, rank: int) -> dict:
    """One training in this process; its peak RSS over the RSS before the model is built."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29400 + os.getpid() % 500), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    import torch.distributed as dist

    from titan_pipe.config import parse_flow
    from titan_pipe.training import trainer as train_mod

    work = Path(tempfile.mkdtemp(prefix="titan-bench-lora-"))
    os.chdir(work)
    cfg = parse_flow(flow(Path(base), steps, rank or None), base=work)
    seen = {}
    orig = train_mod.build_parallel_model

    def build(*a, **k):
        seen["before"] = current_rss_mb()
        return orig(*a, **k)

    train_mod.build_parallel_model = build
    train_mod.train(cfg, base=work)
    records = [json.loads(line) for line in (work / "runs" / cfg.name / "metrics.jsonl").read_text().splitlines()]
    dist.destroy_process_group()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "peak_rss_mb": peak,
        "before_model_mb": seen["before"],
        "training_mb": peak - seen["before"],
        "losses": [r["loss"] for r in records],
        "step_s": sorted(r["step_time_s"] for r in records)[len(records) // 2],
    }


def predicted(rank: int | None) -> dict:
    from titan_pipe.model.args import count_params, resolve_args
    from titan_pipe.model.lora import LoRASpec
    from titan_pipe.training.planner.memory import memory_per_device
    from titan_pipe.training.planner.workload import Layout, Workload

    args = resolve_args("debug", **MODEL)
    lora = LoRASpec(rank, 2.0 * rank, ("q", "k", "v", "o", "gate", "up", "down")) if rank else None
    m = memory_per_device(Workload(args, SEQ, BATCH, lora=lora), Layout(1, 1, 1, zero=0, amp_dtype=None))
    return {
        "total_mb": m.total / 2**20,
        "items_mb": {k: v / 2**20 for k, v in m.items().items()},
        "params": count_params(args),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker[0], int(a.worker[1]), int(a.worker[2]))))
        return
    root = Path(tempfile.mkdtemp(prefix="titan-bench-lora-base-"))
    base = write_base(root)
    # glibc's dynamic mmap threshold keeps freed activation buffers in the heap (RSS) after the first step;
    # a fixed threshold returns them, so RSS follows live memory, what the planner models, in both workers
    env = dict(
        os.environ,
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"),
        PYTHONWARNINGS="ignore",
        MALLOC_MMAP_THRESHOLD_=os.environ.get("MALLOC_MMAP_THRESHOLD_", "131072"),
    )
    res = {}
    for name, rank in (("full", 0), ("lora", a.rank)):
        out = subprocess.run(
            [sys.executable, __file__, "--worker", str(base), str(a.steps), str(rank)],
            capture_output=True,
            text=True,
            env=env,
            timeout=1800,
        )
        if out.returncode != 0:
            raise SystemExit(f"{name} failed:\n{out.stderr[-4000:]}")
        res[name] = json.loads(out.stdout.strip().splitlines()[-1])
        res[name]["predicted"] = predicted(rank or None)
    full, lora = res["full"], res["lora"]
    n = full["predicted"]["params"]
    print(f"model: {n / 1e6:.1f}M parameters, batch {BATCH} x {SEQ}, float32, AdamW, dp=tp=pp=1; LoRA rank {a.rank}")
    for name in ("full", "lora"):
        r = res[name]
        print(
            f"  {name:5s}: measured {r['training_mb']:7.1f} MB over the pre-model RSS (peak {r['peak_rss_mb']:.0f} MB), "
            f"planner {r['predicted']['total_mb']:7.1f} MB; median step {r['step_s']:.3f} s; "
            f"loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}"
        )
    measured = lora["training_mb"] / full["training_mb"]
    planned = lora["predicted"]["total_mb"] / full["predicted"]["total_mb"]
    print(
        f"LoRA / full: measured {measured:.3f}x, planner {planned:.3f}x; step time {lora['step_s'] / full['step_s']:.2f}x"
    )
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "lora.json").write_text(
        json.dumps({"results": res, "measured_ratio": measured, "planned_ratio": planned}, indent=1)
    )


if __name__ == "__main__":
    main()
