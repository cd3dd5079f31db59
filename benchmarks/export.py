"""Export wall time and peak memory against `cp` of the same weights, for large LLaMA shapes, in one run.

For each shape it writes random fp32 weights as a sharded unified dir under a temp directory, then
runs, each as a fresh child process whose own peak RSS is read from wait4():
  cp        `cp -r` of the unified dir (the I/O floor), once before and once after the export
  export    export_model (prefill + decode graphs, weights streamed into model.onnx.data, checks,
            sha256 of every file, export.json; atc skipped)
and prints export time / cp time and export peak RSS / weight bytes. Shapes (default both):
  tinyllama  dim 2048, 22 layers, 32/4 heads, ffn 5632, vocab 32000 (1.10 B params, 4.40 GB fp32)
  llama2w    Llama-2-7B width with few layers: dim 4096, 32 heads, ffn 11008, vocab 32000
             (--wide-layers, default 2: 0.67 B params, 2.67 GB fp32; largest tensor 0.52 GB)
Everything it wrote is deleted at the end. Needs ~3x the largest shape's weights free on disk.

    python benchmarks/export.py [--shapes tinyllama,llama2w] [--wide-layers 2] [--dtype float32] [--keep-under DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD_EXPORT = """
import json, sys, time
from pathlib import Path
t = time.perf_counter()
from titan_pipe.convert.onnx.export import export_model
t1 = time.perf_counter()
r = export_model(model_dir=Path(sys.argv[1]), out_dir=Path(sys.argv[3]), dtype=sys.argv[2], run_atc=False,
                 hash_weights=sys.argv[4] == "hash")
print(json.dumps({"import": t1 - t, "seconds": time.perf_counter() - t1, "timings": r.summary["timings_seconds"]}))
"""

# Weights are written by a child too: this process stays free of torch, so a child's peak RSS
# (which counts the parent's image it was forked from) is the child's own.
CHILD_WRITE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import export as bench
args = bench.shapes(int(sys.argv[4]))[sys.argv[2]]
print(json.dumps(bench.write_random_model(bench.Path(sys.argv[3]), args)))
"""

# The figures of the TorchScript exporter this replaced (docs/export.md, same machine class, load ~10).
BEFORE = {"tinyllama": "before (TorchScript tracer, load_unified_model): 736 s = 31x cp (23.8 s), "
                       "peak RSS 5.65 GB = 1.28x the weights"}


def shapes(wide_layers: int) -> dict:
    from titan_pipe.model.args import ModelArgs

    return {
        "tinyllama": ModelArgs(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, vocab_size=32000,
                               ffn_hidden_dim=5632, max_seq_len=2048),
        "llama2w": ModelArgs(dim=4096, n_layers=wide_layers, n_heads=32, vocab_size=32000, ffn_hidden_dim=11008,
                             max_seq_len=4096),
        "tiny": ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=1000, ffn_hidden_dim=512,
                          max_seq_len=512),  # a seconds-long check that the script runs
    }


def write_random_model(out: Path, args, seed: int = 0, dtype: str = "float32", norms_one: bool = False) -> int:
    """A unified dir with one safetensors shard per layer (so writing never holds the whole model):
    N(0, 0.02) weights stored in ``dtype``; ``norms_one``: norm weights 1 (activations of a usual size)."""
    import torch
    from safetensors.torch import save_file

    from titan_pipe.model.names import native_to_hf, to_hf_config
    from titan_pipe.model.transformer import build_model

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
        shard = {native_to_hf(n): (torch.ones(s) if norms_one and n.endswith("norm.weight")
                                   else torch.randn(s, generator=g) * 0.02).to(getattr(torch, dtype))
                 for n, s in params}
        save_file(shard, str(out / fname))
        total += sum(t.numel() * t.element_size() for t in shard.values())
        weight_map.update({k: fname for k in shard})
        del shard
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(to_hf_config(args)))
    return total


def run_measured(argv: list[str]) -> tuple[float, float, str]:
    """(wall seconds, the child's own peak RSS in GB from wait4, its stdout); exits on failure."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        if proc.returncode != 0:
            raise SystemExit(f"{argv[0]} failed ({proc.returncode}):\n{err.read()[-3000:]}")
        return wall, usage.ru_maxrss * 1024 / 1e9, out.read()


def bench_shape(name: str, args, dtype: str, root: Path, wide_layers: int) -> dict:
    from titan_pipe.model.args import count_params

    n = count_params(args)
    print(f"\n== {name}: dim {args.dim}, {args.n_layers} layers, {args.n_heads}/{args.kv_heads} heads, "
          f"ffn {args.hidden_dim}, vocab {args.vocab_size}: {n / 1e9:.3f} B parameters, export {dtype}")
    src = root / name / "model"
    write_s, _, out = run_measured([sys.executable, "-c", CHILD_WRITE, str(Path(__file__).parent), name, str(src),
                                    str(wide_layers)])
    print(f"wrote random weights: {json.loads(out) / 1e9:.2f} GB in {write_s:.1f} s")
    weight_gb = n * (4 if dtype == "float32" else 2) / 1e9
    cp_s = []
    cp1, cp_rss, _ = run_measured(["cp", "-r", str(src), str(root / name / "copy")])
    shutil.rmtree(root / name / "copy")
    cp_s.append(cp1)
    runs = {}
    for mode in ("hash", "nohash"):  # default (sha256 of every file in export.json), --no-hash-weights
        wall, rss, out = run_measured([sys.executable, "-c", CHILD_EXPORT, str(src), dtype, str(root / name / "onnx"),
                                       mode])
        runs[mode] = (wall, rss, json.loads(out.strip().splitlines()[-1]))
        record = json.loads((root / name / "onnx" / "export.json").read_text())
        files = {k: v["bytes"] for k, v in record["files"].items()}
        shutil.rmtree(root / name / "onnx")
    cp2, _, _ = run_measured(["cp", "-r", str(src), str(root / name / "copy")])
    shutil.rmtree(root / name / "copy")
    cp_s.append(cp2)
    shutil.rmtree(root / name)
    floor = min(cp_s)
    for mode, label in (("hash", "default"), ("nohash", "--no-hash-weights")):
        print(f"export phases, {label} (s): " + ", ".join(f"{k} {v:.1f}" for k, v in runs[mode][2]["timings"].items()))
    print("files: " + ", ".join(f"{k} {v / 1e9:.3f} GB" for k, v in files.items() if v > 1e6))
    print(f"{'':40}{'seconds':>10}{'x cp':>8}{'peak RSS GB':>14}{'x weights':>11}")
    print(f"{'cp -r of the weights (before)':40}{cp1:>10.1f}{cp1 / floor:>8.2f}{cp_rss:>14.3f}")
    print(f"{'cp -r of the weights (after)':40}{cp2:>10.1f}{cp2 / floor:>8.2f}")
    ratios = {}
    for mode, label in (("hash", "export_model"), ("nohash", "export_model --no-hash-weights")):
        wall, rss, child = runs[mode]
        ratios[mode] = (child["seconds"] / floor, rss / weight_gb, wall / floor)
        print(f"{label:40}{child['seconds']:>10.1f}{child['seconds'] / floor:>8.2f}{rss:>14.3f}"
              f"{rss / weight_gb:>11.3f}")
        print(f"{'  whole process (start, imports ' + format(child['import'], '.1f') + ' s)':40}{wall:>10.1f}"
              f"{wall / floor:>8.2f}")
    print(f"weights in {dtype}: {weight_gb:.2f} GB; largest tensor "
          f"{max(args.vocab_size * args.dim, args.hidden_dim * args.dim) * (4 if dtype == 'float32' else 2) / 1e9:.2f} GB")
    t_hash, r_hash, _ = ratios["hash"]
    print(f"ratios: export_model wall / cp = {t_hash:.2f}x (--no-hash-weights {ratios['nohash'][0]:.2f}x; "
          f"target <= 3x); export peak RSS / weights = {r_hash:.3f}x (target <= 0.25x)")
    if name in BEFORE:
        print(BEFORE[name])
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="tinyllama,llama2w")
    ap.add_argument("--wide-layers", type=int, default=2, help="layers of the Llama-2-7B-width shape")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16"))
    ap.add_argument("--keep-under", type=Path, default=None, help="scratch parent dir (default: system temp)")
    opts = ap.parse_args()
    table = shapes(opts.wide_layers)
    import resource

    print(f"this process (no torch): peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.3f} GB")
    print(f"load average at start (1/5/15 min): {', '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"{os.cpu_count()} CPUs")
    root = Path(tempfile.mkdtemp(prefix="titan-export-bench-", dir=opts.keep_under))
    try:
        for name in opts.shapes.split(","):
            bench_shape(name, table[name], opts.dtype, root, opts.wide_layers)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        print(f"\nremoved {root}")
        print(f"load average at end (1/5/15 min): {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
