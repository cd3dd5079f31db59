"""One call on a lent accelerator: the trainer against a bare PyTorch loop and against torchtitan's own
Trainer, eager, compiled and in float8, and evaluate there.

On one CUDA GPU, with a ~1.5 B llama3-style model (Llama-3.2-1B's shape: dim 2048, 16 layers, 32/8
heads, FFN 8192, vocab 128256, untied embeddings as torchtitan 0.2.2's llama3 has them, Llama-3.1
RoPE scaling) in bf16 autocast over fp32 master weights, AdamW, clipping, batch 8 x 2048 tokens:
  loop              a bare PyTorch loop: the same model, batch, sequence, loader, optimizer and
                    schedule, nothing else (the baseline the trainer's own cost is taken against)
  trainer           titan_pipe.training.trainer.train at dp=tp=pp=1 (one-rank process group)
  trainer_compiled  the same with train.compile: true (inductor on cuda)
  trainer_float8    compiled, with precision.float8: tensorwise (torchao; compute capability 9.0+)
  trainer_compiled_other_loss
                    compiled, with the loss form train.loss: auto did not pick (chunked vs full): the
                    ratios then say which is faster at equal losses (``faster_loss``, what the
                    device's profile records for auto to follow)
  kernels           first: the training kernels against the reference ones on the device, forward
                    and gradient (RMSNorm, RoPE, GQA attention with and without a window, packed
                    documents through flex attention, the experts' grouped GEMM against the loop)
  torchtitan        the peer: torchtitan 0.2.2's own Trainer on the same shape, eager and compiled
                    (the harness in shared/peers/torchtitan, --peer DIR), in the same call
each for --steps steps; tokens/s and MFU from the steady steps (after two warm-up steps and any
step that compiled); then the trainer's last checkpoint goes through convert, export (float32
graphs) and evaluate with the PyTorch reference on the device (--device cuda) against ONNX Runtime.
Writes OUT/device_check.json after every phase (each phase's figures and seconds, or its error), so
a call cut short keeps what finished; ``complete`` turns true at the end, with the ratios. A phase
that fails is recorded and the next one still runs. The exit code is 1 when a phase failed, a
kernel is out of bound, evaluate did not PASS, or a requested phase could not run (on the device
torchtitan and float8 are requested: a missing harness or torchao fails the call, its reason in
the JSON; --require/--only choose others). PHASE_BUDGET_S is the plan for an H200: 450 s in all.

--dry-run does the same on the CPU with the debug model (GQA, scaled RoPE, so every path the real
run takes is taken) in seconds, compiling with aot_eager; the float8 phase records the one line that
refuses it off Hopper and the peer phase is skipped with a line saying so (its harness installs
wheels for the GPU machine); tests/test_device_check.py runs it so the script cannot rot. docs/training.md says how to run it with the device tool and what to
carry there. Budget on an H200: well inside 8 minutes (model build, 3 x 12 steps, one inductor
compile, ~15 GB of checkpoint, unified model and ONNX data written and read).

    python benchmarks/device_check.py [--dry-run] [--out DIR] [--steps N] [--peer DIR] [--only P,..] [--require P,..]
"""

from __future__ import annotations

import argparse
from titan_pipe.config import ExportConfig
import gc
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

# Llama-3.2-1B's dims (the real run) and the debug flavour with the same features (the dry run).
LLAMA3_1B = {
    "flavour": "llama3_8b",
    "dim": 2048,
    "n_layers": 16,
    "n_heads": 32,
    "n_kv_heads": 8,
    "ffn_hidden_dim": 8192,
    "tie_embeddings": False,
    "max_seq_len": 2048,
    "rope_scaling": {
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}
DEBUG_LIKE = {
    "flavour": "debug",
    "n_kv_heads": 2,
    "tie_embeddings": False,
    "max_seq_len": 64,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
}
SPECS = {
    "device": {"device": "cuda", "model": LLAMA3_1B, "batch": 8, "seq": 2048, "steps": 12, "backend": "auto"},
    "dry-run": {"device": "cpu", "model": DEBUG_LIKE, "batch": 2, "seq": 32, "steps": 3, "backend": "aot_eager"},
}
WARMUP = 2  # steps left out of the figures (allocator, kernel selection, the first compile)
# The phase budget on an H200 (seconds; a plan, not yet a measurement): 450 in all, inside the
# 8-minute call. A phase over its budget is marked in the JSON; a phase that would start with less
# than its budget left before --deadline is skipped with that reason (a requested one fails the call).
PHASE_BUDGET_S = {
    "kernels": 15,
    "loop": 25,
    "trainer": 30,
    "trainer_compiled": 70,
    "trainer_float8": 70,
    "torchtitan": 120,
    "trainer_compiled_other_loss": 60,
    "deploy": 60,
}
LOSS_FORM_BOUND = 0.01  # chunked vs full loss: each step's loss within 1 % (bf16 autocast, same data and seed)
FLOAT8_LOSS_BOUND = 0.05  # float8's loss at each step within 5 % of bf16's (same data, seed and steps)


def flow_dict(spec: dict, name: str, work: Path, *, compile: bool, float8: str = "none", loss: str = "auto") -> dict:
    train = {
        "steps": spec["steps"],
        "batch_size": spec["batch"],
        "seq_len": spec["seq"],
        "warmup_steps": 2,
        "grad_clip": 1.0,
        "seed": 0,
        "optimizer": {"name": "adamw", "lr": 3e-4},
        "loss": loss,
    }
    if compile:
        train.update(compile=True, compile_backend=spec["backend"])
    return {
        "name": name,
        "runs_dir": str(work / "runs"),
        "device": spec["device"],
        "model": spec["model"],
        "train": train,
        "precision": {"amp": True, "amp_dtype": "bfloat16", "float8": float8},
        "checkpoint": {"every": 10**6, "keep_last": 1, "save_optimizer": False},
    }


def init_group(device: str) -> None:
    """A one-rank process group, as torchrun would set it up (the trainer then finds it initialised)."""
    import torch.distributed as dist

    with socket.socket() as s:  # a free port: other jobs on the machine may hold the usual ones
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo" if device == "cpu" else f"cpu:gloo,{device}:nccl")


def release(device: str) -> None:
    """Free what the last phase held, so each phase's peak memory is its own."""
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def steady(records: list[dict], tokens_per_step: int) -> dict:
    """Figures of the steady steps: not the warm-up ones, nor any step that compiled."""
    timed = [r for r in records[WARMUP:] if not r.get("compile_s")] or records[-1:]
    step_s = statistics.median(r["step_time_s"] for r in timed)
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    return {
        "steps_timed": len(timed),
        "step_s": step_s,
        "tokens_per_s": tokens_per_step / step_s,
        "mfu": statistics.median(mfus) if mfus else None,
        "peak_mem_gb": max(r["peak_mem_mb"] for r in records) * 2**20 / 1e9,
        "compile_s": sum(r.get("compile_s") or 0.0 for r in records),
        "losses": [r["loss"] for r in records],
    }


def run_trainer(spec: dict, work: Path, *, compile: bool, float8: str = "none", loss: str = "auto") -> dict:
    from titan_pipe.config import parse_flow
    from titan_pipe.training.float8 import float8_problem
    from titan_pipe.training.metrics import step_records
    from titan_pipe.training.trainer import train

    if float8 != "none":
        why = float8_problem(float8, spec["device"])
        if why:
            return {"skipped": why}
    name = ("trainer_float8" if float8 != "none" else "trainer_compiled" if compile else "trainer") + (
        "_full_loss" if loss == "full" else ""
    )
    cfg = parse_flow(flow_dict(spec, name, work, compile=compile, float8=float8, loss=loss), base=work)
    summary = train(cfg, base=work)
    out = steady(step_records(cfg.run_dir() / "metrics.jsonl"), spec["batch"] * spec["seq"])
    out.update(
        checkpoint=summary["checkpoint"],
        peak_flops_source=summary["peak_flops_source"],
        loss_form=loss_form(loss, spec),
    )
    return out


def loss_form(choice: str, spec: dict) -> str:
    """The loss the trainer computes for ``choice`` at dp = tp = pp = 1 on this device: "chunked"
    (fused with the output projection) or "full" (auto follows the profile's measured faster_loss)."""
    from titan_pipe.rules.devices import resolve_device
    from titan_pipe.training.metrics import measured_loss
    from titan_pipe.training.trainer import resolve_loss

    measured = measured_loss(resolve_device(spec["device"])) if choice == "auto" else None
    return "chunked" if resolve_loss(choice, tp=1, pp=1, measured=measured) else "full"


def run_other_loss(spec: dict, work: Path, compiled: dict) -> dict:
    """The compiled trainer with the loss form auto did not pick (the chunked-vs-full comparison)."""
    if "loss_form" not in compiled:
        return {"skipped": "the compiled trainer phase did not finish, so there is nothing to compare with"}
    return run_trainer(spec, work, compile=True, loss="full" if compiled["loss_form"] == "chunked" else "chunked")


def run_loop(spec: dict, work: Path) -> dict:
    """The bare loop: model, AdamW, warmup + cosine, clipping, bf16 autocast, cross entropy. Nothing else."""
    import torch
    import torch.nn.functional as F

    from titan_pipe.config import parse_flow
    from titan_pipe.rules.devices import resolve_device
    from titan_pipe.model.args import flops_per_token
    from titan_pipe.model.transformer import build_model
    from titan_pipe.tokens.loader import PackedLoader
    from titan_pipe.tokens.spec import data_spec, open_spec
    from titan_pipe.training.metrics import mfu, peak_flops
    from titan_pipe.training.optim import lr_factor
    from titan_pipe.training.prepare import prepare_spec

    cfg = parse_flow(flow_dict(spec, "loop", work, compile=False), base=work)
    t, args = cfg.train, cfg.model.args()
    device = resolve_device(spec["device"])
    dev = device.torch_device(0)
    spec_data = data_spec(cfg.data, base=work)  # the trainer's data: raw text prepared as it prepares it
    if spec_data.text is not None:
        prepare_spec(spec_data, work / "loop-data", progress=False)
    _, data = open_spec(spec_data, prepared=work / "loop-data", vocab_size=args.vocab_size)
    loader = PackedLoader(data.train, seq_len=t.seq_len, global_batch=t.batch_size, seed=t.seed)
    model = build_model(args, seed=t.seed, device=dev)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=t.optimizer.lr,
        betas=t.optimizer.betas,
        eps=t.optimizer.eps,
        weight_decay=t.optimizer.weight_decay,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, warmup=t.warmup_steps, total=t.steps, min_ratio=t.lr_min_ratio)
    )
    records = []
    for step in range(1, t.steps + 1):
        t0 = time.perf_counter()
        x, y = (v.to(dev, non_blocking=True) for v in loader.next_batch())
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        value = float(loss.detach())  # a host sync each step, as the trainer's loss all-reduce makes one
        records.append(
            {
                "step": step,
                "loss": value,
                "step_time_s": time.perf_counter() - t0,
                "peak_mem_mb": _peak_bytes(device) / 2**20,
            }
        )
    peak, source = peak_flops(device, torch.bfloat16)
    out = steady(records, t.batch_size * t.seq_len)
    out["mfu"] = mfu(out["tokens_per_s"], flops_per_token(args, t.seq_len), peak)
    out["peak_flops_source"] = source
    del model, opt
    return out


def _peak_bytes(device) -> float:
    from titan_pipe.rules.devices import peak_memory_bytes

    return float(peak_memory_bytes(device))


def find_peer(peer: Path | None) -> Path | None:
    """The torchtitan harness: --peer, else carried into the checkout (.peers/torchtitan), else ../shared."""
    here = Path(__file__).resolve().parents[1]
    for p in [peer] if peer else [here / ".peers" / "torchtitan", here.parent / "shared" / "peers" / "torchtitan"]:
        if p is not None and (p / "run.sh").is_file():
            return p
    return None


def run_peer(spec: dict, work: Path, peer: Path | None) -> dict:
    """torchtitan's own Trainer, eager and compiled, on the same shape in this call (its run.sh);
    skipped off CUDA: the harness installs wheels made for the GPU machine."""
    import subprocess

    if spec["device"] != "cuda":
        return {
            "skipped": "the torchtitan peer runs on the accelerator only (its harness installs the GPU "
            "machine's wheels); the dry run leaves it out"
        }
    kit = find_peer(peer)
    if kit is None:
        return {"error": "no torchtitan harness: pass --peer DIR or carry shared/peers/torchtitan as .peers/torchtitan"}
    out = work / "peer"
    out.mkdir()
    proc = subprocess.run(
        ["bash", str(kit / "run.sh")],
        env=dict(os.environ, OUT=str(out), PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=300,
    )
    modes = {}
    for line in (out / "tt.jsonl").read_text().splitlines() if (out / "tt.jsonl").is_file() else []:
        rec = json.loads(line)
        modes[rec.get("mode", "?")] = rec
    if not modes:
        return {"error": f"run.sh exit {proc.returncode}, no tt.jsonl", "log_tail": (proc.stdout + proc.stderr)[-3000:]}
    return {"modes": modes, "run_sh_exit": proc.returncode}


def run_deploy(spec: dict, work: Path, checkpoint: str) -> dict:
    """convert -> export (float32 graphs) -> evaluate with the reference on the device."""
    from titan_pipe.config import EvaluateConfig
    from titan_pipe.convert.api import convert_checkpoint
    from titan_pipe.convert.onnx.export import export_model
    from titan_pipe.evaluate.api import evaluate_model

    times = {}
    t = time.perf_counter()
    convert_checkpoint(Path(checkpoint), work / "model")
    times["convert_s"] = time.perf_counter() - t
    t = time.perf_counter()
    exported = export_model(
        work / "model", work / "onnx", ExportConfig(dtype="float32", atc=False, seq_len=32, cache_len=64)
    )
    times["export_s"] = time.perf_counter() - t
    settings = EvaluateConfig(
        device=spec["device"],
        batches=1,
        batch_size=1,
        seq_len=32,
        prompts=1,
        prompt_len=8,
        new_tokens=4,
        operators=False,
    )
    t = time.perf_counter()
    result = evaluate_model(out_dir=work / "report", model_dir=work / "model", onnx=exported.onnx, settings=settings)
    times["evaluate_s"] = time.perf_counter() - t
    return {
        **times,
        "weight_gb": exported.summary.weight_bytes / 1e9,
        "evaluate_passed": result.passed,
        "evaluate_summary": result.summary,
    }


KERNEL_TOL = {"float32": 2e-5, "bfloat16": 3e-2}  # max |device kernel - reference| / max |reference|


def run_kernels(spec: dict, work: Path) -> dict:
    """The training kernels against the reference ones on the device, forward and gradient: RMSNorm,
    RoPE, causal and windowed GQA attention, packed documents (flex attention's block mask on CUDA
    against SDPA with the document mask), and the experts (grouped matrix multiply in bfloat16
    on SM 9.0+, else the loop) against the per-expert loop. Each row: the largest difference
    relative to the reference's largest value, and whether it is inside KERNEL_TOL."""
    import torch

    from titan_pipe.model.kernels import (
        attention_documents_flex,
        attention_ref,
        experts_grouped,
        experts_grouped_padded,
        experts_loop,
        reference_kernels,
        torch_fused_kernels,
    )

    dev = torch.device(spec["device"])
    ref, fused = reference_kernels(), torch_fused_kernels()
    g = torch.Generator().manual_seed(0)
    rows = {}

    def rel(a, b):
        return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))

    def check(name, f_ref, f_dev, inputs, dtype, backward=True, tables=0):
        """``tables``: the last inputs are constant tables (RoPE's cos/sin), not differentiated."""
        grads = [backward and i < len(inputs) - tables for i in range(len(inputs))]
        xs = [x.detach().to(dev, dtype).clone().requires_grad_(r) for x, r in zip(inputs, grads)]
        ys = [x.detach().clone().requires_grad_(r) for x, r in zip(xs, grads)]
        a, b = f_ref(*xs), f_dev(*ys)
        row = {"forward": rel(b, a)}
        if backward:
            a.float().square().sum().backward()
            b.float().square().sum().backward()
            row["grad"] = max(rel(y.grad, x.grad) for x, y in zip(xs, ys) if x.grad is not None)
        row["dtype"] = str(dtype).removeprefix("torch.")
        row["ok"] = all(v <= KERNEL_TOL[row["dtype"]] for k, v in row.items() if k in ("forward", "grad"))
        rows[name] = row

    B, H, KV, T, D = 2, 8, 2, 128, 64
    q, k, v = (torch.randn(B, h, T, D, generator=g) for h in (H, KV, KV))
    w, x = torch.randn(D, generator=g), torch.randn(B, T, D, generator=g)
    angles = torch.outer(torch.arange(T, dtype=torch.float32), 1.0 / 10000.0 ** (torch.arange(0, D, 2) / D))
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()  # halves repeat
    pos = torch.cat([torch.arange(40), torch.arange(56), torch.arange(32)]).expand(B, T).contiguous()
    # flex attention has no CPU backward: the dry run checks its forward there
    flex_backward = dev.type == "cuda"
    for dtype in (torch.float32, torch.bfloat16):
        check(
            f"rms_norm {dtype}",
            lambda a, b: ref.rms_norm(a, b, 1e-5),
            lambda a, b: fused.rms_norm(a, b, 1e-5),
            [x, w],
            dtype,
        )
        check(
            f"rope {dtype}",
            lambda a, b, c, d: torch.cat(ref.apply_rotary(a, b, c, d), 1),
            lambda a, b, c, d: torch.cat(fused.apply_rotary(a, b, c, d), 1),
            [q, k, cos, sin],
            dtype,
            tables=2,
        )
        for window in (None, 48):
            check(
                f"attention window={window} {dtype}",
                lambda a, b, c: attention_ref(a, b, c, n_rep=H // KV, window=window),
                lambda a, b, c: fused.attention(a, b, c, n_rep=H // KV, window=window),
                [q, k, v],
                dtype,
            )
            check(
                f"packed documents window={window} {dtype}",
                lambda a, b, c: attention_ref(a, b, c, n_rep=H // KV, window=window, positions=pos.to(dev)),
                lambda a, b, c: attention_documents_flex(a, b, c, pos.to(dev), window),
                [q, k, v],
                dtype,
                backward=flex_backward,
            )
    E, N, dim, hidden = 8, 512, 256, 384
    counts = torch.tensor([64, 0, 96, 32, 128, 64, 0, 128]).to(dev)
    tokens = torch.randn(N, dim, generator=g)
    w1, w3 = (torch.randn(E, hidden, dim, generator=g) / dim**0.5 for _ in range(2))
    w2 = torch.randn(E, dim, hidden, generator=g) / hidden**0.5
    check(
        "experts bfloat16",
        lambda a, b, c, d: experts_loop(a, counts, b, c, d),
        lambda a, b, c, d: experts_grouped(a, counts, b, c, d),
        [tokens, w1, w3, w2],
        torch.bfloat16,
    )
    if hasattr(torch, "_grouped_mm"):  # real routing: one expert takes most tokens, two none, no count a multiple of 8
        skewed = torch.tensor([1, 0, 3, 497, 0, 5, 3, 3]).to(dev)
        check(
            "experts grouped, skewed routing, bfloat16",
            lambda a, b, c, d: experts_loop(a, skewed, b, c, d),
            lambda a, b, c, d: experts_grouped_padded(a, skewed, b, c, d),
            [tokens, w1, w3, w2],
            torch.bfloat16,
        )
    grouped = dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (9, 0)
    return {
        "rows": rows,
        "all_ok": all(r["ok"] for r in rows.values()),
        "experts_path": "torch._grouped_mm" if grouped else "the per-expert loop (no SM 9.0 GPU)",
    }


class Report:
    """device_check.json, rewritten (to a temporary name, then renamed) after every phase: a call cut
    short by its time limit still leaves each finished phase's figures behind."""

    def __init__(self, path: Path, spec: dict, required: set[str]) -> None:
        self.path, self.t0 = path, time.perf_counter()
        self.data = {
            "spec": spec,
            "environment": environment(spec),
            "required": sorted(required),
            "phases": {},
            "complete": False,
        }
        self.required = required
        path.parent.mkdir(parents=True, exist_ok=True)
        self.write()

    @property
    def phases(self) -> dict:
        return self.data["phases"]

    def write(self) -> None:
        self.data["total_s"] = time.perf_counter() - self.t0
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)

    def phase(self, name: str, fn, *args, **kwargs) -> dict:
        """Run one phase; record its seconds and result, or its error (the next phase still runs);
        mark a requested phase that could not run, and one over its budget; write the file."""
        print(f"-- {name}", flush=True)
        t = time.perf_counter()
        try:
            result = fn(*args, **kwargs)
        except Exception as e:  # a lease is minutes long: keep what the other phases measure
            result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
            print(result["traceback"], file=sys.stderr, flush=True)
        result["seconds"] = time.perf_counter() - t
        if name in self.required:
            result["required"] = True
        budget = PHASE_BUDGET_S.get(name)
        if self.data["spec"]["device"] != "cpu" and budget and result["seconds"] > budget:
            result["over_budget_s"] = budget
        self.phases[name] = result
        self.write()
        return result

    def failures(self) -> list[str]:
        """What makes the call exit 1: a phase that raised, a requested phase skipped (with its reason),
        a kernel out of bound, an evaluate verdict that is not PASS, float8's loss off bf16's."""
        phases = self.phases
        failed = [f"{n}: {r['error']}" for n, r in phases.items() if "error" in r]
        failed += [
            f"{n} was requested but could not run: {r['skipped']}"
            for n, r in phases.items()
            if "skipped" in r and n in self.required
        ]
        failed += [f"{n} not run" for n in sorted(self.required - set(phases))]
        if "deploy" in phases and not phases["deploy"].get("evaluate_passed") and "error" not in phases["deploy"]:
            failed.append("deploy: evaluate verdict not PASS")
        failed += [
            f"kernel {k} out of bound" for k, r in phases.get("kernels", {}).get("rows", {}).items() if not r["ok"]
        ]
        f8 = self.data.get("ratios", {}).get("float8_loss_max_rel_diff")
        if f8 is not None and f8 > FLOAT8_LOSS_BOUND:
            failed.append(f"float8 loss {f8:.3f} off bf16's (bound {FLOAT8_LOSS_BOUND})")
        return failed


def _figures(r: dict, name: str) -> dict | None:
    """A phase's figures (tokens_per_s, peak_mem_gb), torchtitan's modes as torchtitan_eager/_compile."""
    if name.startswith("torchtitan_"):
        mode = r.get("torchtitan", {}).get("modes", {}).get(name.removeprefix("torchtitan_"))
        return mode if mode and "error" not in mode else None
    p = r.get(name)
    return p if p and "error" not in p and "skipped" not in p else None


def ratios(r: dict) -> dict:
    def ratio(a, b, key="tokens_per_s"):
        fa, fb = _figures(r, a), _figures(r, b)
        if fa is None or fb is None or fa.get(key) is None or not fb.get(key):
            return None
        return fa[key] / fb[key]

    out = {
        "trainer_vs_loop_tokens_per_s": ratio("trainer", "loop"),
        "compiled_vs_eager_tokens_per_s": ratio("trainer_compiled", "trainer"),
        "compiled_vs_loop_tokens_per_s": ratio("trainer_compiled", "loop"),
        "trainer_vs_torchtitan_eager_tokens_per_s": ratio("trainer", "torchtitan_eager"),
        "compiled_vs_torchtitan_compiled_tokens_per_s": ratio("trainer_compiled", "torchtitan_compile"),
        "float8_vs_torchtitan_compiled_tokens_per_s": ratio("trainer_float8", "torchtitan_compile"),
        "float8_vs_compiled_tokens_per_s": ratio("trainer_float8", "trainer_compiled"),
        "trainer_vs_torchtitan_eager_peak_mem": ratio("trainer", "torchtitan_eager", "peak_mem_gb"),
        "compiled_vs_torchtitan_compiled_peak_mem": ratio("trainer_compiled", "torchtitan_compile", "peak_mem_gb"),
    }
    f8, bf = _figures(r, "trainer_float8"), _figures(r, "trainer_compiled")
    if f8 is not None and bf is not None:
        out["float8_loss_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(f8["losses"], bf["losses"]))
    other = _figures(r, "trainer_compiled_other_loss")
    if other is not None and bf is not None:
        forms = {bf["loss_form"]: bf, other["loss_form"]: other}
        if set(forms) == {"chunked", "full"}:
            full, chunked = forms["full"], forms["chunked"]
            diff = max(abs(a - b) / abs(b) for a, b in zip(full["losses"], chunked["losses"]))
            out.update(
                full_vs_chunked_loss_tokens_per_s=full["tokens_per_s"] / chunked["tokens_per_s"],
                full_vs_chunked_loss_peak_mem=full["peak_mem_gb"] / chunked["peak_mem_gb"],
                loss_form_max_rel_diff=diff,
            )
            if diff <= LOSS_FORM_BOUND:  # what train.loss: auto should follow here (the profile's faster_loss)
                out["faster_loss"] = "full" if full["tokens_per_s"] > chunked["tokens_per_s"] else "chunked"
    return out


def environment(spec: dict) -> dict:
    import torch

    env = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "device": spec["device"],
        "date": time.strftime("%Y-%m-%d"),
    }
    if spec["device"] == "cuda" and torch.cuda.is_available():
        env.update(
            gpu=torch.cuda.get_device_name(), gpu_memory_gb=torch.cuda.get_device_properties(0).total_memory / 1e9
        )
    return env


def print_summary(report: dict) -> None:
    kern = report["phases"].get("kernels", {})
    if "error" in kern:
        print(f"{'kernels':>17}: FAILED {kern['error']}")
    for name, r in kern.get("rows", {}).items():
        grad = f", grad {r['grad']:.1e}" if "grad" in r else ""
        print(f"{'kernel':>17}: {name}: forward {r['forward']:.1e}{grad} {'ok' if r['ok'] else 'OUT OF BOUND'}")
    for name in ("loop", "trainer", "trainer_compiled", "trainer_compiled_other_loss", "trainer_float8"):
        r = report["phases"].get(name, {})
        if "error" in r:
            print(f"{name:>17}: FAILED {r['error']}")
        elif "skipped" in r:
            print(f"{name:>17}: skipped: {r['skipped']}")
        elif r:
            mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
            form = f", {r['loss_form']} loss" if "loss_form" in r else ""
            print(
                f"{name:>17}: {r['tokens_per_s']:,.0f} tokens/s, MFU {mfu}, step {r['step_s'] * 1e3:.1f} ms, "
                f"peak {r['peak_mem_gb']:.1f} GB, compile {r['compile_s']:.1f} s{form}"
            )
    peer = report["phases"].get("torchtitan", {})
    if "skipped" in peer or "error" in peer:
        print(
            f"{'torchtitan':>17}: {'skipped: ' + peer['skipped'] if 'skipped' in peer else 'FAILED ' + peer['error']}"
        )
    for mode, rec in peer.get("modes", {}).items():
        print(
            f"{'torchtitan ' + mode:>17}: "
            + (
                f"FAILED {rec['error']}"
                if "error" in rec
                else f"{rec['tokens_per_s']:,.0f} tokens/s, peak {rec['peak_mem_gb']:.1f} GB"
            )
        )
    print(
        "ratios: "
        + ", ".join(
            f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v if v is not None else 'n/a'}"
            for k, v in report["ratios"].items()
        )
    )
    d = report["phases"].get("deploy", {"skipped": "not run"})
    print(
        "deploy: "
        + (
            f"FAILED {d['error']}"
            if "error" in d
            else f"skipped: {d['skipped']}"
            if "skipped" in d
            else f"convert {d['convert_s']:.1f} s, export {d['export_s']:.1f} s, evaluate {d['evaluate_s']:.1f} s, "
            f"passed {d['evaluate_passed']}"
        )
    )


PHASES = (
    "kernels",
    "loop",
    "trainer",
    "trainer_compiled",
    "trainer_float8",
    "torchtitan",
    "trainer_compiled_other_loss",
    "deploy",
)
REQUIRED_ON_DEVICE = {"torchtitan", "trainer_float8"}  # the figures the call is for: their absence fails it


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, debug model, aot_eager: checks the script")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/out")))
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the scratch dir (checkpoint, model, ONNX, report)")
    ap.add_argument(
        "--peer",
        type=Path,
        default=None,
        help="the torchtitan harness dir (default: .peers/torchtitan, then ../shared/peers/torchtitan)",
    )
    ap.add_argument("--only", default=None, help=f"comma-separated phases to run (default all: {', '.join(PHASES)})")
    ap.add_argument(
        "--require",
        default=None,
        help="comma-separated phases whose absence fails the call (default "
        f"on the device: {', '.join(sorted(REQUIRED_ON_DEVICE))}; dry run: none)",
    )
    ap.add_argument(
        "--deadline",
        type=float,
        default=470.0,
        help="seconds: a phase whose budget no longer fits is skipped with that reason (device runs only)",
    )
    a = ap.parse_args(argv)
    spec = dict(SPECS["dry-run" if a.dry_run else "device"])
    spec["steps"] = a.steps or spec["steps"]
    only = set(a.only.split(",")) if a.only else set(PHASES)
    required = set(a.require.split(",")) if a.require else (set() if a.dry_run else set(REQUIRED_ON_DEVICE))
    unknown = (only | required) - set(PHASES)
    if unknown:
        ap.error(f"unknown phase(s) {', '.join(sorted(unknown))}; the phases: {', '.join(PHASES)}")
    init_group(spec["device"])
    report = Report(a.out / "device_check.json", spec, required & only)
    work = Path(tempfile.mkdtemp(prefix="titan-device-check-"))
    phases = report.phases
    steps = {
        "kernels": (run_kernels, (spec, work), {}),
        "loop": (run_loop, (spec, work), {}),
        "trainer": (run_trainer, (spec, work), {"compile": False}),
        "trainer_compiled": (run_trainer, (spec, work), {"compile": True}),
        "trainer_float8": (run_trainer, (spec, work), {"compile": True, "float8": "tensorwise"}),
        # after ours: its wheels go to a site dir of its own
        "torchtitan": (run_peer, (spec, work, a.peer), {}),
        "trainer_compiled_other_loss": (lambda: run_other_loss(spec, work, phases.get("trainer_compiled", {})), (), {}),
        "deploy": (
            lambda: (
                run_deploy(spec, work, phases["trainer"]["checkpoint"])
                if "checkpoint" in phases.get("trainer", {})
                else {"skipped": "the trainer phase wrote no checkpoint"}
            ),
            (),
            {},
        ),
    }
    for name in PHASES:
        if name not in only:
            continue
        left = a.deadline - (time.perf_counter() - report.t0)
        if spec["device"] != "cpu" and left < PHASE_BUDGET_S[name]:
            report.phase(
                name,
                lambda: {
                    "skipped": f"{left:.0f} s left before the {a.deadline:.0f} s deadline, "
                    f"under the phase's {PHASE_BUDGET_S[name]} s budget"
                },
            )
            continue
        fn, args, kwargs = steps[name]
        report.phase(name, fn, *args, **kwargs)
        release(spec["device"])
    report.data["ratios"] = ratios(phases)
    report.data["failed"] = report.failures()
    report.data["complete"] = True
    report.write()
    print_summary(report.data)
    for line in report.data["failed"]:
        print(f"FAILED: {line}")
    print(f"wrote {report.path} ({report.data['total_s']:.0f} s)")
    if a.keep:
        print(f"kept {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if report.data["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
