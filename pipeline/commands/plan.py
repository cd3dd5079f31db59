"""`titan-pipe plan`: rank the dp x tp x pp layouts of a model on a cluster, explain the misfits,
and write the winner as a flow.yaml (a thin shell over training/planner/search.py)."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from titan_pipe.io import faults
from titan_pipe.commands.common import handle_errors
from titan_pipe.processes.run_lock import path_lock
from titan_pipe.commands.options import with_section
from titan_pipe.training.planner.request import PlanRequest


def _workload(model: str, seq_len: int, global_batch: int, lora_rank: int | None = None):
    """A flavour name, or a flow.yaml whose model section (flavour + dims) is used, and its
    train.lora; ``lora_rank``: LoRA of that rank on every linear of the attention and MLP."""
    from titan_pipe.config import LoRAConfig, load_flow
    from titan_pipe.errors import UserError
    from titan_pipe.model.args import FLAVOURS
    from titan_pipe.model.lora import model_problems
    from titan_pipe.training.planner.workload import Workload

    lora = LoRAConfig(rank=lora_rank, alpha=float(2 * lora_rank)).spec() if lora_rank is not None else None
    if model in FLAVOURS:
        w = Workload(FLAVOURS[model], seq_len, global_batch, flavour=model, lora=lora)
    else:
        path = Path(model)
        if not (path.suffix in (".yaml", ".yml") and path.is_file()):
            raise UserError(f"--model {model!r} is neither a flavour ({', '.join(FLAVOURS)}) nor a flow.yaml file")
        cfg = load_flow(path)
        overrides = cfg.model.model_dump(exclude={"flavour", "kernels"}, exclude_none=True)
        if lora is None and cfg.train.lora is not None:
            lora = cfg.train.lora.spec()
        w = Workload(
            cfg.model.args(), seq_len, global_batch, flavour=cfg.model.flavour, model_overrides=overrides, lora=lora
        )
    if w.lora is not None and model_problems(w.lora, w.args):  # a mixture of experts: the attention only
        from dataclasses import replace

        w = replace(w, lora=replace(w.lora, targets=("q", "k", "v", "o")))
    return w


def _gb(b: float) -> str:
    return f"{b / 1e9:.1f}"


def _zero(layout) -> str:
    if layout.offload:
        return "fsdp+offload"
    if layout.dp == 1:
        return "no dp"
    return {3: "fsdp", 2: "fsdp z2", 0: "ddp"}[layout.zero]


def _short(layout) -> str:
    return layout.label().replace("interleaved_1f1b(v=2)", "int1f1b")


def row_label(rank: int | None, e) -> str:
    """One bar's or row's full name: the table's #, layout, microbatches, dp mode, SP and AC (the
    variants of one layout differ only in these, so a layout alone names several rows)."""
    lay = e.layout
    parts = [f"#{rank}" if rank is not None else "misfit", _short(lay), f"mb{lay.microbatches}", _zero(lay)]
    if lay.sequence_parallel:
        parts.append("SP")
    if lay.ac_every:
        parts.append(f"AC{lay.ac_every}")
    return " ".join(parts)


def _table(plan, top: int, *, width: int = 150):
    """The ranked layouts. Under 110 columns (an 80-column terminal) the table drops its borders and
    the columns a layout's label or the caption already says (SP/AC are in the label; activations and
    the bubble in the memory figure), so no number is cut to an ellipsis."""
    from rich import box
    from rich.table import Table

    narrow = width < 110
    kinds = ("tp", "pp", "dp") + (("ep",) if any(e.layout.ep > 1 for e in plan.ranked[:top]) else ())
    t = Table(
        title=f"Top {min(top, len(plan.ranked))} of {len(plan.ranked)} layouts that fit "
        f"({len(plan.misfits)} do not, {len(plan.invalid)} break a config rule)",
        box=box.SIMPLE_HEAD if narrow else box.HEAVY_HEAD,
        padding=(0, 1),
        pad_edge=not narrow,
        caption=f"comm: GB a step over {'/'.join(kinds)}" if narrow else None,
    )
    t.add_column("#", justify="right", no_wrap=True)
    t.add_column("layout", no_wrap=True)
    cols = (
        ("mb", "dp", "GB/dev", "comm", "tok/s", "MFU")
        if narrow
        else ("mb", "dp", "SP", "AC", "GB/dev", "act", "bubble", f"comm GB {'/'.join(kinds)}", "tok/s", "MFU")
    )
    for col in cols:
        t.add_column(col, justify="right", no_wrap=True)
    for i, e in enumerate(plan.ranked[:top], 1):
        lay, m, c = e.layout, e.memory, e.timing.comm
        comm = "/".join(f"{c[k].bytes / 1e9:.0f}" if k in c else "-" for k in kinds)
        label = (
            row_label(None, e).split(" ", 1)[1].replace(f" mb{lay.microbatches}", "").replace(f" {_zero(lay)}", "")
            if narrow
            else _short(lay)
        )
        cells = {
            "mb": str(lay.microbatches),
            "dp": _zero(lay),
            "SP": "y" if lay.sequence_parallel else "",
            "AC": str(lay.ac_every or ""),
            "GB/dev": _gb(m.total),
            "act": _gb(m.activations + m.recompute),
            "bubble": f"{e.timing.bubble:.0%}",
            "comm": comm,
            "tok/s": f"{e.tokens_per_s:,.0f}",
            "MFU": f"{e.mfu:.0%}",
        }
        t.add_row(str(i), label, *(cells[col if not col.startswith("comm") else "comm"] for col in cols))
    return t


def _misfit_table(rows):
    from rich.table import Table

    t = Table(title="Layouts with no variant that fits (their smallest variant)")
    t.add_column("layout")
    t.add_column("why not", overflow="fold", min_width=60)
    for e in rows:
        t.add_row(e.layout.label(), e.reason)
    return t


def memory_figure(plan, top: int):
    """Stacked memory per device of the top layouts (bars in the table's order, each the table's
    GB/dev) and the smallest misfits, against capacity; None when there is no row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from titan_pipe.training.planner.search import best_misfits_per_layout

    rows = plan.ranked[:top] + best_misfits_per_layout(plan)[:top]
    if not rows:
        return None
    n_fit = min(top, len(plan.ranked))
    labels = [row_label(i + 1 if i < n_fit else None, e) for i, e in enumerate(rows)]
    kinds = list(rows[0].memory.items())
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(rows) + 1.5))
    ys = list(range(len(rows)))  # one position per row: equal labels never stack onto one bar
    left = [0.0] * len(rows)
    for k in kinds:
        vals = [e.memory.items()[k] / 1e9 for e in rows]
        ax.barh(ys, vals, left=left, label=k)
        left = [a + b for a, b in zip(left, vals)]
    for y, total in zip(ys, left):
        ax.text(total, y, f" {total:.1f}", va="center", fontsize=7)
    ax.set_yticks(ys, labels, fontsize=8)
    ax.axvline(plan.cluster.memory_bytes / 1e9, color="k", ls="--", label="device memory")
    ax.invert_yaxis()
    ax.set_xlabel("GB per device")
    ax.set_title(f"{plan.workload.flavour or 'model'} on {plan.cluster.n_devices} x {plan.cluster.device}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over them
    fig.tight_layout()
    return fig


def _plot(plan, path: Path, top: int) -> None:
    import matplotlib.pyplot as plt

    from titan_pipe.io.atomic import atomic_file

    fig = memory_figure(plan, top)
    if fig is None:
        return

    try:
        with atomic_file(path) as tmp:
            fig.savefig(tmp, format="png", dpi=110)
    finally:
        plt.close(fig)


def _write_flow(plan, path: Path, force: bool) -> None:
    import yaml

    from titan_pipe.config import parse_flow
    from titan_pipe.errors import UserError
    from titan_pipe.training.planner.search import layout_flow

    if path.exists() and not force:
        raise UserError(f"{path} already exists; pass --force to overwrite it")
    best = plan.best
    data = layout_flow(plan.workload, best.layout, plan.cluster, name=path.stem if path.stem != "flow" else "planned")
    parse_flow(data, source=str(path), base=path.parent.resolve())  # what validate will check
    m = best.memory
    header = (
        f"# Written by `titan-pipe plan`: best of {len(plan.ranked)} fitting layouts for "
        f"{plan.workload.flavour or 'the model'} on {plan.cluster.n_devices} x {plan.cluster.device}.\n"
        f"# Estimate: {best.tokens_per_s:,.0f} tokens/s, {best.step_s:.2f} s/step, MFU {best.mfu:.0%}, "
        f"{m.total / 1e9:.1f} GB/device (docs/plan.md says how it is computed).\n"
        "# Add data.path, train.steps and the optimizer before training; check with titan-pipe validate.\n"
    )
    if "rdzv_endpoint" in data["launch"]:
        header += "# launch.rdzv_endpoint: replace NODE0_HOST with the address of node 0.\n"
    from titan_pipe.io.atomic import write_text

    write_text(path, header + yaml.safe_dump(data, sort_keys=False))


def register(app: typer.Typer) -> None:
    @app.command()
    @handle_errors
    @with_section(PlanRequest, into="request")
    def plan(request: PlanRequest):
        """Find the fastest dp x tp x pp layout that fits: memory, bubble, communication, tokens/s."""
        from rich.console import Console
        from rich.progress import Progress

        from titan_pipe.errors import UserError
        from titan_pipe.model.args import count_params, flops_per_token
        from titan_pipe.training.planner.search import (
            best_misfits_per_layout,
            bounded_candidates,
            build_cluster,
            make_plan,
        )
        from titan_pipe.training.planner.workload import Assumptions

        out = Console()
        if not out.is_terminal and not os.environ.get("COLUMNS"):  # piped, no width given: do not squeeze the table
            out = Console(width=150)
        r = request
        gb = r.batch  # --global-batch, else 4 per device
        cluster, notes = build_cluster(r.device, r.devices, nodes=r.nodes, device_memory=r.device_memory)
        w = _workload(r.model, r.seq_len, gb, r.lora)
        if w.lora is not None and r.write is not None:
            raise UserError(
                "--write with LoRA: a LoRA flow adapts a model it starts from (init_from), which a "
                "flavour does not name; use titan-pipe init DIR --from HF_DIR --sft --lora RANK"
            )
        bounded_candidates(w, cluster, dp=r.dp, tp=r.tp, pp=r.pp)  # a search too large: one line, before any output
        assume = Assumptions(compute_efficiency=r.efficiency, comm_efficiency=r.comm_efficiency)
        if r.calibrate is not None:
            from titan_pipe.training.planner.calibrate import calibrate as fit, read_measurement

            cal = fit(read_measurement(r.calibrate, phase=r.calibrate_phase), cluster, assume)
            for line in cal.lines(r.efficiency):
                out.print(line, highlight=False)
            assume = Assumptions(compute_efficiency=cal.efficiency, comm_efficiency=r.comm_efficiency)
        for note in notes:
            out.print(f"[yellow]note[/yellow] {note}", highlight=False)
        links = ", ".join(
            f"{ln.name} {ln.gbps:g} GB/s" + (f" (groups of {ln.span})" if ln.span else "") for ln in cluster.links
        )
        n = count_params(w.args)
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
        trained = ""
        if w.lora is not None:
            from titan_pipe.model.lora import adapter_count

            k = adapter_count(w.args, w.lora)
            trained = (
                f"; LoRA rank {w.lora.rank} on {', '.join(w.lora.targets)}: {k / 1e6:,.1f}M trained "
                f"({k / n:.2%}), the base frozen"
            )
        out.print(
            f"{w.flavour or 'model'}: {size} parameters, "
            f"{flops_per_token(w.args, r.seq_len) / 1e9:.1f} GFLOP/token (train){trained}; batch {gb} x {r.seq_len} tokens\n"
            f"{r.devices} x {cluster.device} ({cluster.memory_bytes / 1e9:.0f} GB, "
            f"{', '.join(f'{k} {v:g} TFLOPS' for k, v in cluster.peak_tflops.items())}) in "
            f"{r.devices // cluster.devices_per_node} node(s) of {cluster.devices_per_node}; {links}",
            highlight=False,
        )
        with Progress(console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task("estimating layouts", total=None)
            result = make_plan(
                w,
                cluster,
                assume=assume,
                dp=r.dp,
                tp=r.tp,
                pp=r.pp,
                notes=notes,
                progress=lambda i, n: bar.update(task, completed=i, total=n),
            )
        if result.ranked:
            out.print(_table(result, r.top, width=out.width))
        misfits = best_misfits_per_layout(result)
        if misfits:
            out.print(_misfit_table(misfits))
        if r.plot is not None:
            with faults.writing(r.plot, what="the memory chart"), path_lock(r.plot, what="titan-pipe plan --plot"):
                _plot(result, r.plot, r.top)
            out.print(f"wrote {r.plot}")
        if result.best is None:
            raise UserError(
                f"no layout fits in {cluster.memory_bytes / 1e9:.1f} GB per device; see the "
                "reasons above (more devices, a smaller --global-batch or --seq-len)"
            )
        b = result.best
        out.print(
            f"best: {b.layout.label()}, {b.layout.microbatches} microbatches, {_zero(b.layout)}, "
            f"sequence_parallel={b.layout.sequence_parallel}, checkpoint every {b.layout.ac_every or '-'} "
            f"layer(s), {b.layout.amp_dtype}: {b.tokens_per_s:,.0f} tokens/s, "
            f"{b.memory.total / 1e9:.1f} GB/device",
            highlight=False,
        )
        if r.write is not None:
            with faults.writing(r.write, what="the flow.yaml"), path_lock(r.write, what="titan-pipe plan --write"):
                _write_flow(result, r.write, r.force)
            out.print(f"wrote {r.write}; check it with: titan-pipe validate {r.write}")
