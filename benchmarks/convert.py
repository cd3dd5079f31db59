"""Benchmark: titan-pipe convert vs plain file copies (the floor) and the usual alternatives.

Builds a synthetic tp2 x pp2 checkpoint of a LLaMA shape (default: TinyLlama-1.1B, dim 2048,
bf16, ~2.2 GB), then measures, each in its own subprocess with a warm page cache:
  floor        cp of the shard files (reads and writes the same bytes)
  titan-pipe   convert_checkpoint(titan shards -> one model.safetensors), with and without
               the sha256 verification of the source
  load+cat     safetensors.torch.load_file every shard, torch.cat, save_file
  titan-pipe/dcp   convert_checkpoint from a DCP copy of the same weights (source files hashed
               with the default xxh3_128, with --digest sha256, and not at all)
  dcp_to_torch_save   torch.distributed.checkpoint.format_utils (loads everything)
  consolidate  torch's consolidate_safetensors_files on the same shards in DCP's HF layout
and prints wall time (of the work, and of the whole process) and peak RSS, with ratios to the
floor and to the checkpoint size. Targets: wall <= 1.3x floor, peak RSS <= 0.25x checkpoint.
With --cold the sources are evicted from the page cache before every run instead (posix_fadvise
DONTNEED on just these files, after a sync), so every method reads them from the disk.

    python benchmarks/convert.py [--workdir /tmp/titan-pipe-bench] [--layers 22] [--keep] [--cold]
"""

from __future__ import annotations

import argparse
from titan_pipe.config import ConvertConfig
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _peak_self_mb() -> float:
    """VmHWM: this process's own peak RSS (ru_maxrss would count the parent's pages at fork)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _peak_children_mb() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


# ---------------------------------------------------------------------------------------------
# building the inputs (untimed)


def build(work: Path, layers: int) -> dict:
    import torch
    from safetensors.torch import load_file, save_file

    from titan_pipe.convert.api import convert_checkpoint
    from titan_pipe.records.checkpoint_format import Manifest
    from titan_pipe.model.names import native_to_hf
    from titan_pipe.model.hf_config import to_hf_config
    from titan_pipe.model.args import ModelArgs
    from titan_pipe.model.transformer import build_model

    args = ModelArgs(
        dim=2048, n_layers=layers, n_heads=32, n_kv_heads=4, vocab_size=32000, ffn_hidden_dim=5632, max_seq_len=2048
    )
    unified = work / "unified"
    unified.mkdir(parents=True)
    meta = build_model(args, seed=None, device="meta")
    g = torch.Generator().manual_seed(0)
    sd = {}
    for name, p in meta.named_parameters():
        sd[native_to_hf(name)] = torch.randn(p.shape, generator=g, dtype=torch.float32).to(torch.bfloat16)
    save_file(sd, unified / "model.safetensors", metadata={"format": "pt"})
    (unified / "config.json").write_text(json.dumps(to_hf_config(args, torch_dtype="bfloat16")))
    convert_checkpoint(unified, work / "titan", ConvertConfig(tp=2, pp=2))

    import torch.distributed.checkpoint as dcp

    (work / "dcp_root").mkdir()
    dcp.save({k: v for k, v in _native(sd).items()}, checkpoint_id=str(work / "dcp_root/ckpt"), no_dist=True)
    (work / "dcp_root/params.json").write_text(json.dumps({"n_heads": 32, "n_kv_heads": 4}))
    del sd
    shutil.rmtree(unified)

    # The same shards in DCP's Hugging Face layout (custom header metadata with saved offsets),
    # which is the input torch's consolidate_safetensors_files applies to.
    m = Manifest.load(work / "titan")
    cons = work / "consolidate_in"
    cons.mkdir()
    for f in sorted(m.files):
        tensors = load_file(work / "titan" / f)
        offsets = {}
        for name, p in m.params.items():
            for c in p.chunks:
                if c.file == f:
                    offsets[name] = {"saved_offsets": list(c.box.offsets)}
        save_file(tensors, cons / Path(f).name, metadata={"DCP_SHARDING_INFO": json.dumps(offsets), "format": "pt"})
        del tensors
    size = sum((work / "titan" / f).stat().st_size for f in m.files)
    return {"bytes": size, "files": len(m.files), "dim": args.dim, "layers": layers}


def _native(hf_sd: dict) -> dict:
    from titan_pipe.model.names import hf_to_native

    return {hf_to_native(k): v for k, v in hf_sd.items()}


# ---------------------------------------------------------------------------------------------
# the methods (each runs in a child process: `--run METHOD`)


# titan-pipe's own methods: source dir under the work dir, whether the source is hashed, and with what
# (ours is always checked against its manifest's sha256s; the DCP copy is recorded with --digest)
_OURS = {
    "titan-pipe": ("titan", True, "xxh3_128"),
    "titan-pipe --no-verify": ("titan", False, "xxh3_128"),
    "titan-pipe/dcp": ("dcp_root/ckpt", True, "xxh3_128"),
    "titan-pipe/dcp --digest sha256": ("dcp_root/ckpt", True, "sha256"),
    "titan-pipe/dcp --no-verify": ("dcp_root/ckpt", False, "xxh3_128"),
}


def run_method(method: str, work: Path, out: Path) -> dict:
    base = _rss_mb()
    t0 = time.perf_counter()
    if method == "floor":
        out.mkdir()
        files = sorted((work / "titan/model").glob("*.safetensors"))
        subprocess.run(["cp", *map(str, files), str(out)], check=True)
        peak = _peak_children_mb()
        wall = time.perf_counter() - t0
        return {"wall": wall, "peak_mb": peak, "base_mb": 0.0}
    if method in _OURS:
        from titan_pipe.convert.api import convert_checkpoint

        src, verify, digest = _OURS[method]
        base = _rss_mb()
        t0 = time.perf_counter()
        convert_checkpoint(work / src, out, ConvertConfig(verify=verify, digest=digest))
    elif method == "load+cat":
        import torch
        from safetensors.torch import load_file, save_file

        from titan_pipe.records.checkpoint_format import Manifest

        base = _rss_mb()
        t0 = time.perf_counter()
        m = Manifest.load(work / "titan")
        shards = {f: load_file(work / "titan" / f) for f in m.files}
        merged = {}
        for name, p in m.params.items():
            pieces = [shards[c.file][c.key] for c in p.chunks]
            merged[name] = pieces[0] if p.tp_dim is None else torch.cat(pieces, dim=p.tp_dim)
        out.mkdir()
        save_file(merged, out / "model.safetensors")
    elif method == "dcp_to_torch_save":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        base = _rss_mb()
        t0 = time.perf_counter()
        out.mkdir()
        dcp_to_torch_save(work / "dcp_root/ckpt", out / "model.pt")
    elif method == "consolidate":
        from safetensors import safe_open
        from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

        keys = set()
        for f in (work / "consolidate_in").glob("*.safetensors"):
            with safe_open(f, "pt") as h:
                keys.update(h.keys())
        base = _rss_mb()
        t0 = time.perf_counter()
        out.mkdir()
        consolidate_safetensors_files(str(work / "consolidate_in"), str(out), {k: 1 for k in keys})
    else:
        raise SystemExit(f"unknown method {method}")
    return {"wall": time.perf_counter() - t0, "peak_mb": _peak_self_mb(), "base_mb": base}


def plot(results: dict, floor: float, size_mb: float, path: Path) -> None:
    """Two bar charts: wall time / floor and peak RSS / checkpoint size, target lines drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.barh(names, [results[n]["wall"] / floor for n in names], color="tab:blue")
    ax1.axvline(1.3, color="red", linestyle="--", label="target 1.3x")
    ax1.set_xlabel("wall time / plain copy")
    ax1.legend()
    ax2.barh(names, [results[n]["peak_mb"] / size_mb for n in names], color="tab:orange")
    ax2.axvline(0.25, color="red", linestyle="--", label="target 0.25x")
    ax2.set_xlabel("peak RSS / checkpoint size")
    ax2.legend()
    ax2.set_yticklabels([])
    fig.suptitle(f"convert benchmark: {size_mb / 1024:.2f} GiB tp2 x pp2 checkpoint")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


METHODS = (
    "floor",
    "titan-pipe",
    "titan-pipe --no-verify",
    "load+cat",
    "titan-pipe/dcp",
    "titan-pipe/dcp --digest sha256",
    "titan-pipe/dcp --no-verify",
    "dcp_to_torch_save",
    "consolidate",
)


def _warm(work: Path) -> None:
    for d in ("titan", "dcp_root", "consolidate_in"):
        for f in sorted((work / d).rglob("*")):
            if f.is_file():
                with open(f, "rb") as fh:
                    while fh.read(64 * 2**20):
                        pass


def _evict(work: Path) -> None:
    """Drop the (clean, synced) pages of the inputs from the page cache: cold reads, no root needed."""
    for d in ("titan", "dcp_root", "consolidate_in"):
        for f in sorted((work / d).rglob("*")):
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/titan-pipe-bench"))
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--keep", action="store_true", help="keep the synthetic checkpoints")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--repeat", type=int, default=2, help="runs per method; the fastest is reported")
    ap.add_argument("--png", type=Path, help="also draw the figures as a bar chart here")
    ap.add_argument(
        "--cold",
        action="store_true",
        help="evict the inputs from the page cache before every run (disk-bound reads) instead of warming them",
    )
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.run:
        print(json.dumps(run_method(a.run, a.workdir, a.out)))
        return
    work = a.workdir
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    try:
        t = time.perf_counter()
        info = build(work, a.layers)
        print(
            f"checkpoint: tp2 x pp2, dim {info['dim']}, {info['layers']} layers, bf16, "
            f"{info['bytes'] / 1e9:.2f} GB in {info['files']} shards (built in "
            f"{time.perf_counter() - t:.0f} s)",
            flush=True,
        )
        results = {}
        for method in a.methods.split(","):
            for _ in range(a.repeat):
                out = work / "out"
                shutil.rmtree(out, ignore_errors=True)
                subprocess.run(["sync"])
                (_evict if a.cold else _warm)(work)
                t = time.perf_counter()
                r = subprocess.run(
                    [sys.executable, __file__, "--run", method, "--workdir", str(work), "--out", str(out)],
                    capture_output=True,
                    text=True,
                )
                proc = time.perf_counter() - t
                if r.returncode:
                    print(f"{method}: failed\n{r.stderr[-2000:]}", flush=True)
                    break
                res = json.loads(r.stdout.strip().splitlines()[-1])
                res["process"] = proc
                if method not in results or res["wall"] < results[method]["wall"]:
                    results[method] = res
            if method not in results:
                continue
            res = results[method]
            print(
                f"  {method:<24} work {res['wall']:6.2f} s  process {res['process']:6.2f} s  peak RSS "
                f"{res['peak_mb']:7.0f} MB (before the work {res['base_mb']:5.0f} MB)",
                flush=True,
            )
        shutil.rmtree(work / "out", ignore_errors=True)
        floor = results.get("floor", {}).get("wall")
        size_mb = info["bytes"] / 2**20
        print(f"\n{'method':<24} {'work s':>8} {'x floor':>8} {'process s':>10} {'peak RSS MB':>12} {'x ckpt':>7}")
        print(
            f"(repeats: {a.repeat}, fastest shown; inputs {'evicted (cold)' if a.cold else 'in the page cache'}; "
            f"load average {os.getloadavg()[0]:.1f})"
        )
        for method, r in results.items():
            ratio = f"{r['wall'] / floor:8.2f}" if floor else "       -"
            print(
                f"{method:<24} {r['wall']:8.2f} {ratio} {r['process']:10.2f} {r['peak_mb']:12.0f} "
                f"{r['peak_mb'] / size_mb:7.3f}"
            )
        for name, limit in (
            ("titan-pipe", 1.3),
            ("titan-pipe --no-verify", 1.3),
            ("titan-pipe/dcp", 2.0),
            ("titan-pipe/dcp --no-verify", 1.3 if a.cold else 2.0),
        ):
            tp = results.get(name)
            if tp and floor:
                print(
                    f"targets, {name}: wall {tp['wall'] / floor:.2f}x floor (<= {limit}), peak RSS "
                    f"{tp['peak_mb'] / size_mb:.3f}x checkpoint (<= 0.25)"
                )
        if a.png and floor:
            plot(results, floor, size_mb, a.png)
            print(f"chart: {a.png}")
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
