"""Evaluate's wall time and peak memory against the forward passes it needs, measured in one run.

For each shape it writes random bfloat16 weights as a unified dir (one safetensors shard per
layer; N(0, 0.02), norms 1), exports them as `titan-pipe export --dtype float16 --static --batch 1
--seq-len 64` would, then runs, each in a fresh child process whose own peak RSS is read from wait4():
  floor     what evaluate cannot avoid, in three children one after the other (so they never add
            up in memory): the float32 reference loaded and run over the held-out batches; the
            prefill graph in ONNX Runtime over the same batches; the decode graph's session and
            the decode steps the KV row runs (prompts x (new tokens - 1), static batch 1)
  evaluate  evaluate_model with the default comparison set (2 batches, 2 prompts x 16 new tokens,
            operators on) in each mode asked for: --max-memory BUDGET (streamed: one layer at a
            time) and, where it fits in the RAM free now, auto (whole)
and prints evaluate time / floor time (each timed inside its process, after imports), evaluate time /
the hand check's (transformers float32 + one ONNX Runtime session over the same tokens, logits
compared, loading included: what a person checking an export by hand runs), evaluate time / the
hand check + generation's (the same, then transformers' greedy generate and the ONNX prefill +
decode loop on evaluate's prompts and new tokens, tokens compared) and evaluate peak RSS / the
safetensors weight bytes. With --rounds N the hand checks and evaluate run N times in turn (the floor
once) and each ratio is taken within its round, then the median printed: on a shared machine the
same run can take twice as long from one minute to the next, and a ratio of two runs minutes apart
says more about the machine than about evaluate. Shapes (default all three):
  tinyllama  dim 2048, 22 layers, 32/4 heads, ffn 5632, vocab 32000 (1.10 B params, 2.20 GB bf16)
  llama2w2   Llama-2-7B width: dim 4096, 32 heads, ffn 11008, vocab 32000, 2 layers (0.67 B, 1.33 GB)
  llama2w8   the same with 8 layers (1.88 B, 3.76 GB): the same streamed peak as llama2w2 is what
             says a 70B model (80 such layers, dim 8192) can be evaluated within a fixed budget
Everything it wrote is deleted at the end. Needs ~2.2x the largest shape's bf16 weights on disk.

    python benchmarks/evaluate.py [--shapes tinyllama,llama2w2,llama2w8] [--budget 2GB]
                                  [--modes streamed,whole] [--rounds N] [--keep-under DIR] [--metrics] [--linear]
                                  [--reads]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import export as export_bench  # noqa: E402  (the random-weights writer and the measured child runner)

SETTINGS = {"batches": 2, "batch_size": 1, "seq_len": 64, "prompts": 2, "new_tokens": 16}  # evaluate's defaults
# on a static batch-1, 64-token export (a static graph fixes the batch shape)
WHOLE_X = 6.0  # whole mode runs only where this many times the bf16 weight bytes are free

CHILD_EXPORT = """
import sys
from pathlib import Path
from titan_pipe.config import ExportConfig
from titan_pipe.convert.onnx.export import export_model
export_model(Path(sys.argv[1]), Path(sys.argv[2]), ExportConfig(dtype="float16", dynamic=False, batch=1, seq_len=64,
                                                                atc=False, hash_weights=False))
"""

CHILD_WRITE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import evaluate as bench, export
args = bench.shapes()[sys.argv[2]]
print(json.dumps(export.write_random_model(export.Path(sys.argv[3]), args, dtype="bfloat16", norms_one=True)))
"""

# the held-out batches evaluate uses for a model without a tokenizer: seeded random ids
_BATCHES = """
from titan_pipe.evaluate.batches import random_eval_data
s = {settings}
ev = random_eval_data(vocab_size={vocab}, n_batches=s["batches"], batch_size=s["batch_size"], seq_len=s["seq_len"],
                      n_prompts=s["prompts"], prompt_len=16, why="benchmark")
"""

CHILD_FLOOR_REF = """
import json, sys, time, torch
from pathlib import Path
from titan_pipe.model.load import load_unified_model
{batches}
t = time.perf_counter()
model, _ = load_unified_model(Path(sys.argv[1]), dtype="float32")
with torch.no_grad():
    for b in ev.batches:
        model(b)
print(json.dumps({{"seconds": time.perf_counter() - t}}))
"""

CHILD_FLOOR_ORT = """
import json, sys, time, numpy as np
from titan_pipe.graphs.generation import ort_session
{batches}
t = time.perf_counter()
s = ort_session(sys.argv[1])
for b in ev.batches:
    ids = b.numpy()
    s.run(["logits"], {{"input_ids": ids, "attention_mask": np.ones_like(ids),
                       "position_ids": np.arange(ids.shape[1])[None].repeat(ids.shape[0], 0)}})
print(json.dumps({{"seconds": time.perf_counter() - t}}))
"""

CHILD_FLOOR_DECODE = """
import json, sys, time, numpy as np
from titan_pipe.graphs.generation import ort_session
t = time.perf_counter()
s = ort_session(sys.argv[1])
feeds = {{}}
for i in s.get_inputs():
    dims = list(i.shape)
    feeds[i.name] = (np.zeros(dims, np.float16) if "float16" in i.type else
                     np.ones(dims, np.int64) if i.name == "attention_mask" else np.zeros(dims, np.int64))
for _ in range(int(sys.argv[2])):
    s.run(None, feeds)
print(json.dumps({{"seconds": time.perf_counter() - t}}))
"""

# The hand-written check evaluate is held against (issue 36): transformers in float32 and one ONNX
# Runtime session over the same held-out tokens, their logits compared; loading both included.
_HAND_LOGITS = """
import json, sys, time, numpy as np, torch
from titan_pipe.evaluate.run import ragged_prompts
from titan_pipe.graphs.generation import generate, ort_session
{batches}
t = time.perf_counter()
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
s = ort_session(sys.argv[2])
worst = 0.0
with torch.no_grad():
    for b in ev.batches:
        ref = model(b).logits.numpy()
        ids = b.numpy()
        got = s.run(["logits"], {{"input_ids": ids, "attention_mask": np.ones_like(ids),
                                 "position_ids": np.arange(ids.shape[1])[None].repeat(ids.shape[0], 0)}})[0]
        worst = max(worst, float(np.abs(got.astype(np.float64) - ref).max()))
"""
CHILD_HAND = (
    _HAND_LOGITS
    + """
print(json.dumps({{"seconds": time.perf_counter() - t, "max_abs": worst}}))
"""
)
# The same, plus what a person checking the deployed generation loop by hand adds: transformers'
# greedy generate and the ONNX prefill + decode loop (titan_pipe.graphs.generation) on the same prompts
# and new tokens as evaluate's KV row, their tokens compared.
CHILD_HAND_GEN = (
    _HAND_LOGITS
    + """
prompts, n_new = ragged_prompts(ev.prompts), {new_tokens}
with torch.no_grad():
    ref_tokens = [model.generate(torch.tensor([q]), max_new_tokens=n_new, do_sample=False,
                                 pad_token_id=0)[0, len(q):].tolist() for q in prompts]
got = generate(prefill=s, decode=ort_session(sys.argv[3]), prompts=prompts, max_new_tokens=n_new).new_tokens.tolist()
agree = float(np.mean([a == b for r, g in zip(ref_tokens, got) for a, b in zip(r, g)]))
print(json.dumps({{"seconds": time.perf_counter() - t, "max_abs": worst, "agreement": agree}}))
"""
)

CHILD_EVALUATE = """
import json, sys, time
from pathlib import Path
from titan_pipe.config import EvaluateConfig
from titan_pipe.evaluate.api import evaluate_model
t = time.perf_counter()
r = evaluate_model(out_dir=Path(sys.argv[3]), model_dir=Path(sys.argv[1]), onnx=Path(sys.argv[2]),
                   settings=EvaluateConfig(max_memory=sys.argv[4]))
print(json.dumps({"seconds": time.perf_counter() - t, "mode": r.summary.memory_mode, "passed": r.passed,
                  "verdict": r.summary.verdict[:160]}))
"""


def shapes() -> dict:
    from titan_pipe.model.args import ModelArgs

    wide = dict(dim=4096, n_heads=32, vocab_size=32000, ffn_hidden_dim=11008, max_seq_len=4096)
    return {
        "tinyllama": ModelArgs(
            dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, vocab_size=32000, ffn_hidden_dim=5632, max_seq_len=2048
        ),
        "llama2w2": ModelArgs(n_layers=2, **wide),
        "llama2w8": ModelArgs(n_layers=8, **wide),
        "tinyllama8": ModelArgs(
            dim=2048, n_layers=8, n_heads=32, n_kv_heads=4, vocab_size=32000, ffn_hidden_dim=5632, max_seq_len=2048
        ),  # 0.48 B, 0.96 GB: issue 36's size
        "tiny": ModelArgs(
            dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=1000, ffn_hidden_dim=512, max_seq_len=512
        ),  # a seconds-long check that the script runs
    }


def _child(code: str, *argv) -> tuple[dict, float]:
    """(the child's json line, its own peak RSS in GB)."""
    _, rss, out = export_bench.run_measured([sys.executable, "-c", code, *map(str, argv)])
    return json.loads(out.strip().splitlines()[-1]), rss


def floor(md: Path, onnx: Path, vocab: int) -> dict:
    batches = _BATCHES.format(settings=SETTINGS, vocab=vocab)
    ref, ref_rss = _child(CHILD_FLOOR_REF.format(batches=batches), md)
    ort, ort_rss = _child(CHILD_FLOOR_ORT.format(batches=batches), onnx)
    steps = SETTINGS["prompts"] * (SETTINGS["new_tokens"] - 1)  # static batch 1: one prompt a batch
    dec, dec_rss = _child(CHILD_FLOOR_DECODE.format(), onnx.parent / "decode.onnx", steps)
    parts = {
        "reference forward": ref["seconds"],
        "ORT forward": ort["seconds"],
        f"ORT decode ({steps} steps)": dec["seconds"],
    }
    return {"seconds": sum(parts.values()), "parts": parts, "peak_rss": max(ref_rss, ort_rss, dec_rss)}


def _fits_whole(weight_bytes: int) -> bool:
    """Whole mode peaked at 5.3x the bf16 bytes on the issue's model (the float32 reference, then the
    graphs' float32 copies in ORT); 6x of what is free now leaves the machine's other users room."""
    import psutil

    return WHOLE_X * weight_bytes < psutil.virtual_memory().available


def bench_shape(name: str, root: Path, budget: str, modes: list[str], rounds: int = 1) -> dict:
    """The floor once, then ``rounds`` rounds of: the hand check, the hand check + generation, and
    evaluate in each mode, one after the other. Each round's ratios divide evaluate's time by the
    hand checks' of the same round (so a slow spell on the machine lands on both sides more often
    than on one); with several rounds the median of each ratio is printed too."""
    import statistics

    from titan_pipe.model.args import count_params

    args = shapes()[name]
    md, out = root / name / "model", root / name / "onnx"
    wrote, _ = _child(CHILD_WRITE, Path(__file__).parent, name, md)
    export_bench.run_measured([sys.executable, "-c", CHILD_EXPORT, str(md), str(out)])
    print(
        f"\n== {name}: dim {args.dim}, {args.n_layers} layers, vocab {args.vocab_size}: "
        f"{count_params(args) / 1e9:.2f} B params, {wrote / 1e9:.2f} GB bf16; export float16, static 1 x 64"
    )
    f = floor(md, out / "model.onnx", args.vocab_size)
    print(
        f"floor {f['seconds']:.1f} s ("
        + ", ".join(f"{k} {v:.1f} s" for k, v in f["parts"].items())
        + f"), its largest child peak RSS {f['peak_rss']:.2f} GB"
    )
    runs = [m for m in modes if m != "whole" or _fits_whole(wrote)]
    if "whole" in modes and "whole" not in runs:
        print(f"whole: skipped (needs ~{WHOLE_X * wrote / 1e9:.1f} GB; less is free now)")
    results: dict = {m: [] for m in runs}
    for k in range(rounds):
        if rounds > 1:
            print(f"-- round {k + 1} of {rounds}")
        hand, hand_rss = _child(
            CHILD_HAND.format(batches=_BATCHES.format(settings=SETTINGS, vocab=args.vocab_size)), md, out / "model.onnx"
        )
        print(
            f"hand check (transformers float32 + one ORT session, logits over {SETTINGS['batches']} x "
            f"{SETTINGS['seq_len']} tokens, loading included) {hand['seconds']:.1f} s, peak RSS {hand_rss:.2f} GB, "
            f"max |logits diff| {hand['max_abs']:.2e}"
        )
        gen, gen_rss = _child(
            CHILD_HAND_GEN.format(
                batches=_BATCHES.format(settings=SETTINGS, vocab=args.vocab_size), new_tokens=SETTINGS["new_tokens"]
            ),
            md,
            out / "model.onnx",
            out / "decode.onnx",
        )
        print(
            f"hand check + generation (the same, then transformers generate and the ONNX prefill + decode loop, "
            f"{SETTINGS['prompts']} prompts x {SETTINGS['new_tokens']} new tokens, tokens compared) "
            f"{gen['seconds']:.1f} s, peak RSS {gen_rss:.2f} GB, token agreement {gen['agreement']:.2f}"
        )
        for mode in runs:
            setting = budget if mode == "streamed" else "auto"
            r, rss = _child(CHILD_EVALUATE, md, out / "model.onnx", root / name / f"rep-{mode}", setting)
            results[mode].append(
                {
                    "seconds": r["seconds"],
                    "time_ratio": r["seconds"] / f["seconds"],
                    "peak_rss": rss,
                    "rss_ratio": rss * 1e9 / wrote,
                    "ran": r["mode"],
                    "hand_ratio": r["seconds"] / hand["seconds"],
                    "hand_gen_ratio": r["seconds"] / gen["seconds"],
                }
            )
            print(
                f"evaluate --max-memory {setting}: ran {r['mode']}, {r['seconds']:.1f} s = "
                f"{r['seconds'] / f['seconds']:.2f}x the floor, {r['seconds'] / hand['seconds']:.2f}x the hand check, "
                f"{r['seconds'] / gen['seconds']:.2f}x the hand check + generation; "
                f"peak RSS {rss:.2f} GB = {rss * 1e9 / wrote:.3f}x the "
                f"weights; {'PASS' if r['passed'] else 'FAIL'}: {r['verdict'][:100]}"
            )
    if rounds > 1:
        for mode, rs in results.items():
            med = {k: statistics.median(r[k] for r in rs) for k in ("hand_ratio", "hand_gen_ratio", "rss_ratio")}
            print(
                f"median of {rounds} rounds, {mode}: {med['hand_ratio']:.2f}x the hand check (rounds: "
                + ", ".join(f"{r['hand_ratio']:.2f}" for r in rs)
                + f"), {med['hand_gen_ratio']:.2f}x the hand "
                f"check + generation, peak RSS {med['rss_ratio']:.3f}x the weights"
            )
    shutil.rmtree(root / name, ignore_errors=True)
    return {m: max(rs, key=lambda r: r["peak_rss"]) for m, rs in results.items() if rs}


def bench_metrics(tokens: int, vocab: int) -> None:
    """compare_tensors on a (tokens, vocab) logits pair vs one float64 |c - r|.max() pass."""
    import time

    import numpy as np
    import torch

    from titan_pipe.evaluate.metrics import compare_tensors

    g = torch.Generator().manual_seed(0)
    r = torch.randn(tokens, vocab, generator=g)
    c = r + 1e-3 * torch.randn(tokens, vocab, generator=g)
    t = time.perf_counter()
    ref = float(np.abs(c.numpy().astype(np.float64) - r.numpy().astype(np.float64)).max())
    t_floor = time.perf_counter() - t
    t = time.perf_counter()
    m = compare_tensors(r, c)
    t_metrics = time.perf_counter() - t
    assert abs(m.max_abs - ref) < 1e-12
    print(
        f"metrics: {r.numel() / 1e6:.1f}M logits, compare_tensors {t_metrics:.2f} s = {t_metrics / t_floor:.1f}x "
        f"one float64 |c-r|.max() pass ({t_floor:.2f} s)"
    )


def bench_linear(rows: int = 2, out_f: int = 32000, in_f: int = 2048, repeat: int = 5) -> None:
    """The reference's linear layer over a bfloat16 weight (evaluate/runners/pytorch.StoredLinear,
    cast a band at a time) vs a float32 copy held and vs casting the whole weight each call, on the
    same input; StoredLinear's result is checked equal to the whole cast's bit for bit."""
    import time

    import torch
    import torch.nn.functional as F

    from titan_pipe.evaluate.runners.pytorch import StoredLinear

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(out_f, in_f, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(rows, in_f, generator=g)
    held, lin = w.float(), StoredLinear(w, None, exact={})
    assert torch.equal(lin(x), F.linear(x, held)) and all(lin.exact.values())

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    whole, copy, banded = (best(lambda: F.linear(x, w.float())), best(lambda: F.linear(x, held)), best(lambda: lin(x)))
    print(
        f"linear {out_f} x {in_f} bfloat16, {rows} input rows (best of {repeat}): StoredLinear {banded * 1e3:.1f} ms "
        f"= {banded / copy:.2f}x a float32 copy held ({copy * 1e3:.1f} ms, 2x the memory), "
        f"{banded / whole:.2f}x casting the whole weight per call ({whole * 1e3:.1f} ms)"
    )


def bench_reads(root: Path, name: str = "tinyllama8", rounds: int = 4, n_new: int = 16) -> None:
    """The streamed reference's greedy generation (evaluate's "reference generation", 2 prompts) with
    its linear weights used from the files' pages (SafetensorsWeights.mapped) vs read into its buffer
    (the plain-read path), alternating in one process, the same tokens checked."""
    import gc
    import time

    import torch

    from titan_pipe.evaluate.runners.pytorch import LayeredModel
    from titan_pipe.model.weights import open_weights

    md = root / name / "reads"
    export_bench.write_random_model(md, shapes()[name], dtype="bfloat16", norms_one=True)
    gc.freeze()  # as evaluate_model does: the collections between layers skip what exists now
    prompts, times, tokens = [list(range(5, 21)), list(range(30, 42))], {"mapped": [], "read": []}, {}
    for k in range(rounds):
        for how in ("mapped", "read") if k % 2 == 0 else ("read", "mapped"):
            src = open_weights(md)
            if how == "read":
                src._maps = None  # the path a kernel without MADV_POPULATE_READ takes
            start = time.perf_counter()
            tokens[how] = LayeredModel(src, keep=False).greedy(prompts, n_new)
            times[how].append(time.perf_counter() - start)
    gc.unfreeze()
    shutil.rmtree(root / name, ignore_errors=True)
    assert torch.equal(tokens["mapped"], tokens["read"])
    print(
        f"streamed reference, {n_new} greedy steps of {name} ({rounds} runs each, alternating): weights from the "
        f"files' pages {min(times['mapped']):.2f} s at best ("
        + ", ".join(f"{t:.2f}" for t in times["mapped"])
        + f") = {min(times['mapped']) / min(times['read']):.2f}x reading them into the buffer "
        f"{min(times['read']):.2f} s (" + ", ".join(f"{t:.2f}" for t in times["read"]) + ")"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="tinyllama,llama2w2,llama2w8")
    ap.add_argument(
        "--budget",
        default="2GB",
        help="--max-memory of the streamed runs (a 7B-width "
        "decode layer with its static 4096-slot cache needs ~1.9 GB)",
    )
    ap.add_argument("--modes", default="streamed,whole")
    ap.add_argument("--keep-under", type=Path, default=None, help="scratch parent dir (default: system temp)")
    ap.add_argument("--metrics", action="store_true", help="also time compare_tensors on 1024 x 32000 logits")
    ap.add_argument("--linear", action="store_true", help="also time the reference's banded linear layer")
    ap.add_argument(
        "--reads",
        action="store_true",
        help="also time the streamed reference's greedy steps "
        "with its weights from the files' pages vs read into its buffer",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of hand checks + evaluate per shape (ratios within a round; the median printed)",
    )
    opts = ap.parse_args()
    print(
        f"load average at start (1/5/15 min): {', '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs"
    )
    if opts.metrics:
        bench_metrics(1024, 32000)
    if opts.linear:
        bench_linear()
    root = Path(tempfile.mkdtemp(prefix="titan-evaluate-bench-", dir=opts.keep_under))
    results = {}
    try:
        if opts.reads:
            bench_reads(root)
        for name in opts.shapes.split(","):
            results[name] = bench_shape(name, root, opts.budget, opts.modes.split(","), opts.rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        print(f"\nremoved {root}")
        print(f"load average at end (1/5/15 min): {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    two, eight = (results.get(n, {}).get("streamed") for n in ("llama2w2", "llama2w8"))
    if two and eight:
        print(
            f"7B width, streamed: peak RSS {two['peak_rss']:.2f} GB with 2 layers, {eight['peak_rss']:.2f} GB with "
            f"8 ({eight['peak_rss'] / two['peak_rss']:.3f}x; target within 15%)"
        )


if __name__ == "__main__":
    main()
