"""Benchmark: per-rank peak RSS of the sharded forward (evaluate's sharded_vs_unified side), resident
vs layer-streamed, at 2 and 8 layers of the same width.

Builds a float32 tp2 x pp2 checkpoint (4 ranks) of random weights per depth (``titan-pipe convert
--tp 2 --pp 2`` of a unified dir: the trainer's layout and manifest), then runs training's sharded
forward (``python -m titan_pipe.training.sharded_forward``, as evaluate starts it) once resident and
once ``--streamed`` over the same tokens, and prints each rank's peak RSS (VmHWM, from done.json),
the float32 weight bytes it holds each way (evaluate's estimate: its stage's parameters, or its
ends plus its largest layer), and the ratios: streamed / resident per rank, and
8 layers / 2 layers for each mode. The outputs of the two runs are checked equal (torch.equal).
Target: the streamed per-rank peak does not grow with depth (8 vs 2 layers within 15 %).

    python benchmarks/sharded_forward.py [--dim 1024] [--ffn 4096] [--vocab 32000] [--workdir DIR]
"""

from __future__ import annotations

import argparse
from titan_pipe.config import ConvertConfig
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def build(work: Path, *, dim: int, ffn: int, vocab: int, layers: int) -> Path:
    """A tp2 pp2 float32 checkpoint of random weights (std 0.02) of the given shape."""
    from safetensors.torch import save_file

    from titan_pipe.convert.api import convert_checkpoint
    from titan_pipe.model.args import ModelArgs
    from titan_pipe.model.names import native_to_hf
    from titan_pipe.model.hf_config import to_hf_config
    from titan_pipe.model.transformer import build_model

    args = ModelArgs(
        dim=dim,
        n_layers=layers,
        n_heads=dim // 64,
        n_kv_heads=max(1, dim // 256),
        vocab_size=vocab,
        ffn_hidden_dim=ffn,
        max_seq_len=256,
    )
    unified = work / f"unified-{layers}"
    unified.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    sd = {
        native_to_hf(n): torch.randn(p.shape, generator=g) * 0.02
        for n, p in build_model(args, seed=None, device="meta").named_parameters()
    }
    save_file(sd, str(unified / "model.safetensors"), metadata={"format": "pt"})
    (unified / "config.json").write_text(json.dumps(to_hf_config(args, torch_dtype="float32")))
    del sd
    out = work / f"ckpt-{layers}"
    convert_checkpoint(unified, out, ConvertConfig(tp=2, pp=2))
    shutil.rmtree(unified)
    return out


def forward(ckpt: Path, tokens: Path, *, streamed: bool) -> dict:
    """One torchrun launch of the sharded forward: seconds, done.json, logits."""
    from safetensors.torch import load_file

    from titan_pipe.records import sharded_outputs as so

    out = Path(tempfile.mkdtemp(prefix="shfwd-"))
    shutil.copy(tokens, out / so.TOKENS_FILE)
    cmd = so.command(world_size=4, checkpoint=ckpt, out_dir=out, device="cpu", streamed=streamed)
    t = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    seconds = time.perf_counter() - t
    done = so.read_done(out)
    logits = load_file(str(out / so.LOGITS_FILE))
    shutil.rmtree(out)
    return {"seconds": seconds, "peak_rss": done["peak_rss"], "streamed": done["streamed"], "logits": logits}


def rank_bytes(ckpt: Path) -> list[tuple[int, int]]:
    """(resident, streamed) weight bytes of each global rank (dp1: rank = pp_rank * tp + tp_rank), as
    evaluate's memory estimate counts them (titan_pipe.evaluate.runners.sharded.pp_rank_bytes)."""
    from titan_pipe.records.checkpoint_format import Manifest
    from titan_pipe.evaluate.runners.sharded import pp_rank_bytes
    from titan_pipe.model.args import ModelArgs

    m = Manifest.load(ckpt)
    return [b for b in pp_rank_bytes(ModelArgs.from_dict(m.model), m.parallel) for _ in range(m.parallel.tp)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--workdir", type=Path, default=None)
    a = ap.parse_args()
    from safetensors.torch import save_file

    from titan_pipe.records.checkpoint_format import Manifest

    work = a.workdir or Path(tempfile.mkdtemp(prefix="titan-shfwd-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    tokens = work / "tokens.safetensors"
    g = torch.Generator().manual_seed(1)
    save_file({f"batch.{i}": torch.randint(0, a.vocab, (1, 64), generator=g) for i in range(2)}, str(tokens))
    peaks = {}
    try:
        for layers in (2, 8):
            ckpt = build(work, dim=a.dim, ffn=a.ffn, vocab=a.vocab, layers=layers)
            held = rank_bytes(ckpt)
            res, st = forward(ckpt, tokens, streamed=False), forward(ckpt, tokens, streamed=True)
            same = all(torch.equal(res["logits"][k], st["logits"][k]) for k in res["logits"])
            total = sum(4 * math.prod(spec.shape) for spec in Manifest.load(ckpt).params.values())
            print(
                f"\n== dim {a.dim}, ffn {a.ffn}, vocab {a.vocab}, {layers} layers, tp2 pp2: "
                f"{total / 1e6:.0f} MB of float32 weights; outputs equal: {same}; "
                f"{res['seconds']:.1f} s resident, {st['seconds']:.1f} s streamed"
            )
            print("rank  weights: resident  streamed   peak RSS: resident  streamed   streamed/resident")
            for r, ((h, big), p_res, p_st) in enumerate(zip(held, res["peak_rss"], st["peak_rss"])):
                print(
                    f"{r:4d}  {h / 1e6:14.0f} MB  {big / 1e6:5.0f} MB  {p_res / 1e6:15.0f} MB  "
                    f"{p_st / 1e6:5.0f} MB  {p_st / p_res:14.2f}x"
                )
            peaks[layers] = (res["peak_rss"], st["peak_rss"])
            shutil.rmtree(ckpt)
        print("\nper-rank peak, 8 layers / 2 layers:")
        for mode, k in (("resident", 0), ("streamed", 1)):
            ratios = [b / a_ for a_, b in zip(peaks[2][k], peaks[8][k])]
            print(f"  {mode:9s} " + "  ".join(f"rank {r}: {x:.3f}x" for r, x in enumerate(ratios)))
    finally:
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
