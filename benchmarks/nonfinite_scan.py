"""Benchmark: what the NaN/Inf check adds to convert's sha256 pass over a safetensors source.

Writes one safetensors file of random weights (default 512 MiB: half bf16, half fp32, tensors of
4-32 MiB like a 1B model's), reads it once to warm the page cache, then times in this process,
alternating, best of --repeat:
  sha256        convert/hashing.py scan_file with no tensors (the hash pass as it was)
  sha256+scan   scan_file with the header's tensors (hash + exponent-bit check of every float)
and prints wall and CPU seconds, GB/s and the ratio scan/plain. The conversion runs this pass on
background threads beside the copy, so the ratio bounds the cost; it is not the convert wall time.

    python benchmarks/nonfinite_scan.py [--mib 512] [--repeat 3] [--workdir /tmp/titan-pipe-scan]
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from titan_pipe.convert.hashing import scan_file
from titan_pipe.io.safetensors_io import read_header


def build(path: Path, mib: int) -> int:
    g = torch.Generator().manual_seed(0)
    tensors, total, i = {}, 0, 0
    while total < mib * 2**20:
        dtype = torch.bfloat16 if i % 2 else torch.float32
        rows = [1024, 2048, 4096, 8192][i % 4]
        t = torch.randn(rows, 1024, generator=g).to(dtype)
        tensors[f"t{i}"] = t
        total += t.numel() * t.element_size()
        i += 1
    save_file(tensors, str(path))
    return path.stat().st_size


def timed(fn) -> tuple[float, float]:
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/titan-pipe-scan"))
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    f = a.workdir / "weights.safetensors"
    size = build(f, a.mib)
    spans = [(t.start, t.nbytes, t.dtype, k) for k, t in read_header(f)[0].items()]
    scan_file(f)  # warm the page cache
    best = {"sha256": (1e9, 1e9), "sha256+scan": (1e9, 1e9)}
    for _ in range(a.repeat):
        for name, fn in (("sha256", lambda: scan_file(f)), ("sha256+scan", lambda: scan_file(f, None, spans))):
            w, c = timed(fn)
            best[name] = min(best[name], (w, c))
    digest, bad = scan_file(f, None, spans)
    assert bad == [] and digest == scan_file(f)[0]
    print(f"file {size / 1e6:.0f} MB, {len(spans)} tensors, page cache warm")
    for name, (w, c) in best.items():
        print(f"  {name:12s} wall {w:6.3f} s  cpu {c:6.3f} s  {size / w / 1e9:5.2f} GB/s")
    ratio = best["sha256+scan"][0] / best["sha256"][0]
    print(f"  sha256+scan / sha256: wall {ratio:.2f}x, cpu {best['sha256+scan'][1] / best['sha256'][1]:.2f}x")
    shutil.rmtree(a.workdir)


if __name__ == "__main__":
    main()
