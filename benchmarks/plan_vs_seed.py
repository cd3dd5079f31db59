"""The planner on the configurations of the document titan-pipe started from (docs/plan.md):
LLaMA-13B on 8 x Ascend 910 (32 GB) and LLaMA-70B on 32 x 910, printed as Markdown tables.

    python benchmarks/plan_vs_seed.py

Pure arithmetic (no devices); the figures are what docs/plan.md quotes.
"""

from __future__ import annotations

from titan_pipe.model.args import FLAVOURS, count_params, flops_per_token
from titan_pipe.training.planner.search import build_cluster, estimate, make_plan
from titan_pipe.training.planner.workload import Layout, Workload

SEQ = 4096


def row(label: str, w: Workload, lay: Layout, cluster, seed: str) -> str:
    e = estimate(w, lay, cluster)
    m = e.memory
    state = m.params + m.grads + m.optimizer
    fit = "fits" if e.fits else "does not fit"
    dp = ("fsdp+offload" if lay.offload else "fsdp") if lay.zero == 3 else ("fsdp z2" if lay.zero == 2 else "ddp")
    return (
        f"| {label} | {lay.label()} mb={lay.microbatches} {dp}"
        f"{' sp' if lay.sequence_parallel else ''}{f' ac{lay.ac_every}' if lay.ac_every else ''} | "
        f"{state / 1e9:.1f} | {(m.activations + m.recompute) / 1e9:.1f} | {m.total / 1e9:.1f} ({fit}) | "
        f"{e.tokens_per_s:,.0f} ({e.mfu:.0%}) | {seed} |"
    )


def main() -> None:
    c8, _ = build_cluster("ascend910a", 8)
    c16, _ = build_cluster("ascend910a", 16)
    a13 = FLAVOURS["llama2_13b"]
    n13 = count_params(a13)
    print(
        f"LLaMA-2 13B: {n13:,} parameters; 16 B/param (fp32 weights + grads + AdamW m, v) = "
        f"{16 * n13 / 1e9:.1f} GB; fp16 weights {2 * n13 / 1e9:.1f} GB; "
        f"{flops_per_token(a13, SEQ) / 1e9:.1f} GFLOP/token at seq {SEQ}"
    )
    print(
        "\n| seed layout | planner layout | P+G+O GB | act GB | GB/device | tokens/s (MFU) | seed: tokens/s, GB/device |"
    )
    print("|---|---|---|---|---|---|---|")
    fp16 = "float16"
    w32, w4, w8 = (Workload(a13, SEQ, b, flavour="llama2_13b") for b in (32, 4, 8))
    print(row("DP=8, batch 4/card", w32, Layout(8, 1, 1, zero=0, amp_dtype=fp16), c8, "8,500, 31 GB"))
    print(row("DP=8 + AC every layer", w32, Layout(8, 1, 1, zero=0, ac_every=1, amp_dtype=fp16), c8, "8,500, 31 GB"))
    print(row("DP=8 as FSDP + AC", w32, Layout(8, 1, 1, zero=3, ac_every=1, amp_dtype=fp16), c8, "8,500, 31 GB"))
    print(row("TP=8, batch 4", w4, Layout(1, 8, 1, amp_dtype=fp16), c8, "12,200, 9.5 GB"))
    print(
        row(
            "TP=8 + SP + AC",
            w4,
            Layout(1, 8, 1, sequence_parallel=True, ac_every=1, amp_dtype=fp16),
            c8,
            "12,200, 9.5 GB",
        )
    )
    print(row("TP=4 PP=2, batch 4", w4, Layout(1, 4, 2, "1f1b", 1, 4, amp_dtype=fp16), c8, "11,800, 12 GB"))
    print(row("TP=4 PP=2 DP=2 (16 cards)", w8, Layout(2, 4, 2, "1f1b", 1, 4, amp_dtype=fp16), c16, "22,500, 12 GB"))
    for gb in (8, 32):
        plan = make_plan(Workload(a13, SEQ, gb, flavour="llama2_13b"), c8)
        b = plan.best
        if b:
            print(row(f"planner's best, batch {gb}", plan.workload, b.layout, c8, "-"))
    a70 = FLAVOURS["llama2_70b"]
    n70 = count_params(a70)
    print(
        f"\nLLaMA-2 70B: {n70:,} parameters; fp16 weights {2 * n70 / 1e9:.1f} GB (seed: ~140 GB); "
        f"16 B/param = {16 * n70 / 1e9:.0f} GB"
    )
    c32, _ = build_cluster("ascend910a", 32)
    print("\n| seed layout | planner layout | P+G+O GB | act GB | GB/device | tokens/s (MFU) | seed |")
    print("|---|---|---|---|---|---|---|")
    w = Workload(a70, SEQ, 16, flavour="llama2_70b")
    print(row("dp4 tp4 pp2, batch 4/replica", w, Layout(4, 4, 2, "1f1b", 1, 4, amp_dtype=fp16), c32, "-"))
    print(
        row(
            "  + SP + AC every layer",
            w,
            Layout(4, 4, 2, "1f1b", 1, 4, sequence_parallel=True, ac_every=1, amp_dtype=fp16),
            c32,
            "-",
        )
    )
    print(
        row(
            "  + SP + AC + CPU offload",
            w,
            Layout(4, 4, 2, "1f1b", 1, 4, sequence_parallel=True, ac_every=1, amp_dtype=fp16, offload=True),
            c32,
            "ZeRO-3 + offload",
        )
    )
    for gb in (8, 16):
        plan = make_plan(Workload(a70, SEQ, gb, flavour="llama2_70b"), c32)
        print(f"| planner, batch {gb} x {SEQ} | {len(plan.ranked)} layouts fit | | | | | |")
        if plan.best:
            print(row(f"planner's best, batch {gb}", plan.workload, plan.best.layout, c32, "-"))
    c32b, _ = build_cluster("ascend910b3", 32)
    plan = make_plan(Workload(a70, SEQ, 16, flavour="llama2_70b"), c32b)
    if plan.best:
        print(row("on 32 x 910B3 (64 GB), batch 16", plan.workload, plan.best.layout, c32b, "-"))


if __name__ == "__main__":
    main()
