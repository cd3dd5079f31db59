"""Export time and peak memory for a >= 1B-parameter LLaMA shape, as ratios against baselines of the same run.

Writes random weights (a TinyLlama-1.1B shape by default) as a sharded unified dir under a temp
directory, then measures, each in a fresh child process (peak RSS = the child's ru_maxrss):
  copy      cp of the weight files (the I/O floor)
  load      load_unified_model alone (one copy of the weights in memory)
  export    export_model (prefill + decode graphs, checks, export.json; atc skipped)
and prints time and peak RSS of export against the weight bytes, load and copy. Everything it
wrote is deleted at the end. Check `free -g` first: the fp32 shape needs ~2x its weights in RAM.

    python benchmarks/export.py [--layers 22] [--dim 2048] [--dtype float32] [--keep-under DIR]
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD_LOAD = """
import sys, time, torch
from pathlib import Path
from titan_pipe.convert.unified import load_unified_model
t = time.perf_counter()
model, _ = load_unified_model(Path(sys.argv[1]), dtype=sys.argv[2])
# Touch every weight: safetensors may hand back lazily paged tensors, and the baseline is one
# resident copy of the weights.
assert all(torch.isfinite(p.sum()) for p in model.parameters())
print(time.perf_counter() - t)
"""

CHILD_EXPORT = """
import sys, time
from pathlib import Path
from titan_pipe.convert.onnx.export import export_model
t = time.perf_counter()
r = export_model(model_dir=Path(sys.argv[1]), out_dir=Path(sys.argv[3]), dtype=sys.argv[2], run_atc=False)
print(r.summary["timings_seconds"])
print(time.perf_counter() - t)
"""


def write_random_model(out: Path, args, seed: int = 0) -> int:
    """A unified dir with one safetensors shard per layer (so writing never holds the whole model)."""
    import torch
    from safetensors.torch import save_file

    from titan_pipe.names import native_to_hf, to_hf_config
    from titan_pipe.training.model import build_model

    out.mkdir(parents=True)
    meta = build_model(args, seed=None, device="meta")
    groups: dict[str, list[tuple[str, tuple]]] = {}
    for name, p in meta.named_parameters():
        key = name.split(".")[1] if name.startswith("layers.") else "rest"
        groups.setdefault(key, []).append((name, tuple(p.shape)))
    g = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for i, (key, params) in enumerate(groups.items()):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {native_to_hf(n): (torch.randn(s, generator=g) * 0.02) for n, s in params}
        save_file(shard, str(out / fname))
        total += sum(t.numel() * t.element_size() for t in shard.values())
        weight_map.update({k: fname for k in shard})
        del shard
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(to_hf_config(args)))
    return total


def run_child(code: str, *argv: str) -> tuple[float, float]:
    """(seconds reported by the child, the child's peak RSS in GB)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"child failed:\n{proc.stderr[-3000:]}")
    peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if peak_kb <= before:  # ru_maxrss is the max over all children so far; children run biggest-last
        print("  (warning: peak RSS not above an earlier child's; figure is an upper bound)")
    return float(proc.stdout.strip().splitlines()[-1]), peak_kb * 1024 / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16"))
    ap.add_argument("--keep-under", type=Path, default=None, help="scratch parent dir (default: system temp)")
    opts = ap.parse_args()

    from titan_pipe.model_args import ModelArgs, count_params

    args = ModelArgs(dim=opts.dim, n_layers=opts.layers, n_heads=opts.heads, n_kv_heads=opts.kv_heads,
                     vocab_size=opts.vocab, ffn_hidden_dim=opts.ffn, max_seq_len=2048)
    n = count_params(args)
    print(f"shape: dim {args.dim}, {args.n_layers} layers, {args.n_heads}/{args.kv_heads} heads, ffn {args.ffn_hidden_dim}, "
          f"vocab {args.vocab_size}: {n / 1e9:.3f} B parameters, export dtype {opts.dtype}")
    root = Path(tempfile.mkdtemp(prefix="titan-export-bench-", dir=opts.keep_under))
    try:
        t = time.perf_counter()
        stored = write_random_model(root / "model", args)
        print(f"wrote random weights: {stored / 1e9:.2f} GB in {time.perf_counter() - t:.1f} s")
        weight_gb = n * (4 if opts.dtype == "float32" else 2) / 1e9

        t = time.perf_counter()
        shutil.copytree(root / "model", root / "copy")
        copy_s = time.perf_counter() - t
        shutil.rmtree(root / "copy")
        load_s, load_gb = run_child(CHILD_LOAD, str(root / "model"), opts.dtype)
        export_s, export_gb = run_child(CHILD_EXPORT, str(root / "model"), opts.dtype, str(root / "onnx"))
        record = json.loads((root / "onnx" / "export.json").read_text())
        print("export phases (s): " + ", ".join(f"{k} {v:.1f}" for k, v in record["timings_seconds"].items()))
        files = {k: v["bytes"] for k, v in record["files"].items()}
        print(f"files: " + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in files.items() if v > 1e6))
        print(f"{'':24}{'seconds':>10}{'peak RSS GB':>14}")
        print(f"{'copy weights (cp)':24}{copy_s:>10.1f}{'-':>14}")
        print(f"{'load_unified_model':24}{load_s:>10.1f}{load_gb:>14.2f}")
        print(f"{'export_model':24}{export_s:>10.1f}{export_gb:>14.2f}")
        print(f"weights in {opts.dtype}: {weight_gb:.2f} GB")
        print(f"ratios: export peak RSS / weights = {export_gb / weight_gb:.2f}x; export / load peak RSS = "
              f"{export_gb / load_gb:.2f}x; export time / load time = {export_s / load_s:.1f}x; "
              f"export time / copy time = {export_s / copy_s:.1f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        print(f"removed {root}")


if __name__ == "__main__":
    main()
