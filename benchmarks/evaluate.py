"""Benchmark the evaluate stage's own cost, as ratios against baselines measured in the same run.

  metrics:  compare_tensors on a (B, T, vocab) logits pair vs the floor of one float64 pass
            (|c - r|.max() on the same data); peak extra memory vs the input size
  overhead: evaluate_model (no operators, no generation) on the debug model vs the bare
            forward passes it must run anyway (PyTorch + ONNX Runtime)

  /work/venv/bin/python benchmarks/evaluate.py [--vocab 32000] [--tokens 1024]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import torch


def bench_metrics(tokens: int, vocab: int) -> dict:
    from titan_pipe.evaluate.metrics import compare_tensors

    g = torch.Generator().manual_seed(0)
    r = torch.randn(tokens, vocab, generator=g)
    c = r + 1e-3 * torch.randn(tokens, vocab, generator=g)
    t = time.perf_counter()
    floor = float(np.abs(c.numpy().astype(np.float64) - r.numpy().astype(np.float64)).max())
    t_floor = time.perf_counter() - t
    tracemalloc.start()
    t = time.perf_counter()
    m = compare_tensors(r, c)
    t_metrics = time.perf_counter() - t
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert abs(m.max_abs - floor) < 1e-12
    in_bytes = 2 * r.numel() * 4
    return {"elements": r.numel(), "floor_s": t_floor, "compare_tensors_s": t_metrics,
            "time_ratio": t_metrics / t_floor, "peak_extra_bytes": peak, "memory_ratio_vs_inputs": peak / in_bytes}


def bench_overhead() -> dict:
    import onnxruntime as ort
    from safetensors.torch import save_file

    from titan_pipe.config import EvaluateConfig
    from titan_pipe.model.names import native_to_hf, to_hf_config
    from titan_pipe.convert.onnx.export import export_model
    from titan_pipe.evaluate.api import evaluate_model
    from titan_pipe.evaluate.batches import load_eval_data
    from titan_pipe.model.transformer import build_model
    from titan_pipe.model.args import resolve_args

    args = resolve_args("debug")
    model = build_model(args, seed=0).eval()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        md = tmp / "model"
        md.mkdir()
        save_file({native_to_hf(k): v for k, v in model.state_dict().items()}, str(md / "model.safetensors"))
        (md / "config.json").write_text(json.dumps(to_hf_config(args)))
        onnx = export_model(model_dir=md, out_dir=tmp / "onnx", kv_cache=False, expose_hidden=True,
                            run_atc=False).onnx
        s = EvaluateConfig(batches=4, batch_size=4, seq_len=64, operators=False, prompts=0)
        ev = load_eval_data(data=None, model_dir=md, vocab_size=args.vocab_size, n_batches=4, batch_size=4,
                            seq_len=64, n_prompts=0, prompt_len=16)
        t = time.perf_counter()
        sess = ort.InferenceSession(str(onnx), providers=["CPUExecutionProvider"])
        with torch.no_grad():
            for b in ev.batches:
                model(b)
                sess.run(None, {"input_ids": b.numpy()})
        t_forward = time.perf_counter() - t
        t = time.perf_counter()
        r = evaluate_model(out_dir=tmp / "rep", model_dir=md, onnx=onnx, settings=s)
        t_eval = time.perf_counter() - t
        assert r.passed
    return {"forward_only_s": t_forward, "evaluate_s": t_eval, "time_ratio": t_eval / t_forward}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=1024)
    a = ap.parse_args()
    m = bench_metrics(a.tokens, a.vocab)
    print(f"metrics: {m['elements'] / 1e6:.1f}M logits, compare_tensors {m['compare_tensors_s']:.2f} s = "
          f"{m['time_ratio']:.1f}x one float64 |c-r|.max() pass ({m['floor_s']:.2f} s); peak extra memory "
          f"{m['peak_extra_bytes'] / 2**20:.0f} MiB = {m['memory_ratio_vs_inputs']:.1f}x the float32 inputs")
    o = bench_overhead()
    print(f"overhead: evaluate_model {o['evaluate_s']:.2f} s = {o['time_ratio']:.1f}x the bare torch+ORT "
          f"forwards ({o['forward_only_s']:.2f} s), debug model, 4 batches of 4x64, report included")


if __name__ == "__main__":
    main()
