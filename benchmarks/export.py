"""Export wall time and peak memory against `cp` of the same weights, for every dtype pair, in one run.

For one LLaMA shape it writes random weights as a sharded unified dir in each source dtype the
pairs need, then, per source, each as a fresh child process whose own peak RSS is read from wait4():
  cp        `cp -r` of the unified dir (the I/O floor): one untimed, then one before and --repeat - 1
            after that source's exports
  export    export_model to each target dtype (prefill + decode graphs, weights streamed, cast and
            hashed into the data files, two by default; checks, export.json; atc skipped): the default
            (each data file's XXH3-128 digest) --repeat times, --digest sha256 and --no-hash-weights once
and prints export time / cp time and peak RSS / weights (the smaller of the source and the export
bytes; the largest peak of the repeats). Each export deletes the previous export's output after its
imports; each cp's copy is deleted right after it.

Pre-backed pages (the default; --as-drawn turns it off): these VMs hand memory that has been free for
a moment back to the host (free page reporting, /sys/module/page_reporting), and the first write to
a page the host took back costs ~1-10 s a GB of system time, against ~0.2 s for a page the host
backed a moment ago: a `dd` of 2 GB took 21.9 s, the same `dd` right after it 0.49 s; the same
bf16 -> fp32 export alternately as drawn and pre-backed: 27.3/2.6/3.0 s against 1.9/1.3/1.5 s. Which
kind a run draws depends on what ran before it and when, not on the program, so right before each
timed run's clock (cp and export alike, and untimed) a file of the bytes that run writes is written
and deleted: the pages it frees are the ones the run's output takes. That is the page cache a
bare-metal host gives every write; the cost of backing them is printed apart. Repeats (--repeat,
default 3) still run, every run is printed and the fastest is held to the targets.
Targets (the default digest's row): wall <= 2.5x cp and peak RSS <= 0.2x the weights, at >= 2 GB of
weights; the sha256 and no-hash rows are figures.

Pairs (default all): bf16:fp16 fp32:fp16 fp16:fp16 bf16:fp32 (what users run: models train in bf16,
ATC wants fp16). Shapes:
  llama2w    Llama-2-7B width with few layers: dim 4096, 32 heads, ffn 11008, vocab 32000
             (--wide-layers, default 4: 1.07 B params, 2.14 GB in bf16/fp16, 4.28 GB in fp32)
  tinyllama  dim 2048, 22 layers, 32/4 heads, ffn 5632, vocab 32000 (1.10 B params)
  tiny       a seconds-long check that the script runs
Everything it wrote is deleted at the end. Needs ~3x the largest source's weights free on disk.

    python benchmarks/export.py [--shape llama2w] [--wide-layers 4] [--pairs bf16:fp16,...] [--repeat 3]
                                [--as-drawn] [--before PYTHON] [--keep-under DIR] [--json FILE]
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
import json, os, sys, time
from pathlib import Path
import shutil
t = time.perf_counter()
from titan_pipe.convert.onnx.export import export_model
shutil.rmtree(sys.argv[3], ignore_errors=True)  # the previous run's output: its pages are free from here
nbytes, scratch = int(sys.argv[5]), Path(sys.argv[6])
if nbytes:  # pre-back the pages this run writes (--as-drawn: off); the same function as cp's, untimed
    sys.path.insert(0, sys.argv[7])
    import export as bench
    prebacked = bench.preback_pages(scratch, nbytes)
else:
    prebacked = 0.0
t1, c1 = time.perf_counter(), os.times()
mode = sys.argv[4]
import inspect  # a --before titan_pipe may predate --digest (its only digest was sha256)
params = inspect.signature(export_model).parameters
if "settings" in params:  # export_model(model_dir, out_dir, ExportConfig)
    from titan_pipe.config import ExportConfig
    settings = ExportConfig(dtype=sys.argv[2], atc=False, hash_weights=mode != "nohash",
                            **({"digest": mode} if mode == "sha256" else {}))
    r = export_model(Path(sys.argv[1]), Path(sys.argv[3]), settings)
else:  # a --before titan_pipe: keyword options
    digest = {"digest": mode} if mode == "sha256" and "digest" in params else {}
    r = export_model(model_dir=Path(sys.argv[1]), out_dir=Path(sys.argv[3]), dtype=sys.argv[2], run_atc=False,
                     hash_weights=mode != "nohash", **digest)
c2 = os.times()
print(json.dumps({"import": t1 - t - prebacked, "preback_s": prebacked, "seconds": time.perf_counter() - t1, "timings": r.summary.timings_seconds,
                  "cpu_export": c2.user - c1.user + c2.system - c1.system, "torch": "torch" in sys.modules}))
"""

# Weights are written by a child too: this process stays free of torch, so a child's peak RSS
# (which counts the parent's image it was forked from) is the child's own.
CHILD_WRITE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import export as bench
args = bench.shapes(int(sys.argv[4]))[sys.argv[2]]
print(json.dumps(bench.write_random_model(bench.Path(sys.argv[3]), args, sys.argv[5])))
"""

NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
SIZES = {"bf16": 2, "fp16": 2, "fp32": 4}
DEFAULT_PAIRS = "bf16:fp16,fp32:fp16,fp16:fp16,bf16:fp32"
MODES = ("default", "sha256", "nohash")  # export.json's digest: XXH3-128 (the default), sha256, none
# CPU seconds of each measured child, in order: on a shared machine the wall clock measures the
# other jobs too, the CPU time what this work costs (cp's copy runs in the kernel, on one thread).
CPU_SECONDS: list[float] = []
PREBACK_SECONDS: list[float] = []  # untimed: writing and deleting the pages each run then writes into

# The figures of the torch-cast exporter this replaced (docs/export.md), for the case.
BEFORE = (
    "before (cast through torch, 32 MB chunks, no overlap): Llama-2-7B width fp32 -> fp16 5.15x cp "
    "(4.38x --no-hash-weights), peak RSS 0.32x the weights"
)


def shapes(wide_layers: int) -> dict:
    from titan_pipe.model.args import ModelArgs

    return {
        "tinyllama": ModelArgs(
            dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, vocab_size=32000, ffn_hidden_dim=5632, max_seq_len=2048
        ),
        "llama2w": ModelArgs(
            dim=4096, n_layers=wide_layers, n_heads=32, vocab_size=32000, ffn_hidden_dim=11008, max_seq_len=4096
        ),
        "tiny": ModelArgs(
            dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=1000, ffn_hidden_dim=512, max_seq_len=512
        ),
    }


def write_random_model(out: Path, args, dtype: str = "float32", seed: int = 0, norms_one: bool = False) -> int:
    """A unified dir with one safetensors shard per layer (so writing never holds the whole model):
    N(0, 0.02) weights stored in ``dtype``; ``norms_one``: norm weights 1 (activations of a usual size)."""
    import torch
    from safetensors.torch import save_file

    from titan_pipe.model.names import native_to_hf
    from titan_pipe.model.hf_config import to_hf_config
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
        shard = {
            native_to_hf(n): (
                torch.ones(s) if norms_one and n.endswith("norm.weight") else torch.randn(s, generator=g) * 0.02
            ).to(getattr(torch, dtype))
            for n, s in params
        }
        save_file(shard, str(out / fname))
        total += sum(t.numel() * t.element_size() for t in shard.values())
        weight_map.update({k: fname for k in shard})
        del shard
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(to_hf_config(args)))
    return total


def run_measured(argv: list[str]) -> tuple[float, float, str]:
    """(wall seconds, the child's own peak RSS in GB from wait4, its stdout); exits on failure.
    The child's CPU seconds (user + system, all its threads) go to CPU_SECONDS[-1]."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t
        proc.returncode = os.waitstatus_to_exitcode(status)
        CPU_SECONDS.append(usage.ru_utime + usage.ru_stime)
        out.seek(0), err.seek(0)
        if proc.returncode != 0:
            raise SystemExit(f"{argv[0]} failed ({proc.returncode}):\n{err.read()[-3000:]}")
        return wall, usage.ru_maxrss * 1024 / 1e9, out.read()


def preback_pages(root: Path, nbytes: int) -> float:
    """Write and delete a file of ``nbytes`` under ``root`` (seconds it took): the pages it frees are
    the ones the next write takes, backed by the host a moment ago (these VMs back a fresh page
    slowly on its first write; see the module docstring)."""
    path, block = root / "preback", b"\1" * 2**20  # 1 MB: the child's peak RSS stays the export's
    t = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(-(-nbytes // len(block))):
            f.write(block)
    path.unlink()
    return time.perf_counter() - t


def cp_floor(src: Path, dst: Path, preback: int) -> tuple[float, float]:
    """(wall, CPU seconds) of `cp -r`, right after ``preback`` bytes of pages are pre-backed (0: none)."""
    if preback:
        PREBACK_SECONDS.append(preback_pages(dst.parent, preback))
    wall, _, _ = run_measured(["cp", "-r", str(src), str(dst)])
    shutil.rmtree(dst)
    return wall, CPU_SECONDS[-1]


def export_runs(src: Path, target: str, out: Path, python: str, repeat: int, preback: int) -> dict:
    """Default (xxh3_128; ``repeat`` times, the fastest kept, every time listed), --digest sha256 and
    --no-hash-weights exports of ``src`` to ``target`` by the titan_pipe that ``python`` imports:
    {mode: (wall, rss, child's json)}."""
    runs = {}
    for mode in MODES:
        tries = []
        for _ in range(repeat if mode == "default" else 1):
            wall, rss, text = run_measured(
                [
                    python,
                    "-c",
                    CHILD_EXPORT,
                    str(src),
                    NAMES[target],
                    str(out),
                    mode,
                    str(preback),
                    str(out.parent),
                    str(Path(__file__).parent),
                ]
            )
            child = json.loads(text.strip().splitlines()[-1])
            PREBACK_SECONDS.append(child.get("preback_s", 0.0))
            tries.append((wall, rss, {**child, "cpu_s": CPU_SECONDS[-1]}))
        best = min(tries, key=lambda r: r[2]["seconds"])
        runs[mode] = (best[0], max(r[1] for r in tries), {**best[2], "runs_s": [r[2]["seconds"] for r in tries]})
    shutil.rmtree(out)  # each run deletes its predecessor's output after its imports, before its clock starts
    return runs


def row_figures(runs: dict, floor: float, floor_cpu: float, weights_gb: float) -> dict:
    return {
        mode: {
            "seconds": child["seconds"],
            "x_cp": child["seconds"] / floor,
            "process_s": wall,
            "import_s": child["import"],
            "rss_gb": rss,
            "x_weights": rss / weights_gb,
            "cpu_s": child["cpu_s"],
            "cpu_export_s": child["cpu_export"],
            "x_cp_cpu": child["cpu_export"] / floor_cpu,
            "torch_imported": child["torch"],
            "timings": child["timings"],
            "runs_s": child["runs_s"],
        }
        for mode, (wall, rss, child) in runs.items()
    }


def bench_source(src_key: str, targets: list[str], args, root: Path, opts) -> list[dict]:
    """Write the weights in one source dtype, then cp / exports (/ the --before exports) / cp; a row per target."""
    from titan_pipe.model.args import count_params

    n = count_params(args)
    src = root / f"model-{src_key}"
    write_s, _, text = run_measured(
        [
            sys.executable,
            "-c",
            CHILD_WRITE,
            str(Path(__file__).parent),
            opts.shape,
            str(src),
            str(opts.wide_layers),
            NAMES[src_key],
        ]
    )
    t = time.perf_counter()
    os.sync()  # flushed, as a checkpoint is by the time it is exported: no writeback of it during the timings
    print(
        f"\n-- source {src_key}: wrote {json.loads(text) / 1e9:.2f} GB of random weights in {write_s:.1f} s, "
        f"flushed in {time.perf_counter() - t:.1f} s"
    )
    cp_back = 0 if opts.as_drawn else n * SIZES[src_key]
    back = {t: 0 if opts.as_drawn else n * SIZES[t] for t in targets}  # the data files' bytes
    cp_floor(src, root / "copy", 0)  # untimed: the source's pages are in the page cache from here on
    cp_runs = [cp_floor(src, root / "copy", cp_back)]
    runs = {t: export_runs(src, t, root / "onnx", sys.executable, opts.repeat, back[t]) for t in targets}
    before = (
        {t: export_runs(src, t, root / "onnx", opts.before, opts.repeat, back[t]) for t in targets}
        if opts.before
        else {}
    )
    cp_runs += [cp_floor(src, root / "copy", cp_back) for _ in range(opts.repeat - 1)]
    shutil.rmtree(src)
    cps = [w for w, _ in cp_runs]
    floor, floor_cpu = min(cps), min(c for _, c in cp_runs)
    rows = []
    for t in targets:
        weights_gb = n * min(SIZES[src_key], SIZES[t]) / 1e9
        row = {
            "pair": f"{src_key}->{t}",
            "cp_s": floor,
            "cp_runs_s": cps,
            "cp_cpu_s": floor_cpu,
            "weights_gb": weights_gb,
            "source_bytes": n * SIZES[src_key],
            "output_bytes": n * SIZES[t],
            **row_figures(runs[t], floor, floor_cpu, weights_gb),
        }
        if t in before:
            row["before"] = row_figures(before[t], floor, floor_cpu, weights_gb)
        rows.append(row)
        print(
            f"{row['pair']:>10}: cp {floor:.2f} s (runs {', '.join(f'{c:.2f}' for c in cps)}); "
            f"export {row['default']['seconds']:.2f} s = {row['default']['x_cp']:.2f}x cp "
            f"(runs {', '.join(f'{x:.2f}' for x in row['default']['runs_s'])}), "
            f"--digest sha256 {row['sha256']['seconds']:.2f} s = {row['sha256']['x_cp']:.2f}x, "
            f"--no-hash-weights {row['nohash']['seconds']:.2f} s = {row['nohash']['x_cp']:.2f}x; "
            f"peak RSS {row['default']['rss_gb']:.3f} GB = {row['default']['x_weights']:.3f}x the weights; "
            f"torch imported: {row['default']['torch_imported']}"
        )
    return rows


def add_output_floor(rows: list[dict]) -> None:
    """``x_cp_out`` on each row's default export: its time over the fastest `cp` of as many bytes as
    it writes, where this run copied a source of that size (a bf16 -> fp32 export writes what `cp`
    of the fp32 source writes); a figure beside the target, which is against `cp` of the same weights."""
    floors: dict[int, float] = {}
    for r in rows:
        floors[r["source_bytes"]] = min(r["cp_s"], floors.get(r["source_bytes"], r["cp_s"]))
    for r in rows:
        out = floors.get(r["output_bytes"])
        for fig in (r, r.get("before")):
            if fig is not None:
                fig["default"]["x_cp_out"] = fig["default"]["seconds"] / out if out else None


def print_table(rows: list[dict]) -> None:
    add_output_floor(rows)
    print(
        f"\n{'pair':>10}{'':>8}{'weights GB':>11}{'cp s':>7}{'export s':>10}{'x cp':>7}{'x cp out':>9}{'sha256 s':>10}"
        f"{'x cp':>7}{'no-hash s':>11}{'x cp':>7}{'CPU x cp':>10}{'RSS GB':>8}{'x weights':>11}{'process s':>11}  targets"
    )
    for r in rows:
        for label, fig in (("after", r), ("before", r.get("before"))):
            if fig is None:
                continue
            h, sh, nh = fig["default"], fig.get("sha256"), fig["nohash"]
            sha = f"{sh['seconds']:>10.2f}{sh['x_cp']:>7.2f}" if sh else f"{'-':>10}{'-':>7}"
            ok = "ok" if h["x_cp"] <= 2.5 and h["x_weights"] <= 0.2 else "MISSED"
            out = f"{h['x_cp_out']:>9.2f}" if h.get("x_cp_out") else f"{'-':>9}"
            print(
                f"{r['pair']:>10}{label:>8}{r['weights_gb']:>11.2f}{r['cp_s']:>7.2f}{h['seconds']:>10.2f}"
                f"{h['x_cp']:>7.2f}{out}{sha}{nh['seconds']:>11.2f}{nh['x_cp']:>7.2f}{h['x_cp_cpu']:>10.2f}{h['rss_gb']:>8.3f}"
                f"{h['x_weights']:>11.3f}{h['process_s']:>11.2f}  {ok} (<= 2.5x cp, <= 0.2x weights)"
            )
    print(
        "export s: the default (XXH3-128 digest of each data file), against the targets; sha256 s: --digest sha256; "
        "no-hash s: --no-hash-weights"
    )
    print(
        "x cp out: over the fastest cp of as many bytes as the export writes (a source of that size, where "
        "this run copied one); a figure, not a target"
    )
    print("CPU x cp: CPU seconds of export_model (every thread; not the interpreter's start and imports) over cp's")


def positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text}: at least 1 run is needed")
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama2w", choices=("llama2w", "tinyllama", "tiny"))
    ap.add_argument("--wide-layers", type=int, default=4, help="layers of the Llama-2-7B-width shape")
    ap.add_argument("--pairs", default=DEFAULT_PAIRS, help="SRC:DST,... from bf16, fp16, fp32 (DST fp16 or fp32)")
    ap.add_argument("--keep-under", type=Path, default=None, help="scratch parent dir (default: system temp)")
    ap.add_argument(
        "--repeat",
        type=positive_int,
        default=3,
        help="timed cp runs and default exports per pair; the fastest of each is the figure",
    )
    ap.add_argument(
        "--as-drawn",
        action="store_true",
        help="do not pre-back each run's output pages: time them as the VM hands them out",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument(
        "--before",
        default=None,
        metavar="PYTHON",
        help="also export with this interpreter's titan_pipe (e.g. a checkout of the previous "
        "version's venv): before/after rows against the same cp, in the same run",
    )
    opts = ap.parse_args()
    pairs = [tuple(p.split(":")) for p in opts.pairs.split(",")]
    by_source: dict[str, list[str]] = {}
    for s, t in pairs:
        if s not in NAMES or t not in ("fp16", "fp32"):
            raise SystemExit(f"--pairs: {s}:{t} is not SRC:DST with SRC in bf16/fp16/fp32 and DST fp16/fp32")
        by_source.setdefault(s, []).append(t)
    args = shapes(opts.wide_layers)[opts.shape]
    from titan_pipe.model.args import count_params

    n = count_params(args)
    print(
        f"{opts.shape}: dim {args.dim}, {args.n_layers} layers, ffn {args.hidden_dim}, vocab {args.vocab_size}: "
        f"{n / 1e9:.3f} B parameters; pairs {', '.join(f'{s}->{t}' for s, t in pairs)}"
    )
    print(
        f"load average at start (1/5/15 min): {', '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs"
    )
    root = Path(tempfile.mkdtemp(prefix="titan-export-bench-", dir=opts.keep_under))
    rows = []
    try:
        print(
            "pages: as drawn from the VM (--as-drawn)"
            if opts.as_drawn
            else "pages: each timed run's output bytes pre-backed just before its clock, cp and export alike"
        )
        for s, targets in by_source.items():
            rows += bench_source(s, targets, args, root, opts)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        print(f"\nremoved {root}")
        print(f"load average at end (1/5/15 min): {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print_table(rows)
    if any(PREBACK_SECONDS):
        print(
            f"pre-backing: {sum(PREBACK_SECONDS):.0f} s in all, untimed ({min(PREBACK_SECONDS):.1f}-"
            f"{max(PREBACK_SECONDS):.1f} s a run)"
        )
    if not opts.before:
        print(BEFORE)
    if opts.json:
        opts.json.write_text(
            json.dumps({"shape": opts.shape, "params": n, "rows": rows, "load_end": os.getloadavg()}, indent=1)
        )


if __name__ == "__main__":
    main()
